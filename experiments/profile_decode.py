"""Where a decode step's time goes: model forward (XLA vs Pallas decode attention), sampling.

    python experiments/profile_decode.py --preset qwen2.5-0.5b --batch 256 --context 384

Times one jitted decode forward + unembedding over a KV cache of `--context` slots,
with each decode-attention implementation, and one sampling step over `[B, V]`
logits (no filter; top-p 0.9), each the median of `--repeats` runs after warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp

from jrl.models.cache import init_cache
from jrl.models.config import ModelConfig
from jrl.models.heads import unembed
from jrl.models.transformer import forward, init_params
from jrl.rollout import sampler


def median_ms(fn, *args, repeats: int = 15) -> float:
    """Milliseconds of `fn(*args)`, median of `repeats` calls after one untimed call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=384, help="cache slots (P + R)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    base = ModelConfig.preset(args.preset, param_dtype=args.dtype, dtype=args.dtype)
    params = jax.jit(functools.partial(init_params, base))(jax.random.key(0))
    b, s = args.batch, args.context
    tokens = jax.random.randint(jax.random.key(1), (b, 1), 0, base.vocab_size)
    positions = jnp.full((b, 1), s // 2, jnp.int32)
    key_mask = (jnp.arange(s)[None, :] <= s // 2).astype(jnp.int32).repeat(b, 0)
    rows = [("device", jax.devices()[0].device_kind), ("jax", jax.__version__)]
    for impl in ("xla", "pallas"):
        if impl == "pallas" and (jax.default_backend() != "gpu" or s % 64):
            continue
        config = dataclasses.replace(base, decode_attention_impl=impl)
        cache = init_cache(config, b, s)

        def step(params, cache, config=config):
            hidden, cache = forward(params, tokens, positions, key_mask, cache, s // 2,
                                    config=config)
            return unembed(params, hidden[:, 0]), cache

        # Compiled as the sampler compiles its programs (`sampler.compiler_options`).
        step = jax.jit(step, compiler_options=sampler.compiler_options(sampler.SamplingConfig()))

        ms = median_ms(step, params, cache, repeats=args.repeats)
        rows.append((f"decode forward+unembed, {impl} attention", f"{ms:.3f} ms"))
    logits = jax.random.normal(jax.random.key(2), (b, base.vocab_size), jnp.float32)
    keys = jax.random.split(jax.random.key(3), b)
    for name, sampling in (("sample, no filter", sampler.SamplingConfig()),
                           ("sample, top_p=0.9", sampler.SamplingConfig(top_p=0.9)),
                           ("greedy", sampler.SamplingConfig(do_sample=False))):
        fn = jax.jit(functools.partial(sampler.sample_tokens, sampling=sampling))
        rows.append((name, f"{median_ms(fn, logits, keys, repeats=args.repeats):.3f} ms"))
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    kv_bytes = 2 * base.num_layers * b * s * base.num_kv_heads * base.head_dim * 2
    rows.append(("weights + full cache read at 3350 GB/s",
                 f"{(weight_bytes + kv_bytes) / 3350e9 * 1e3:.3f} ms"))
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
