#!/usr/bin/env bash
# The decode step's matmuls on the Mosaic GPU prototype against cuBLAS, on one GPU:
#
#   OUT=/path/to/results [MOSAIC_GEMM="KxN=TN,SPLITS,TK,STAGES;..."] \
#       bash experiments/bench_decode_gemm.sh [kernel] [sampler]
#
#   kernel   experiments/skinny_matmul_mgpu.py: each 0.5B decode matmul (qkv, output,
#            gate/up, down) at 64 / 128 / 256 rows, GPU kernel time (CUPTI) of XLA's
#            dot and of each block configuration, and their errors
#   sampler  experiments/bench_rollout.py --gemm cublas mosaic at batch 64 / 128 / 256 /
#            512 (P128 / R256): the sampler with the decode steps' projections on the
#            kernel (blocks from MOSAIC_GEMM, else the script's default_config)
# Needs wheels/ beside the tree; BUDGET_S (default 560) caps the whole call.
set -uo pipefail
OUT=${OUT:-bench_out}
BUDGET_S=${BUDGET_S:-560}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/wheels.sh"
install_wheels || exit 1
export PYTHONPATH=/tmp/site:$PWD
runs=("$@")
((${#runs[@]})) || runs=(kernel sampler)
for run in "${runs[@]}"; do
  left=$((BUDGET_S - SECONDS))
  if ((left < 45)); then echo "== $run skipped: ${left}s left"; continue; fi
  echo "== $run (timeout ${left}s)"
  case "$run" in
    kernel) timeout "$left" python3 experiments/skinny_matmul_mgpu.py --out "$OUT/kernel.json" \
              2>&1 | grep -v "^[WI]0000" | tee "$OUT/kernel.log" ;;
    sampler) timeout "$left" python3 experiments/bench_rollout.py --batch-sizes 64 128 256 512 \
               --no-hf --gemm cublas mosaic --mosaic_gemm "${MOSAIC_GEMM:-}" \
               --out "$OUT/sampler.json" 2>&1 | grep -v "^[WI]0000" | tee "$OUT/sampler.log" ;;
    *) echo "unknown run $run" >&2; exit 2 ;;
  esac
  echo "== $run exit ${PIPESTATUS[0]} at ${SECONDS}s"
done
