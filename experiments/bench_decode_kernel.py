"""The decode-step kernel alone (`jrl.kernels.decode_attention.append_and_attend`):
its tile settings against the previous implementation and the XLA path, on one GPU.

    python experiments/bench_decode_kernel.py --out decode_kernel.json
    python experiments/bench_decode_kernel.py --batch 4 16 64 --slots 65600 --fill 65000 \
        --splits 0 1 4 8 17 32 --no_tiles_sweep           # a few rows of a long cache
    python experiments/bench_decode_kernel.py --no_tiles_sweep --splits 0 \
        --skip previous xla --mosaic 64,2,compact 128,2,compact,fused   # vs Mosaic GPU

Qwen2.5-0.5B's heads (14 query, 2 key/value, head_dim 64; `--heads`), a cache of 384 slots,
rows starting at a random slot below 32 and the new token at `--fill`. One jitted
call runs the step on 24 separate cache buffers (a decode step's layers, each
donated and updated in place). The time per layer is the GPU time of the variant's
program in a profiler trace of `--repeats` calls (every kernel it launched, launch
gaps excluded), divided by 24 and the calls. "previous" is the path this kernel
replaced in round six: RoPE and two cache writes in XLA, then JAX's split-K
decode-attention kernel (`pallas.ops.gpu.decode_attention.gqa`) and its merge.
`--mosaic` adds the Mosaic GPU kernel at the tiles given (`MosaicTiles.from_spec`);
each batch also prints its kernels' time per call (which kernel the time is in).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import itertools
import math
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import results_json  # this folder is on the path when a script here runs
import trace_summary  # noqa: E402  (this folder is on the path when a script here runs)

from jrl.kernels import decode_attention as da

LAYERS = 24


def previous(q, k_new, v_new, sin, cos, k, v, start, slot):
    from jax.experimental.pallas.ops.gpu import decode_attention as kernels

    q, k, v = da.rotate_and_write(q, k_new, v_new, sin, cos, k, v, slot)
    b, _, s, h = k.shape
    out = kernels.gqa(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), start_idx=start,
                      kv_seq_len=jnp.broadcast_to(slot + 1, (b,)), sm_scale=1 / math.sqrt(h),
                      block_k=64, k_splits=s // 64)
    return out.astype(q.dtype), k, v


def run_variant(index, fn, batch, fill, slots, repeats, heads=(14, 2, 64)):
    """Compiles and warms up variant `index`, then runs it `repeats` times (to be
    traced); its program is named `variant_<index>`."""
    n, kv, h = heads
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, n, h), jnp.bfloat16)
    k_new, v_new = (jax.random.normal(key, (batch, kv, h), jnp.bfloat16) for key in keys[1:3])
    start = jnp.asarray(np.random.default_rng(0).integers(0, 32, batch), jnp.int32)
    angles = (start[:, None] + fill) * jnp.ones((1, h // 2), jnp.float32) / 100
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    zeros = lambda: jnp.zeros((batch, kv, slots, h), jnp.bfloat16)
    caches = [(zeros(), zeros()) for _ in range(LAYERS)]

    def layers(caches, q):
        out, new = q, []
        for k, v in caches:
            out, k, v = fn(out, k_new, v_new, sin, cos, k, v, start, jnp.int32(fill))
            new.append((k, v))
        return new, out

    layers.__name__ = f"variant_{index}"
    layers = jax.jit(layers, donate_argnums=0)
    caches, out = layers(caches, q)
    jax.block_until_ready(out)

    def timed():
        nonlocal caches, out
        for _ in range(repeats):
            caches, out = layers(caches, q)
        jax.block_until_ready(out)

    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--fill", type=int, default=256, help="the new token's slot")
    parser.add_argument("--slots", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--heads", type=int, nargs=3, default=[14, 2, 64],
                        metavar=("N", "K", "H"), help="query heads, key/value heads, head_dim "
                        "(default Qwen2.5-0.5B's; 28 4 128 is Qwen2.5-7B's)")
    parser.add_argument("--splits", type=int, nargs="*", default=[],
                        help="also the kernel (default tiles) split over slots into this many "
                             "parts (Tiles.splits; 0: slot_splits' choice)")
    parser.add_argument("--mosaic", nargs="*", default=[],
                        help="also the Mosaic GPU kernel at these tiles "
                             "(MosaicTiles.from_spec strings, e.g. 64,2,compact)")
    parser.add_argument("--no_tiles_sweep", action="store_true",
                        help="skip the sweep over block / warps / stages")
    parser.add_argument("--skip", nargs="*", default=[],
                        help="variants to leave out, e.g. previous xla")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    variants = {"previous": previous,
                "xla": functools.partial(da.append_and_attend, impl="xla")}
    sweep = () if args.no_tiles_sweep else itertools.product((64, 128), (2, 4, 8), (1, 2, 3, 4))
    for block, warps, stages in sweep:
        tiles = da.Tiles(block, warps, stages, splits=1)
        variants[f"kernel {block}/{warps}/{stages}"] = functools.partial(
            da.append_and_attend, impl="pallas", tiles=tiles)
    for splits in args.splits:
        tiles = dataclasses.replace(da.TILES, splits=splits)
        variants[f"kernel splits {splits or 'auto'}"] = functools.partial(
            da.append_and_attend, impl="pallas", tiles=tiles)
    for spec in args.mosaic:
        variants[f"mosaic {spec}"] = functools.partial(
            da.append_and_attend, impl="mosaic", tiles=da.MosaicTiles.from_spec(spec))
    variants = {name: fn for name, fn in variants.items() if name not in args.skip}
    rows = []
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; heads {args.heads}, "
          f"{args.slots} slots; us per layer-step")
    for batch in args.batch:
        runs = {}  # name: (program name, traced runs)
        for name, fn in variants.items():
            index = len(rows) + len(runs)
            try:
                runs[name] = (f"jit_variant_{index}", run_variant(
                    index, fn, batch, args.fill, args.slots, args.repeats, args.heads))
            except Exception as e:  # a setting Triton rejects
                rows.append(dict(batch=batch, variant=name, error=str(e)[:300]))
                print(f"batch {batch:4d} {name:22s} error {str(e)[:120]}")
        trace_dir = tempfile.mkdtemp()
        with jax.profiler.trace(trace_dir):
            for _, timed in runs.values():
                timed()
        with contextlib.redirect_stdout(io.StringIO()):
            tables = trace_summary.summarize(trace_dir)
        programs = {program: ms for program, ms, _ in tables["kernels by program"]}
        for kernel, ms, calls in tables["kernels"][:12]:  # which kernels the time is in
            print(f"batch {batch:4d}   kernel {kernel[:60]:60s} {ms / calls * 1e3:8.2f} us "
                  f"x {calls}")
        for name, (program, _) in runs.items():
            us = 1e3 * programs[program] / (args.repeats * LAYERS)
            rows.append(dict(batch=batch, variant=name, us=us))
            print(f"batch {batch:4d} {name:22s} {us:8.2f}")
    results_json.write(args.out, args=vars(args), rows=rows)


if __name__ == "__main__":
    main()
