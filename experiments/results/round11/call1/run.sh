# next session, call 1 (nvidia-h200-x2; branch sample-one-pass checked out; .before = export of main 0a9df54)
# GPU0: the kernel and sampling tests ON THE GPU (JAX_PLATFORMS=cuda; conftest only sets a default),
#       then sampler + GRPO forced, before vs after (bench_decode_step.sh)
# GPU1: this tree's GRPO forced, default vs --log_prob_micro_batch 256 vs --logprob_chunk_size 128 (a later flag wins)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv > $OUT/devices.txt
END=$(( $(date +%s) + 565 )); left() { echo $(( END - $(date +%s) )); }
R=/tmp/res; mkdir -p $R/g0 $R/g1
(
  export CUDA_VISIBLE_DEVICES=0 JAX_COMPILATION_CACHE_DIR=/tmp/cc0
  JAX_PLATFORMS=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider tests/models/test_decode_attention.py \
    -k "not mesh" --tb=short 2>&1 | grep -E "^E |passed|failed|skipped" | head -20
  JAX_PLATFORMS=cuda timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_rollout.py \
    -k "block_stats or log_probs_match or first_token" --tb=short 2>&1 | grep -E "^E |passed|failed|skipped" | head -20
  AFTER_ARGS=--scan_unroll BEFORE_ARGS=--scan_unroll timeout $(left) bash experiments/bench_decode_step.sh $R/g0 .before rollout grpo:forced
) > $OUT/gpu0.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1 JAX_COMPILATION_CACHE_DIR=/tmp/cc1
  common="--algo grpo --warmup 1 --steps 2 --micro_batch 64 --remat dots_saveable --logprob_chunk_size 64 --scan_unroll"
  for v in "default:" "lpmb256:--log_prob_micro_batch 256" "chunk128:--logprob_chunk_size 128"; do
    name=${v%%:*}; flags=${v#*:}
    echo "== grpo $name ($flags) $(date +%T)"
    timeout $(left) python3 experiments/bench_rl_step.py $common $flags --out $R/g1/grpo_$name.json 2>&1 \
      | grep -E "^\| (gen|forward|learn|step|MFU|peak|first)|Error|error" | tail -8
  done
) > $OUT/gpu1.log 2>&1 &
wait
cd /tmp/res && tar czf $OUT/results.tgz g0 g1
cat $OUT/gpu0.log $OUT/gpu1.log
