"""The decode-attention kernel's split of the cache, timed inside a scan over layers.

One jitted program applies `decode_attention` 24 times (a layer loop: each layer its
own cache, each output feeding the next query), so the figures are the kernel and its
merge as a decode step runs them, not the dispatch of single calls. Qwen2.5-0.5B's
attention shape (14 query heads, 2 key/value heads, head_dim 64), a cache of 384 slots
(P128 + R256) filled to `--fill` slots after up to 16 slots of left padding, bf16.
Variants: `decode_attention.SPLIT` (cache slots per program: 64 = one block per
program, 384 = one program per row and head), checked against the XLA path.

    python experiments/bench_decode_splits.py --out splits.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import jax
import jax.numpy as jnp

from jrl.models import decode_attention as da


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256, 512])
    p.add_argument("--fill", type=int, nargs="+", default=[192, 320])
    p.add_argument("--splits", type=int, nargs="+", default=[64, 128, 192, 384])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for b in args.batch:
        keys = jax.random.split(jax.random.key(b), 4)
        shape = (args.layers, b, 2, 384, 64)
        k = jax.random.normal(keys[0], shape, jnp.bfloat16)
        v = jax.random.normal(keys[1], shape, jnp.bfloat16)
        q = jax.random.normal(keys[2], (b, 14, 64), jnp.bfloat16)
        start = jax.random.randint(keys[3], (b,), 0, 16)
        for fill in args.fill:
            def layers(q, k, v, start, impl, fill=fill):
                def layer(q, kv):
                    out = da.decode_attention(q, kv[0], kv[1], start, fill, impl=impl)
                    return out, None
                return jax.lax.scan(layer, q, (k, v))[0]

            want = jax.jit(layers, static_argnames="impl")(q, k, v, start, "xla")
            for split in args.splits:
                da.SPLIT = split
                fn = jax.jit(lambda q, k, v, s: layers(q, k, v, s, "pallas"))
                got = fn(q, k, v, start)
                err = float(jnp.linalg.norm((got - want).astype(jnp.float32))
                            / jnp.linalg.norm(want.astype(jnp.float32)))
                for _ in range(3):
                    jax.block_until_ready(fn(q, k, v, start))
                times = []
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(q, k, v, start))
                    times.append(time.perf_counter() - t0)
                us = statistics.median(times) / args.layers * 1e6
                # Bytes the filled slots hold: keys and values of every row and head.
                gbps = 2 * b * 2 * fill * 64 * 2 / (us * 1e-6) / 1e9
                row = dict(batch=b, fill=fill, split=split, programs=384 // math.gcd(384, split),
                           us_per_layer=us, filled_gb_per_s=gbps, rel_err=err)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| batch | filled slots | slots per program | µs per layer | GB/s of filled cache "
          "| rel. err |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['fill']} | {r['split']} | {r['us_per_layer']:.1f} | "
              f"{r['filled_gb_per_s']:.0f} | {r['rel_err']:.1e} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
