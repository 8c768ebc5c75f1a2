# session 10, call 1 (nvidia-h200-x2; branch decode-qkv-operand checked out; .before = export of main 28a0bf2)
# GPU0: decode tests, then sampler + GRPO forced, before vs after (bench_decode_step.sh)
# GPU1: PPO forced on this tree: default, --critic_micro_batch 128, --logprob_impl pallas
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv > $OUT/devices.txt
python3 -c "import jax, jaxlib, flax, optax; print(jax.__version__, jaxlib.__version__, flax.__version__, optax.__version__)" >> $OUT/devices.txt
END=$(( $(date +%s) + 560 )); left() { echo $(( END - $(date +%s) )); }
R=/tmp/res; mkdir -p $R/g0 $R/g1
(
  export CUDA_VISIBLE_DEVICES=0 JAX_COMPILATION_CACHE_DIR=/tmp/cc0
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/models/test_decode_attention.py 2>&1 | tail -3
  AFTER_ARGS=--scan_unroll BEFORE_ARGS=--scan_unroll timeout $(left) bash experiments/bench_decode_step.sh $R/g0 .before grpo:forced
  timeout $(left) bash experiments/bench_decode_step.sh $R/g0 .before rollout
) > $OUT/gpu0.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1 JAX_COMPILATION_CACHE_DIR=/tmp/cc1
  common="--algo ppo --warmup 1 --steps 2 --micro_batch 64 --remat dots_saveable --logprob_chunk_size 64 --scan_unroll"
  for v in "default:" "cmb128:--critic_micro_batch 128" "pallas:--logprob_impl pallas"; do
    name=${v%%:*}; flags=${v#*:}
    echo "== ppo $name ($flags) $(date +%T)"
    timeout $(left) python3 experiments/bench_rl_step.py $common $flags --out $R/g1/ppo_$name.json 2>&1 | grep -E "^\| (gen|forward|learn|step|MFU|peak)|Error|error" 
  done
) > $OUT/gpu1.log 2>&1 &
wait
cd /tmp/res && tar czf $OUT/results.tgz g0 g1
tail -n 60 $OUT/gpu0.log $OUT/gpu1.log
