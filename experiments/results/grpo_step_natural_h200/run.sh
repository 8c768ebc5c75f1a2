# session 10, call 2 (nvidia-h200-x2; branch decode-qkv-operand + lowering-test fix)
# GPU0: decode lowering tests; GRPO forced (micro-batch 64), natural stops, micro-batch 128
# GPU1: PPO forced default vs --logprob_impl pallas
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv > $OUT/devices.txt
END=$(( $(date +%s) + 565 )); left() { echo $(( END - $(date +%s) )); }
R=/tmp/res; mkdir -p $R/g0 $R/g1
show() { grep -E "^\| (gen|forward|learn|step|MFU|peak|first)|response_length|Error|error" | tail -12; }
common="--warmup 1 --steps 2 --remat dots_saveable --logprob_chunk_size 64 --scan_unroll"
(
  export CUDA_VISIBLE_DEVICES=0 JAX_COMPILATION_CACHE_DIR=/tmp/cc0
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/models/test_decode_attention.py -k "lowers or sampler" 2>&1 | tail -3
  for v in "forced:--micro_batch 64" "natural:--micro_batch 64 --natural_stops --stop_prob 0.004" "forced_mb128:--micro_batch 128"; do
    name=${v%%:*}; flags=${v#*:}
    echo "== grpo $name ($flags) $(date +%T)"
    timeout $(left) python3 experiments/bench_rl_step.py --algo grpo $common $flags --out $R/g0/grpo_$name.json 2>&1 | show
  done
) > $OUT/gpu0.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1 JAX_COMPILATION_CACHE_DIR=/tmp/cc1
  for v in "default:" "pallas:--logprob_impl pallas"; do
    name=${v%%:*}; flags=${v#*:}
    echo "== ppo $name ($flags) $(date +%T)"
    timeout $(left) python3 experiments/bench_rl_step.py --algo ppo --micro_batch 64 $common $flags --out $R/g1/ppo_$name.json 2>&1 | show
  done
) > $OUT/gpu1.log 2>&1 &
wait
cd /tmp/res && tar czf $OUT/results.tgz g0 g1
cat $OUT/gpu0.log $OUT/gpu1.log
