#!/usr/bin/env bash
# The GRPO step of docs/performance.md before and after a change, and TRL's, in one
# process per run on one GPU: Qwen2.5-0.5B shape, 64 prompts x 8, P128, R256, bf16
# compute, 64-sequence micro-batches with dots_saveable, forced to 256 tokens and with
# natural stops (--stop_prob 0.004), in BEFORE (an export of an older commit) and in
# this tree; then this tree with 128-token log-prob chunks (the config's default), and
# TRL's GRPOTrainer on the forced workload (needs trl, datasets, dill, multiprocess).
#
#   bash experiments/bench_before_after.sh OUT_DIR BEFORE_TREE
set -euo pipefail
out=$(realpath -m "${1:?usage: bench_before_after.sh OUT_DIR BEFORE_TREE}"); mkdir -p "$out"
before=${2:?usage: bench_before_after.sh OUT_DIR BEFORE_TREE}
args=(--algo grpo --warmup 1 --steps 2 --micro_batch 64 --remat dots_saveable)
natural=(--natural_stops --stop_prob 0.004)
show() { grep -E "^\| (gen|forward|learn|step|MFU|HFU|peak|first)" | sed "s/^/$1 /"; }
run() {  # tree, name, flags...
  local tree=$1 name=$2
  shift 2
  (cd "$tree" && PYTHONPATH="$PWD:${PYTHONPATH:-}" python3 experiments/bench_rl_step.py \
    "${args[@]}" "$@" --out "$out/$name.json") 2>&1 | show "$name"
}
run "$before" before_forced --logprob_chunk_size 64
run . after_forced --logprob_chunk_size 64
run "$before" before_natural --logprob_chunk_size 64 "${natural[@]}"
run . after_natural --logprob_chunk_size 64 "${natural[@]}"
run . after_forced_chunk128 --logprob_chunk_size 128
python3 experiments/bench_trl_grpo.py --preset qwen2.5-0.5b --batch 64 --n 8 --prompt_len 128 \
  --response_len 256 --warmup 1 --steps 2 --out "$out/trl_forced.json" 2>&1 | tail -14
