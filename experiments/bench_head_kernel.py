"""The log-prob head's Mosaic GPU kernel against XLA, timed on a Hopper GPU.

At the Qwen2.5-0.5B shape (D 896, V 151,936, tied embedding, bf16 hidden states and
unembedding) and `--tokens` tokens (16,384 and 32,768 by default), with and without the
entropy, each variant's `(log_z, target_logit, entropy)` is timed (median of `--iters`
calls after two warm-ups) and compared with an XLA reference (float32 logits of the same
bf16 operands, 1,024 tokens at a time): the reference and the Mosaic GPU kernel over
several `MosaicBlocks` (`--configs`, all at the first shape, then the three fastest
there). A variant that fails (a compile error, say) is recorded with the first lines of
its error and the sweep goes on; variants left when `--budget-s` seconds have passed are
skipped. Then the outputs the trainer uses: the log-probs and entropy of
`jrl.rl.logprobs.token_log_probs` and their gradients (the entropy as a metric, as in the
update) with `impl` "mosaic" (the fastest config as `MOSAIC_FORWARD`) and "xla". Writes
`--out` (JSON) and prints a table. The errors are there to show a variant computes the
same numbers; tests/kernels/test_gpu_checks.py asserts them on a GPU.

    python experiments/bench_head_kernel.py --out head.json
    python experiments/bench_head_kernel.py --smoke   # toy sizes, interpret mode, CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import jax
import jax.numpy as jnp

from jrl.kernels import logprob_head as hk
from jrl.rl import logprobs

# t, v, k, stages, overlap[, group[, consumers]] (MosaicBlocks). (64 + 256) x 64 bf16 =
# 40 KB of SMEM a stage: 2 stages leave room for two programs on an SM (one's epilogue
# beside the other's matmuls), 5 fill the 227 KB. Two consumers: 128 tokens a program.
CONFIGS = ("64,256,64,4,1", "64,256,64,2,1", "64,128,64,3,1", "64,256,64,3,1",
           "64,256,64,5,1", "64,256,64,4,0", "64,256,64,4,1,0", "64,256,64,4,1,8",
           "128,128,64,4,1", "128,256,64,4,1,16,2", "128,128,64,4,1,16,2",
           "128,256,64,3,1,16,2")
SMOKE_CONFIGS = ("64,128,64,2,1", "64,64,64,3,0,1", "128,128,64,2,1,32,2")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="toy sizes in interpret mode (checks the script on a CPU)")
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--configs", nargs="+", default=None,
                   help="MosaicBlocks to try: t,v,k,stages,overlap[,group[,consumers]] each")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=180.0,
                   help="skip the variants left after this many seconds")
    p.add_argument("--out", default="mosaic_head.json")
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.hidden, args.vocab, args.iters = [96], 128, 1000, 1
        args.configs = args.configs or list(SMOKE_CONFIGS)
    args.configs = args.configs or list(CONFIGS)
    return args


def mosaic_blocks(text):
    t, v, k, stages, overlap, *rest = map(int, text.split(","))
    return hk.MosaicBlocks(t=t, v=v, k=k, stages=stages, overlap=bool(overlap),
                           **dict(zip(["group", "consumers"], rest, strict=False)))


def timed(fn, *args, iters):
    """Median milliseconds of `iters` calls after two warm-ups."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def reference(h_td, w_vd, y_t, with_entropy, chunk=1024):
    """XLA: `(log_z, target_logit, entropy)` from float32 logits, `chunk` tokens at a time."""
    t, d = h_td.shape
    chunk = min(chunk, t)

    def one(xs):
        h, y = xs
        z = jnp.einsum("td,vd->tv", h, w_vd, preferred_element_type=jnp.float32)
        log_z = jax.nn.logsumexp(z, axis=-1)
        target = jnp.take_along_axis(z, y[:, None], axis=-1)[:, 0]
        if not with_entropy:
            return log_z, target, jnp.zeros_like(log_z)
        p = jnp.exp(z - log_z[:, None])
        return log_z, target, log_z - jnp.sum(p * z, axis=-1)

    out = jax.lax.map(one, (h_td.reshape(-1, chunk, d), y_t.reshape(-1, chunk)))
    return tuple(x.reshape(t) for x in out)


def errors(got, want):
    names = ("log_z", "target", "entropy")
    out = {f"err_{n}": float(jnp.max(jnp.abs(g - w)))
           for n, g, w in zip(names, got, want, strict=True)}
    out["err_log_prob"] = float(jnp.max(jnp.abs((got[1] - got[0]) - (want[1] - want[0]))))
    return out


def first_lines(e, n=6):
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return "\n".join(text[:n])


class Sweep:
    """Runs variants in turn within the time budget, recording each as a row."""

    def __init__(self, args):
        self.args, self.rows, self.start = args, [], time.perf_counter()

    def run(self, row, fn):
        if time.perf_counter() - self.start > self.args.budget_s:
            row["skipped"] = "time budget"
        else:
            try:
                row.update(fn())
            except Exception as e:  # a compile error or a wrong shape: record, go on
                row["error"] = first_lines(e)
                traceback.print_exc(limit=3)
        self.rows.append(row)
        print(json.dumps(row), flush=True)


