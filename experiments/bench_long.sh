#!/usr/bin/env bash
# Long responses on one GPU: the Qwen2.5-0.5B shape, GRPO, 16 prompts x 8, P512 / R8192.
#
#   OUT=/path/to/results bash experiments/bench_long.sh RUN [RUN ...]
#
# Runs (each one bench_rl_step.py process, its JSON and log written to $OUT):
#   forced          token-budget micro-batches (--dynamic_bsz), every response 8192 tokens
#   natural         the same, rows stopping at lengths uniform in [512, 8192] (seeded)
#   long_tail       token-budget micro-batches, 90% of the rows stopping uniformly in
#                   [256, 1024] and 10% running to 8192 (picked by each row's key)
#   third           token-budget micro-batches, rows stopping uniformly in [512, 4949]
#                   (a third of the maximum on average)
#   paged_third     third with the paged KV cache (rollout.kv_cache=paged), its pool
#                   half of the contiguous cache's pages (PAGES, default 34,817 of 16
#                   slots: 128 rows x 544 pages / 2, and the trash page; by "+pageN"'s size)
#   paged_natural   natural with the paged KV cache, its pool every row at full length
#   partial         long_tail with partial rollouts (rollout.partial, 1,024 tokens a row
#                   a round; 9 warm-up steps, by which the rows running to 8192 hold
#                   their steady share of the decode rows)
#   partial_natural natural with partial rollouts (PTOK tokens a row a round, default
#                   2,048; 9 warm-up steps): the decode rows kept full between rounds
#                   instead of the batch's tail decoding alone
#   forced_mosaic / natural_mosaic   those two with the decode attention on Mosaic GPU
#                   (`--decode_attention mosaic`, MOSAIC_TILES' default tiles)
#   before_forced   the tree in before/ (an export of an earlier commit), forced, with
#                   the settings it was measured at (--micro_batch 8 --remat dots_saveable)
#   before_natural  likewise with the uniform lengths (needs a before/ that has the flag)
#   natural_before / forced_before   natural / forced (token-budget micro-batches) in
#                   before/: this tree's runs on an earlier commit, same settings
#   short / before_short   the docs/performance.md workload (64 x 8, P128 / R256), GRPO
#   short_natural / before_short_natural   the same with stop ids (--stop_prob 0.004)
#   short_packed    that workload with token-budget micro-batches
#   profile         forced, one traced step after the compile: where the time goes
#   decode_kernel   the decode kernel alone at the batch sizes the decode loop compacts to
#                   (32 / 64 / 96 / 128 rows of 8,704 slots, half and nearly full), split
#                   over slots into 1, 2, 4 or 8 parts (experiments/bench_decode_kernel.py)
#   head_backward   the log-prob head's backward (experiments/bench_head_backward.py; its
#                   --configs from HB_CONFIGS when set, HB_TIMEOUT seconds) and
#                   tests/kernels/test_logprob_head.py compiled on the GPU
# A run's name may carry settings after "+": "+splitPER_SM,MIN_SLOTS" (--decode_split),
# "+bN" (--decode_buckets N), "+tokN" (--max_token_len N: the token budget), "+mosaic"
# or "+mosaicSPEC" (--decode_attention mosaic [--mosaic_tiles SPEC]), "+xla" (--decode_attention
# xla), "+pageN" (--page_size N, the paged cache's pages), "+keep" (--partial_keep_cache),
# "+seqsN" (--max_num_seqs N: the paged cache's decode slots, refilled as rows stop),
# "+pfused" / "+punfused" (--paged_fused always / off: the paged decode in the fused
# kernel at any rows, or never; the default takes it where the unfused one would not split),
# "+pmaxN" (--paged_fused_max_splits N: the default's fused kernel also where the unfused
# one would split a row's blocks into at most N parts), "+paged" (--kv_cache paged: partial+paged is partial rollouts on the paged cache, its
# pool every row at full length), "+hxla" (--decode_head xla: the sampler's head on XLA's
# logits, not the kernel's masses), "+gxla" (--rollout_gemm xla: the sampler's matmuls
# left to XLA, Triton GEMM fusions included, not cuBLAS alone), "+hbxla" (--head_backward xla: the log-prob head's
# backward in XLA),
# "+hbT,V,K,STAGES,OVERLAP,GROUP,CONSUMERS" (--head_backward_blocks), e.g.
# natural+split4,1024+b8 or forced+tok32768. Its files are named with "_" for "+".
# Needs wheels/ (ml_collections, tensorboardX, absl) beside the tree; BUDGET_S (default
# 560) caps the whole call, each run getting what is left.
set -uo pipefail
OUT=${OUT:-bench_out}
BUDGET_S=${BUDGET_S:-560}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jrl_jax_cache}
source "$(dirname "$0")/wheels.sh"
install_wheels || exit 1
ROOT=$PWD
LONG=(--preset qwen2.5-0.5b --algo grpo --batch 16 --n 8 --prompt_len 512 --response_len 8192
  --warmup 1 --steps 1)
