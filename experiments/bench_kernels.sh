#!/usr/bin/env bash
# jrl's GPU kernels on Pallas' Mosaic GPU backend against XLA, in one call on one Hopper
# GPU (every comparison below comes from the same machine, since two machines of one kind
# differ by about 2%):
#   1. the log-prob head kernel alone (experiments/bench_head_kernel.py: tile sweep, times
#      and errors against XLA at the same shapes), then its backward
#      (experiments/bench_head_backward.py);
#   2. the decode-step attention alone, GPU time a layer-step
#      (experiments/bench_decode_kernel.py: 256 and 512 rows of 384 slots, 128 rows of
#      8,704), Mosaic GPU at the sampler's settings against XLA;
#   3. the sampler (experiments/bench_rollout.py, batch 64 / 256 / 512, P128 / R256),
#      decode attention on XLA against the Mosaic GPU kernel;
#   4. the GRPO step of docs/performance.md at the trainer's default settings (both
#      kernels where they apply), then with both on XLA;
#   5. with TESTS=1, the kernels' test files compiled on the GPU.
#
#   OUT=out bash experiments/bench_kernels.sh
#   HEAD=0 OUT=out bash experiments/bench_kernels.sh   # without 1., so the rest fits 10 min
# Needs `wheels/` (ml_collections, absl, tensorboardX, PyYAML) when they are not installed.
set -uo pipefail
OUT=${OUT:-kernels_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/wheels.sh"
install_wheels || exit 1
export PYTHONPATH=$PWD:/tmp/site
quiet() { grep -v "^[WI]0000\|^WARNING: All log" ; }
step() {  # name cap command...
  local name=$1 cap=$2; shift 2
  echo "== $name (${SECONDS}s)"
  timeout --kill-after=10 "$cap" "$@" 2>&1 | quiet > "$OUT/$name.log"
  echo "== $name exit ${PIPESTATUS[0]} at ${SECONDS}s" | tee -a "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/env.log"
python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__)" \
  | tee -a "$OUT/env.log"
rl=(python3 experiments/bench_rl_step.py --algo grpo --warmup 1 --steps 2)
step grpo 110 "${rl[@]}" --out "$OUT/grpo.json"
step grpo_xla 110 "${rl[@]}" --decode_attention xla --logprob_impl xla --out "$OUT/grpo_xla.json"
if [[ "${HEAD:-1}" == 1 ]]; then
  step head 90 python3 experiments/bench_head_kernel.py --budget-s 55 --out "$OUT/head.json"
  step head_backward 90 python3 experiments/bench_head_backward.py --out "$OUT/head_backward.json"
fi
step decode 120 python3 experiments/bench_decode_kernel.py --no_tiles_sweep --batch 256 512 \
  --out "$OUT/decode.json"
step decode_long 120 python3 experiments/bench_decode_kernel.py --no_tiles_sweep --batch 128 \
  --slots 8704 --fill 8600 --out "$OUT/decode_long.json"
step rollout 150 python3 experiments/bench_rollout.py --batch-sizes 64 256 512 --no-hf \
  --decode-attention xla mosaic --out "$OUT/rollout.json"
for name in grpo grpo_xla; do
  grep -E "^\| (gen|forward|learn|step|MFU actor update \||peak|first)" "$OUT/$name.log" \
    | sed "s/^/$name /"
done
if [[ "${TESTS:-0}" == 1 ]]; then
  JAX_PLATFORMS=cuda,cpu step gpu_tests 300 python3 -m pytest -q -p no:cacheprovider -n 4 \
    tests/kernels/test_decode_attention.py tests/kernels/test_logprob_head.py \
    tests/kernels/test_gpu_checks.py
  tail -3 "$OUT/gpu_tests.log"
fi
# The device machine returns at most 8 files from $OUT: everything in one archive.
(cd "$OUT" && tar czf results.tgz -- *.log *.json && rm -f -- *.log *.json)
echo "done in ${SECONDS}s; logs and JSON in $OUT/results.tgz"