def kernel_rows(sweep, tokens, with_entropy, inputs, want, configs):
    """The reference and the Mosaic (`configs`) variants at one shape."""
    args = sweep.args
    h, w, y = inputs
    flops = 2 * tokens * args.hidden * args.vocab
    base = dict(tokens=tokens, with_entropy=with_entropy)

    def measure(fn, *operands):
        out = fn(*operands)
        ms = timed(fn, *operands, iters=args.iters)
        return dict(errors(out, want), ms=ms, tflops=flops / ms / 1e9)

    ref = jax.jit(lambda h, w, y: reference(h, w, y, with_entropy))
    sweep.run(dict(base, variant="xla reference"), lambda: measure(ref, h, w, y))

    def kernel(impl, blocks):
        padded = hk.pad_vocab(w, True, blocks)
        fn = jax.jit(lambda h, w, y: tuple(x[0] for x in hk.log_softmax_stats(
            h[None], w, y[None], vocab=args.vocab, vocab_first=True,
            with_entropy=with_entropy, impl=impl, blocks=blocks)))
        return lambda: measure(fn, h, padded, y)

    for text in configs:
        sweep.run(dict(base, variant=f"mosaic {text}"), kernel("mosaic", mosaic_blocks(text)))


def fastest(rows, n):
    """The `n` fastest Mosaic configs among `rows` that ran and matched the reference."""
    ok = [r for r in rows if r["variant"].startswith("mosaic ") and "ms" in r
          and r["err_log_prob"] < 0.05 and r["err_entropy"] < 0.05]
    return [r["variant"].split()[1] for r in sorted(ok, key=lambda r: r["ms"])[:n]]


def trainer_rows(sweep, tokens, inputs):
    """`token_log_probs` (log-probs, entropy and their gradients) per impl against XLA's."""
    h, w, y = inputs
    rows = max(1, tokens // 256)
    hidden = h.reshape(rows, -1, h.shape[-1])
    targets = y.reshape(rows, -1)
    params = {"embed": {"embedding": w.astype(jnp.float32)}}
    g_lp = jax.random.normal(jax.random.key(7), targets.shape, jnp.float32)

    def make(impl):
        fwd = jax.jit(lambda p, h: logprobs.token_log_probs(
            p, h, targets, chunk_size=64, with_entropy=True, impl=impl))

        def loss(p, h):
            lp, ent = logprobs.token_log_probs(p, h, targets, chunk_size=64, with_entropy=True,
                                               entropy_grad=False, impl=impl)
            return jnp.sum(lp * g_lp), ent

        return fwd, jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))

    fwd, grad = make("xla")
    want = fwd(params, hidden), grad(params, hidden)[0]

    def check(impl):
        def go():
            f, g = make(impl)
            (lp, ent), (gp, gh) = f(params, hidden), g(params, hidden)[0]
            diff = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32)
                                                      - b.astype(jnp.float32))))
            return dict(err_log_prob=diff(lp, want[0][0]), err_entropy=diff(ent, want[0][1]),
                        err_grad_w=diff(gp["embed"]["embedding"],
                                        want[1][0]["embed"]["embedding"]),
                        err_grad_h=diff(gh, want[1][1]),
                        ms=timed(f, params, hidden, iters=sweep.args.iters))
        return go

    for impl in ("xla", "mosaic"):
        sweep.run(dict(tokens=tokens, with_entropy=True, variant=f"token_log_probs {impl}"),
                  check(impl))


def table(rows):
    print("| tokens | entropy | variant | ms | TFLOP/s | err log_z | err target | err entropy "
          "| err log-prob | err grad h | note |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        f = lambda k, fmt, r=r: format(r[k], fmt) if k in r else "-"
        note = (r.get("error") or r.get("skipped") or "").splitlines()
        note = note or ([f"max abs error {r['err']:.1e}"] if "err" in r else [])
        print(f"| {r['tokens']} | {r['with_entropy']} | {r['variant']} | {f('ms', '.2f')} "
              f"| {f('tflops', '.0f')} | {f('err_log_z', '.1e')} | {f('err_target', '.1e')} "
              f"| {f('err_entropy', '.1e')} | {f('err_log_prob', '.1e')} "
              f"| {f('err_grad_h', '.1e')} | {note[0][:90] if note else ''} |")


def main():
    args = parse_args()
    if not args.smoke and jax.default_backend() != "gpu":
        raise SystemExit("no GPU: run with --smoke for the toy sizes in interpret mode")
    sweep = Sweep(args)
    key = jax.random.split(jax.random.key(0), 3)
    w = (0.05 * jax.random.normal(key[1], (args.vocab, args.hidden))).astype(jnp.bfloat16)
    configs = args.configs  # all at the first shape, then its three fastest
    for tokens in args.tokens:
        h = jax.random.normal(key[0], (tokens, args.hidden), jnp.bfloat16)
        y = jax.random.randint(key[2], (tokens,), 0, args.vocab)
        for with_entropy in (True, False):
            want = jax.jit(lambda h, w, y, e=with_entropy: reference(h, w, y, e))(h, w, y)
            kernel_rows(sweep, tokens, with_entropy, (h, w, y), want, configs)
            configs = fastest(sweep.rows, 3) if configs is args.configs else configs
    h = jax.random.normal(key[0], (args.tokens[0], args.hidden), jnp.bfloat16)
    y = jax.random.randint(key[2], (args.tokens[0],), 0, args.vocab)
    best = fastest(sweep.rows, 1)
    hk.MOSAIC_FORWARD = mosaic_blocks(best[0]) if best else hk.MOSAIC_FORWARD
    print(f"token_log_probs with MOSAIC_FORWARD = {hk.MOSAIC_FORWARD}", flush=True)
    trainer_rows(sweep, args.tokens[0], (h, w, y))
    device = jax.devices()[0].device_kind
    print(f"\n{device}; jax {jax.__version__}; D {args.hidden}, V {args.vocab}; "
          f"{time.perf_counter() - sweep.start:.0f} s")
    table(sweep.rows)
    with open(args.out, "w") as f:
        json.dump(dict(device=device, jax=jax.__version__, args=vars(args), rows=sweep.rows),
                  f, indent=1)


if __name__ == "__main__":
    main()
