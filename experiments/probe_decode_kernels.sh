#!/usr/bin/env bash
# The decode attention's Mosaic GPU kernel next to the Triton kernel on one GPU: each
# variant's GPU time per layer-step (launch gaps excluded) and the Mosaic GPU kernels'
# registers, which decide how many programs share a multiprocessor.
#
#   OUT=/path/to/results bash experiments/probe_decode_kernels.sh [STEP ...]
#
# Steps (all by default):
#   registers  experiments/bench_decode_kernel.py at 256 and 512 rows of 384 slots with
#              MOSAIC_GPU_DUMP_PTXAS=1 (ptxas' report: registers, spills), the Triton
#              kernel and the Mosaic GPU tiles in PROBE_TILES; again for the tree in
#              before/ (an export of an earlier commit's jrl/), when there is one
#   sweep      the same times at 64 / 256 / 512 rows of 384 slots and 128 rows of 8,704
#   wide       the same times at Qwen2.5-7B's heads (28 / 4 / 128) at 128 and 256 rows of
#              384 slots and 128 rows of 2,048, for the tree and before/ (when there is one)
#   profile    experiments/profile_decode_kernel.py: cycles in each named region of the
#              fused kernel (0.5B heads at 256 and 512 rows, 7B heads at 128 and 256)
#   compile    experiments/probe_mosaic_compile.py: seconds to lower and to compile 1, 2,
#              8 and 24 decode steps (the sampler's layers) on either kernel, and how
#              many times ptxas compiled a Mosaic GPU kernel for each
#   tests      tests/kernels/test_decode_attention.py compiled on the GPU (the kernels
#              against XLA, through the sampler)
#   sampler    experiments/bench_rollout.py (batch 64 / 256 / 512, P128 / R256) on the
#              Triton kernel and on Mosaic GPU at SAMPLER_TILES (default
#              "64,2,compact,fused")
# Each unfused Mosaic GPU variant's program also runs XLA's RoPE, query padding and two
# cache writes; the fused tiles read the qkv projection's output (the bench joins its
# q, k and v first, ~2 us, which a sampler's fused projection does not); the "kernel"
# lines split the time by kernel.
# Nsight Compute (ncu) hung on these programs (no kernel profiled in 150 s): not used.
# Needs wheels/ beside the tree (ml_collections for jrl's imports).
set -uo pipefail
OUT=${OUT:-probe_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/wheels.sh"
install_wheels || exit 1
TILES=(${PROBE_TILES:-64,2,compact 128,2,compact 64,2,compact,fused 128,2,compact,fused})
STEPS=("$@")
((${#STEPS[@]})) || STEPS=(registers sweep)

bench() {  # bench TREE LOG SECONDS ARGS...: bench_decode_kernel.py, jrl from TREE
  local tree=$1 log=$2 limit=$3
  shift 3
  PYTHONPATH=/tmp/site:$tree MOSAIC_GPU_DUMP_PTXAS=1 timeout -k 5 "$limit" \
    python3 experiments/bench_decode_kernel.py --no_tiles_sweep --skip previous xla "$@" \
    > "$log" 2>&1 < /dev/null
  echo "-- $log: exit $?"
  grep -E "Used [0-9]+ registers" "$log" | sort | uniq -c
  grep -E "^batch" "$log"
}

for step in "${STEPS[@]}"; do
  echo "== $step at ${SECONDS}s"
  case "$step" in
    registers)
      bench "$PWD" "$OUT/registers.log" 200 --batch 256 512 --splits 0 --mosaic "${TILES[@]}"
      if [[ -d before/jrl ]]; then
        bench "$PWD/before" "$OUT/registers_before.log" 150 --batch 256 512 \
          --mosaic "${TILES[@]}"
      fi ;;
    sweep)
      bench "$PWD" "$OUT/sweep_short.log" 250 --batch 64 256 512 --splits 0 \
        --mosaic "${TILES[@]}"
      bench "$PWD" "$OUT/sweep_long.log" 150 --batch 128 --slots 8704 --fill 8600 \
        --splits 0 --mosaic "${TILES[@]}" ;;
    wide)
      for tree in "$PWD" "$PWD/before"; do
        [[ -d $tree/jrl ]] || continue
        tag=$([[ $tree == "$PWD" ]] && echo tree || echo before)
        bench "$tree" "$OUT/wide_short_$tag.log" 200 --heads 28 4 128 --batch 128 256 \
          --splits 0 --mosaic "${TILES[@]}"
        bench "$tree" "$OUT/wide_long_$tag.log" 150 --heads 28 4 128 --batch 128 \
          --slots 2048 --fill 1900 --splits 0 --mosaic "${TILES[@]}"
      done ;;
    profile)
      for shape in "14 2 64 --batch 256 512" "28 4 128 --batch 128 256"; do
        PYTHONPATH=/tmp/site:$PWD timeout -k 5 150 python3 experiments/profile_decode_kernel.py \
          --heads $shape --out "$OUT/profile_${shape%% *}.json" \
          >> "$OUT/profile.log" 2>&1 < /dev/null
        echo "-- profile $shape: exit $?"
      done
      grep -v "^[WI]0000" "$OUT/profile.log" | tail -n 60 ;;
    compile)
      PYTHONPATH=/tmp/site:$PWD MOSAIC_GPU_DUMP_PTXAS=1 timeout -k 5 200 \
        python3 experiments/probe_mosaic_compile.py --mosaic "${SAMPLER_TILES:-64,2,compact,fused}" \
        > "$OUT/compile.log" 2>&1 < /dev/null
      echo "-- compile: exit $?"
      awk '/^== .* begin/ {name = $2 " " $3; n = 0} /Compiling entry function/ {n++}
           /^== .* lower/ {print $0 "; ptxas runs " n}' "$OUT/compile.log" ;;
    tests)
      JAX_PLATFORMS=cuda,cpu PYTHONPATH=/tmp/site:$PWD timeout -k 5 300 python3 -m pytest \
        -q -p no:cacheprovider tests/kernels/test_decode_attention.py > "$OUT/tests.log" \
        2>&1 < /dev/null
      echo "-- tests: exit $?"; tail -n 15 "$OUT/tests.log" ;;
    sampler)
      PYTHONPATH=/tmp/site:$PWD timeout -k 5 300 python3 experiments/bench_rollout.py \
        --batch-sizes 64 256 512 --no-hf --decode-attention pallas mosaic \
        --mosaic-tiles "${SAMPLER_TILES:-64,2,compact,fused}" --out "$OUT/sampler.json" \
        > "$OUT/sampler.log" 2>&1 < /dev/null
      echo "-- sampler: exit $?"; grep -v "^[WI]0000" "$OUT/sampler.log" | tail -n 25 ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
echo "== done at ${SECONDS}s"
