#!/usr/bin/env bash
# The GPU kernels on Pallas' Mosaic GPU backend, in one call on one Hopper GPU (every
# before/after below comes from the same machine):
#   1. the log-prob head kernel alone (experiments/check_mosaic_head.py: tile sweep,
#      errors and times against XLA at the same shapes);
#   2. the decode-step attention alone (experiments/check_mosaic_decode.py);
#   3. the sampler (experiments/bench_rollout.py, batch 64 / 256 / 512, P128 / R256),
#      decode attention "pallas" (Triton) against "mosaic";
#   4. the GRPO step of docs/performance.md at the trainer's default settings, the
#      decode attention on Triton, then on Mosaic GPU (the head: `auto`, Mosaic GPU),
#      then on Mosaic GPU's fused variant (`MosaicTiles(128, 2, compact, fused)`: the
#      cache written by the kernel, one XLA fusion before it; the sampler's rows too);
#   5. with TESTS=1, the two kernels' test files compiled on the GPU.
#
#   OUT=out bash experiments/bench_kernels.sh
#   HEAD=0 OUT=out bash experiments/bench_kernels.sh   # without 1. (the fused rows' time)
# Needs `wheels/` (ml_collections, absl, tensorboardX, PyYAML) when they are not installed.
# (experiments/results/mosaic/call4 is this script's run before the head's Triton kernel
# was removed: its GRPO steps forced `--logprob_impl pallas` / `mosaic`.)
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
step grpo_triton 110 "${rl[@]}" --decode_attention pallas \
  --out "$OUT/grpo_triton.json"
step grpo_mosaic 110 "${rl[@]}" --decode_attention mosaic \
  --out "$OUT/grpo_mosaic.json"
step grpo_mosaic_fused 110 "${rl[@]}" --decode_attention mosaic \
  --mosaic_tiles 128,2,compact,fused --out "$OUT/grpo_mosaic_fused.json"
if [[ "${HEAD:-1}" == 1 ]]; then  # HEAD=0: skip it (measured in call4), so the rest fits 10 min
  step head 90 python3 experiments/check_mosaic_head.py --budget-s 55 --out "$OUT/head.json"
fi
step decode 200 python3 experiments/check_mosaic_decode.py --layers 8 --repeats 10 \
  --only "0.5B b256" "0.5B b128 long" --out "$OUT/decode.json"
step rollout 120 python3 experiments/bench_rollout.py --batch-sizes 64 256 512 --no-hf \
  --decode-attention pallas mosaic --out "$OUT/rollout.json"
step rollout_fused 90 python3 experiments/bench_rollout.py --batch-sizes 256 512 --no-hf \
  --decode-attention mosaic --mosaic-tiles 128,2,compact,fused --out "$OUT/rollout_fused.json"
for name in grpo_triton grpo_mosaic grpo_mosaic_fused; do
  grep -E "^\| (gen|forward|learn|step|MFU actor update \||peak|first)" "$OUT/$name.log" \
    | sed "s/^/$name /"
done
if [[ "${TESTS:-0}" == 1 ]]; then
  JAX_PLATFORMS=cuda,cpu step gpu_tests 200 python3 -m pytest -q -p no:cacheprovider -n 4 \
    tests/kernels/test_decode_attention.py tests/kernels/test_logprob_head.py
  tail -3 "$OUT/gpu_tests.log"
fi
# The device machine returns at most 8 files from $OUT: everything in one archive.
(cd "$OUT" && tar czf results.tgz -- *.log *.json && rm -f -- *.log *.json)
echo "done in ${SECONDS}s; logs and JSON in $OUT/results.tgz"
