#!/usr/bin/env bash
# The context (sequence) axis on 1, 2 and 4 GPUs, and the 32k / 64k GRPO steps.
#
#   OUT=/path/to/results bash experiments/bench_context.sh RUN[@GPUS] [RUN[@GPUS] ...]
#
# Runs (each one process; its devices chosen with CUDA_VISIBLE_DEVICES, the default
# below or the GPUS after `@`, e.g. weak2@1,2). `A&B` runs A and B side by side, `A+B`
# runs B after A in one lane: "weak1@0&weak2@1,2&docs_before@3+docs@3" then "weak4".
#   weak1 / weak2 / weak4   the passes after the rollout (reference log-prob forward and
#                           GRPO update, token-budget micro-batches of one sequence each,
#                           experiments/profile_long_update.py) at a fixed 16,384 tokens
#                           of sequence a GPU: Qwen2.5-0.5B shape, 4 sequences of
#                           P1024 + R15360 on one GPU, P1024 + R31744 with mesh.context=2
#                           on two, P1024 + R64512 with mesh.context=4 on four
#   lora7b                  the same passes for Qwen2.5-7B, LoRA rank 64, 4 sequences of
#                           P1024 + R31744, mesh.context=4 on four GPUs
#   full7b                  one whole GRPO step of the trainer (rollout included,
#                           experiments/bench_rl_step.py): Qwen2.5-7B, LoRA rank 64,
#                           4 prompts x 4 samples, P1024 + R32768 forced, mesh.context=4
#   full05b                 the same for Qwen2.5-0.5B, full fine-tuning, P1024 + R65536
#   full05b_2               the 0.5B step at P1024 + R32768, mesh.context=2 on two GPUs
#   decode_split            the decode-attention kernel alone at a few rows of a 65,600-slot
#                           cache (batch 4 / 16 / 64), one program per (row, head) against
#                           the split over slots (experiments/bench_decode_kernel.py)
#   docs / docs_before      the docs workload's GRPO step (P128 + R256 forced, 64 x 8) on
#                           one GPU, from this tree / from the tree in before/ (the
#                           1-GPU path before the context axis and the cache segments)
# The full steps run one warm-up step (compiling; FULL_WARMUP=0 skips it, and the one
# step's figures then include compiling) and one timed step, with the update's layers
# rolled (`--scan_unroll off`: an unrolled 7B update compiles for minutes). Needs
# wheels/ (ml_collections, absl, tensorboardX) beside the tree when they are not
# installed (SKIP_INSTALL=1 skips installing them).
set -uo pipefail
OUT=${OUT:-context_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/wheels.sh"
install_wheels || exit 1
COMMON=(--batch 1 --n 4 --prompt_len 1024 --repeats 2)
FULL=(--algo grpo --batch 4 --n 4 --prompt_len 1024 --warmup "${FULL_WARMUP:-1}" --steps 1
      --dynamic_bsz --scan_unroll off)
DOCS=(--algo grpo --warmup 1 --steps 2 --micro_batch 64 --remat dots_saveable
      --logprob_chunk_size 64 --scan_unroll)

run() {  # run NAME GPUS CAP TREE SCRIPT ARGS...
  local name=$1 gpus=$2 cap=$3 tree=$4 script=$5
  shift 5
  echo "== $name on GPUs $gpus (${SECONDS}s)"
  (cd "$tree" && CUDA_VISIBLE_DEVICES=$gpus PYTHONPATH=$PWD:$SITE \
    timeout --kill-after=10 "$cap" python3 "experiments/$script" "$@" \
    --out "$OUT/$name.json") 2>&1 | grep -v "^[WI]0000\|^WARNING: All log" \
    > "$OUT/$name.log"
  echo "== $name exit ${PIPESTATUS[0]} at ${SECONDS}s"
  grep -E "^\|" "$OUT/$name.log" | tail -n 1
}

one() {  # one NAME[@GPUS]
  local name=${1%@*} gpus=
  [[ "$1" == *@* ]] && gpus=${1#*@}
  case "$name" in
    weak1) run weak1 "${gpus:-0}" "${CAP:-200}" . profile_long_update.py "${COMMON[@]}" \
             --response_len 15360 --variants "dyn:16384" ;;
    weak2) run weak2 "${gpus:-0,1}" "${CAP:-200}" . profile_long_update.py "${COMMON[@]}" \
             --response_len 31744 --variants "dyn:32768+mesh_context=2" ;;
    weak4) run weak4 "${gpus:-0,1,2,3}" "${CAP:-240}" . profile_long_update.py \
             "${COMMON[@]}" --response_len 64512 --variants "dyn:65536+mesh_context=4" ;;
    lora7b) run lora7b "${gpus:-0,1,2,3}" "${CAP:-400}" . profile_long_update.py \
              "${COMMON[@]}" --preset qwen2.5-7b --response_len 31744 \
              --variants "dyn:32768+mesh_context=4+lora_rank=64" ;;
    full7b) run full7b "${gpus:-0,1,2,3}" "${CAP:-420}" . bench_rl_step.py "${FULL[@]}" \
              --preset qwen2.5-7b --lora_rank 64 --response_len 32768 --mesh_context 4 \
              --max_token_len 33792 ;;
    full05b) run full05b "${gpus:-0,1,2,3}" "${CAP:-300}" . bench_rl_step.py "${FULL[@]}" \
               --response_len 65536 --mesh_context 4 --max_token_len 66560 ;;
    full05b_2) run full05b_2 "${gpus:-0,1}" "${CAP:-300}" . bench_rl_step.py "${FULL[@]}" \
                 --response_len 32768 --mesh_context 2 --max_token_len 33792 ;;
    decode_split) run decode_split "${gpus:-0}" "${CAP:-300}" . bench_decode_kernel.py \
                    --batch 4 16 64 --slots 65600 --fill 65000 --splits 0 1 4 8 17 32 \
                    --no_tiles_sweep ;;
    docs) run docs "${gpus:-0}" "${CAP:-240}" . bench_rl_step.py "${DOCS[@]}" ;;
    docs_before) run docs_before "${gpus:-0}" "${CAP:-240}" before bench_rl_step.py \
                   "${DOCS[@]}" ;;
    *) echo "unknown run $name" >&2; return 2 ;;
  esac
}

lane() {  # lane A+B+...: one run after another
  local r
  IFS='+' read -ra seq <<< "$1"
  for r in "${seq[@]}"; do one "$r"; done
}

for group in "$@"; do  # lanes joined by & start together; the next group waits for them
  IFS='&' read -ra lanes <<< "$group"
  for l in "${lanes[@]}"; do lane "$l" & done
  wait
done
(cd "$OUT" && tar czf results.tgz -- *.log *.json 2>/dev/null && rm -f -- *.log *.json)
echo "done in ${SECONDS}s; logs and JSON in $OUT/results.tgz"