SHORT=(--preset qwen2.5-0.5b --algo grpo --batch 64 --n 8 --prompt_len 128 --response_len 256
  --warmup 1 --steps 2)
NATURAL=(--natural_stops --uniform_lengths 512,8192)
LONG_TAIL=(--natural_stops --long_tail 256,1024,0.1)
THIRD=(--natural_stops --uniform_lengths 512,4949)

run() {  # run NAME TREE ARGS...
  local name=$1 tree=$2
  local log="$OUT/${1//+/_}.log"  # "+" in a file name does not come back from the device
  shift 2
  local left=$((BUDGET_S - SECONDS))
  if ((left < 45)); then echo "== $name skipped: ${left}s left"; return; fi
  echo "== $name (timeout ${left}s, ${SECONDS}s elapsed)"
  (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout --kill-after=10 "$left" \
    python3 experiments/bench_rl_step.py "$@" --out "${log%.log}.json") 2>&1 \
    | grep -v "^[WI]0000" > "$log"
  echo "== $name exit ${PIPESTATUS[0]} at ${SECONDS}s"
  if grep -q '^| phase' "$log"; then sed -n '/^| phase/,$p' "$log"
  else tail -n 70 "$log"; fi
}

for name in "$@"; do
  base=${name%%+*}
  extra=()
  PAGE=
  IFS=+ read -ra opts <<< "${name#"$base"}"
  for o in "${opts[@]}"; do
    case "$o" in
      "") ;;
      split*) extra+=(--decode_split "${o#split}") ;;
      b*) extra+=(--decode_buckets "${o#b}") ;;
      tok*) extra+=(--max_token_len "${o#tok}") ;;
      hbxla) extra+=(--head_backward xla) ;;
      hxla) extra+=(--decode_head xla) ;;
      gxla) extra+=(--rollout_gemm xla) ;;
      hb[0-9]*) extra+=(--head_backward_blocks "${o#hb}") ;;
      page[0-9]*) PAGE=${o#page}; extra+=(--page_size "$PAGE") ;;
      keep) extra+=(--partial_keep_cache) ;;
      paged) extra+=(--kv_cache paged) ;;
      seqs[0-9]*) extra+=(--max_num_seqs "${o#seqs}") ;;
      pfused) extra+=(--paged_fused always) ;;
      punfused) extra+=(--paged_fused off) ;;
      pmax[0-9]*) extra+=(--paged_fused_max_splits "${o#pmax}") ;;
      xla) extra+=(--decode_attention xla) ;;
      mosaic) extra+=(--decode_attention mosaic) ;;
      mosaic*) extra+=(--decode_attention mosaic --mosaic_tiles "${o#mosaic}") ;;
      *) echo "unknown setting $o in $name" >&2; exit 2 ;;
    esac
  done
  LONG_RUN=("${LONG[@]}" "${extra[@]}")
  SHORT_RUN=("${SHORT[@]}" "${extra[@]}")
  case "$base" in
    decode_kernel)
      for fill in 4608 8600; do
        PYTHONPATH=/tmp/site:$ROOT timeout 150 python3 experiments/bench_decode_kernel.py \
          --batch 32 64 96 128 --slots 8704 --fill $fill --splits 0 1 2 4 8 \
          --no_tiles_sweep --out "$OUT/decode_kernel_$fill.json" 2>&1 \
          | grep -v "^[WI]0000" | tee "$OUT/decode_kernel_$fill.log"
      done ;;
    head_backward)
      PYTHONPATH=/tmp/site:$ROOT timeout "${HB_TIMEOUT:-200}" python3 \
        experiments/bench_head_backward.py ${HB_CONFIGS:+--configs $HB_CONFIGS} \
        --out "$OUT/head_backward.json" 2>&1 | grep -v "^[WI]0000" | tee "$OUT/head_backward.log"
      JAX_PLATFORMS=cuda,cpu PYTHONPATH=/tmp/site:$ROOT timeout 200 python3 -m pytest -q \
        -p no:cacheprovider tests/kernels/test_logprob_head.py 2>&1 | tail -n 30 \
        | tee "$OUT/head_tests.log" ;;
    forced) run "$name" "$ROOT" "${LONG_RUN[@]}" --dynamic_bsz ;;
    natural) run "$name" "$ROOT" "${LONG_RUN[@]}" --dynamic_bsz "${NATURAL[@]}" ;;
    long_tail) run "$name" "$ROOT" "${LONG_RUN[@]}" --dynamic_bsz "${LONG_TAIL[@]}" ;;
    third) run "$name" "$ROOT" "${LONG_RUN[@]}" --dynamic_bsz "${THIRD[@]}" ;;
    paged_third) run "$name" "$ROOT" "${LONG_RUN[@]}" --dynamic_bsz "${THIRD[@]}" \
                   --kv_cache paged --num_pages "${PAGES:-$((128 * (8704 / ${PAGE:-16}) / 2 + 1))}" ;;
    paged_natural) run "$name" "$ROOT" "${LONG_RUN[@]}" --dynamic_bsz "${NATURAL[@]}" \
                     --kv_cache paged ;;
    partial) run "$name" "$ROOT" "${LONG_RUN[@]}" --dynamic_bsz "${LONG_TAIL[@]}" \
               --partial_max_tokens 1024 --warmup 9 --steps 2 ;;
    partial_natural) run "$name" "$ROOT" "${LONG_RUN[@]}" --dynamic_bsz "${NATURAL[@]}" \
               --partial_max_tokens "${PTOK:-2048}" --warmup 9 --steps 2 ;;
    forced_mosaic) run forced_mosaic "$ROOT" "${LONG_RUN[@]}" --dynamic_bsz --decode_attention mosaic ;;
    natural_mosaic) run natural_mosaic "$ROOT" "${LONG_RUN[@]}" --dynamic_bsz "${NATURAL[@]}" \
                      --decode_attention mosaic ;;
    before_forced) run before_forced "$ROOT/before" "${LONG_RUN[@]}" --micro_batch 8 \
                     --remat dots_saveable ;;
    before_natural) run before_natural "$ROOT/before" "${LONG_RUN[@]}" --micro_batch 8 \
                      --remat dots_saveable "${NATURAL[@]}" ;;
    natural_before) run "$name" "$ROOT/before" "${LONG_RUN[@]}" --dynamic_bsz "${NATURAL[@]}" ;;
    forced_before) run "$name" "$ROOT/before" "${LONG_RUN[@]}" --dynamic_bsz ;;
    short) run "$name" "$ROOT" "${SHORT_RUN[@]}" ;;
    short_packed) run short_packed "$ROOT" "${SHORT[@]}" --dynamic_bsz ;;
    profile_short) run profile_short "$ROOT" "${SHORT[@]}" --dynamic_bsz --steps 0 \
                     --trace_dir /tmp/trace_short ;;
    profile) run profile "$ROOT" "${LONG_RUN[@]}" --dynamic_bsz --steps 0 --trace_dir /tmp/trace ;;
    before_short) run before_short "$ROOT/before" "${SHORT[@]}" ;;
    short_natural) run "$name" "$ROOT" "${SHORT_RUN[@]}" --natural_stops --stop_prob 0.004 ;;
    before_short_natural) run "$name" "$ROOT/before" "${SHORT[@]}" --natural_stops --stop_prob 0.004 ;;
    *) echo "unknown run $name" >&2; exit 2 ;;
  esac
done
