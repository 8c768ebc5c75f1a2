"""The training attention's accelerator kernels over a mesh of 8 CPU devices, lowered or
compiled as far as the CPU allows: what no CPU test that runs the XLA reference sees.

- cuDNN under a `tensor` axis that splits the query heads but not the key/value heads
  (Qwen2.5-3B's 16 / 2 at tensor 4), with cuDNN's version checks passed: JAX's cuDNN
  partitioner refuses queries, keys and values split differently, so jrl repeats the
  key/value heads first (`heads_split_alike`). The compile then stops where it should
  on a CPU, at the missing CPU lowering of cuDNN's op, past the partitioner.
- Splash attention (a Mosaic TPU call) lowered for a TPU: XLA cannot split such a call
  over devices, so jrl runs it on each device's rows and heads (`_splash_per_shard`)."""

import textwrap

import pytest

from tests.eight_devices import run_script

_SCRIPT = textwrap.dedent("""
    import dataclasses, json
    import jax, jax.numpy as jnp
    from jax._src.cudnn import fused_attention_stablehlo as fa
    # The checks that would stop tracing off a GPU: what a Hopper GPU would answer.
    fa.check_cudnn_version = lambda: 91000
    fa.check_compute_capability = lambda capability: True
    fa.is_cuda_compute_capability_equal = lambda capability: False
    from jrl import sharding
    from jrl.rl import logprobs
    from jrl.models import ModelConfig, init_params
    from jrl.kernels import packed_attention as pa

    sharder = sharding.Sharder(sharding.make_mesh(
        sharding.MeshSettings(data=2, tensor=4), jax.devices()))

    def stops_at(f, *args):
        with sharder.active():
            try:
                jax.jit(f).lower(*args).compile()
                return "compiled"
            except Exception as e:  # the first line that names an error
                return [line for line in str(e).splitlines() if "Error" in line][-1]

    out = {}
    for n, k in ((16, 2), (16, 4)):
        config = ModelConfig(family="qwen2", vocab_size=128, hidden_size=256,
                             intermediate_size=128, num_layers=1, num_heads=n,
                             num_kv_heads=k, head_dim=64, dtype="bfloat16",
                             attention_impl="cudnn")
        params = init_params(dataclasses.replace(config, attention_impl="xla"),
                             jax.random.key(0))
        ones = lambda t: jnp.ones((4, t), jnp.int32)
        padded = lambda p, *a, config=config: logprobs.response_log_probs(p, *a, config=config)
        out[f"padded_{n}_{k}"] = stops_at(padded, params, ones(6), ones(6), ones(8), ones(8))

        def packed(q, kv, ids):
            q = sharding.constrain(q, ("batch", "length", "heads", None))
            kv = sharding.constrain(kv, ("batch", "length", "kv_heads", None))
            return pa.attend(q, kv, kv, pa.segments(ids, 4), "cudnn")

        ids = jnp.array([[1] * 6 + [2] * 6 + [0] * 4, [1] * 16], jnp.int32)
        out[f"packed_{n}_{k}"] = stops_at(packed, jnp.zeros((2, 16, n, 64), jnp.bfloat16),
                                          jnp.zeros((2, 16, k, 64), jnp.bfloat16), ids)
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def stops():
    return run_script(_SCRIPT)


@pytest.mark.parametrize("case", ["padded_16_2", "packed_16_2", "padded_16_4",
                                  "packed_16_4"])
def test_cudnn_gets_past_the_partitioner_when_tensor_splits_only_the_query_heads(stops,
                                                                                   case):
    assert "same sharding" not in stops[case], stops
    assert "not found for platform cpu" in stops[case], stops


_SPLASH = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp
    from jrl import sharding
    from jrl.rl import logprobs
    from jrl.models import ModelConfig, init_params
    from jrl.kernels import packed_attention

    config = ModelConfig.preset("qwen3-0.6b", num_layers=1, vocab_size=256, hidden_size=256,
                                intermediate_size=256, num_heads=4, num_kv_heads=2,
                                dtype="bfloat16")
    params = init_params(config, jax.random.key(0))
    jax.default_backend = lambda: "tpu"  # what jrl sees on a TPU host
    out = {"impl": packed_attention.choose_impl("auto", config.dtype, 128, 256)}
    ones = lambda t: jnp.ones((8, t), jnp.int32)  # padded rows of 128 + 128 slots
    f = lambda p, *a: logprobs.response_log_probs(p, *a, config=config)
    for sizes in (dict(data=8), dict(data=4, tensor=2)):
        sharder = sharding.Sharder(sharding.make_mesh(sharding.MeshSettings(**sizes),
                                                      jax.devices()))
        with sharder.active():
            try:
                text = jax.jit(f).trace(params, ones(128), ones(128), ones(128),
                                        ones(128)).lower(lowering_platforms=("tpu",)).as_text()
                out[str(sizes)] = text.count("tpu_custom_call") > 0
            except Exception as e:
                out[str(sizes)] = str(e).splitlines()[0][:300]
    print(json.dumps(out))
""")


def test_splash_attention_lowers_for_a_tpu_over_several_devices():
    out = run_script(_SPLASH)
    assert out.pop("impl") == "splash", out
    assert out == {"{'data': 8}": True, "{'data': 4, 'tensor': 2}": True}, out
