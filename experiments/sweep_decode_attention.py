"""Tile settings of the Pallas decode-attention kernel (`jrl.models.decode_attention`).

    python experiments/sweep_decode_attention.py --out sweep.json

Times one decode step's attention (Qwen2.5-0.5B heads: 14 query heads over 2 key/value
heads, head_dim 64) over a cache of `--slots` slots with rows left-padded by 0-63
slots, at a half-filled (`end` = 2/3 of the slots) and a full cache, for each
combination of key splits (`k_splits`), slots per block (`block_k`), warps and
pipeline stages; the median of `--repeats` jitted calls after a warm-up, with XLA's
masked attention over every slot as the reference.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.gpu import decode_attention as kernels

from jrl.models import decode_attention


def median_us(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e6 * sorted(times)[len(times) // 2]


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256, 512])
    p.add_argument("--slots", type=int, default=384)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    s, h = args.slots, args.head_dim
    results = []
    for b in args.batch_sizes:
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.normal(size=(b, args.heads, h)), jnp.bfloat16)
        k, v = (jnp.asarray(rng.normal(size=(b, args.kv_heads, s, h)), jnp.bfloat16)
                for _ in range(2))
        start = jnp.asarray(rng.integers(0, 64, b), jnp.int32)
        for end in (2 * s // 3, s):
            ref = jax.jit(lambda q, k, v, st, end=end: decode_attention.decode_attention(
                q, k, v, st, end, impl="xla"))
            want = np.asarray(ref(q, k, v, start), np.float32)
            xla_us = median_us(ref, q, k, v, start, repeats=args.repeats)
            print(f"B={b} end={end}: xla {xla_us:.1f} us", flush=True)
            for splits, block_k, warps, stages in itertools.product(
                    (1, 2, 3, 6), (64, 128), (4, 8), (2, 3)):
                if s % splits or (s // splits) % min(block_k, s // splits):
                    continue

                def run(q, k, v, st, splits=splits, block_k=block_k, warps=warps,
                        stages=stages, b=b, end=end):
                    kt, vt = (jnp.swapaxes(t, 1, 2) for t in (k, v))
                    return kernels.gqa(q, kt, vt, start_idx=st,
                                       kv_seq_len=jnp.full((b,), end, jnp.int32),
                                       sm_scale=1 / math.sqrt(h), block_k=block_k,
                                       k_splits=splits, num_warps=warps, num_stages=stages)
                fn = jax.jit(run)
                try:
                    err = float(np.max(np.abs(np.asarray(fn(q, k, v, start), np.float32) - want)))
                    us = median_us(fn, q, k, v, start, repeats=args.repeats)
                except Exception as e:  # a setting the compiler rejects
                    print(f"  splits={splits} block_k={block_k} warps={warps} "
                          f"stages={stages}: {type(e).__name__}", flush=True)
                    continue
                results.append(dict(batch=b, end=end, k_splits=splits, block_k=block_k,
                                    num_warps=warps, num_stages=stages, us=us, xla_us=xla_us,
                                    max_abs_err=err))
                print(f"  splits={splits} block_k={block_k} warps={warps} stages={stages}: "
                      f"{us:.1f} us (err {err:.1e})", flush=True)
            best = min((r for r in results if r["batch"] == b and r["end"] == end),
                       key=lambda r: r["us"])
            print(f"B={b} end={end} best: {best}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                           args=vars(args), results=results), f, indent=1)


if __name__ == "__main__":
    main()
