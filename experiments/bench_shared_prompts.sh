#!/usr/bin/env bash
# What shared prompts buy (actor.share_prompts): the GRPO (and PPO) workload of
# docs/performance.md (Qwen2.5-0.5B shape, 64 prompts x 8, P128, R256, bf16 compute,
# 64-sequence micro-batches with dots_saveable), responses forced to 256 tokens and with
# natural stops (--stop_prob 0.004: mean ~160 tokens), each with the prompts shared (the
# default) and not, one process per run, on one GPU.
#
#   [EXTRA="flags"] [MODES="forced natural"] bash experiments/bench_shared_prompts.sh OUT_DIR [grpo|ppo|both]
set -euo pipefail
out=${1:?usage: bench_shared_prompts.sh OUT_DIR [grpo|ppo|both]}
algos=${2:-grpo}
mkdir -p "$out"
[ "$algos" = both ] && algos="grpo ppo"
args=(--warmup 1 --steps 2 --micro_batch 64 --remat dots_saveable --logprob_chunk_size 64 ${EXTRA:-})
for algo in $algos; do
  for mode in ${MODES:-forced natural}; do
    stops=()
    [ "$mode" = natural ] && stops=(--natural_stops --stop_prob 0.004)
    for share in on off; do
      python3 experiments/bench_rl_step.py "${args[@]}" --algo "$algo" "${stops[@]}" \
        --share_prompts "$share" --out "$out/${algo}_${mode}_share_${share}.json" 2>&1 \
        | grep -E "^\| (gen|forward|learn|step|MFU|peak|first)" | sed "s/^/${algo} ${mode} ${share} /"
    done
  done
done
