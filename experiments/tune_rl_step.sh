#!/usr/bin/env bash
# Tries update settings of the GRPO step on one GPU (Qwen2.5-0.5B shape, 64 x 8, forced
# 256 tokens), then runs experiments/run_bench.sh (jrl next to TRL) with the fastest:
#
#   OUT=/path/to/results bash experiments/tune_rl_step.sh
#
# Writes $OUT/tune_<name>.json per variant and run_bench.sh's files.
set -uo pipefail
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jrl_jax_cache}
source "$(dirname "$0")/wheels.sh"
install_wheels .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD

declare -A VARIANTS=(
  [micro64]="--micro_batch 64"
  [micro128_dots]="--micro_batch 128 --remat dots_saveable"
  [micro64_chunk64]="--micro_batch 64 --logprob_chunk_size 64 --log_prob_micro_batch 256"
)
best="" best_s=1e9
for name in micro64 micro128_dots micro64_chunk64; do
  # shellcheck disable=SC2086
  timeout 150 python3 experiments/bench_rl_step.py --algo grpo --batch 64 --n 8 \
    --prompt_len 128 --response_len 256 --warmup 1 --steps 2 ${VARIANTS[$name]} \
    --out "$OUT/tune_$name.json" 2>&1 | grep -E "^\| (gen|old_log_prob|ref|update_actor|step|MFU|peak)"
  step=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['results'][0]['phases_s']['step'])" "$OUT/tune_$name.json" 2>/dev/null || echo 1e9)
  echo "== $name: step $step s"
  if python3 -c "import sys; sys.exit(not float(sys.argv[1]) < float(sys.argv[2]))" "$step" "$best_s"; then
    best=$name best_s=$step
  fi
done
echo "== fastest: $best ($best_s s): ${VARIANTS[$best]:-}"
JRL_EXTRA="${VARIANTS[$best]:-}" SKIP_INSTALL=1 BUDGET_S=${BUDGET_S:-300} \
  bash experiments/run_bench.sh all
