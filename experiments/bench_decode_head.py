"""The sampler's decode head alone: XLA's float32 logits and draw against the log-prob
kernel's masses and the draw from them (`sampler.next_tokens`), on a Hopper GPU.

For each head shape (`--shapes` D,V: tied, bf16) and number of rows, `--steps` heads run
in one jitted `fori_loop`, each step's hidden states nudged by the tokens the last one
drew (so XLA cannot hoist a step out of the loop); the time is the median over `--iters`
calls after two warm-ups, divided by the steps. XLA's path (`decode_head_impl="xla"`)
runs first, then the kernel at each of `--configs` (`MosaicBlocks`, as
`logprob_head.SAMPLE_BLOCKS`, at any rows), each with the blocks split into each of `--parts` ranges
(`logprob_head.SAMPLE_PARTS`). Each kernel row also counts the tokens it drew that
XLA's path did not, for the same keys (a uniform number between the two sums' roundings:
a handful at most). Writes `--out` (JSON) and prints a table.

    python experiments/bench_decode_head.py --out head.json
    python experiments/bench_decode_head.py --smoke   # toy sizes, interpret mode, CPU
"""

from __future__ import annotations

import argparse
import json
import traceback

import jax
import jax.numpy as jnp
from bench_head_kernel import mosaic_blocks, timed

from jrl.kernels import logprob_head as hk
from jrl.models import ModelConfig
from jrl.rollout import sampler

# t, v, k, stages, overlap[, group[, consumers]]: SAMPLE_BLOCKS, SAMPLE_BLOCKS_FEW, and 128
# rows a program on two warpgroups.
CONFIGS = ("256,128,64,3,1,16,2", "64,128,64,4,1", "128,128,64,3,1,16,2")
SMOKE_CONFIGS = ("64,32,16,2,1", "128,32,16,2,1,16,2")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="toy sizes in interpret mode (checks the script on a CPU)")
    p.add_argument("--shapes", nargs="+", default=["896,151936"],
                   help="hidden size,vocabulary of each head (tied)")
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256, 512])
    p.add_argument("--configs", nargs="+", default=None)
    p.add_argument("--parts", type=int, nargs="+", default=[2, 4],
                   help="column ranges of a block (logprob_head.SAMPLE_PARTS), each a run")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=20, help="heads per timed call")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default="decode_head.json")
    args = p.parse_args()
    if args.smoke:
        args.shapes, args.rows, args.steps, args.iters, args.parts = ["32,101"], [37], 2, 1, [2]
        args.configs = args.configs or list(SMOKE_CONFIGS)
    args.configs = args.configs or list(CONFIGS)
    return args


def head_config(hidden: int, vocab: int, dtype: str, impl: str) -> ModelConfig:
    """A tied one-layer model of the head's shape (the head reads nothing else)."""
    return ModelConfig(family="qwen2", vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=hidden, num_layers=1, num_heads=1, num_kv_heads=1,
                       head_dim=hidden, tie_word_embeddings=True, dtype=dtype,
                       param_dtype=dtype, decode_head_impl=impl)


def make_loop(config: ModelConfig, sampling, steps: int):
    """`steps` heads in a row: `(tokens, log_probs)` of the last, and the first's tokens."""
    @jax.jit
    def run(params, hidden, keys):
        def body(i, carry):
            h, tokens, _, first = carry
            h = h + (tokens % 2)[:, None].astype(h.dtype)  # a step depends on the last
            step_keys = jax.vmap(jax.random.fold_in, (0, None))(keys, i)
            tokens, log_probs = sampler.next_tokens(params, h, step_keys, sampling, config)
            first = jnp.where(i == 0, tokens, first)
            return h, tokens, log_probs, first

        zeros = jnp.zeros(hidden.shape[:1], jnp.int32)
        _, tokens, log_probs, first = jax.lax.fori_loop(
            0, steps, body, (hidden, zeros, jnp.zeros(zeros.shape, jnp.float32), zeros))
        return tokens, log_probs, first

    return run


def main() -> None:
    args = parse_args()
    dtype = "float32" if args.smoke else "bfloat16"
    sampling = sampler.SamplingConfig(temperature=args.temperature)
    rows_out = []
    for shape in args.shapes:
        hidden, vocab = map(int, shape.split(","))
        key_w, key_h = jax.random.split(jax.random.key(0))
        params = {"embed": {"embedding": (0.05 * jax.random.normal(
            key_w, (vocab, hidden))).astype(dtype)}}
        for rows in args.rows:
            h = jax.random.normal(key_h, (rows, hidden)).astype(dtype)
            keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(1), jnp.arange(rows))
            reference = None
            variants = ["xla", *(f"{c}/{parts}" for c in args.configs for parts in args.parts)]
            for variant in variants:
                row = dict(hidden=hidden, vocab=vocab, rows=rows, variant=variant)
                try:
                    impl = "xla" if variant == "xla" else "mosaic"
                    config = head_config(hidden, vocab, dtype, impl)
                    if impl == "mosaic":
                        blocks, parts = variant.split("/")
                        hk.SAMPLE_BLOCKS, hk.SAMPLE_PARTS = mosaic_blocks(blocks), int(parts)
                        hk.SAMPLE_FEW_ROWS = 0  # this config at any rows
                    # The unembedding padded to whole blocks where the vocabulary needs
                    # it, once, as `sampler.per_layer` does per rollout.
                    head = {**params, **sampler._padded_head(params, config)}
                    run = make_loop(config, sampling, args.steps)
                    ms = timed(run, head, h, keys, iters=args.iters)
                    first = run(head, h, keys)[2]
                    row["us_per_head"] = 1e3 * ms / args.steps
                    if reference is None:
                        reference = first
                    else:
                        row["tokens_unlike_xla"] = int(jnp.sum(first != reference))
                except Exception as e:  # a config that does not compile, say
                    row["error"] = "".join(traceback.format_exception_only(e))[:400]
                rows_out.append(row)
                print(json.dumps(row), flush=True)
    xla = {(r["hidden"], r["rows"]): r.get("us_per_head") for r in rows_out
           if r["variant"] == "xla"}
    print("\n| D | V | rows | head | us a step | XLA / it | tokens unlike XLA's |")
    print("|---|---|---|---|---|---|---|")
    for r in rows_out:
        us, base = r.get("us_per_head"), xla.get((r["hidden"], r["rows"]))
        ratio = f"{base / us:.2f}x" if us and base else "-"
        print(f"| {r['hidden']} | {r['vocab']} | {r['rows']} | {r['variant']} | "
              f"{us and f'{us:.1f}' or r.get('error', '-')[:60]} | {ratio} | "
              f"{r.get('tokens_unlike_xla', '-')} |")
    with open(args.out, "w") as f:
        json.dump(dict(args=vars(args), device=jax.devices()[0].device_kind,
                       jax=jax.__version__, rows=rows_out), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
