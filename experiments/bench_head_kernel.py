"""The log-prob head alone: XLA's chunked logits against the fused Pallas kernels.

Times, on the GPU, the unembedding + log-softmax of `--rows x --tokens` response tokens
(Qwen2.5-0.5B shape by default: D 896, V 151,936, tied embedding, bf16 hidden states)
as the step runs it: the forward with the entropy (the update's), its backward with
the entropy as a metric only (`entropy_grad=False`), and the reference pass's forward
without the entropy. Variants: `model.logprob_impl="xla"` (64-token chunks) and the
kernel over several tile settings (its backward pass is XLA's either way; the fastest
forward's is timed). Each variant is first checked against the XLA path on the same
random inputs (relative error of log-probs, entropy and both gradients). Median of
`--iters` timed calls after two warm-ups.

    python experiments/bench_head_kernel.py --out head.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jrl import logprobs
from jrl.models import head_kernel as hk

FORWARD_SWEEP = ("64,128,64,4,3", "64,128,64,4,4", "64,128,64,4,5", "64,128,32,4,4",
                 "128,128,64,4,3", "128,128,64,4,4", "128,256,64,8,3", "128,256,64,8,4",
                 "64,128,64,8,3", "32,128,64,4,3")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk", type=int, default=64, help="the XLA path's chunk (tokens)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tiles", nargs="+", default=list(FORWARD_SWEEP),
                   help="kernel tile settings to time: t,v,k,warps,stages each")
    p.add_argument("--out", default=None)
    return p.parse_args()


def timed(fn, *args, iters):
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main():
    args = parse_args()
    key = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(key[0], (args.rows, args.tokens, args.hidden), jnp.bfloat16)
    weight = 0.05 * jax.random.normal(key[1], (args.vocab, args.hidden), jnp.float32)
    targets = jax.random.randint(key[2], (args.rows, args.tokens), 0, args.vocab)
    g_lp = jax.random.normal(key[3], (args.rows, args.tokens), jnp.float32)
    params = {"embed": {"embedding": weight}}

    def make(impl):
        def forward(params, hidden, with_entropy):
            return logprobs.token_log_probs(params, hidden, targets, chunk_size=args.chunk,
                                            with_entropy=with_entropy, impl=impl)

        def loss(params, hidden):
            lp, ent = logprobs.token_log_probs(params, hidden, targets, chunk_size=args.chunk,
                                               with_entropy=True, entropy_grad=False,
                                               impl=impl)
            return jnp.sum(lp * g_lp), ent

        return (jax.jit(lambda p, h: forward(p, h, True)),
                jax.jit(lambda p, h: forward(p, h, False)),
                jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True)))

    rows = []

    def run(name, impl, forward_blocks=None, parts=("fwd", "ref", "grad")):
        if forward_blocks is not None:
            hk.FORWARD = hk.Blocks(*map(int, forward_blocks.split(",")))
        fwd, ref, grad = make(impl)
        row = dict(name=name, impl=impl, forward=forward_blocks)
        try:
            if "fwd" in parts:
                lp, ent = fwd(params, hidden)
                row["err_lp"], row["err_ent"] = rel(lp, want_lp), rel(ent, want_ent)
                row["fwd_ms"] = timed(fwd, params, hidden, iters=args.iters)
            if "ref" in parts:
                row["ref_ms"] = timed(ref, params, hidden, iters=args.iters)
            if "grad" in parts:
                (g_params, g_hidden), _ = grad(params, hidden)
                row["err_grad_w"] = rel(g_params["embed"]["embedding"], want_gw)
                row["err_grad_h"] = rel(g_hidden, want_gh)
                row["grad_ms"] = timed(grad, params, hidden, iters=args.iters)
        except Exception as e:  # a tile setting the compiler rejects: record, go on
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)

    fwd, _, grad = make("xla")
    want_lp, want_ent = fwd(params, hidden)
    (want_g, want_gh), _ = grad(params, hidden)
    want_gw = want_g["embed"]["embedding"]
    run("xla", "xla")
    for blocks in args.tiles:
        run(f"pallas {blocks}", "pallas", blocks, parts=("fwd", "ref"))
    best = min((r for r in rows if "fwd_ms" in r and r["impl"] == "pallas"),
               key=lambda r: r["fwd_ms"])["forward"]
    run(f"pallas {best} (fastest), fwd + bwd", "pallas", best, parts=("grad",))

    tokens = args.rows * args.tokens
    flops = 2 * tokens * args.hidden * args.vocab
    print(f"\n{jax.devices()[0].device_kind}; {tokens} tokens, D {args.hidden}, V {args.vocab}; "
          f"one matmul {flops / 1e12:.2f} TFLOP")
    print("| variant | fwd+entropy ms | ref fwd ms | fwd+bwd ms | err lp | err grad h |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        f = lambda k, r=r: f"{r[k]:.2f}" if k in r else "-"
        e = lambda k, r=r: f"{r[k]:.1e}" if k in r else "-"
        print(f"| {r['name']} | {f('fwd_ms')} | {f('ref_ms')} | {f('grad_ms')} | {e('err_lp')} "
              f"| {e('err_grad_h')} |" + (f" {r['error'][:80]}" if "error" in r else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, versions=jax.__version__,
                           args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
