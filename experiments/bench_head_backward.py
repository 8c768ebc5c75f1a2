"""The log-prob head's backward pass timed on a Hopper GPU: `logprob_head.grad_logits` (the
logits recomputed on chip, `d loss / d z` written once in bf16) against XLA's chunked
float32 logits.

At the Qwen2.5-0.5B head (D 896, V 151,936, tied, bf16 hidden states and unembedding):

1. `d loss / d z` alone for `--tokens` tokens (one chunk of the update's backward):
   XLA (the float32 logits and the elementwise pass of `jrl.rl.logprobs._fused_bwd`) and
   the kernel at each of `--configs` (`MosaicBlocks`: t,v,k,stages,overlap[,group[,
   consumers]]), with and without the entropy's term; errors against XLA's result
   (the same bf16 rounding of the same formula, so they are of bf16's size);
2. the whole backward of `token_log_probs` (`jax.grad` of a weighted sum of the
   log-probs and entropies, the forward on the Mosaic kernel in both) over
   `--rows` x `--length` tokens in chunks of `--chunk` (the trainer's
   `actor.logprob_chunk_size`), `logprob_head.BACKWARD` "xla" against "mosaic", with
   the largest differences of their gradients.

A variant that fails prints the first lines of its error and the next runs. Writes
`--out` (JSON) and prints each row. tests/kernels/test_gpu_checks.py asserts the errors
on a GPU.

    python experiments/bench_head_backward.py --out head_backward.json
    python experiments/bench_head_backward.py --smoke   # toy sizes, interpret mode, CPU
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jrl.kernels import logprob_head as hk
from jrl.rl import logprobs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.bench_head_kernel import first_lines, mosaic_blocks, timed  # noqa: E402

CONFIGS = ("128,256,64,3,1,16,2", "128,256,64,2,1,16,2", "128,128,64,4,1,16,2",
           "64,256,64,3,1", "64,128,64,4,1")
SMOKE_CONFIGS = ("64,128,64,2,1", "128,128,64,2,1,32,2")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="toy sizes in interpret mode (CPU)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens of one d loss / d z call")
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--configs", nargs="+", default=None)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default="head_backward.json")
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.hidden, args.vocab, args.iters = 96, 128, 1000, 1
        args.rows, args.length, args.chunk = 2, 48, 16
        args.configs = args.configs or list(SMOKE_CONFIGS)
    args.configs = args.configs or list(CONFIGS)
    return args


def xla_grad_logits(h_td, w_vd, y_t, log_z_t, g_lp_t, g_ent_t, ent_t, entropy_grad):
    """`_fused_bwd`'s XLA formula on one chunk, `[T, V]` bf16."""
    log_p = jnp.einsum("td,vd->tv", h_td, w_vd, preferred_element_type=jnp.float32) \
        - log_z_t[:, None]
    p = jnp.exp(log_p)
    onehot = jnp.arange(w_vd.shape[0])[None] == y_t[:, None]
    grad = g_lp_t[:, None] * (onehot.astype(jnp.float32) - p)
    if entropy_grad:
        grad -= g_ent_t[:, None] * p * (log_p + ent_t[:, None])
    return grad.astype(h_td.dtype)


