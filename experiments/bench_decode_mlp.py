"""The decode step's gate/up projection and SwiGLU: XLA's two kernels (cuBLAS's matmul
writing `[N, 2, F]`, then the activation) against `jrl.kernels.decode_mlp.gated_up`'s one,
at the row counts a decode step runs.

    python experiments/bench_decode_mlp.py --preset qwen2.5-0.5b --rows 8 64 128 256 512

Each table row applies one path over copies of the layer's `[D, 2, F]` weight (at least the
preset's layers, and `--min-mbytes` in all: far above the GPU's L2), each to its own input,
in one program, and traces the calls: µs a layer from all its kernels' device time, and the
share of the HBM roofline that the weight's bytes give (`--hbm-gbps`; default by the
device's name). `--blocks` lists the kernel's tiles as `T,V,STAGES,CONSUMERS`
(`decode_mlp.MlpBlocks`: rows and features a program, pipeline depth, warpgroups that
multiply).
The kernel's outputs are checked against XLA's on the first copy (largest difference
printed, in units of the compute dtype's rounding of the value).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import trace_summary  # noqa: E402

from jrl.kernels import decode_mlp  # noqa: E402
from jrl.models import PRESETS, transformer  # noqa: E402


def xla_path(x_nd, w_d2f):
    """The sampler's path: one matmul to `[N, 2, F]` in the compute dtype, then SwiGLU."""
    return transformer.swiglu(jnp.einsum("nd,dkf->nkf", x_nd, w_d2f))


def programs(rows, d, f, copies, impl, blocks, options, seed=0):
    keys = jax.random.split(jax.random.key(seed), 2)
    weights = tuple(jax.random.normal(key, (d, 2, f), jnp.bfloat16) * d ** -0.5
                    for key in jax.random.split(keys[0], copies))
    xs = tuple(jax.random.normal(key, (rows, d), jnp.bfloat16)
               for key in jax.random.split(keys[1], copies))
    one = (xla_path if impl == "xla"
           else lambda x, w: decode_mlp.gated_up(x, w, blocks=blocks))

    def apply(xs, ws):
        return tuple(one(x, w) for x, w in zip(xs, ws, strict=True))

    return jax.jit(apply, compiler_options=options or None), (xs, weights)


def measure(fun, operands, repeats, trace_dir):
    jax.block_until_ready(fun(*operands))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fun(*operands)
    jax.block_until_ready(out)
    calls = repeats * len(operands[0])
    wall_us = (time.perf_counter() - start) / calls * 1e6
    with trace_summary.maybe_trace(trace_dir):
        for _ in range(repeats):
            out = fun(*operands)
        jax.block_until_ready(out)
    with open(os.devnull, "w") as quiet:
        stdout, sys.stdout = sys.stdout, quiet
        try:
            kernels = trace_summary.summarize(trace_dir).get("kernels", [])
        finally:
            sys.stdout = stdout
    return {"wall_us": wall_us,
            "device_us": sum(ms for _, ms, _ in kernels) * 1e3 / calls,
            "kernels": sorted({name[:40] for name, _, _ in kernels})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64, 128, 256, 512])
    parser.add_argument("--blocks", nargs="+",
                        default=["64,64,6,1", "128,64,4,2", "128,128,3,2", "256,64,3,2"],
                        help="the kernel's tiles, T,V,STAGES,CONSUMERS each")
    parser.add_argument("--min-mbytes", type=float, default=256.0)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--hbm-gbps", type=float, default=None,
                        help="default: H200 4800, else 3350 (H100 SXM)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.hbm_gbps is None:
        args.hbm_gbps = 4800.0 if "H200" in jax.devices()[0].device_kind else 3350.0

    config = PRESETS[args.preset]
    d, f = config.hidden_size, config.intermediate_size
    copies = max(config.num_layers, math.ceil(args.min_mbytes * 1e6 / (4 * d * f)))
    options = ({"xla_gpu_enable_triton_gemm": False} if jax.default_backend() == "gpu"
               else {})  # the sampler's default GEMMs (`rollout.gemm` "cublas")
    variants = [("xla", None)] + [
        ("mosaic", decode_mlp.MlpBlocks(t=int(t), v=int(v), stages=int(s), consumers=int(c)))
        for t, v, s, c in (spec.split(",") for spec in args.blocks)
        if f % int(v) == 0]
    print(f"{args.preset} bf16 D {d} F {f}, {copies} copies, {jax.devices()[0].device_kind}, "
          f"HBM {args.hbm_gbps:.0f} GB/s")
    print("| rows | path | tiles | device µs a layer | wall µs | % of roofline | vs XLA | "
          "max diff (ulps) | kernels |")
    print("|---|---|---|---|---|---|---|---|---|")
    results = []
    for rows in args.rows:
        base = None
        for impl, blocks in variants:
            fun, operands = programs(rows, d, f, copies, impl, blocks, options)
            try:
                with tempfile.TemporaryDirectory() as trace_dir:
                    got = measure(fun, operands, args.repeats, trace_dir)
            except Exception as e:  # e.g. tiles past the chip's shared memory
                print(f"| {rows} | {impl} | {blocks} | failed: {str(e).splitlines()[0][:160]} "
                      "| | | | | |", flush=True)
                continue
            out = fun(operands[0][:1], operands[1][:1])[0]
            ref = xla_path(operands[0][0], operands[1][0]).astype(jnp.float32)
            ulp = jnp.maximum(jnp.abs(ref) * 2.0 ** -8, 2.0 ** -133)
            diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref) / ulp))
            moved = 2 * (2 * d * f + rows * (d + f))
            bound_us = moved / (args.hbm_gbps * 1e3)
            us = got["device_us"] or got["wall_us"]  # no device trace off a GPU
            base = base or us
            row = {"rows": rows, "impl": impl,
                   "blocks": blocks and [blocks.t, blocks.v, blocks.stages, blocks.consumers],
                   "bound_us": bound_us, "max_diff_ulps": diff, **got}
            results.append(row)
            tiles = (f"{blocks.t},{blocks.v},{blocks.stages},{blocks.consumers}" if blocks
                     else "-")
            print(f"| {rows} | {impl} | {tiles} | {got['device_us']:.2f} | {got['wall_us']:.2f} "
                  f"| {100 * bound_us / us:.1f} | {base / us:.3f} | {diff:.1f} "
                  f"| {', '.join(got['kernels'])} |", flush=True)
    if args.out:
        with open(args.out, "w") as f_out:
            json.dump({"preset": args.preset, "device": jax.devices()[0].device_kind,
                       "jax": jax.__version__, "copies": copies, "results": results},
                      f_out, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
