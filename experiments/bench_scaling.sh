#!/usr/bin/env bash
# Data-parallel scaling of the GRPO step on 1, 2 and 4 GPUs of one host, and a model
# that needs FSDP on 4 GPUs: the command for a 4-GPU machine.
#
#   OUT=/path/to/results bash experiments/bench_scaling.sh [dp] [strong] [fsdp]
#
# dp:     Qwen2.5-0.5B shape, 64 prompts x n=8 per GPU (weak scaling), mesh data=G
# strong: the same shape with 64 prompts x n=8 in all, on 2 and 4 GPUs
# fsdp:   Qwen2.5-7B shape on 4 GPUs, mesh fsdp=4, full rematerialisation
# Every response runs to 256 tokens (ignore_eos), prompts are 128 tokens; the actor's
# micro-batch is 32 sequences per GPU (jrl's ppo_micro_batch_size counts all GPUs).
# Each run writes $OUT/<name>.json; all output goes to $OUT/scaling.log. Needs wheels/
# (ml_collections, tensorboardX, absl) next to the tree.
set -uo pipefail
MODES=("${@:-dp}")
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jrl_jax_cache}
source "$(dirname "$0")/wheels.sh"
install_wheels || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv >"$OUT/gpus.txt"

bench() {  # bench NAME GPUS ARGS...
  local name=$1 gpus=$2
  shift 2
  local devices
  devices=$(seq -s, 0 $((gpus - 1)))
  echo "== $name on GPUs $devices"
  CUDA_VISIBLE_DEVICES=$devices timeout "${LIMIT:-420}" python3 experiments/bench_rl_step.py --algo grpo \
    --prompt_len 128 --response_len 256 --out "$OUT/$name.json" "$@" 2>&1 |
    grep -v "^W0000\|^I0000" | tee -a "$OUT/scaling.log" | tail -25
}

for MODE in "${MODES[@]}"; do
case "$MODE" in
  dp)
    for g in 1 2 4; do
      bench "dp_${g}gpu" "$g" --batch $((64 * g)) --n 8 --mesh_data "$g" --warmup 2 --steps 3 \
        --micro_batch $((32 * g))
    done ;;
  strong)
    for g in 2 4; do
      bench "strong_${g}gpu" "$g" --batch 64 --n 8 --mesh_data "$g" --warmup 2 --steps 3 \
        --micro_batch $((32 * g))
    done ;;
  fsdp)
    LIMIT=250 bench fsdp_7b_4gpu 4 --preset qwen2.5-7b --batch 32 --n 8 --mesh_data 1 --mesh_fsdp 4 \
      --remat full --micro_batch 32 --log_prob_micro_batch 64 --warmup 1 --steps 2 ;;
  *) echo "usage: $0 [dp] [strong] [fsdp]" >&2; exit 2 ;;
esac
done
