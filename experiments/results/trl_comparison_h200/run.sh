# session 10, call 3 (nvidia-h200-x2; branch decode-qkv-operand)
# GPU1: lowering tests' failure on a GPU host (traceback + custom calls), GPU seeds 0-2 of grpo_arith, PPO natural
# GPU0: jrl GRPO forced; then, once GPU1 is done, TRL GRPOTrainer and jrl GRPO forced again
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl_trl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv > $OUT/devices.txt
pip list 2>/dev/null | grep -iE "^(torch|transformers|trl|jax|jaxlib) " >> $OUT/devices.txt
END=$(( $(date +%s) + 560 )); left() { echo $(( END - $(date +%s) )); }
R=/tmp/res; mkdir -p $R/g0 $R/g1
show() { grep -E "^\| (gen|forward|learn|step|MFU|peak|first)|response_length|Error|error" | tail -12; }
common="--warmup 1 --steps 2 --micro_batch 64 --remat dots_saveable --logprob_chunk_size 64 --scan_unroll"
(
  export CUDA_VISIBLE_DEVICES=1 JAX_COMPILATION_CACHE_DIR=/tmp/cc1
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/models/test_decode_attention.py -k lowers --tb=short 2>&1 | grep -E "^E |assert|Error|passed|failed" | head -30
  python3 - <<'PY'
import jax, jax.numpy as jnp
from unittest import mock
from jrl.models import decode_attention as da
sds = jax.ShapeDtypeStruct
b, n, kv, h, s = 8, 14, 2, 64, 128
args = (sds((b, n, h), jnp.bfloat16), sds((b, kv, h), jnp.bfloat16), sds((b, kv, h), jnp.bfloat16),
        sds((b, h // 2), jnp.float32), sds((b, h // 2), jnp.float32), sds((b, kv, s, h), jnp.bfloat16),
        sds((b, kv, s, h), jnp.bfloat16), sds((b,), jnp.int32), sds((), jnp.int32))
fn = lambda *a: da.append_and_attend(*a, impl="pallas")
with mock.patch.object(jax, "default_backend", lambda: "gpu"):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
for line in text.splitlines():
    if "custom_call" in line or "dynamic_update_slice" in line or "alias" in line:
        print(line[:400])
PY
  mkdir -p $R/g1/seeds
  for s in 0 1 2; do t0=$SECONDS
    timeout 150 python3 -m jrl.train --config=configs/grpo_arith.py --config.seed=$s --workdir=/tmp/w$s > /tmp/seed$s.log 2>&1
    cp /tmp/w$s/metrics.jsonl $R/g1/seeds/seed$s.metrics.jsonl 2>/dev/null
    echo "seed $s: $((SECONDS-t0)) s $(grep -E 'points' /tmp/seed$s.log | tail -1)"; tail -2 /tmp/seed$s.log | grep -i error
  done
  echo "== ppo natural $(date +%T)"
  timeout $(( $(left) - 150 )) python3 experiments/bench_rl_step.py --algo ppo $common --natural_stops --stop_prob 0.004 --out $R/g1/ppo_natural.json 2>&1 | show
  touch /tmp/gpu1_done
) > $OUT/gpu1.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=0 JAX_COMPILATION_CACHE_DIR=/tmp/cc0
  echo "== grpo forced, first $(date +%T)"
  timeout $(left) python3 experiments/bench_rl_step.py --algo grpo $common --out $R/g0/grpo_forced_1.json 2>&1 | show
  while [ ! -e /tmp/gpu1_done ] && [ $(left) -gt 150 ]; do sleep 2; done
  echo "== trl $(date +%T)"
  timeout $(left) python3 experiments/bench_trl_grpo.py --preset qwen2.5-0.5b --batch 64 --n 8 --prompt_len 128 --response_len 256 --warmup 1 --steps 2 --out $R/g0/trl_forced.json 2>&1 | tail -10
  echo "== grpo forced, after trl $(date +%T)"
  timeout $(left) python3 experiments/bench_rl_step.py --algo grpo $common --out $R/g0/grpo_forced_2.json 2>&1 | show
) > $OUT/gpu0.log 2>&1 &
wait
cd /tmp/res && tar czf $OUT/results.tgz g0 g1
cat $OUT/gpu1.log $OUT/gpu0.log
