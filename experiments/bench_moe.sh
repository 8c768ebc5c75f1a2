#!/usr/bin/env bash
# The mixture-of-experts figures of docs/performance.md (Qwen3-30B-A3B shapes, random
# weights, bf16) in one device call, each RUN named:
#
#   OUT=/path/to/results bash experiments/bench_moe.sh [RUN ...]   # default: tests step
#
#   tests     the grouped-matmul kernels against XLA on the GPU
#             (tests/kernels/test_gpu_checks.py -k grouped)
#   step      C17: a GRPO step, LoRA r64 on every projection, 32 x 8, P128 / R256 forced,
#             remat dots_saveable, MB-sequence micro-batches (MB, default 128); NL layers
#             of 48 (default: 24 on a card of 120 GB or more, else 12: the frozen base
#             and the merged rollout weights take 57 GiB at 24)
#   trace     the same step with one more traced step, summarised by kernel
#             (experiments/trace_summary.py): where the update's time goes
#   rollout   C18: the MoE sampler against its HBM roofline, batch 256 and 64
#   rollout_gate_up   C32: the sampler at batch 256, the experts' gate and up joined into one
#             grouped matmul (the default) against two
#   kernels   C20: the grouped matmuls alone by kernel settings
#   ep        the step with the experts split over every GPU of the machine
#             (--mesh_expert P, P times the prompts: weak scaling); two GPUs or more
#
# Needs wheels/ beside the tree (experiments/wheels.sh). BUDGET_S (default 560) caps the
# whole call: a run that would start past it is skipped.
set -uo pipefail
OUT=${OUT:-moe_out}
BUDGET_S=${BUDGET_S:-560}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/wheels.sh"
install_wheels || exit 1
export PYTHONPATH=$PWD:$SITE
quiet() { grep -v "^[WI]0000\|^WARNING: All log" ; }
step() {  # name cap command...
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET_S - SECONDS))
  if ((left < 60)); then echo "== $name skipped: ${left}s of the budget left"; return; fi
  ((cap > left)) && cap=$left
  echo "== $name (${SECONDS}s)"
  timeout --kill-after=10 "$cap" "$@" 2>&1 | quiet > "$OUT/$name.log"
  echo "== $name exit ${PIPESTATUS[0]} at ${SECONDS}s" | tee -a "$OUT/$name.log"
  grep -E "^\| (learn|step|MFU actor update|peak memory|first step)|tok/s|roofline|passed|failed" \
    "$OUT/$name.log" | tail -8
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/env.log"
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
layers=${NL:-$((mib >= 120000 ? 24 : 12))}
c17=(python3 experiments/bench_rl_step.py --preset qwen3-30b-a3b --num_layers "$layers"
     --algo grpo --n 8 --prompt_len 128 --response_len 256 --warmup 1 --steps 2
     --lora_rank 64 --remat dots_saveable --micro_batch "${MB:-128}" --logprob_chunk_size 64)
for run in "${@:-tests step}"; do
  for name in $run; do
    case $name in
      tests) JAX_PLATFORMS=cuda step tests 200 python3 -m pytest -q -p no:cacheprovider \
               tests/kernels/test_gpu_checks.py -k grouped ;;
      step) step "step_${layers}l_mb${MB:-128}" 330 "${c17[@]}" --batch 32 \
              --out "$OUT/step_${layers}l_mb${MB:-128}.json" ;;
      trace) step "trace_${layers}l_mb${MB:-128}" 360 "${c17[@]}" --batch 32 \
               --trace_dir "$OUT/trace" --out "$OUT/trace_${layers}l_mb${MB:-128}.json" ;;
      rollout) step rollout 200 python3 experiments/bench_rollout.py --preset qwen3-30b-a3b \
                 --num_layers "$layers" --batch-sizes 256 64 --no-hf --repeats 2 \
                 --out "$OUT/rollout_${layers}l.json" ;;
      rollout_gate_up) step rollout_gate_up 200 python3 experiments/bench_rollout.py \
                 --preset qwen3-30b-a3b --num_layers "$layers" --batch-sizes 256 --no-hf \
                 --repeats 2 --moe-gate-up joined separate \
                 --out "$OUT/rollout_gate_up_${layers}l.json" ;;
      kernels) step kernels 200 python3 experiments/bench_grouped_matmul.py \
                 --preset qwen3-30b-a3b --tokens 12288 \
                 --tiles auto 128,128,64,4,1 128,128,64,4,2 128,128,64,6,1 \
                 --out "$OUT/grouped_matmul.json" ;;
      ep) if ((gpus < 2)); then echo "== ep skipped: one GPU"; continue; fi
          step "ep${gpus}_${layers}l" 400 "${c17[@]}" --batch $((32 * gpus)) \
            --mesh_expert "$gpus" --out "$OUT/ep${gpus}_${layers}l.json" ;;
      *) echo "unknown run $name"; exit 2 ;;
    esac
  done
done
