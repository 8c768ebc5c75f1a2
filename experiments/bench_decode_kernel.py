"""The decode-step kernel alone (`jrl.kernels.decode_attention.append_and_attend`): the
Mosaic GPU kernel at its settings against the XLA path, in GPU time, on one Hopper GPU.

    python experiments/bench_decode_kernel.py --out decode_kernel.json
    python experiments/bench_decode_kernel.py --batch 4 16 64 --slots 65600 --fill 65000 \
        --splits 0 1 4 8 17 32 --no_tiles_sweep           # a few rows of a long cache
    python experiments/bench_decode_kernel.py --no_tiles_sweep --skip xla \
        --heads 28 4 128 --batch 128 --mosaic 64,2,compact 128,2,compact,fused

Qwen2.5-0.5B's heads (14 query, 2 key/value, head_dim 64; `--heads`), a cache of 384 slots,
rows starting at a random slot below 32 and the new token at `--fill`. One jitted
call runs the step on 24 separate cache buffers (a decode step's layers, each
donated and updated in place). The time per layer is the GPU time of the variant's
program in a profiler trace of `--repeats` calls (every kernel it launched, launch
gaps excluded), divided by 24 and the calls. The variants: "xla", "mosaic" (the
sampler's default settings, `MOSAIC_TILES`), a sweep over the unfused kernel's block,
stages and query layout (unless `--no_tiles_sweep`), the default compact unfused kernel
split over slots into `--splits` parts (0: `slot_splits`' choice) and the settings given
to `--mosaic` (`MosaicTiles.from_spec`); each batch also prints its kernels' time per
call (which kernel the time is in).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import itertools
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import results_json  # this folder is on the path when a script here runs
import trace_summary  # noqa: E402  (this folder is on the path when a script here runs)

from jrl.kernels import decode_attention as da

LAYERS = 24


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
                        help="also the compact unfused kernel split over slots into this many "
                             "parts (MosaicTiles.splits; 0: slot_splits' choice)")
    parser.add_argument("--mosaic", nargs="*", default=[],
                        help="also the Mosaic GPU kernel at these settings "
                             "(MosaicTiles.from_spec strings, e.g. 64,2,compact)")
    parser.add_argument("--no_tiles_sweep", action="store_true",
                        help="skip the sweep over block / stages / compact")
    parser.add_argument("--skip", nargs="*", default=[],
                        help="variants to leave out, e.g. xla mosaic")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    mosaic = lambda tiles: functools.partial(da.append_and_attend, impl="mosaic", tiles=tiles)
    variants = {"xla": functools.partial(da.append_and_attend, impl="xla"),
                "mosaic": mosaic(None)}
    sweep = () if args.no_tiles_sweep else itertools.product((64, 128), (2, 3), (False, True))
    for block, stages, compact in sweep:
        variants[f"mosaic {block}/{stages}{' compact' if compact else ''}"] = mosaic(
            da.MosaicTiles(block, stages, compact))
    for splits in args.splits:
        variants[f"mosaic splits {splits or 'auto'}"] = mosaic(
            da.MosaicTiles(0, 2, compact=True, splits=splits))
    for spec in args.mosaic:
        variants[f"mosaic {spec}"] = mosaic(da.MosaicTiles.from_spec(spec))
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
            except Exception as e:  # a setting the kernel rejects at these shapes
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
