# round eleven, call 4 (nvidia-h200-x2): tests on the GPU with tests/conftest.py's full float32
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
sel="not mesh and not sharded and not eight"
(
  export CUDA_VISIBLE_DEVICES=0 JAX_COMPILATION_CACHE_DIR=/tmp/cc0
  timeout 420 python3 -m pytest -q -p no:cacheprovider --tb=line -W ignore::DeprecationWarning -k "$sel" \
    tests/models/test_transformer.py tests/models/test_shared_prompts.py tests/models/test_cache.py \
    tests/models/test_hf_parity.py tests/models/test_lora.py tests/test_logprobs.py
) > $OUT/gpu0_tests.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1 JAX_COMPILATION_CACHE_DIR=/tmp/cc1
  timeout 420 python3 -m pytest -q -p no:cacheprovider --tb=line -W ignore::DeprecationWarning -k "$sel" \
    tests/models/test_decode_attention.py tests/models/test_head_kernel.py tests/test_rollout.py
) > $OUT/gpu1_tests.log 2>&1 &
wait
tail -c 4000 $OUT/gpu0_tests.log; tail -c 4000 $OUT/gpu1_tests.log
