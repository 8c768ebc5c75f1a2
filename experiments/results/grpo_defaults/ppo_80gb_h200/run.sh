#!/usr/bin/env bash
# SwiGLU's backward as one elementwise pass and the down projection recomputing the
# hidden values from gate_up (see README.md here) against the tree before (before/, an
# export of 2e11d36): the rolled backbone's fwd+bwd alone (profile_update.py, one
# micro-batch of the trainer's defaults, traced), then the docs workload (Qwen2.5-0.5B
# shape, 64 x 8, P128 / R256 forced, GRPO) at the bench's defaults, sides alternating.
#   OUT=dir RUNS="profile defaults" bash experiments/results/grpo_defaults/ppo_80gb_h200/run.sh
# (experiments/results/grpo_defaults/step_h200/run.sh calls this with before/ an export of 369cdc4.)
set -u
R=${OUT:?}
ROOT=$PWD
source experiments/wheels.sh
install_wheels || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$R/card.txt"
export PYTHONUNBUFFERED=1
DOCS=(--preset qwen2.5-0.5b --algo grpo --batch 64 --n 8 --prompt_len 128 --response_len 256
  --warmup 1 --steps 3)
run() {  # NAME TREE ARGS...
  local name=$1 tree=$2; shift 2
  local left=$((${BUDGET_S:-560} - SECONDS))
  if ((left < 60)); then echo "== $name skipped"; return; fi
  echo "== $name (${SECONDS}s)"
  (cd "$tree" && JAX_COMPILATION_CACHE_DIR=/tmp/cc_$name PYTHONPATH=/tmp/site:$PWD \
    timeout "$left" python3 experiments/bench_rl_step.py "$@" --out "$R/$name.json") 2>&1 \
    | grep -v "^[WI]0000" > "$R/$name.log"
  grep -E "^\| (gen|forward|learn|step|peak|first|MFU actor update) " "$R/$name.log"
}
profile() {  # NAME TREE
  echo "== profile $1"
  # This tree's script on either tree's jrl (before/'s script has no --trace_dir).
  (cd "$2" && PYTHONPATH=/tmp/site:$2 timeout 200 python3 "$ROOT/experiments/profile_update.py" \
    --micro 32 --remat none --repeats 9 --trace_dir "/tmp/trace_$1" --top 12) 2>&1 \
    | grep -v "^[WI]0000" > "$R/profile_$1.log"
  grep -E "^\| backbone|^kernels:" "$R/profile_$1.log"
}
for set in ${RUNS:-profile defaults}; do
  case $set in
    profile) profile after "$PWD"; profile before "$PWD/before"; profile after2 "$PWD" ;;
    defaults) run defaults_after . "${DOCS[@]}"; run defaults_before before "${DOCS[@]}" ;;
    ppo) PPO=(--preset qwen2.5-0.5b --algo ppo --batch 64 --n 8 --prompt_len 128
           --response_len 256 --warmup 1 --steps 2)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.52 run ppo_h100mem_after . "${PPO[@]}"
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.52 run ppo_h100mem_before before "${PPO[@]}" ;;
  esac
done
