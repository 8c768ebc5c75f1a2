#!/usr/bin/env bash
# A decode-step change on one GPU, before and after, each run its own process in one
# call: the sampler alone (bench_rollout.py, batch 64/256/512, forced 256 tokens), a
# profile of this tree's sampler at batch 512 with one decode step's kernels in order,
# then RL steps of docs/performance.md's workload (Qwen2.5-0.5B shape, 64 prompts x 8,
# P128, R256, 64-sequence micro-batches with dots_saveable, 64-token log-prob chunks)
# in BEFORE (an export of an older commit) and in this tree. RUNS: grpo:forced
# grpo:natural ppo:forced ppo:natural (natural: --stop_prob 0.004), and trl (TRL's
# GRPOTrainer, forced; needs trl, datasets, dill, multiprocess); "rollout" runs the
# sampler part. AFTER_ARGS and BEFORE_ARGS (environment variables) add flags to this
# tree's and BEFORE's RL steps (e.g. AFTER_ARGS=--scan_unroll).
#
#   bash experiments/bench_decode_step.sh OUT_DIR BEFORE_TREE rollout grpo:forced
set -euo pipefail
out=$(realpath -m "${1:?usage: bench_decode_step.sh OUT_DIR BEFORE_TREE RUN...}"); shift
before=$(realpath "${1:?usage: bench_decode_step.sh OUT_DIR BEFORE_TREE RUN...}"); shift
mkdir -p "$out"
show() { grep -E "^\| (gen|forward|learn|step|MFU|HFU|peak|first)" | sed "s/^/$1 /"; }
in_tree() {  # tree, command...
  local tree=$1
  shift
  (cd "$tree" && PYTHONPATH="$PWD:${PYTHONPATH:-}" "$@")
}
for run in "$@"; do
  case $run in
    rollout)
      for side in before after; do
        tree=$([ $side = before ] && echo "$before" || echo "$PWD")
        in_tree "$tree" python3 experiments/bench_rollout.py --batch-sizes 64 256 512 --no-hf \
          --out "$out/rollout_$side.json" 2>&1 | grep -E "^\| [0-9]" | sed "s/^/rollout_$side /"
      done
      python3 experiments/bench_rollout.py --batch-sizes 512 --no-hf --repeats 1 \
        --trace_dir "$out/trace" > /dev/null 2>&1
      python3 experiments/trace_summary.py "$out/trace" --top 30 --anchor append_and_attend \
        --skip 3000 --count 2 > "$out/rollout_profile_512.txt" 2>&1
      rm -rf "$out/trace"
      tail -40 "$out/rollout_profile_512.txt"
      ;;
    trl)
      python3 experiments/bench_trl_grpo.py --preset qwen2.5-0.5b --batch 64 --n 8 \
        --prompt_len 128 --response_len 256 --warmup 1 --steps 2 --out "$out/trl_forced.json" \
        2>&1 | tail -14
      ;;
    *)
      algo=${run%%:*}; stops=${run##*:}
      args=(--algo "$algo" --warmup 1 --steps 2 --micro_batch 64 --remat dots_saveable
            --logprob_chunk_size 64)
      [ "$stops" = natural ] && args+=(--natural_stops --stop_prob 0.004)
      for side in before after; do
        tree=$([ $side = before ] && echo "$before" || echo "$PWD")
        extra=()
        if [ $side = after ]; then read -ra extra <<< "${AFTER_ARGS:-}"
        else read -ra extra <<< "${BEFORE_ARGS:-}"; fi
        in_tree "$tree" python3 experiments/bench_rl_step.py "${args[@]}" "${extra[@]}" \
          --out "$out/${algo}_${stops}_$side.json" 2>&1 | show "${algo}_${stops}_$side"
      done
      ;;
  esac
done
