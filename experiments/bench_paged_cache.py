"""The paged KV cache's memory against the contiguous cache's, at natural response lengths.

Rows stop at target lengths drawn uniformly in [LO, HI] (`--lengths`; the default
averages a third of the maximum), as a reasoning batch's do: a random model cannot be
made to stop there, so each row stops when it reaches its target, as the benchmarks'
forced lengths do (`bench_rl_step.stop_at_lengths`). For each pool size (`--pool`, a
fraction of the contiguous cache's slots) the paged program (`jrl.rollout.paged`) runs
the batch and reports the most pages its rows held at once, the rows it preempted, and
its compiled memory beside the contiguous program's; the responses are checked equal to
the contiguous program's.

    python experiments/bench_paged_cache.py --preset tiny --rows 128 --prompt_len 64 \\
        --response_len 1024 --pool 1.0 0.5 0.35 --out paged_cache.json

On XLA:CPU the compiled memory is the program's buffers (`memory_analysis`): the cache,
the parameters and the temporaries.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_rl_step import stop_at_lengths  # this folder is on the path for its scripts

from jrl.models import ModelConfig, init_params
from jrl.rollout import paged, sampler


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", help="jrl.models.PRESETS name (random weights)")
    p.add_argument("--rows", type=int, default=128, help="prompts (one sample each)")
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--response_len", type=int, default=1024)
    p.add_argument("--lengths", default=None, metavar="LO,HI",
                   help="target lengths, uniform (default: R/16 to 5R/8, a third of R on average)")
    p.add_argument("--page_size", type=int, default=16)
    p.add_argument("--max_num_seqs", type=int, default=0, help="decode slots (0: every row)")
    p.add_argument("--pool", type=float, nargs="+", default=[1.0, 0.5, 0.35],
                   help="pool sizes as fractions of the contiguous cache's pages")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args()


def compiled_bytes(compiled) -> int:
    analysis = compiled.memory_analysis()
    return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes
               + analysis.argument_size_in_bytes)


def main() -> None:
    args = parse_args()
    config = ModelConfig.preset(args.preset)
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(args.seed))
    rng = np.random.default_rng(args.seed)
    lo, hi = (map(int, args.lengths.split(",")) if args.lengths else
              (args.response_len // 16, 5 * args.response_len // 8))
    targets = rng.integers(lo, hi + 1, size=args.rows)
    stop_at_lengths(lambda rows, keys: jnp.asarray(targets)[rows])
    ids = jnp.asarray(rng.integers(1, config.vocab_size, (args.rows, args.prompt_len)),
                      jnp.int32)
    mask = jnp.ones_like(ids)
    key = jax.random.key(args.seed)
    # No stop ids: the rows stop at their targets only (a random model's draws would
    # otherwise stop some early).
    base = sampler.SamplingConfig(max_new_tokens=args.response_len, pad_token_id=0)
    contiguous = jax.jit(sampler.generate_program, static_argnames=("sampling", "config"))
    start = time.perf_counter()
    want = contiguous(params, ids, mask, key, sampling=base, config=config)
    jax.block_until_ready(want)
    contiguous_s = time.perf_counter() - start
    contiguous_bytes = compiled_bytes(contiguous.lower(params, ids, mask, key, sampling=base,
                                                       config=config).compile())
    slots = args.prompt_len + args.response_len
    cache_bytes = (2 * config.num_layers * args.rows * slots * config.num_kv_heads
                   * config.head_dim * jnp.dtype(config.dtype).itemsize)
    full_pages = args.rows * -(-slots // args.page_size)
    lengths = np.asarray(want.response_lengths)
    print(f"{args.preset}, {args.rows} rows, P{args.prompt_len} / R{args.response_len}, "
          f"lengths uniform in [{lo}, {hi}] (mean {lengths.mean():.0f}, "
          f"{lengths.mean() / args.response_len:.1%} of R); contiguous cache "
          f"{cache_bytes / 2**20:.1f} MiB, program {contiguous_bytes / 2**20:.1f} MiB, "
          f"{contiguous_s:.1f} s")
    results = []
    run = jax.jit(paged.run, static_argnames=("sampling", "config"))
    for fraction in args.pool:
        pages = max(int(full_pages * fraction), -(-slots // args.page_size)) + 1
        sampling = dataclasses.replace(base, kv_cache="paged", page_size=args.page_size,
                                       num_pages=pages, max_num_seqs=args.max_num_seqs)
        start = time.perf_counter()
        state = jax.block_until_ready(run(params, ids, mask, key, sampling=sampling,
                                          config=config)[2])
        seconds = time.perf_counter() - start
        program_bytes = compiled_bytes(run.lower(params, ids, mask, key, sampling=sampling,
                                                 config=config).compile())
        same = bool(np.array_equal(np.asarray(state.responses), np.asarray(want.responses))
                    and np.array_equal(np.asarray(state.out_lengths), lengths))
        pool_bytes = paged.pool_bytes(sampling, config, args.rows, args.prompt_len)
        row = dict(pool_fraction=fraction, pool_pages=pages, pool_bytes=pool_bytes,
                   pool_over_contiguous=pool_bytes / cache_bytes,
                   peak_pages=int(state.peak_pages),
                   peak_over_contiguous=int(state.peak_pages) / full_pages,
                   preemptions=int(np.sum(state.preemptions)), program_bytes=program_bytes,
                   program_over_contiguous=program_bytes / contiguous_bytes,
                   seconds=seconds, same_responses=same)
        results.append(row)
        print(json.dumps(row))
    print("\n| pool (of the contiguous cache) | pages | peak pages held (of the contiguous "
          "cache's) | preemptions | program memory (of the contiguous program's) | same "
          "responses |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['pool_over_contiguous']:.1%} | {r['pool_pages']} | {r['peak_pages']} "
              f"({r['peak_over_contiguous']:.1%}) | {r['preemptions']} | "
              f"{r['program_bytes'] / 2**20:.1f} MiB ({r['program_over_contiguous']:.1%}) | "
              f"{r['same_responses']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), targets_mean=float(targets.mean()),
                           contiguous_cache_bytes=cache_bytes,
                           contiguous_program_bytes=contiguous_bytes,
                           contiguous_s=contiguous_s, results=results), f, indent=1)


if __name__ == "__main__":
    main()
