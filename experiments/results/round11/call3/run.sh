# round eleven, call 3 (nvidia-h200-x2): the kernel tests compiled on the GPU under full
# float32 (GPU0); the other model tests on the GPU, for information (GPU1)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
(
  export CUDA_VISIBLE_DEVICES=0 JAX_COMPILATION_CACHE_DIR=/tmp/cc0
  timeout 400 python3 -m pytest -q -p no:cacheprovider --durations=5 --tb=short -W ignore::DeprecationWarning \
    tests/models/test_decode_attention.py tests/models/test_head_kernel.py -k "not mesh and not sharded"
) > $OUT/gpu0_tests.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1 JAX_COMPILATION_CACHE_DIR=/tmp/cc1
  timeout 400 python3 -m pytest -q -p no:cacheprovider --tb=line -W ignore::DeprecationWarning \
    tests/models/test_transformer.py tests/models/test_shared_prompts.py tests/models/test_cache.py \
    tests/models/test_hf_parity.py tests/test_logprobs.py -k "not mesh and not sharded and not eight"
) > $OUT/gpu1_tests.log 2>&1 &
wait
tail -c 5000 $OUT/gpu0_tests.log; tail -c 5000 $OUT/gpu1_tests.log
