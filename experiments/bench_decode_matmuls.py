"""The decode step's matmuls alone, at the row counts a decode step runs, by the layout of
the weight: `[K, N]` (inputs first, how jrl stores a projection's kernel) against
`[N, K]` (each output's weights contiguous), with cuBLAS alone or XLA's choice.

    python experiments/bench_decode_matmuls.py --preset qwen2.5-0.5b --rows 8 32 128 256

A decode step applies each layer's q/k/v (one matmul where the sampler fuses them), output,
gate/up (one) and down projections to one token a row, reading every weight once: at few
rows each matmul is bound by the weight's bytes. Each row of the table applies one of them
over the model's layers (each its own weight, one program) and traces the calls: µs a
matmul from its kernels' device time (GEMM kernels and any other, e.g. a copy for the
layout) and the share of the HBM roofline that the weight's bytes give (`--hbm-gbps`).

Each matmul has its own input (one input for all would let XLA merge the matmuls into
one, as its dot merger does for dots that share an operand), and the weights are copied
until they hold `--min-mbytes` (default 256 MB: far above the GPU's L2, which would
otherwise hold the small projections' weights from one call to the next). `--residual
both` also times each matmul with a residual added to its output (`x W + r`, as the
decode's output and down projections are), which XLA gives cuBLAS as the matmul's C
operand.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import trace_summary  # noqa: E402

from jrl import metrics  # noqa: E402
from jrl.models import PRESETS  # noqa: E402

GEMM_KERNEL = re.compile(r"nvjet|gemm|splitK|cutlass|xmma|triton", re.IGNORECASE)


def shapes(config) -> dict[str, tuple[int, int]]:
    """{projection: (K, N)} of one decode layer, the sampler's fused q/k/v and gate/up."""
    d, h = config.hidden_size, config.head_dim
    return {"qkv": (d, (config.num_heads + 2 * config.num_kv_heads) * h),
            "o": (config.num_heads * h, d),
            "gate_up": (d, 2 * config.intermediate_size),
            "down": (config.intermediate_size, d)}


def layer_matmuls(rows: int, k: int, n: int, copies: int, layout: str, residual: bool, dtype,
                  options=None, seed: int = 0):
    """(jitted function of `(xs, weights, residuals)` applying each weight to its own
    input, plus its residual where `residual`, compiled with XLA `options`; its three
    operands, `copies` of each)."""
    keys = jax.random.split(jax.random.key(seed), 3)
    shape = (k, n) if layout == "kn" else (n, k)
    weights = tuple(jax.random.normal(key, shape, dtype) * 0.02
                    for key in jax.random.split(keys[0], copies))
    xs = tuple(jax.random.normal(key, (rows, k), dtype)
               for key in jax.random.split(keys[1], copies))
    rs = tuple(jax.random.normal(key, (rows, n), dtype)
               for key in jax.random.split(keys[2], copies)) if residual else None
    spec = "rk,kn->rn" if layout == "kn" else "rk,nk->rn"

    def apply(xs, ws, rs):
        outs = [jnp.einsum(spec, x, w) for x, w in zip(xs, ws, strict=True)]
        return tuple(outs if rs is None else (y + r for y, r in zip(outs, rs, strict=True)))

    return jax.jit(apply, compiler_options=options or None), (xs, weights, rs)


def measure(fun, operands, repeats: int, trace_dir: str) -> dict:
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
    gemm = [(name, ms) for name, ms, _ in kernels if GEMM_KERNEL.search(name)]
    other = [(name, ms) for name, ms, _ in kernels if not GEMM_KERNEL.search(name)]
    return {"wall_us": wall_us,
            "gemm_us": sum(ms for _, ms in gemm) * 1e3 / calls,
            "other_us": sum(ms for _, ms in other) * 1e3 / calls,
            "kernels": sorted({name[:48] for name, _ in gemm}),
            "other_kernels": sorted({name[:48] for name, _ in other})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32, 128, 256])
    parser.add_argument("--layouts", nargs="+", default=["kn", "nk"], choices=("kn", "nk"))
    parser.add_argument("--residual", default="both", choices=("off", "on", "both"),
                        help="time the matmuls with a residual added, without, or both")
    parser.add_argument("--gemm", nargs="+", default=["cublas"], choices=("cublas", "xla"),
                        help="cublas: no Triton GEMM fusions (the sampler's default)")
    parser.add_argument("--min-mbytes", type=float, default=256.0,
                        help="copies of each weight (at least the preset's layers) to hold this")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--hbm-gbps", type=float, default=None,
                        help="default: the device's from jrl.metrics.PEAK_HBM_GBPS, else "
                             "3350 (H100 SXM)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    if args.hbm_gbps is None:
        args.hbm_gbps = metrics.peak_hbm_gbps(jax.devices()[0].device_kind) or 3350.0
    config = PRESETS[args.preset]
    residuals = {"off": [False], "on": [True], "both": [False, True]}[args.residual]
    results = []
    print(f"{args.preset} bf16, {jax.devices()[0].device_kind}, HBM {args.hbm_gbps:.0f} GB/s")
    print("| rows | matmul | K x N | layout | residual | GEMM | copies | µs (GEMM kernels) "
          "| other kernels µs | wall µs | % of roofline | kernels | other kernels |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for gemm in args.gemm:
        options = ({"xla_gpu_enable_triton_gemm": False}
                   if gemm == "cublas" and jax.default_backend() == "gpu" else {})
        for rows in args.rows:
            for name, (k, n) in shapes(config).items():
                copies = max(config.num_layers, math.ceil(args.min_mbytes * 1e6 / (2 * k * n)))
                for layout, residual in itertools.product(args.layouts, residuals):
                    fun, operands = layer_matmuls(rows, k, n, copies, layout, residual, dtype=
                                                  jnp.bfloat16, options=options)
                    with tempfile.TemporaryDirectory() as trace_dir:
                        got = measure(fun, operands, args.repeats, trace_dir)
                    # The weight, the input and the output (and the residual) once each.
                    moved = k * n + rows * (k + n * (2 if residual else 1))
                    bound_us = moved * 2 / (args.hbm_gbps * 1e3)
                    row = {"rows": rows, "matmul": name, "k": k, "n": n, "layout": layout,
                           "residual": residual, "gemm": gemm, "copies": copies,
                           "bound_us": bound_us, **got}
                    results.append(row)
                    device_us = got["gemm_us"] + got["other_us"]  # 0 without a GPU trace
                    share = f"{100 * bound_us / device_us:.1f}" if device_us else "-"
                    print(f"| {rows} | {name} | {k} x {n} | {layout} | {residual} | {gemm} "
                          f"| {copies} | {got['gemm_us']:.2f} | {got['other_us']:.2f} "
                          f"| {got['wall_us']:.2f} | {share} | {', '.join(got['kernels'])} "
                          f"| {', '.join(got['other_kernels'])} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"preset": args.preset, "device": jax.devices()[0].device_kind,
                       "jax": jax.__version__, "results": results}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
