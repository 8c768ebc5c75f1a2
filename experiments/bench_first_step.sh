#!/usr/bin/env bash
# The first step of the docs/performance.md workload (Qwen2.5-0.5B shape, 64 x 8, P128 /
# R256 forced), compiles included, with no persistent compilation cache:
#
#   OUT=/path/to/results bash experiments/bench_first_step.sh [RUN ...]
#
#   grpo_serial    GRPO at the docs command's settings, each program compiled when first
#                  called (--parallel_compile off)
#   grpo_parallel  the same, the step's programs compiled at once first (on, the default)
#   ppo_h100mem    PPO at the bench's defaults (micro-batch 32, no remat), compiled at
#                  once, in an H100's memory: XLA_PYTHON_CLIENT_MEM_FRACTION=0.52 of an
#                  H200's 141 GB is the 72.7 GiB an 80 GB card lets XLA use
#   ppo_h100mem_serial   the same, compiled one after another
#   grpo_noautotune      grpo_parallel with XLA_FLAGS=--xla_gpu_autotune_level=0 (cuBLAS'
#                  heuristics, no kernel autotuning): how much of a compile is autotuning
#   grpo_notriton  grpo_parallel with XLA_FLAGS=--xla_gpu_enable_triton_gemm=false (every
#                  matmul on cuBLAS, as the sampler's program already is)
#   grpo_threads   grpo_parallel with XLA_FLAGS=--xla_gpu_force_compilation_parallelism=16
#                  (a thread per core of the device machine for XLA's code generation;
#                  0, the default, leaves it to XLA). jaxlib 0.11.2 no longer knows
#                  --xla_gpu_enable_llvm_module_compilation_parallelism
# Each run prints the first step's wall time and its programs' trace / lower / compile
# seconds (bench_rl_step.py), and any rematerialization warning XLA gave. Needs wheels/
# beside the tree; BUDGET_S (default 560) caps the whole call.
set -uo pipefail
OUT=${OUT:-bench_out}
BUDGET_S=${BUDGET_S:-560}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
unset JAX_COMPILATION_CACHE_DIR
source "$(dirname "$0")/wheels.sh"
install_wheels || exit 1
export PYTHONPATH=/tmp/site:$PWD
DOCS=(--preset qwen2.5-0.5b --batch 64 --n 8 --prompt_len 128 --response_len 256
  --warmup 1 --steps 1)
TUNED=(--micro_batch 64 --remat dots_saveable --logprob_chunk_size 64 --scan_unroll)
runs=("$@")
((${#runs[@]})) || runs=(grpo_serial grpo_parallel ppo_h100mem)
for name in "${runs[@]}"; do
  left=$((BUDGET_S - SECONDS))
  if ((left < 60)); then echo "== $name skipped: ${left}s left"; continue; fi
  echo "== $name (timeout ${left}s, ${SECONDS}s elapsed)"
  env=()
  case "$name" in
    grpo_serial) args=(--algo grpo "${TUNED[@]}" --parallel_compile off) ;;
    grpo_parallel) args=(--algo grpo "${TUNED[@]}" --parallel_compile on) ;;
    ppo_h100mem) env=(XLA_PYTHON_CLIENT_MEM_FRACTION=0.52); args=(--algo ppo) ;;
    ppo_h100mem_serial) env=(XLA_PYTHON_CLIENT_MEM_FRACTION=0.52)
      args=(--algo ppo --parallel_compile off) ;;
    grpo_noautotune) env=(XLA_FLAGS=--xla_gpu_autotune_level=0)
      args=(--algo grpo "${TUNED[@]}") ;;
    grpo_notriton) env=(XLA_FLAGS=--xla_gpu_enable_triton_gemm=false)
      args=(--algo grpo "${TUNED[@]}") ;;
    grpo_threads) env=(XLA_FLAGS=--xla_gpu_force_compilation_parallelism=16)
      args=(--algo grpo "${TUNED[@]}") ;;
    *) echo "unknown run $name" >&2; exit 2 ;;
  esac
  env "${env[@]}" timeout --kill-after=10 "$left" python3 experiments/bench_rl_step.py \
    "${DOCS[@]}" "${args[@]}" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "== $name exit $? at ${SECONDS}s"
  grep -E "programs:|^\| [a-z_]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \||^\| all|step [0-9] \(|rematerializ" \
    "$OUT/$name.log" | cut -c1-300 | head -30
done
