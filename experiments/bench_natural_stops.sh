#!/usr/bin/env bash
# What the response-length buckets and the decode compaction buy: the GRPO (and PPO)
# workload of docs/performance.md (Qwen2.5-0.5B shape, 64 prompts x 8, P128, R256,
# bf16 compute, 64-sequence micro-batches with dots_saveable), with responses forced
# to 256 tokens and with natural stops (--stop_prob 0.004: mean ~160 tokens), each
# with both features on (the defaults) and off (actor.response_buckets=1,
# rollout.decode_buckets=1), one process per run, on one GPU.
#
#   [EXTRA="flags"] bash experiments/bench_natural_stops.sh OUT_DIR [grpo|ppo|both] [TREE]
#
# TREE (default .): the source tree to benchmark, e.g. an export of an older commit
# (its bench_rl_step.py may lack the feature flags: then only "off" runs there).
set -euo pipefail
out=${1:?usage: bench_natural_stops.sh OUT_DIR [grpo|ppo|both] [TREE]}
algos=${2:-grpo}
tree=${3:-.}
mkdir -p "$out"
out=$(realpath "$out")
[ "$algos" = both ] && algos="grpo ppo"
args=(--warmup 1 --steps 2 --micro_batch 64 --remat dots_saveable --logprob_chunk_size 64 ${EXTRA:-})
natural=(--natural_stops --stop_prob 0.004)
tag=$(basename "$(realpath "$tree")")
run() {  # name, flags...
  local name=$1
  shift
  (cd "$tree" && PYTHONPATH="$PWD:${PYTHONPATH:-}" python3 experiments/bench_rl_step.py \
    "${args[@]}" "$@" --out "$out/$name.json") 2>&1 | grep -v "^WARNING\|^I0000\|^W0000"
}
for algo in $algos; do
  if grep -q -- "--decode_buckets" "$tree/experiments/bench_rl_step.py"; then
    run "${algo}_natural_on" --algo "$algo" "${natural[@]}"
    run "${algo}_natural_off" --algo "$algo" "${natural[@]}" --response_buckets 1 --decode_buckets 1
    run "${algo}_forced_on" --algo "$algo"
  else
    run "${algo}_natural_${tag}" --algo "$algo" "${natural[@]}"
    run "${algo}_forced_${tag}" --algo "$algo"
  fi
done
