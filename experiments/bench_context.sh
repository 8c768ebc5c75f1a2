#!/usr/bin/env bash
# The context (sequence) axis on 1, 2 and 4 GPUs: the passes after the rollout (the
# reference log-prob forward and the GRPO update, token-budget micro-batches of one
# sequence each) on a synthetic batch, through experiments/profile_long_update.py.
#
#   OUT=/path/to/results bash experiments/bench_context.sh RUN [RUN ...]
#
# Runs (each one process; its devices chosen with CUDA_VISIBLE_DEVICES):
#   weak1 / weak2 / weak4   weak scaling at a fixed 16,384 tokens of sequence a GPU:
#                           Qwen2.5-0.5B shape, 4 sequences of P1024 + R15360 on one GPU,
#                           P1024 + R31744 with mesh.context=2 on two, P1024 + R64512
#                           with mesh.context=4 on four (the 0.5B model at 64k tokens)
#   lora7b                  Qwen2.5-7B, LoRA rank 64, 4 sequences of P1024 + R31744,
#                           mesh.context=4 on four GPUs
# The rollout is not run (decoding 32k-64k tokens is minutes of its own; its memory is
# the KV cache's, see docs/guide.md). Needs wheels/ (ml_collections, absl, tensorboardX)
# beside the tree when they are not installed.
set -uo pipefail
OUT=${OUT:-context_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [[ -d wheels ]]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site wheels/*.whl 2>/dev/null
  export PYTHONPATH=$PWD:/tmp/site
fi
COMMON=(--batch 1 --n 4 --prompt_len 1024 --repeats 2)

run() {  # run NAME GPUS CAP ARGS...
  local name=$1 gpus=$2 cap=$3
  shift 3
  echo "== $name on GPUs $gpus (${SECONDS}s)"
  CUDA_VISIBLE_DEVICES=$gpus timeout --kill-after=10 "$cap" python3 \
    experiments/profile_long_update.py "${COMMON[@]}" "$@" --out "$OUT/$name.json" 2>&1 \
    | grep -v "^[WI]0000\|^WARNING: All log" > "$OUT/$name.log"
  echo "== $name exit ${PIPESTATUS[0]} at ${SECONDS}s"
  grep -E "^\|" "$OUT/$name.log" | tail -n 1
}

for name in "$@"; do
  case "$name" in
    weak1) run weak1 0 ${CAP:-200} --response_len 15360 --variants "dyn:16384" ;;
    weak2) run weak2 0,1 ${CAP:-200} --response_len 31744 --variants "dyn:32768+mesh_context=2" ;;
    weak4) run weak4 0,1,2,3 ${CAP:-240} --response_len 64512 \
             --variants "dyn:65536+mesh_context=4" ;;
    lora7b) run lora7b 0,1,2,3 ${CAP:-400} --preset qwen2.5-7b --response_len 31744 \
              --variants "dyn:32768+mesh_context=4+lora_rank=64" ;;
    *) echo "unknown run $name" >&2; exit 2 ;;
  esac
done
(cd "$OUT" && tar czf results.tgz -- *.log *.json 2>/dev/null && rm -f -- *.log *.json)
echo "done in ${SECONDS}s; logs and JSON in $OUT/results.tgz"
