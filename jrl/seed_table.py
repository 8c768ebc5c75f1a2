"""The README's seed table in one command: seeds 0-4 of GRPO and PPO on the main job.

Each algorithm is one process whose five runs train at once in one program
(`reward.in_graph_fn=exact_match`, `trainer.runs=5`; run r is the run `--config.seed=r`
makes alone), warm start included. Prints the markdown table of held-out accuracy
before -> after RL and draws every run's curves with their mean and min-max band
into one PNG (a panel per algorithm and curve). Run from the repository root (the
configs are `configs/grpo_arith.py` and `configs/ppo_arith.py`):

    python -m jrl.seed_table --workdir=runs/seed_table [--runs=5] [-- --config.k=v]

The workdirs (`<workdir>/grpo`, `<workdir>/ppo`) keep each run's metrics; running the
command again reuses finished ones. One seed alone is `python -m jrl.train
--config=configs/grpo_arith.py --config.seed=S` (rewards on the host).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from jrl import metrics

CONFIGS = {"GRPO": "configs/grpo_arith.py", "PPO": "configs/ppo_arith.py"}
VAL_KEY = "val-core/synthetic/arithmetic/acc/mean@1"


def _accuracy(records: list[dict], runs: int) -> list[tuple[float, float]]:
    """Each run's first and last held-out accuracy."""
    out = []
    for run in range(runs):
        points = [r[VAL_KEY] for r in sorted(records, key=lambda r: r["step"])
                  if r.get("run") == run and VAL_KEY in r]
        out.append((points[0], points[-1]))
    return out


def _figure(records_by_name: dict[str, list[dict]]) -> Figure:
    """A row per algorithm, a panel per curve (training score, held-out accuracy): each
    run thin, the mean bold, the band between min and max (`metrics.draw_runs`)."""
    fig = Figure(figsize=(10, 4.5 * len(records_by_name)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(records_by_name), 2, squeeze=False)
    for row, (name, records) in zip(axes, records_by_name.items(), strict=True):
        for ax, (key, per_run) in zip(row, metrics.run_series(records).items(), strict=False):
            metrics.draw_runs(ax, key, per_run, [f"seed {run}" for run in per_run])
            ax.set_title(name)
    return fig


def table(results: dict[str, list[tuple[float, float]]], runs: int) -> list[str]:
    """The markdown table of `results` (algorithm: each run's (before, after) accuracy)."""
    lines = ["| seed | " + " | ".join(f"{n} before → after" for n in results) + " |",
             "|---|" + "---|" * len(results)]
    for seed in range(runs):
        cells = [f"{b:.3f} → {f:.3f} ({100 * (f - b):+.1f})"
                 for b, f in (results[n][seed] for n in results)]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    """Trains both algorithms' runs (flags after `--` go to `jrl.train`), prints the table
    and writes `<workdir>/seeds.png`."""
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m jrl.seed_table",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/seed_table")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    results, records_by_name = {}, {}
    for name, config in CONFIGS.items():
        workdir = os.path.join(args.workdir, name.lower())
        cmd = [sys.executable, "-m", "jrl.train", f"--config={config}", f"--workdir={workdir}",
               "--config.reward.in_graph_fn=exact_match", f"--config.trainer.runs={args.runs}",
               "--config.trainer.steps_per_call=25", *extra]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        records = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
        results[name], records_by_name[name] = _accuracy(records, args.runs), records
    print("\n" + "\n".join(table(results, args.runs)))
    png = os.path.join(args.workdir, "seeds.png")
    _figure(records_by_name).savefig(png, dpi=120)
    print(f"curves: {png}")


if __name__ == "__main__":
    main()
