#!/usr/bin/env bash
# Shared prompts with packed responses against the tree before shared prompts, on the
# GRPO workload of docs/performance.md (Qwen2.5-0.5B shape, 64 prompts x 8, P128, R256,
# bf16 compute, 64-sequence micro-batches with dots_saveable, 64-token log-prob chunks),
# one process per run on one GPU: natural stops (--stop_prob 0.004) in BEFORE_TREE, in
# this tree, and in this tree with one response bucket (shared prompts, no packing);
# forced in this tree; TRL's GRPOTrainer forced (needs trl, datasets, dill, multiprocess).
#
#   bash experiments/bench_packing.sh OUT_DIR BEFORE_TREE
set -euo pipefail
out=$(realpath -m "${1:?usage: bench_packing.sh OUT_DIR BEFORE_TREE}"); mkdir -p "$out"
before=${2:?usage: bench_packing.sh OUT_DIR BEFORE_TREE}
args=(--algo grpo --warmup 1 --steps 2 --micro_batch 64 --remat dots_saveable
  --logprob_chunk_size 64)
natural=(--natural_stops --stop_prob 0.004)
show() { grep -E "^\| (gen|forward|learn|step|MFU|HFU|peak|first)" | sed "s/^/$1 /"; }
run() {  # tree, name, flags...
  local tree=$1 name=$2
  shift 2
  (cd "$tree" && PYTHONPATH="$PWD:${PYTHONPATH:-}" python3 experiments/bench_rl_step.py \
    "${args[@]}" "$@" --out "$out/$name.json") 2>&1 | show "$name"
}
run "$before" before_natural "${natural[@]}"
run . packed_natural "${natural[@]}"
run . unpacked_natural "${natural[@]}" --response_buckets 1
run . packed_forced
python3 experiments/bench_trl_grpo.py --preset qwen2.5-0.5b --batch 64 --n 8 --prompt_len 128 \
  --response_len 256 --warmup 1 --steps 2 --out "$out/trl_forced.json" 2>&1 | tail -14
