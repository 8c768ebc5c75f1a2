"""The decode-step kernel on a GPU against the XLA path, at the presets' head shapes.

    python experiments/check_decode_kernel.py

For each shape, and for the first also at slots on block edges and the last slot
under two tilings: random bf16 queries, new keys/values and a cache, ragged row starts;
prints the largest difference of the attention output (the kernel and XLA, each
against the XLA path in float32) and the largest difference between the caches
(the rotated keys may differ by a bf16 rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jrl.kernels import decode_attention as da

SHAPES = [  # (B, N, K, H, S)
    (512, 14, 2, 64, 384),   # Qwen2.5-0.5B
    (64, 28, 4, 128, 384),   # Qwen2.5-7B
    (64, 16, 8, 128, 256),   # Qwen3-0.6B
    (8, 32, 8, 128, 1024),   # Llama-3-8B, a long cache
]


def check_kernel(b, n, k, h, s, slot=None, tiles=da.TILES) -> dict:
    keys = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(keys[0], (b, n, h), jnp.bfloat16)
    k_new, v_new = (jax.random.normal(key, (b, k, h), jnp.bfloat16) for key in keys[1:3])
    cache = [jax.random.normal(key, (b, k, s, h), jnp.bfloat16) for key in keys[3:5]]
    angles = jax.random.uniform(keys[5], (b, h // 2), maxval=1000.0)
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    slot = s - 37 if slot is None else slot
    start = jnp.asarray(np.random.default_rng(0).integers(0, slot + 1, b), jnp.int32)
    run = jax.jit(lambda *a, impl: da.append_and_attend(*a, impl=impl, tiles=tiles),
                  static_argnames="impl")
    got = run(q, k_new, v_new, sin, cos, *cache, start, slot, impl="pallas")
    want = run(q, k_new, v_new, sin, cos, *cache, start, slot, impl="xla")
    exact = da.append_and_attend(q.astype(jnp.float32), k_new.astype(jnp.float32),
                                 v_new.astype(jnp.float32), sin, cos,
                                 *(c.astype(jnp.float32) for c in cache), start, slot)[0]
    err = lambda out: float(jnp.abs(out.astype(jnp.float32) - exact).max())
    cache_diff = max(float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())
                     for a, b in zip(got[1:], want[1:], strict=True))
    return dict(shape=(b, n, k, h, s), slot=slot, tiles=tiles, kernel_err=err(got[0]),
                xla_err=err(want[0]), cache_diff=cache_diff)


def main() -> None:
    print(jax.devices()[0].device_kind, jax.__version__)
    for shape in SHAPES:
        print(check_kernel(*shape))
    # The real kernel (not interpret mode) at block edges and the last slot, per tiling.
    for tiles in (da.TILES, da.Tiles(64, 2, 3)):
        for slot in (0, 63, 64, 65, 383):
            print(check_kernel(*SHAPES[0], slot=slot, tiles=tiles))


if __name__ == "__main__":
    main()
