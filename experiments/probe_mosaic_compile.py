"""Where the sampler's longer compile with the Mosaic GPU decode kernel goes: one jitted
program of N decode-attention steps (N separate caches, as the sampler's N layers),
lowered and compiled for N = 1, 2, 8 and 24, for the Triton kernel and the Mosaic GPU
kernel at `--mosaic` tiles; prints the seconds of `lower()` and of `compile()`, the
distinct Mosaic GPU kernel hashes in the lowered program and, with
MOSAIC_GPU_DUMP_PTXAS=1, how many times ptxas compiled a Mosaic GPU kernel (stdout
lines "Compiling entry function", counted by `probe_decode_kernels.sh compile`).

    MOSAIC_GPU_DUMP_PTXAS=1 python experiments/probe_mosaic_compile.py
"""

from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp

from jrl.kernels import decode_attention as da


def program(impl: str, tiles, layers: int, b: int, n: int, kv: int, h: int, s: int):
    """The jitted steps and their arguments (shapes only)."""
    def steps(qkv, sin, cos, ks, vs, start, slot):
        outs = []
        for k, v in zip(ks, vs, strict=True):
            out, _, _ = da.append_and_attend_qkv(qkv, None, sin, cos, k, v, start, slot,
                                                 num_heads=n, impl=impl, tiles=tiles)
            outs.append(out)
        return outs

    sds = jax.ShapeDtypeStruct
    cache = [sds((b, kv, s, h), jnp.bfloat16)] * layers
    args = (sds((b, n + 2 * kv, h), jnp.bfloat16), sds((b, h // 2), jnp.float32),
            sds((b, h // 2), jnp.float32), cache, cache, sds((b,), jnp.int32),
            sds((), jnp.int32))
    return jax.jit(steps), args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mosaic", default="64,2,compact,fused")
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 8, 24])
    args = parser.parse_args()
    variants = [("pallas", da.Tiles()), ("mosaic", da.MosaicTiles.from_spec(args.mosaic))]
    for impl, tiles in variants:
        for layers in args.layers:
            fn, shapes = program(impl, tiles, layers, b=256, n=14, kv=2, h=64, s=384)
            print(f"== {impl} layers={layers} begin", flush=True)
            t0 = time.perf_counter()
            lowered = fn.trace(*shapes).lower()
            t1 = time.perf_counter()
            lowered.compile()
            t2 = time.perf_counter()
            # Mosaic GPU compiles a kernel once per distinct hash (its runtime's cache):
            # as many hashes as steps would explain one ptxas run a step.
            hashes = set(re.findall(r'kernel_hash = "([^"]*)"', lowered.as_text()))
            print(f"== {impl} layers={layers} lower {t1 - t0:.2f} s compile {t2 - t1:.2f} s"
                  f" distinct kernel hashes {len(hashes)}", flush=True)


if __name__ == "__main__":
    main()
