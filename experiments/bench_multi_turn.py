"""The multi-turn sampler against the single-turn one, at the same response budget.

Both decode B rows of a random-weight model (`--preset`, bf16) from P-token prompts
with a budget of R response tokens. The single-turn sampler generates all R tokens
(stops ignored). The multi-turn one (`jrl.rollout.multi_turn.generate`) ends a turn at any of
V/`--turn-len` stop ids (turns of about `--turn-len` tokens on a near-uniform random
model), answers every turn with a tool block of `--block-tokens` tokens and goes on
until the budget is spent, so both fill about B x R response slots; the multi-turn
rows also pay for their idle slots (a segment lasts until its longest turn ends),
the compaction of the cache and the host round trips between segments.

With `--end-prob p` a turn makes no call with probability p (decided by a hash of its
text, so the same in every run), which ends its row: rows of unlike lengths, as real
conversations are. `--caches` runs the multi-turn rows on either KV cache: "paged" on
a pool of every row at full length, "paged:F" on F of it (rows preempted when it runs
short), each with the pool's use, its preemptions and its bytes beside the contiguous
cache's.

    python experiments/bench_multi_turn.py --preset qwen2.5-0.5b --batch 256 --out F.json
    python experiments/bench_multi_turn.py --budget 512 --end-prob 0.3 --end-fractions 0.5 \
        --caches contiguous paged paged:0.5 --no-single [--trace_dir DIR]

Prints one table; `--out` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import results_json  # this folder is on the path when a script here runs
import trace_summary

from jrl import tools as tools_lib
from jrl.data.tokenizers import CharTokenizer
from jrl.models import ModelConfig, init_params
from jrl.rollout import multi_turn, paged, sampler


class _AnyIdTokenizer(CharTokenizer):
    """The char tokenizer, decoding any model id (a random model samples the whole vocabulary)."""

    def decode(self, ids, skip_special_tokens=True):
        return super().decode([i % self.vocab_size for i in ids], skip_special_tokens)


class _Echo(tools_lib.Tool):
    def __init__(self, text):
        super().__init__({}, {"type": "function", "function": {
            "name": "echo", "description": "echo",
            "parameters": {"type": "object", "properties": {}}}})
        self.text = text

    def execute(self, instance_id, arguments):
        return self.text, 0.0, {}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--budget", type=int, default=256, help="R, response tokens per row")
    p.add_argument("--turn-len", type=int, default=64, help="mean model tokens per turn")
    p.add_argument("--block-tokens", type=int, default=24, help="tokens of each tool block")
    p.add_argument("--end-fractions", type=float, nargs="+", default=[1.0, 0.5],
                   help="multi-turn rows, one per rollout.multi_turn.segment_end_fraction")
    p.add_argument("--end-prob", type=float, default=0.0,
                   help="chance that a turn makes no call (ending its row)")
    p.add_argument("--caches", nargs="+", default=["contiguous"],
                   help="the multi-turn rows' KV caches: contiguous, paged, paged:F")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--no-single", action="store_true", help="skip the single-turn row")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--trace_dir", default=None,
                   help="trace one more run of each sampler here (a folder each), summarised "
                        "by kernel (experiments/trace_summary.py)")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    config = ModelConfig.preset(args.preset, dtype="bfloat16", param_dtype="bfloat16")
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    ids = rng.integers(100, config.vocab_size, (args.batch, args.prompt_len)).astype(np.int32)
    mask = np.ones_like(ids)
    ids_d, mask_d = jnp.asarray(ids), jnp.asarray(mask)
    tok = _AnyIdTokenizer()
    # "Tool: " + text + "\nAssistant: " after a "\n" turn closing: block_tokens in all.
    text = "x" * max(args.block_tokens - len("\nTool: \nAssistant: "), 1)
    tools = {"echo": _Echo(text)}
    tools_lib_parse = tools_lib.parse_tool_calls

    def call_or_end(turn, fmt):
        if zlib.crc32(turn.encode()) / 2**32 < args.end_prob:
            return [], []
        return [tools_lib.ToolCall("echo", {})], []

    tools_lib.parse_tool_calls = call_or_end
    stops = tuple(range(config.vocab_size - config.vocab_size // args.turn_len,
                        config.vocab_size))
    sampling = sampler.SamplingConfig(n=1, max_new_tokens=args.budget, pad_token_id=0)
    mts = {f: multi_turn.MultiTurnConfig(max_assistant_turns=10**6, max_user_turns=10**6,
                                         max_tool_response_tokens=args.block_tokens + 8,
                                         turn_stop_ids=stops, segment_end_fraction=f)
           for f in args.end_fractions}
    single = sampler.SamplingConfig(n=1, max_new_tokens=args.budget, ignore_stop=True)

    def run_single(key):
        out = sampler.generate(params, ids_d, mask_d, key, single, config=config)
        jax.block_until_ready(out.responses)
        return {"tokens": args.batch * args.budget, "model_tokens": args.batch * args.budget}

    block = args.block_tokens + 9  # `max_tool_response_tokens` + 1
    slots = sampler.cache_slots(config, args.prompt_len + args.budget + block)
    cache_bytes = (2 * config.num_layers * args.batch * config.num_kv_heads * slots
                   * config.head_dim * jnp.dtype(config.dtype).itemsize)

    def cache_sampling(cache):
        if cache == "contiguous":
            return sampling
        full = dataclasses.replace(sampling, kv_cache="paged", page_size=args.page_size)
        pages = paged.shape(full, args.batch, args.prompt_len)["pages"]
        fraction = float(cache.split(":")[1]) if ":" in cache else 1.0
        return dataclasses.replace(full, num_pages=0 if fraction == 1 else
                                   max(int(fraction * (pages - 1)), 1) + 1)

    def run_multi(key, mt, sampling):
        out = multi_turn.generate(params, ids, mask, key, sampling=sampling, config=config,
                                  tokenizer=tok, tools=tools, mt=mt)
        pages = {}
        if out.page_usage is not None:
            pool = paged.pool_bytes(sampling, config, args.batch, args.prompt_len)
            pages = {"page_usage": out.page_usage, "preemptions": int(out.preemptions.sum()),
                     "cache_gib": pool / 2**30}
        return {"tokens": int(out.attention_mask.sum()),
                "model_tokens": int(out.response_mask.sum()),
                "cache_gib": cache_bytes / 2**30, **pages, **out.metrics}

    rows = []
    runs = [] if args.no_single else [("single-turn", run_single)]
    runs += [(f"multi-turn, end fraction {f:g}, {cache} cache",
              lambda key, mt=mt, cache=cache: run_multi(key, mt, cache_sampling(cache)))
             for f, mt in mts.items() for cache in args.caches]
    for name, fn in runs:
        start = time.perf_counter()
        fn(jax.random.key(99))
        compile_s = time.perf_counter() - start
        times, last = [], None
        for r in range(args.repeats):
            start = time.perf_counter()
            last = fn(jax.random.key(r))
            times.append(time.perf_counter() - start)
        seconds = min(times)
        if args.trace_dir:
            folder = os.path.join(args.trace_dir, name.replace(", ", "_").replace(" ", "_"))
            with trace_summary.maybe_trace(folder):
                fn(jax.random.key(0))
            trace_summary.summarize(folder)
            trace_summary.busy(folder)
        rows.append({"sampler": name, "compile_s": compile_s, "seconds": seconds,
                     "tokens_per_s": last["tokens"] / seconds,
                     "model_tokens_per_s": last["model_tokens"] / seconds, **last})
        print(json.dumps(rows[-1]), flush=True)
    tools_lib.parse_tool_calls = tools_lib_parse

    print(f"\n{args.preset} bf16, B={args.batch}, P={args.prompt_len}, R={args.budget}, "
          f"turns ~{args.turn_len} tokens, tool blocks {args.block_tokens} tokens, "
          f"rows end after a turn with chance {args.end_prob:g}; "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}\n")
    print("| sampler | s | response tokens/s (all) | model tokens/s | turns/row | segments "
          "| cache GiB | page usage | preemptions |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        usage = f"{r['page_usage']:.3f}" if "page_usage" in r else "-"
        print(f"| {r['sampler']} | {r['seconds']:.3f} | {r['tokens_per_s']:,.0f} | "
              f"{r['model_tokens_per_s']:,.0f} | {r.get('num_turns/mean', 1):.1f} | "
              f"{r.get('multi_turn/segments', 1):.0f} | {r.get('cache_gib', 0):.2f} | "
              f"{usage} | {r.get('preemptions', '-')} |")
    results_json.write(args.out, args=vars(args), rows=rows)


if __name__ == "__main__":
    main()
