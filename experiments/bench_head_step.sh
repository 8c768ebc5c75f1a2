#!/usr/bin/env bash
# The log-prob kernel (jrl/models/head_kernel.py) on one GPU: the head alone over tile
# settings (bench_head_kernel.py, once per OUT_DIR), then steps of docs/performance.md's
# workload with model.logprob_impl=xla and =pallas (the head bench's fastest tiles),
# each its own process, in one call. RUNS: grpo:forced grpo:natural ppo:forced
# ppo:natural, and trl (TRL's GRPOTrainer, forced; needs trl, datasets, dill, multiprocess).
#
#   bash experiments/bench_head_step.sh OUT_DIR grpo:forced grpo:natural
set -euo pipefail
out=$(realpath -m "${1:?usage: bench_head_step.sh OUT_DIR RUN...}"); shift
mkdir -p "$out"
if [ ! -f "$out/head.json" ]; then
  python3 experiments/bench_head_kernel.py --out "$out/head.json" 2>&1 | tail -16
fi
blocks=$(python3 - "$out/head.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
ok = [r for r in rows if r["impl"] == "pallas" and "fwd_ms" in r and "error" not in r]
print(min(ok, key=lambda r: r["fwd_ms"])["forward"])
PY
)
echo "head blocks: $blocks"
show() { grep -E "^\| (gen|forward|learn|step|MFU|HFU|peak|first)" | sed "s/^/$1 /"; }
for run in "$@"; do
  if [ "$run" = trl ]; then
    python3 experiments/bench_trl_grpo.py --preset qwen2.5-0.5b --batch 64 --n 8 \
      --prompt_len 128 --response_len 256 --warmup 1 --steps 2 --out "$out/trl_forced.json" \
      2>&1 | tail -14
    continue
  fi
  algo=${run%%:*}; stops=${run##*:}
  args=(--algo "$algo" --warmup 1 --steps 2 --micro_batch 64 --remat dots_saveable
        --logprob_chunk_size 64)
  [ "$stops" = natural ] && args+=(--natural_stops --stop_prob 0.004)
  for impl in xla pallas; do
    python3 experiments/bench_rl_step.py "${args[@]}" --logprob_impl $impl --head_blocks "$blocks" \
      --out "$out/${algo}_${stops}_$impl.json" 2>&1 | show "${algo}_${stops}_$impl"
  done
done
