# round eleven, call 2 (nvidia-h200-x2; main + the GPU-aware kernel tests)
# GPU0: the kernel tests compiled on the GPU (JAX_PLATFORMS=cuda), then the sampling tests
# GPU1: PPO forced and natural in one call (round ten's natural PPO came on another machine)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv > $OUT/devices.txt
python3 -c "import jax, jaxlib, flax, optax; print(jax.__version__, jaxlib.__version__, flax.__version__, optax.__version__)" >> $OUT/devices.txt
END=$(( $(date +%s) + 560 )); left() { echo $(( END - $(date +%s) )); }
R=$OUT; mkdir -p $R/g1
(
  export CUDA_VISIBLE_DEVICES=0 JAX_COMPILATION_CACHE_DIR=/tmp/cc0 JAX_PLATFORMS=cuda
  python3 -c "import jax; print(jax.devices())"
  timeout 330 python3 -m pytest -q -p no:cacheprovider --durations=8 --tb=short \
    tests/models/test_decode_attention.py tests/models/test_head_kernel.py -k "not mesh and not sharded"
  echo "== sampling tests $(date +%T)"
  timeout $(left) python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_rollout.py \
    -k "block_stats or log_probs_match or first_token or threshold"
) > $R/gpu0_tests.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1 JAX_COMPILATION_CACHE_DIR=/tmp/cc1
  common="--algo ppo --warmup 1 --steps 2 --micro_batch 64 --remat dots_saveable --logprob_chunk_size 64 --scan_unroll"
  for v in "forced:" "natural:--natural_stops --stop_prob 0.004"; do
    name=${v%%:*}; flags=${v#*:}
    echo "== ppo $name ($flags) $(date +%T)"
    timeout $(left) python3 experiments/bench_rl_step.py $common $flags --out $R/g1/ppo_$name.json 2>&1 \
      | grep -E "^\| |Error|error" | tail -14
  done
) > $R/gpu1.log 2>&1 &
wait
tail -c 6000 $R/gpu0_tests.log; cat $R/gpu1.log
