#!/usr/bin/env bash
# One-step asynchronous training against the synchronous trainer on the same GPUs:
# the Qwen2.5-0.5B GRPO workload of docs/performance.md (64 prompts x 8, P128, R256
# forced, bf16 compute), with experiments/bench_rl_step.py.
#
#   [SPLIT=k] [TAG=name] bash experiments/bench_async.sh OUT_DIR [extra bench_rl_step.py flags]
#
# On N GPUs: synchronous on all N; asynchronous with SPLIT (default N/2) sampling and
# the rest training; and on 2 GPUs, without extra flags, also both with truncated IS
# (token level), for the mismatch metrics and what the correction does with them.
# BUDGET_S (default: none) caps the whole call, each run getting what is left; wheels/
# beside the tree (ml_collections, absl, tensorboardX) are installed when present.
# Long responses on 2 GPUs (docs/performance.md, "Long responses"):
#   TAG=_r8192 bash experiments/bench_async.sh OUT --batch 16 --prompt_len 512 \
#       --response_len 8192 --dynamic_bsz [--natural_stops --uniform_lengths 512,8192]
set -euo pipefail
out=${1:?usage: bench_async.sh OUT_DIR [flags]}
shift
mkdir -p "$out"
source "$(dirname "$0")/wheels.sh"
install_wheels
export PYTHONPATH=${SITE}:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
n=$(python3 -c "import jax; print(jax.device_count())")
kind=$(python3 -c "import jax; print(jax.devices()[0].device_kind.replace(' ', '_'))")
bench() {  # name, flags...
  local name=$1 limit=()
  shift
  if [[ -n ${BUDGET_S:-} ]]; then
    local left=$((BUDGET_S - SECONDS))
    if ((left < 60)); then echo "== $name skipped: ${left}s left"; return; fi
    limit=(timeout --kill-after=10 "$left")
  fi
  local log="$out/${name}${TAG:-}_${n}x${kind}.log" rc=0
  echo "== $name at ${SECONDS}s"
  ${limit[@]+"${limit[@]}"} python3 experiments/bench_rl_step.py --algo grpo --steps 3 \
    --warmup 2 "$@" --out "${log%.log}.json" > "$log" 2>&1 || rc=$?
  echo "== $name exit $rc at ${SECONDS}s"
  if grep -q '^| phase' "$log"; then sed -n '/^| phase/,$p' "$log"
  else grep -v "^[WI]0000" "$log" | tail -n 40; fi
}
bench sync "$@"
bench async --rollout_devices "${SPLIT:-$((n / 2))}" "$@"
if [ "$n" -eq 2 ] && [ $# -eq 0 ]; then
  bench sync_tis --rollout_is token "$@"
  bench async_tis --rollout_devices 1 --rollout_is token "$@"
fi
python3 - "$out" "$n" "${TAG:-}" <<'PY'
import glob, json, sys
out, n = sys.argv[1], sys.argv[2]
rows = {}
tag = sys.argv[3]
for path in sorted(glob.glob(f"{out}/*{tag}_{n}x*.json")):
    d = json.load(open(path))
    r = d["results"][0]
    name = path.split("/")[-1].rsplit(f"{tag}_{n}x", 1)[0]
    rows[name] = r
    m = r["last_metrics"]
    print(f"{name:10s} step {r['phases_s']['step']:.3f} s  " + "  ".join(
        f"{k} {r['phases_s'][k]:.3f}"
        for k in ("gen", "sync_rollout_weights", "wait_rollout", "forward", "learn")
        if k in r["phases_s"]) + f"  tok/s/dev {r['throughput_tokens_per_s_per_device']:.0f}"
        f"  peak {(r['peak_memory_bytes_process'] or 0) / 2**30:.1f} GiB  "
        f"kl {m.get('rollout_corr/kl', float('nan')):.2e}  "
        f"diff_mean {m.get('training/rollout_probs_diff_mean', float('nan')):.2e}")
if "sync" in rows and "async" in rows:
    print(f"async / sync throughput: {rows['sync']['phases_s']['step'] / rows['async']['phases_s']['step']:.2f}x")
PY
