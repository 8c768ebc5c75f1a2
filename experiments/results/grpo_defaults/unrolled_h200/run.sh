#!/usr/bin/env bash
# The MLP's gate/up as one matmul and SwiGLU's backward from that one array (see
# README.md here) against the tree before (before/, an export of 9b6b8e5): the docs
# workload (Qwen2.5-0.5B shape, 64 x 8, P128 / R256 forced, GRPO) at the bench's
# defaults (remat none, micro-batch 32, the update's layers rolled) and at the docs
# command's settings (remat dots_saveable, micro-batch 64, layers unrolled), sides
# alternating, each run with a compilation cache of its own.
#   OUT=dir RUNS="defaults docs" bash experiments/results/grpo_defaults/unrolled_h200/run.sh
set -u
R=${OUT:?}
source experiments/wheels.sh
install_wheels || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$R/card.txt"
export PYTHONUNBUFFERED=1
DOCS=(--preset qwen2.5-0.5b --algo grpo --batch 64 --n 8 --prompt_len 128 --response_len 256
  --warmup 1 --steps 3)
TUNED=(--micro_batch 64 --remat dots_saveable --logprob_chunk_size 64 --scan_unroll)
run() {  # NAME TREE ARGS...
  local name=$1 tree=$2; shift 2
  local left=$((${BUDGET_S:-550} - SECONDS))
  if ((left < 60)); then echo "== $name skipped"; return; fi
  echo "== $name (${SECONDS}s)"
  (cd "$tree" && JAX_COMPILATION_CACHE_DIR=/tmp/cc_$name PYTHONPATH=/tmp/site:$PWD \
    timeout "$left" python3 experiments/bench_rl_step.py "$@" --out "$R/$name.json") 2>&1 \
    | grep -v "^[WI]0000" > "$R/$name.log"
  grep -E "^\| (gen|forward|learn|step|peak|first|MFU actor update) " "$R/$name.log"
}
for set in ${RUNS:-defaults docs}; do
  case $set in
    defaults) run defaults_after . "${DOCS[@]}"; run defaults_before before "${DOCS[@]}" ;;
    docs) run docs_after . "${DOCS[@]}" "${TUNED[@]}"; run docs_before before "${DOCS[@]}" "${TUNED[@]}" ;;
    defaults_unrolled) run defaults_unrolled_before before "${DOCS[@]}" --scan_unroll ;;
  esac
done
# The second call: `RUNS="tests ppo"`: the README's GPU tests on this tree, then PPO at
# the bench's defaults in an 80 GB card's memory (as bench_first_step.sh ppo_h100mem).
for set in ${RUNS:-}; do
  case $set in
    tests) JAX_PLATFORMS=cuda,cpu PYTHONPATH=/tmp/site:$PWD timeout 260 python3 -m pytest -q \
      -n 4 -p no:cacheprovider -k "not mesh and not sharded" tests/test_{logprobs,rollout}.py \
      tests/models/test_{transformer,shared_prompts,cache,hf_parity,lora,decode_attention,head_kernel}.py \
      > "$R/tests.log" 2>&1; tail -n 4 "$R/tests.log" ;;
    ppo) PPO=(--preset qwen2.5-0.5b --algo ppo --batch 64 --n 8 --prompt_len 128
           --response_len 256 --warmup 1 --steps 2)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.52 run ppo_h100mem_after . "${PPO[@]}"
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.52 run ppo_h100mem_before before "${PPO[@]}" ;;
  esac
done