def main():
    args = parse_args()
    interpret = args.smoke or jax.default_backend() != "gpu"
    keys = jax.random.split(jax.random.key(0), 5)
    t, d, v = args.tokens, args.hidden, args.vocab
    dtype = jnp.float32 if interpret else jnp.bfloat16
    h = jax.random.normal(keys[0], (t, d), dtype)
    w = (jax.random.normal(keys[1], (v, d)) * 0.05).astype(dtype)
    y = jax.random.randint(keys[2], (t,), 0, v)
    g_lp, g_ent = (jax.random.normal(k, (t,)) for k in keys[3:5])
    first = mosaic_blocks(args.configs[0])
    log_z, _, ent = hk.log_softmax_stats(h[None], hk.pad_vocab(w, True, first), y[None],
                                         vocab=v, vocab_first=True, with_entropy=True,
                                         blocks=first, interpret=interpret)
    log_z, ent = log_z[0], ent[0]
    rows = []

    def record(row, fn):
        try:
            row.update(fn())
        except Exception as e:  # noqa: BLE001 (a variant that does not compile)
            row["error"] = first_lines(e)
        rows.append(row)
        print(json.dumps(row), flush=True)

    grad_bytes = t * v * jnp.dtype(dtype).itemsize
    for entropy_grad in (True, False):
        xla = jax.jit(functools.partial(xla_grad_logits, entropy_grad=entropy_grad))
        want = xla(h, w, y, log_z, g_lp, g_ent, ent)
        record(dict(part="dz", impl="xla", entropy_grad=entropy_grad),
               lambda xla=xla: dict(ms=timed(xla, h, w, y, log_z, g_lp, g_ent, ent,
                                             iters=args.iters)))
        for config in args.configs:
            blocks = mosaic_blocks(config)
            wp = hk.pad_vocab(w, True, blocks)

            def measure(blocks=blocks, wp=wp, entropy_grad=entropy_grad, want=want):
                fn = jax.jit(lambda *a: hk.grad_logits(
                    *(x[None] for x in a[:1]), wp, *(x[None] for x in a[1:]), vocab=v,
                    vocab_first=True, entropy_grad=entropy_grad, blocks=blocks,
                    interpret=interpret)[0, :, :v])
                got = fn(h, y, log_z, g_lp, g_ent, ent)
                ms = timed(fn, h, y, log_z, g_lp, g_ent, ent, iters=args.iters)
                diff = jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))
                return dict(ms=ms, max_diff=float(diff.max()),
                            max_ref=float(jnp.abs(want.astype(jnp.float32)).max()),
                            tflops=2 * t * d * wp.shape[0] / ms / 1e9,
                            write_gbps=grad_bytes / ms / 1e6)
            record(dict(part="dz", impl="mosaic", config=config, entropy_grad=entropy_grad),
                   measure)

    # The whole backward through token_log_probs, as the update takes it.
    b, r = args.rows, args.length
    hidden = jax.random.normal(keys[0], (b, r, d), dtype)
    targets = jax.random.randint(keys[2], (b, r), 0, v)
    params = {"embed": {"embedding": w.astype(jnp.float32)}}
    weights = jax.random.normal(keys[3], (2, b, r))
    hk.MOSAIC_FORWARD = hk.MOSAIC_BACKWARD = first

    def loss(params, hidden):
        lp, e = logprobs.token_log_probs(params, hidden, targets, chunk_size=args.chunk,
                                         with_entropy=True, entropy_grad=True, impl="mosaic")
        return jnp.sum(lp * weights[0]) + jnp.sum(e * weights[1])

    grads = {}
    for backward in ("xla", "mosaic"):
        def run(backward=backward):
            hk.BACKWARD = backward
            fn = jax.jit(jax.grad(loss, argnums=(0, 1)))
            start = time.perf_counter()
            grads[backward] = jax.block_until_ready(fn(params, hidden))
            compile_s = time.perf_counter() - start
            return dict(ms=timed(fn, params, hidden, iters=args.iters), compile_s=compile_s)
        record(dict(part="token_log_probs grad (forward + backward)", backward=backward,
                    tokens=b * r, chunk=args.chunk), run)
    if len(grads) == 2:
        diffs = jax.tree.map(lambda a, c: float(jnp.abs(a.astype(jnp.float32)
                                                        - c.astype(jnp.float32)).max()),
                             grads["mosaic"], grads["xla"])
        scale = jax.tree.map(lambda a: float(jnp.abs(a.astype(jnp.float32)).max()),
                             grads["xla"])
        record(dict(part="gradient differences (mosaic - xla)"),
               lambda: dict(unembedding=diffs[0]["embed"]["embedding"],
                            unembedding_max=scale[0]["embed"]["embedding"],
                            hidden=diffs[1], hidden_max=scale[1]))
    with open(args.out, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                       args=vars(args), rows=rows), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
