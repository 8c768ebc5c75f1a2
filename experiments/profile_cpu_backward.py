"""Where jrl's actor backward pass spends its time under XLA:CPU (the main job's shapes).

Times forward and forward + backward of a policy-gradient loss over the CI warm start
(`tests/data/arith_warm_start`, 128 sequences x 13 tokens, as one mini-batch of the main
job's update), then traces five backward calls with `jax.profiler` and sums the XLA
thunks by kind: dots (YNNPACK fusions), elementwise fusions that write a transposed
layout (`copy_*`), other elementwise and reduce fusions, and loop control.

    python experiments/profile_cpu_backward.py [--trace_dir /tmp/jrl_cpu_trace]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments.profile_decode import median_ms  # noqa: E402
from jrl.models import hf  # noqa: E402
from jrl.rl.logprobs import response_log_probs  # noqa: E402

WARM_START = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "tests", "data", "arith_warm_start")


def kind_of(thunk: str) -> str:
    if thunk.startswith("ynn_fusion"):
        return "dots (YNNPACK fusions)"
    if thunk.startswith("copy"):
        return "elementwise writing a transposed layout (copy_*)"
    if thunk.startswith("while"):
        return "loop control"
    return "other elementwise and reduce fusions"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace_dir", default="/tmp/jrl_cpu_trace")
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    model, params = hf.load_pretrained(WARM_START, dtype="float32")
    rng = np.random.default_rng(0)
    b, p, r = args.batch, 8, 5
    prompts = jnp.asarray(rng.integers(3, model.vocab_size, (b, p)), jnp.int32)
    responses = jnp.asarray(rng.integers(3, model.vocab_size, (b, r)), jnp.int32)
    advantages = jnp.asarray(rng.standard_normal((b, r)), jnp.float32)

    def loss(params):
        log_probs, _ = response_log_probs(params, prompts, jnp.ones_like(prompts), responses,
                                          jnp.ones_like(responses), config=model)
        return -(log_probs * advantages).mean()

    forward, backward = jax.jit(loss), jax.jit(jax.value_and_grad(loss))
    print(f"forward            {median_ms(forward, params):7.1f} ms")
    print(f"forward + backward {median_ms(backward, params):7.1f} ms")
    shutil.rmtree(args.trace_dir, ignore_errors=True)
    calls = 5
    with jax.profiler.trace(args.trace_dir, create_perfetto_trace=True):
        for _ in range(calls):
            jax.block_until_ready(backward(params))
    trace = glob.glob(os.path.join(args.trace_dir, "**", "perfetto_trace.json.gz"),
                      recursive=True)[0]
    events = json.load(gzip.open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    by_kind, by_thunk = collections.Counter(), collections.Counter()
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or name.startswith(("ThunkExecutor", "$", "SlinkyThreadPool")):
            continue
        by_kind[kind_of(name)] += e["dur"] / calls / 1e3
        by_thunk[name] += e["dur"] / calls / 1e3
    total = sum(by_kind.values())
    print(f"thunk time per call (summed over threads): {total:.1f} ms")
    for kind, ms in by_kind.most_common():
        print(f"  {kind:<50} {ms:7.1f} ms  {100 * ms / total:4.1f}%")
    print("largest thunks:")
    for name, ms in by_thunk.most_common(6):
        print(f"  {name:<50} {ms:7.1f} ms")


if __name__ == "__main__":
    main()
