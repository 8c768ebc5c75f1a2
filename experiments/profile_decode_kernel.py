"""Where the fused Mosaic GPU decode kernel's time goes inside each program: its named
regions (`jax.named_scope` in `_mosaic_fused_kernel`) timed by Mosaic GPU's own
profiler (`JRL_MOSAIC_PROFILE_DIR`, `mosaic_backend.compiler_params`), on one GPU.

    python experiments/profile_decode_kernel.py --out profile.json
    python experiments/profile_decode_kernel.py --heads 28 4 128 --batch 128 --slots 384

The kernel (`append_and_attend_qkv`, `impl="mosaic"`) on random inputs, rows starting
below 32 and the new token at `--fill`: three calls without the profiler warm the GPU,
then the first call of the program built with it is traced (the kernel compiled anew:
the figures are a cold program's first call). Each program's first warpgroup records the
SM clock at each region's entry and exit (thread 0 of the warpgroup, so a region that
ends in a wait ends when that thread's wait does). Per region: the programs' mean and
median cycles inside it (summed over its entries, e.g. every cache block), and when it
starts, in cycles after the program's first record. The clock is the multiprocessor's
(about 1.98 GHz on an H200 at full clock): figures are cycles. The profile adds a clock
read and a shared-memory store at each boundary (and 16 bytes of shared memory a region
entry); Mosaic GPU's dump subtracts an estimate of that overhead from each event, which
shifts the start times and shortens regions that hold others.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import results_json  # this folder is on the path when a script here runs

from jrl.kernels import decode_attention as da
from jrl.kernels import mosaic_backend


def programs(trace):
    """{program (tid): [(name, begin cycles, end cycles)]} of a Perfetto trace written
    by Mosaic GPU's profiler (its timestamps: the program's start in ns plus cycles,
    divided by 1,000; the start is the same for a program's events)."""
    events = collections.defaultdict(list)
    for event in trace["traceEvents"]:
        events[event["tid"]].append(event)
    out = {}
    for tid, evs in events.items():
        stack, regions = [], []
        base = evs[0]["ts"]
        for event in evs:
            cycles = round((event["ts"] - base) * 1e3)
            if event["ph"] == "B":
                stack.append((event["name"], cycles))
            else:
                name, begin = stack.pop()
                regions.append((name, begin, cycles))
        out[tid] = regions
    return out


def summarize(regions_by_program):
    total = collections.defaultdict(list)
    first = collections.defaultdict(list)
    count = collections.defaultdict(list)
    spans = []
    for regions in regions_by_program.values():
        sums, starts, counts = collections.Counter(), {}, collections.Counter()
        for name, begin, end in regions:
            sums[name] += end - begin
            starts.setdefault(name, begin)
            counts[name] += 1
        for name in sums:
            total[name].append(sums[name])
            first[name].append(starts[name])
            count[name].append(counts[name])
        spans.append(max(end for _, _, end in regions))
    rows = [dict(region=name, programs=len(total[name]), entries=float(np.mean(count[name])),
                 mean=float(np.mean(total[name])), median=float(np.median(total[name])),
                 starts_at=float(np.mean(first[name])))
            for name in sorted(total, key=lambda n: np.mean(first[n]))]
    return rows, dict(mean=float(np.mean(spans)), median=float(np.median(spans)),
                      max=float(np.max(spans)))


def kernel_call(num_heads, fill, tiles):
    """A new jitted kernel call (the profiler's setting is read when a call is built)."""
    da._fused_call.cache_clear()
    return jax.jit(lambda qkv, bias, sin, cos, k, v, start: da.append_and_attend_qkv(
        qkv, bias, sin, cos, k, v, start, jnp.int32(fill), num_heads=num_heads,
        impl="mosaic", tiles=tiles))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=int, nargs=3, default=[14, 2, 64],
                        metavar=("N", "K", "H"), help="query heads, key/value heads, head_dim")
    parser.add_argument("--batch", type=int, nargs="+", default=[256])
    parser.add_argument("--slots", type=int, default=384)
    parser.add_argument("--fill", type=int, default=256, help="the new token's slot")
    parser.add_argument("--tiles", default="0,2,compact,fused",
                        help="MosaicTiles.from_spec string (fused)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    n, kv, h = args.heads
    tiles = da.MosaicTiles.from_spec(args.tiles)
    results = []
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; cycles a program")
    if not 0 <= args.fill < args.slots:
        parser.error(f"--fill {args.fill} must be a slot of the cache's {args.slots}")
    for batch in args.batch:
        keys = jax.random.split(jax.random.key(batch), 4)
        qkv = jax.random.normal(keys[0], (batch, n + 2 * kv, h), jnp.bfloat16)
        bias = jax.random.normal(keys[1], (n + 2 * kv, h), jnp.bfloat16)
        start = jnp.asarray(np.random.default_rng(0).integers(0, 32, batch), jnp.int32)
        angles = (start[:, None] + args.fill) * jnp.ones((1, h // 2), jnp.float32) / 100
        cache = jax.random.normal(keys[2], (batch, kv, args.slots, h), jnp.bfloat16)
        inputs = (qkv, bias, jnp.sin(angles), jnp.cos(angles), cache, cache, start)
        build = functools.partial(kernel_call, n, args.fill, tiles)
        warm = build()
        for _ in range(3):  # the clock and the caches warm, without the profiler
            jax.block_until_ready(warm(*inputs))
        # Mosaic GPU names the trace file once, when the kernel is lowered, and will not
        # overwrite it: the profiled program's first call is the one traced.
        with tempfile.TemporaryDirectory() as directory:
            os.environ[mosaic_backend.PROFILE_DIR_ENV] = directory
            try:
                jax.block_until_ready(build()(*inputs))
            finally:
                del os.environ[mosaic_backend.PROFILE_DIR_ENV]
                da._fused_call.cache_clear()
            files = sorted(glob.glob(os.path.join(directory, "*-trace.json")))
            if not files:
                raise SystemExit(f"no trace written in {directory}: is this a Hopper GPU?")
            with open(files[-1]) as f:
                rows, span = summarize(programs(json.load(f)))
        print(f"batch {batch}, {n}/{kv}/{h}, {args.slots} slots, new token at {args.fill}: "
              f"{len(files)} traces; program span mean {span['mean']:.0f}, median "
              f"{span['median']:.0f}, max {span['max']:.0f} cycles")
        print(f"  {'region':14s} {'entries':>7s} {'mean':>8s} {'median':>8s} {'starts at':>9s}")
        for row in rows:
            print(f"  {row['region']:14s} {row['entries']:7.1f} {row['mean']:8.0f} "
                  f"{row['median']:8.0f} {row['starts_at']:9.0f}")
        results.append(dict(batch=batch, heads=args.heads, slots=args.slots, fill=args.fill,
                            tiles=args.tiles, span=span, regions=rows))
    results_json.write(args.out, results=results)


if __name__ == "__main__":
    main()
