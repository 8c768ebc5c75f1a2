"""The grouped matmuls of an MoE layer alone, at a model's projection shapes, for several
kernel settings (`jrl.kernels.grouped_matmul.Tiles`): the forward (`ragged_dot`), the
input gradient (the weights read transposed) and the weight gradient
(`transposed_ragged_dot`), each beside one dense matmul of the same FLOPs; gate and up
each alone and joined (one matmul of the two kernels side by side).

The rows are N tokens x k choices sorted by expert, the experts' shares drawn from a
uniform multinomial (the router of a trained model is about that even). Times are
medians of `--repeats` calls after two warm-ups (`bench_head_kernel.timed`); TFLOP/s count 2 M K N.

    python experiments/bench_grouped_matmul.py --preset qwen3-30b-a3b --tokens 12288 \\
        --tiles 128,128,64,4,1 64,128,64,4,1 128,256,64,4,1 --out gmm.json   # Hopper
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from bench_head_kernel import timed  # (this folder is on the path when a script here runs)

from jrl.kernels import grouped_matmul as gm
from jrl.models import ModelConfig


def parse_tiles(spec: str) -> gm.Tiles | None:
    """BLOCK_M,BLOCK_N,BLOCK_K,STEPS,GRID_BLOCK_N, or "auto" (the layer's own choice)."""
    if spec == "auto":
        return None
    m, n, k, steps, grid = (int(x) for x in spec.split(","))
    return gm.Tiles(block_m=m, block_n=n, block_k=k, max_concurrent_steps=steps,
                    grid_block_n=grid)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=12288, help="N; the rows are N k")
    p.add_argument("--tiles", nargs="+", default=["auto"],
                   help="kernel settings to time: BLOCK_M,BLOCK_N,BLOCK_K,STEPS,GRID_BLOCK_N "
                        "or auto")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    config = ModelConfig.preset(args.preset)
    d, f, e, k = (config.hidden_size, config.moe_intermediate_size, config.num_experts,
                  config.num_experts_per_tok)
    m = args.tokens * k
    rng = np.random.default_rng(0)
    sizes = jnp.asarray(rng.multinomial(m, np.full(e, 1.0 / e)), jnp.int32)
    key = iter(jax.random.split(jax.random.key(0), 16))
    normal = lambda *shape: jax.random.normal(next(key), shape, jnp.bfloat16)
    results = []
    # (name, K, N): gate and up ([D, F] each), down ([F, D]), and gate and up as one
    # grouped matmul of their kernels side by side ([D, 2F]: against twice "gate_up").
    for name, width_in, width_out in (("gate_up", d, f), ("down", f, d),
                                      ("gate_up_joined", d, 2 * f)):
        x, w, dy = normal(m, width_in), normal(e, width_in, width_out), normal(m, width_out)
        flops = 2 * m * width_in * width_out
        dense = jax.jit(lambda a, b: a @ b)
        row = {"projection": name, "rows": m, "k": width_in, "n": width_out,
               "dense_ms": timed(dense, x, w[0], iters=args.repeats)}
        per_group = m // e  # "auto": the grid the layer's own call picks
        calls = {  # kernel -> (function of the tiles, operands)
            "forward": (lambda t, g=per_group: functools.partial(
                gm._forward, tiles=t, rows_per_group=g), (x, w, sizes)),
            "input_gradient": (lambda t, g=per_group: functools.partial(
                gm._forward, transpose_rhs=True, tiles=t, rows_per_group=g), (dy, w, sizes)),
            "weight_gradient": (lambda t: functools.partial(gm._weight_gradient, tiles=t),
                                (x, dy, sizes)),
        }
        for spec in args.tiles:
            for kind, (make, operands) in calls.items():
                try:
                    ms = timed(make(parse_tiles(spec)), *operands, iters=args.repeats)
                except Exception as error:  # a setting the kernel refuses (shared memory)
                    print(f"{name} {kind} {spec}: {type(error).__name__}: {error}"[:200])
                    continue
                results.append({**row, "tiles": spec, "kernel": kind, "ms": ms,
                                "tflops": flops / ms / 1e9})
                print(f"{name:8s} {kind:16s} {spec:18s} {ms:8.3f} ms "
                      f"{flops / ms / 1e9:7.1f} TFLOP/s (dense {row['dense_ms']:.3f} ms)",
                      flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), "device": jax.devices()[0].device_kind,
                       "jax": jax.__version__, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
