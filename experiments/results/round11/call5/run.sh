python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore::DeprecationWarning tests/test_rollout.py -k compiler_options 2>&1 | tail -30
