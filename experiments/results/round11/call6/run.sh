python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore::DeprecationWarning -k "not mesh and not sharded" \
  tests/models/test_triton_backend.py tests/models/test_head_kernel.py tests/test_rollout.py::test_the_samplers_compiler_options \
  "tests/models/test_decode_attention.py::test_sampler_through_the_kernel_matches_the_xla_path" 2>&1 | tail -15
