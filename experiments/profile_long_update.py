"""The passes after the rollout at long responses, without the rollout: the trainer's
own jitted `step.forward` and `step.learn` on a synthetic batch of the benchmark's
shape, for several settings in one process.

    python experiments/profile_long_update.py --variants "dyn:16384 dyn:32768 pad:8:dots_saveable"
        [--uniform_lengths 512,8192] [--trace_dir DIR]

Each variant builds the trainer as `bench_rl_step.py` does (Qwen2.5-0.5B shape, GRPO
with a KL loss, 16 prompts x 8, P512 / R8192 by default) and times, after one
compiling call, `--repeats` calls of the forward (the reference log-probs) and of the
update on a batch whose responses are forced to R or drawn from `--uniform_lengths`
(the benchmark's draw). Variants:
  dyn:BUDGET[:REMAT]          token-budget micro-batches (actor.use_dynamic_bsz)
  pad:MICRO[:REMAT]           padded micro-batches of MICRO sequences
each optionally followed by `+FLAG` or `+FLAG=VALUE` for more of `bench_rl_step.py`'s
flags (`dyn:32768+scan_unroll+logprob_impl=xla`).
With `--trace_dir`, the first variant's update (and forward) is traced once more and
its kernels summarised (`trace_summary.py`); with `--trace_all`, every variant's, each
in its own folder, the summaries (and each variant's kernel totals, in `--out`) kept
to the programs `--trace_program` matches (e.g. `learn`), for comparing variants
kernel by kernel. A rollout of this length is ~2 million
kernel launches, more than a trace holds, which is why the update is traced alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import bench_rl_step  # this folder is on the path when a script here runs
import jax
import jax.numpy as jnp
import numpy as np
import results_json  # this folder is on the path when a script here runs
import trace_summary

from jrl import metrics
from jrl.rl import types


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default="dyn:16384",
                   help="space-separated dyn:BUDGET[:REMAT] / pad:MICRO[:REMAT]")
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=512)
    p.add_argument("--response_len", type=int, default=8192)
    p.add_argument("--uniform_lengths", default=None, metavar="LO,HI")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--trace_dir", default=None)
    p.add_argument("--trace_all", action="store_true",
                   help="trace every variant (TRACE_DIR/v0, v1, ...), not only the first")
    p.add_argument("--trace_program", default=None,
                   help="with --trace_all: summarise only these programs' kernels (a regex)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def bench_args(args, variant: str):
    """`bench_rl_step.py`'s arguments for one variant."""
    base, *extras = variant.split("+")
    kind, size, *rest = base.split(":")
    argv = ["--preset", args.preset, "--algo", "grpo", "--batch", str(args.batch),
            "--n", str(args.n), "--prompt_len", str(args.prompt_len),
            "--response_len", str(args.response_len),
            "--remat", rest[0] if rest else "none"]
    if kind == "dyn":
        argv += ["--dynamic_bsz", "--max_token_len", size]
    elif kind == "pad":
        argv += ["--micro_batch", size]
    else:
        raise SystemExit(f"variant {variant!r}: expected dyn:BUDGET[:REMAT] or pad:MICRO[:REMAT]")
    for extra in extras:
        flag, _, value = extra.partition("=")
        argv += [f"--{flag}", value] if value else [f"--{flag}"]
    if args.uniform_lengths:
        argv += ["--natural_stops", "--uniform_lengths", args.uniform_lengths]
    return bench_rl_step.parse_args(argv)


