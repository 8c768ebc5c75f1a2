"""Where the actor update's time goes: the backbone vs the log-prob head.

    python experiments/profile_update.py --preset qwen2.5-0.5b --micro 128
    python experiments/profile_update.py --micro 32 --remat none [--scan_unroll] \
        --trace_dir /tmp/trace   # the trainer's defaults; the backbone's kernels by op

Times, for one micro-batch of `--micro` sequences of `--prompt_len + --response_len`
tokens (float32 parameters, bfloat16 compute, as the trainer runs them):
  backbone fwd+bwd  the decoder forward and backward (loss = a weighted sum of the
                    response hidden states), with `--remat`;
  head fwd+bwd      unembedding + float32 log-softmax of the response tokens
                    (`logprobs.token_log_probs`, chunked) and its backward;
  head fwd          the same forward only (as in the old/ref log-prob passes);
and reports each as a share of 6·N·T-style FLOPs at 989 TFLOP/s. Median of
`--repeats` runs after warm-up. With `--trace_dir`, one more backbone run is traced
and its device time printed by kernel and by HLO op (`trace_summary.summarize`): the
rolled scan's (the default) against the unrolled one's (`--scan_unroll`) shows what
the loop costs.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

# The sibling script's timer (this folder is on the path when a script here runs).
from profile_decode import median_ms
from trace_summary import maybe_trace, summarize

from jrl.models.config import ModelConfig
from jrl.models.transformer import init_params
from jrl.rl import logprobs

PEAK = 989e12


def _median_s(fn, *args, repeats):
    return median_ms(fn, *args, repeats=repeats) / 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--micro", type=int, default=128)
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--response_len", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--remat", default="dots_saveable")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scan_unroll", action="store_true",
                        help="the layers unrolled (model.scan_unroll) instead of a rolled scan")
    parser.add_argument("--trace_dir", default=None,
                        help="trace one more backbone fwd+bwd here and summarize its kernels")
    parser.add_argument("--top", type=int, default=30, help="rows of the trace's tables")
    parser.add_argument("--show_args", type=int, default=0,
                        help="print an event's arguments for each of the N top kernels")
    parser.add_argument("--hlo_out", default=None,
                        help="write the backbone fwd+bwd's optimized HLO to this file")
    args = parser.parse_args()
    model = ModelConfig.preset(args.preset, param_dtype="float32", dtype="bfloat16",
                               remat=args.remat, scan_unroll=args.scan_unroll)
    params = jax.jit(functools.partial(init_params, model))(jax.random.key(0))
    b, p, r = args.micro, args.prompt_len, args.response_len
    keys = jax.random.split(jax.random.key(1), 3)
    prompt_ids = jax.random.randint(keys[0], (b, p), 0, model.vocab_size)
    responses = jax.random.randint(keys[1], (b, r), 0, model.vocab_size)
    ones_p, ones_r = jnp.ones((b, p), jnp.int32), jnp.ones((b, r), jnp.int32)
    weights = jax.random.normal(keys[2], (b, r, model.hidden_size), jnp.bfloat16)

    def backbone_loss(params):
        hidden = logprobs.response_hidden(params, prompt_ids, ones_p, responses, ones_r,
                                          config=model)
        return jnp.sum((hidden * weights).astype(jnp.float32))

    def head_loss(params, hidden):
        log_probs, _ = logprobs.token_log_probs(params, hidden, responses,
                                                chunk_size=args.chunk)
        return jnp.sum(log_probs)

    hidden = jax.jit(lambda prm: logprobs.response_hidden(
        prm, prompt_ids, ones_p, responses, ones_r, config=model))(params)
    backbone = jax.jit(jax.grad(backbone_loss))
    head = jax.jit(jax.grad(head_loss, argnums=(0, 1)))
    head_fwd = jax.jit(head_loss)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    head_params = model.vocab_size * model.hidden_size
    tokens = b * (p + r)
    rows = [("backbone fwd+bwd", _median_s(backbone, params, repeats=args.repeats),
             6 * (n_params - head_params) * tokens),
            ("head fwd+bwd", _median_s(head, params, hidden, repeats=args.repeats),
             6 * head_params * b * r),
            ("head fwd", _median_s(head_fwd, params, hidden, repeats=args.repeats),
             2 * head_params * b * r)]
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {args.preset}, micro-batch "
          f"{b} x ({p}+{r}) tokens, remat={args.remat}, scan_unroll={args.scan_unroll}, "
          f"chunk={args.chunk}")
    print("| part | ms | TFLOP/s | MFU |\n|---|---|---|---|")
    for name, seconds, flops in rows:
        print(f"| {name} | {1e3 * seconds:.1f} | {flops / seconds / 1e12:.0f} | "
              f"{100 * flops / seconds / PEAK:.1f}% |")
    if args.hlo_out:
        with open(args.hlo_out, "w") as f:
            f.write(backbone.lower(params).compile().as_text())
    if args.trace_dir:
        with maybe_trace(args.trace_dir):
            jax.block_until_ready(backbone(params))
        summarize(args.trace_dir, args.top, show_args=args.show_args)


if __name__ == "__main__":
    main()
