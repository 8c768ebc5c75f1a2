"""How long the sampler's program takes to trace and to lower (not compile), the
host-side part of its first call: abstract arguments, no weights, any backend.

    python experiments/trace_sampler.py [--preset qwen2.5-0.5b] [--buckets 1 8] \
        [--impl xla pallas] [--out results.json]

On a CPU `pallas` lowers the decode kernel in interpret mode (larger than its GPU
lowering); on a GPU it is the Triton kernel itself. Run it in another tree
(`cd before && python ../experiments/trace_sampler.py`) for a before/after.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import results_json  # this folder is on the path when a script here runs

from jrl.models import PRESETS, init_params
from jrl.rollout import sampler


def measure(preset: str, buckets: int, impl: str, batch: int, prompt: int, response: int):
    config = dataclasses.replace(PRESETS[preset], dtype="bfloat16", decode_attention_impl=impl)
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    sampling = sampler.SamplingConfig(n=8, max_new_tokens=response, stop_token_ids=(1,),
                                      pad_token_id=0, decode_buckets=buckets)
    ids = jax.ShapeDtypeStruct((batch, prompt), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    program = jax.jit(functools.partial(sampler.generate_program, sampling=sampling,
                                        config=config))
    start = time.perf_counter()
    traced = program.trace(params, ids, ids, key)
    traced_at = time.perf_counter()
    lowered = traced.lower()
    lowered_at = time.perf_counter()
    return {"preset": preset, "decode_buckets": buckets, "impl": impl,
            "trace_s": traced_at - start, "lower_s": lowered_at - traced_at,
            "stablehlo_bytes": len(lowered.as_text())}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--buckets", type=int, nargs="+", default=[1, 8])
    p.add_argument("--impl", nargs="+", default=["xla"])
    p.add_argument("--batch", type=int, default=16, help="prompts (8 samples each)")
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--response_len", type=int, default=256)
    p.add_argument("--out", default="")
    args = p.parse_args()
    rows = []
    for impl in args.impl:
        for buckets in args.buckets:
            row = measure(args.preset, buckets, impl, args.batch, args.prompt_len,
                          args.response_len)
            print(f"{args.preset} decode_buckets={buckets} impl={impl}: trace "
                  f"{row['trace_s']:.2f} s, lower {row['lower_s']:.2f} s, StableHLO "
                  f"{row['stablehlo_bytes'] / 1e6:.1f} MB", flush=True)
            rows.append(row)
    results_json.write(args.out, backend=jax.default_backend(), args=vars(args), rows=rows)


if __name__ == "__main__":
    main()
