#!/usr/bin/env bash
# The jitted cached-forward layer on a GPU (see README.md here): the sampler's trace and
# lower in both trees, then the long natural run and the docs workload in both trees,
# each with a compilation cache of its own (no run reads another's programs).
#   OUT=dir bash experiments/results/first_step/sampler_trace_h200/run.sh
set -u
R=${OUT:?}
source experiments/wheels.sh
install_wheels || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$R/card.txt"
python3 -c "import jax; print(jax.__version__)" >> "$R/card.txt"
export PYTHONUNBUFFERED=1
T=experiments/trace_sampler.py
PYTHONPATH=/tmp/site:$PWD python3 $T --impl auto mosaic --out "$R/trace_after.json" 2>&1 \
  | grep -v "^[WI]0000" | tee "$R/trace_after.log"
(cd before && PYTHONPATH=/tmp/site:$PWD python3 ../$T --impl auto mosaic \
  --out "$R/trace_before.json" 2>&1 | grep -v "^[WI]0000" | tee "$R/trace_before.log")
t0=$SECONDS
for run in natural natural_before short before_short; do
  left=$((470 - (SECONDS - t0)))
  JAX_COMPILATION_CACHE_DIR=/tmp/cache_$run BUDGET_S=$left OUT=$R \
    bash experiments/bench_long.sh $run 2>&1 | grep -E "^== |^\||step [0-9] \(" | cut -c1-200 | head -60
done
