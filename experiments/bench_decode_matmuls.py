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
"""

from __future__ import annotations

import argparse
import json
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

from jrl.models import PRESETS  # noqa: E402

GEMM_KERNEL = re.compile(r"nvjet|gemm|splitK|cutlass|xmma|triton", re.IGNORECASE)


def shapes(config) -> dict[str, tuple[int, int]]:
    """{projection: (K, N)} of one decode layer, the sampler's fused q/k/v and gate/up."""
    d, h = config.hidden_size, config.head_dim
    return {"qkv": (d, (config.num_heads + 2 * config.num_kv_heads) * h),
            "o": (config.num_heads * h, d),
            "gate_up": (d, 2 * config.intermediate_size),
            "down": (config.intermediate_size, d)}


def layer_matmuls(rows: int, k: int, n: int, layers: int, layout: str, dtype, options=None,
                  seed: int = 0):
    """(jitted function of `(x, weights)` applying each weight to `x`, compiled with XLA
    `options`; x; weights)."""
    keys = jax.random.split(jax.random.key(seed), layers + 1)
    shape = (k, n) if layout == "kn" else (n, k)
    weights = tuple(jax.random.normal(key, shape, dtype) * 0.02 for key in keys[1:])
    x = jax.random.normal(keys[0], (rows, k), dtype)
    spec = "rk,kn->rn" if layout == "kn" else "rk,nk->rn"
    fun = jax.jit(lambda x, ws: tuple(jnp.einsum(spec, x, w) for w in ws),
                  compiler_options=options or None)
    return fun, x, weights


def measure(fun, x, weights, repeats: int, trace_dir: str) -> dict:
    jax.block_until_ready(fun(x, weights))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fun(x, weights)
    jax.block_until_ready(out)
    wall_us = (time.perf_counter() - start) / (repeats * len(weights)) * 1e6
    with trace_summary.maybe_trace(trace_dir):
        for _ in range(repeats):
            out = fun(x, weights)
        jax.block_until_ready(out)
    with open(os.devnull, "w") as quiet:
        stdout, sys.stdout = sys.stdout, quiet
        try:
            kernels = trace_summary.summarize(trace_dir).get("kernels", [])
        finally:
            sys.stdout = stdout
    calls = repeats * len(weights)
    gemm = sum(ms for name, ms, _ in kernels if GEMM_KERNEL.search(name)) * 1e3 / calls
    other = sum(ms for name, ms, _ in kernels if not GEMM_KERNEL.search(name)) * 1e3 / calls
    names = sorted({name[:48] for name, _, _ in kernels if GEMM_KERNEL.search(name)})
    return {"wall_us": wall_us, "gemm_us": gemm, "other_us": other, "kernels": names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32, 128, 256])
    parser.add_argument("--layouts", nargs="+", default=["kn", "nk"], choices=("kn", "nk"))
    parser.add_argument("--gemm", nargs="+", default=["cublas"], choices=("cublas", "xla"),
                        help="cublas: no Triton GEMM fusions (the sampler's default)")
    parser.add_argument("--layers", type=int, default=None, help="default: the preset's")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--hbm-gbps", type=float, default=3350.0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    config = PRESETS[args.preset]
    layers = args.layers or config.num_layers
    dtype = jnp.bfloat16
    results = []
    print(f"{args.preset} bf16, {layers} layers a program, {jax.devices()[0].device_kind}, "
          f"HBM {args.hbm_gbps:.0f} GB/s")
    print("| rows | matmul | K x N | layout | GEMM | µs (GEMM kernels) | other kernels µs "
          "| wall µs | % of roofline | kernels |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for gemm in args.gemm:
        options = ({"xla_gpu_enable_triton_gemm": False}
                   if gemm == "cublas" and jax.default_backend() == "gpu" else {})
        for rows in args.rows:
            for name, (k, n) in shapes(config).items():
                for layout in args.layouts:
                    fun, x, weights = layer_matmuls(rows, k, n, layers, layout, dtype,
                                                    options)
                    with tempfile.TemporaryDirectory() as trace_dir:
                        got = measure(fun, x, weights, args.repeats, trace_dir)
                    bound_us = (k * n + rows * (k + n)) * 2 / (args.hbm_gbps * 1e3)
                    row = {"rows": rows, "matmul": name, "k": k, "n": n, "layout": layout,
                           "gemm": gemm, "bound_us": bound_us, **got}
                    results.append(row)
                    device_us = got["gemm_us"] + got["other_us"]  # 0 without a GPU trace
                    share = f"{100 * bound_us / device_us:.1f}" if device_us else "-"
                    print(f"| {rows} | {name} | {k} x {n} | {layout} | {gemm} "
                          f"| {got['gemm_us']:.2f} | {got['other_us']:.2f} "
                          f"| {got['wall_us']:.2f} | {share} "
                          f"| {', '.join(got['kernels'])} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"preset": args.preset, "layers": layers,
                       "device": jax.devices()[0].device_kind,
                       "jax": jax.__version__, "results": results}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