def synthetic_batch(bargs, vocab: int):
    """(Rollout, Experience) of the benchmark's shape: random tokens, full prompts,
    responses of the forced or drawn lengths, reference log-probs and a score each."""
    rng = np.random.default_rng(0)
    n, p, r = bargs.batch * bargs.n, bargs.prompt_len, bargs.response_len
    targets = bench_rl_step.target_lengths(bargs)
    lengths = np.full(n, r) if targets is None else targets
    mask = (np.arange(r)[None, :] < lengths[:, None]).astype(np.int32)
    prompt_ids = np.repeat(rng.integers(0, vocab, (bargs.batch, p)), bargs.n, axis=0)
    responses = rng.integers(0, vocab, (n, r)) * mask
    rollout = types.Rollout(prompt_ids=jnp.asarray(prompt_ids, jnp.int32),
                            prompt_mask=jnp.ones((n, p), jnp.int32),
                            responses=jnp.asarray(responses, jnp.int32),
                            response_mask=jnp.asarray(mask))
    scores = np.zeros((n, r), np.float32)
    scores[np.arange(n), lengths - 1] = rng.integers(0, 2, n)
    exp = types.Experience.of(
        rollout, ref_log_probs=jnp.asarray(-rng.exponential(2.0, (n, r)) * mask, jnp.float32),
        token_level_scores=jnp.asarray(scores),
        uid=jnp.asarray(np.arange(n) // bargs.n, jnp.int32))
    return rollout, exp, int(n * p + lengths.sum()), targets


def timed(fn, repeats: int):
    """(first call's seconds, median of `repeats` further calls)."""
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return times[0], statistics.median(times[1:])


def run_variant(args, variant: str, trace: str | None) -> dict:
    bargs = bench_args(args, variant)
    with tempfile.TemporaryDirectory(prefix="profile_long_") as workdir:
        trainer, _, _ = bench_rl_step.build_trainer(bargs, "grpo", workdir)
        rollout, exp, tokens, targets = synthetic_batch(bargs, trainer.model_config.vocab_size)
        key = jax.random.key(0)

        def forward():  # traced as the trainer traces it: under its mesh's rules
            with trainer.sharder.active():
                return trainer.programs.forward(trainer.state, trainer.ref_params, rollout,
                                               trainer.frozen)

        def learn():
            with trainer.sharder.active():
                trainer.state, m = trainer.programs.learn(trainer.state, exp, key,
                                                           trainer.frozen)
            return m

        forward_first, forward_s = timed(forward, args.repeats)
        learn_first, learn_s = timed(learn, args.repeats)
        if trace:
            with trace_summary.maybe_trace(trace):
                jax.block_until_ready(forward())
                jax.block_until_ready(learn())
        flops_token = getattr(trainer, "train_flops_per_token", 6.0 * trainer.num_params)
        devices = trainer.sharder.mesh.size
        trainer.close()
    peak = metrics.peak_flops(jax.devices()[0].device_kind)
    peak = peak * devices if peak else None  # the MFUs below are of all the mesh's devices
    attention = bench_rl_step.attention_flops(bargs, targets)
    out = dict(variant=variant, devices=devices, tokens=tokens, forward_s=forward_s,
               learn_s=learn_s,
               forward_first_s=forward_first, learn_first_s=learn_first,
               mfu_6n=flops_token * tokens / learn_s / peak if peak else None,
               mfu_attention=(flops_token * tokens + attention) / learn_s / peak
               if peak and attention else None,
               peak_gib=(bench_rl_step.peak_memory_bytes() or 0) / 2**30)  # largest device's
    print(json.dumps(out), flush=True)
    if trace and args.trace_all:
        tables = trace_summary.summarize(trace, top=40, program=args.trace_program)
        out["kernels"] = [dict(name=n, ms=ms, calls=c)
                          for n, ms, c in tables.get("kernels", [])[:200]]  # none on a CPU
    return out


def main(argv=None):
    args = parse_args(argv)
    if args.trace_all and not args.trace_dir:
        raise SystemExit("--trace_all needs --trace_dir")
    if args.trace_program and not args.trace_all:
        raise SystemExit("--trace_program applies with --trace_all")
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)

    def trace(i):
        if args.trace_dir and args.trace_all:
            return os.path.join(args.trace_dir, f"v{i}")
        return args.trace_dir if i == 0 else None

    results = [run_variant(args, v, trace(i)) for i, v in enumerate(args.variants.split())]
    print("\n| variant | forward s | learn s | MFU 6N | MFU with attention | first learn s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        mfu = lambda x: f"{100 * x:.1f}%" if x else "-"
        print(f"| {r['variant']} | {r['forward_s']:.2f} | {r['learn_s']:.2f} | "
              f"{mfu(r['mfu_6n'])} | {mfu(r['mfu_attention'])} | {r['learn_first_s']:.1f} |")
    if args.trace_dir and not args.trace_all:
        trace_summary.summarize(args.trace_dir, top=40)
    results_json.write(args.out, results=results)


if __name__ == "__main__":
    main()
