#!/usr/bin/env bash
# The full RL step on one GPU, jrl next to TRL: the one command for the GPU machine.
#
#   OUT=/path/to/results bash experiments/run_bench.sh [all|jrl|trl]
#
# Run from the repository root, with `wheels/` (ml_collections, tensorboardX, absl)
# and, unless the mode is `jrl`, `.whl/` (trl, datasets, dill, multiprocess) present;
# both folders are git-ignored, so a copy of the tree to another machine must carry them.
# Modes: all (default) = jrl forced, TRL forced, jrl natural stops; jrl = both jrl
# runs; trl = the TRL run only. Writes at most 7 files to $OUT:
#   env.log                       nvidia-smi, package versions, each run's exit status
#   jrl_forced.{json,log}         GRPO then PPO, every response 256 tokens (ignore_stop)
#   trl_grpo.{json,log}           TRL GRPOTrainer, same shapes, forced 256 tokens
#   jrl_natural.{json,log}        GRPO with natural stops (stop ids added: --stop_prob)
# Each run gets a timeout, cut to what is left of BUDGET_S (default 530 s), so the
# script ends in time; a run cut short still leaves the JSON of what it finished.
# SMOKE=1 runs the same flow at toy sizes (CPU); SKIP_INSTALL=1 uses the packages
# already importable (PYTHONPATH as set by the caller).
set -uo pipefail

MODE=${1:-all}
case "$MODE" in all | jrl | trl) ;; *) echo "usage: $0 [all|jrl|trl]" >&2; exit 2 ;; esac
OUT=${OUT:-bench_out}
BUDGET_S=${BUDGET_S:-530}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Runs share compiled programs (the forced and natural GRPO runs differ only in the rollout).
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jrl_jax_cache}

source "$(dirname "$0")/wheels.sh"
if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
  more=()
  if [[ "$MODE" != jrl ]]; then more=(.whl/*.whl); fi
  install_wheels "${more[@]}" || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi

{
  date -u
  nvidia-smi
  python3 - <<'EOF'
import importlib.metadata as md
names = ("jax jaxlib jax-cuda13-plugin flax optax orbax-checkpoint ml_collections torch "
         "transformers accelerate trl datasets tokenizers huggingface-hub pyarrow fsspec "
         "dill multiprocess")
for name in names.split():
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}: not installed")
EOF
} 2>&1 | tee "$OUT/env.log"

# run NAME CAP_S COMMAND...: tees the output to $OUT/NAME.log under a timeout.
run() {
  local name=$1 cap=$2
  shift 2
  local left=$((BUDGET_S - SECONDS))
  if ((left < 60)); then
    echo "== $name skipped: ${left}s of the budget left" | tee -a "$OUT/env.log"
    return
  fi
  local limit=$((cap < left ? cap : left))
  echo "== $name (timeout ${limit}s, ${SECONDS}s elapsed)"
  timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=$?
  echo "== $name exit $rc at ${SECONDS}s" | tee -a "$OUT/env.log"
}

# JRL_EXTRA: more bench_rl_step.py flags (e.g. --micro_batch 64 --remat dots_saveable).
# shellcheck disable=SC2206
JRL=(python3 experiments/bench_rl_step.py --preset qwen2.5-0.5b --batch 64 --n 8
  --prompt_len 128 --response_len 256 --warmup 2 --steps 3 ${JRL_EXTRA:-})
TRL=(python3 experiments/bench_trl_grpo.py --preset qwen2.5-0.5b --batch 64 --n 8
  --prompt_len 128 --response_len 256 --warmup 1 --steps 2)
if [[ "${SMOKE:-0}" == 1 ]]; then  # the same flow at toy sizes, on a CPU
  SHAPES=(--preset tiny --batch 4 --n 2 --prompt_len 16 --response_len 16 --steps 1
    --micro_batch 4)
  JRL=(python3 experiments/bench_rl_step.py "${SHAPES[@]}" --warmup 1)
  TRL=(python3 experiments/bench_trl_grpo.py "${SHAPES[@]}" --warmup 1 --cpu)
fi

if [[ "$MODE" != trl ]]; then
  run jrl_forced 330 "${JRL[@]}" --algo both --out "$OUT/jrl_forced.json"
fi
if [[ "$MODE" != jrl ]]; then
  run trl_grpo 210 "${TRL[@]}" --out "$OUT/trl_grpo.json"
fi
if [[ "$MODE" != trl ]]; then
  # A random model almost never samples the one EOS id of 152k; 0.4% of the vocabulary as
  # stop ids ends rows after ~160 tokens on average (the longest still reach 256).
  run jrl_natural 180 "${JRL[@]}" --algo grpo --natural_stops --stop_prob 0.004 \
    --out "$OUT/jrl_natural.json"
fi
# Side by side, from the JSON files that exist.
OUT="$OUT" python3 - <<'EOF' 2>&1 | tee -a "$OUT/env.log"
import json, os
out = os.environ["OUT"]
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
rows = {}
for file, suffix in (("jrl_forced.json", ""), ("jrl_natural.json", " natural")):
    for r in (load(file) or {}).get("results", []):
        rows[f"jrl {r['algo']}{suffix}"] = dict(
            step=r["phases_s"]["step"], gen=r["phases_s"]["gen"],
            tok=r["throughput_tokens_per_s_per_device"], resp=r["response_length_mean"],
            mem=(r["peak_memory_bytes_process"] or 0) / 2**30)
trl = load("trl_grpo.json")
if trl:
    r = trl["result"]
    rows["trl grpo"] = dict(step=r["phases_s"]["step"], gen=r["phases_s"].get("gen", 0),
                            tok=r["throughput_tokens_per_s"], resp=r["response_length_mean"],
                            mem=(r["peak_memory_bytes"] or 0) / 2**30)
print("\n| run | step s | gen s | tokens/s/GPU | mean response | peak GiB |")
print("|---|---|---|---|---|---|")
for label, v in rows.items():
    print(f"| {label} | {v['step']:.2f} | {v['gen']:.2f} | {v['tok']:.0f} | {v['resp']:.0f} "
          f"| {v['mem']:.1f} |")
if "jrl grpo" in rows and "trl grpo" in rows:
    ratio = rows["trl grpo"]["step"] / rows["jrl grpo"]["step"]
    print(f"\nGRPO step time, TRL / jrl: {ratio:.2f}x")
EOF
echo "done in ${SECONDS}s; results in $OUT" | tee -a "$OUT/env.log"
