"""One MoE block (`jrl.models.moe.MoeMlp`) at a real model's shapes: forward and
forward + backward time, and TFLOP/s counted on the experts a token actually runs.

    python experiments/bench_moe_layer.py --preset qwen3-30b-a3b --tokens 4096 16384 --out moe.json

`--grad input` differentiates the input alone, the weights frozen (a LoRA update's base);
`--gate-up separate joined joined_per_call` runs the block with the experts' gate and up as
two kernels, as one `[E, D, 2F]` kernel held joined (`moe.join_gate_up`, the sampler's
layout) and as the two joined inside each call (the copy a training pass would make).

FLOPs of the block per token: the router (2 D E) and k experts' SwiGLU MLPs
(3 projections, 2 D F each); backward twice the forward (once with `--grad input`). As
a reference for what the grouped matmuls could reach, the same FLOPs as one dense matmul
chain (`[N k, D] x [D, F]` gate, up and down) are timed beside them. Random bf16
weights; the router spreads tokens about evenly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from jrl.models import ModelConfig, moe


def _time(fn, *args, repeats: int = 5) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def bench(config: ModelConfig, tokens: int, gate_up: str = "separate",
          grad: str = "all") -> dict:
    d, e, k, f = (config.hidden_size, config.num_experts, config.num_experts_per_tok,
                  config.moe_intermediate_size)
    block = moe.MoeMlp(config)
    x = jax.random.normal(jax.random.key(0), (1, tokens, d), jnp.bfloat16)
    params = nn.meta.unbox(jax.jit(block.init)(jax.random.key(1), x)["params"])
    if gate_up == "joined":
        params = jax.jit(moe.join_gate_up)(params)
    per_call = moe.join_gate_up if gate_up == "joined_per_call" else (lambda p: p)
    forward = jax.jit(lambda p, x: block.apply({"params": per_call(p)}, x))
    loss = lambda p, x: jnp.sum(forward(p, x).astype(jnp.float32))
    backward = jax.jit(jax.grad(loss, argnums=(0, 1) if grad == "all" else 1))
    flops = 2 * tokens * (d * e + 3 * k * d * f)

    rows = jax.random.normal(jax.random.key(2), (tokens * k, d), jnp.bfloat16)
    w_gate, w_up = (jax.random.normal(jax.random.key(i), (d, f), jnp.bfloat16) for i in (3, 5))
    w_out = jax.random.normal(jax.random.key(4), (f, d), jnp.bfloat16)
    dense = jax.jit(lambda r: ((r @ w_gate) * (r @ w_up)) @ w_out)
    t_forward, t_backward = _time(forward, params, x), _time(backward, params, x)
    t_dense = _time(dense, rows)
    return {"tokens": tokens, "gate_up": gate_up, "grad": grad, "forward_ms": 1e3 * t_forward,
            "forward_backward_ms": 1e3 * t_backward,
            "forward_tflops": flops / t_forward / 1e12,
            # The input alone: the backward runs one matmul a projection, not two.
            "forward_backward_tflops": (3 if grad == "all" else 2) * flops / t_backward / 1e12,
            "dense_same_flops_ms": 1e3 * t_dense,
            "dense_tflops": 2 * tokens * k * 3 * d * f / t_dense / 1e12}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--gate-up", nargs="+", default=["separate"],
                        choices=("separate", "joined", "joined_per_call"))
    parser.add_argument("--grad", default="all", choices=("all", "input"),
                        help="the backward's gradients: weights and input, or the input alone")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = dataclasses.replace(ModelConfig.preset(args.preset), dtype="bfloat16",
                                 param_dtype="bfloat16")
    results = {"preset": args.preset, "device": jax.devices()[0].device_kind,
               "jax": jax.__version__, "runs": []}
    for tokens in args.tokens:
        for gate_up in args.gate_up:
            results["runs"].append(bench(config, tokens, gate_up, args.grad))
        print(json.dumps(results["runs"][-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
