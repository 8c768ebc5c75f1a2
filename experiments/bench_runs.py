"""Many runs in one program against one run at a time: the main job, warm start included.

Each variant is a whole `python -m jrl.train` process (compilation, warm start, RL and
validation), timed from start to exit, with its GPU's utilisation sampled by
nvidia-smi every 100 ms (where there is one):

    host:S          the host loop (rewards scored on the host), seed S
    hostseq:N       the host loop for seeds 0..N-1, one process after another
    runs:R[:K]      R seeds in one program (reward.in_graph_fn=exact_match, trainer.runs=R),
                    K steps a call (default 25)

    python experiments/bench_runs.py --out=results.jsonl host:0 runs:1 runs:8 runs:32

Extra `--config.*` flags after `--` go to every variant. Prints one line per variant
(wall seconds, RL steps' seconds, tokens per second over all runs, GPU busy share,
each run's held-out accuracy before -> after) and appends it to `--out` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np


def _sample_gpu(stop: threading.Event, samples: list[float]) -> None:
    """Appends the GPU's utilisation (%) every 100 ms until `stop` is set."""
    if shutil.which("nvidia-smi") is None:
        return
    proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu",
                             "--format=csv,noheader,nounits", "-lms", "100"],
                            stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if stop.is_set():
                break
            try:
                samples.append(float(line.split(",")[0]))
            except ValueError:
                pass
    finally:
        proc.kill()


def _records(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def _summary(records: list[dict], sequences: int) -> dict:
    """RL seconds (run 0's steps), tokens over all runs, each run's accuracy."""
    val = [k for r in records for k in r if k.startswith("val-core/")]
    key = val[0] if val else None
    runs = sorted({r.get("run", 0) for r in records})
    seconds = sum(r.get("timing_s/step", 0.0) for r in records if r.get("run", 0) == runs[0])
    tokens = sum((r["prompt_length/mean"] + r["response_length/mean"]) * sequences
                 for r in records if "response_length/mean" in r)
    acc = []
    for run in runs:
        points = [r[key] for r in records if r.get("run", 0) == run and key in r]
        acc.append((points[0], points[-1]) if points else (None, None))
    return {"rl_seconds": seconds, "tokens": tokens, "acc": acc, "runs": len(runs)}


def run_variant(spec: str, extra: list[str], config: str, sequences: int) -> dict:
    kind, *args = spec.split(":")
    seeds, flags = [0], []
    if kind == "host":
        seeds = [int(args[0]) if args else 0]
    elif kind == "hostseq":
        seeds = list(range(int(args[0])))
    elif kind == "runs":
        steps = args[1] if len(args) > 1 else "25"
        flags = ["--config.reward.in_graph_fn=exact_match", f"--config.trainer.runs={args[0]}",
                 f"--config.trainer.steps_per_call={steps}"]
    else:
        raise SystemExit(f"unknown variant {spec!r}")
    samples, stop = [], threading.Event()
    sampler = threading.Thread(target=_sample_gpu, args=(stop, samples), daemon=True)
    sampler.start()
    start, summaries, logs = time.perf_counter(), [], []
    for seed in seeds:
        workdir = tempfile.mkdtemp(prefix="bench_runs_")
        cmd = [sys.executable, "-m", "jrl.train", f"--config={config}", f"--workdir={workdir}",
               f"--config.seed={seed}", "--config.trainer.logger=('jsonl',)", *flags, *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        logs.append(proc.stdout[-3000:] + proc.stderr[-3000:])
        if proc.returncode:
            stop.set()
            return {"variant": spec, "error": proc.returncode, "log": logs[-1]}
        summaries.append(_summary(_records(workdir), sequences))
        shutil.rmtree(workdir, ignore_errors=True)
    wall = time.perf_counter() - start
    stop.set()
    runs = sum(s["runs"] for s in summaries)
    rl_seconds = sum(s["rl_seconds"] for s in summaries)
    tokens = sum(s["tokens"] for s in summaries)
    return {"variant": spec, "wall_s": round(wall, 1), "rl_s": round(rl_seconds, 1),
            "runs": runs, "tokens": tokens,
            "tok_per_s_rl": round(tokens / rl_seconds) if rl_seconds else None,
            "gpu_busy": round(float(np.mean(samples)) / 100, 3) if samples else None,
            "acc": [a for s in summaries for a in s["acc"]], "log_tail": logs[-1][-600:]}


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--config", default="configs/grpo_arith.py")
    parser.add_argument("--sequences", type=int, default=32 * 8,
                        help="sequences per step (train_batch_size x rollout.n)")
    parser.add_argument("--out", default=None)
    a = parser.parse_args(argv)
    for spec in a.variants:
        result = run_variant(spec, extra, a.config, a.sequences)
        accs = result.get("acc", [])
        gains = [f"{b:.3f}->{f:.3f}" for b, f in accs if b is not None]
        line = {k: v for k, v in result.items() if k not in ("acc", "log_tail", "log")}
        print(json.dumps(line), "|", ", ".join(gains[:8]) + (" ..." if len(gains) > 8 else ""),
              flush=True)
        if "error" in result:
            print(result["log"], flush=True)
        if accs and all(b is not None for b, _ in accs):
            finals = [f for _, f in accs]
            print(f"  after RL over {len(finals)} runs: mean {np.mean(finals):.3f}, "
                  f"min {min(finals):.3f}, max {max(finals):.3f}", flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
