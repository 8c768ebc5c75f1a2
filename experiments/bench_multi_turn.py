"""The multi-turn sampler against the single-turn one, at the same response budget.

Both decode B rows of a random-weight model (`--preset`, bf16) from P-token prompts
with a budget of R response tokens. The single-turn sampler generates all R tokens
(stops ignored). The multi-turn one (`jrl.rollout.multi_turn.generate`) ends a turn at any of
V/`--turn-len` stop ids (turns of about `--turn-len` tokens on a near-uniform random
model), answers every turn with a tool block of `--block-tokens` tokens and goes on
until the budget is spent, so both fill about B x R response slots; the multi-turn
rows also pay for their idle slots (a segment lasts until its longest turn ends),
the compaction of the cache and the host round trips between segments.

    python experiments/bench_multi_turn.py --preset qwen2.5-0.5b --batch 256 --out F.json

Prints one table; `--out` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import results_json  # this folder is on the path when a script here runs

from jrl import tools as tools_lib
from jrl.data.tokenizers import CharTokenizer
from jrl.models import ModelConfig, init_params
from jrl.rollout import multi_turn, sampler


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
    p.add_argument("--repeats", type=int, default=2)
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
    tools_lib.parse_tool_calls = lambda turn, fmt: ([tools_lib.ToolCall("echo", {})], [])
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

    def run_multi(key, mt):
        out = multi_turn.generate(params, ids, mask, key, sampling=sampling, config=config,
                                  tokenizer=tok, tools=tools, mt=mt)
        return {"tokens": int(out.attention_mask.sum()),
                "model_tokens": int(out.response_mask.sum()), **out.metrics}

    rows = []
    runs = [("single-turn", run_single)] + [
        (f"multi-turn, end fraction {f:g}", lambda key, mt=mt: run_multi(key, mt))
        for f, mt in mts.items()]
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
        rows.append({"sampler": name, "compile_s": compile_s, "seconds": seconds,
                     "tokens_per_s": last["tokens"] / seconds,
                     "model_tokens_per_s": last["model_tokens"] / seconds, **last})
        print(json.dumps(rows[-1]), flush=True)
    tools_lib.parse_tool_calls = tools_lib_parse

    print(f"\n{args.preset} bf16, B={args.batch}, P={args.prompt_len}, R={args.budget}, "
          f"turns ~{args.turn_len} tokens, tool blocks {args.block_tokens} tokens; "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}\n")
    print("| sampler | s | response tokens/s (all) | model tokens/s | turns/row | segments |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sampler']} | {r['seconds']:.3f} | {r['tokens_per_s']:,.0f} | "
              f"{r['model_tokens_per_s']:,.0f} | {r.get('num_turns/mean', 1):.1f} | "
              f"{r.get('multi_turn/segments', 1):.0f} |")
    results_json.write(args.out, args=vars(args), rows=rows)


if __name__ == "__main__":
    main()
