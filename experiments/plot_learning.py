"""Plot and tables of experiments/compare_trl.py's runs: held-out accuracy against RL step
and against training seconds, jrl beside TRL, the mean over seeds and each seed thin.

    python experiments/plot_learning.py [--results experiments/results/learning] \\
        [--out docs/learning.png]

Prints the per-seed table and the summary (markdown) and writes them, with the numbers
behind them, to `<results>/summary.json`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEWORKS = (("jrl", "tab:blue"), ("trl", "tab:orange"))
LABELS = {"jrl": "jrl", "trl": "TRL GRPOTrainer"}


def load(results: str) -> dict[str, list[dict]]:
    runs = {}
    for path in sorted(glob.glob(os.path.join(results, "*_seed*.json"))):
        with open(path) as f:
            run = json.load(f)
        runs.setdefault(run["framework"], []).append(run)
    return runs


def mean_curve(runs: list[dict]) -> tuple[list[int], list[float], list[float]]:
    """(steps, mean seconds, mean accuracy) over the seeds, at the steps all of them have."""
    common = set.intersection(*({e["step"] for e in r["evals"]} for r in runs))
    steps = sorted(common)
    at = lambda r, s, key: next(e[key] for e in r["evals"] if e["step"] == s)
    seconds = [statistics.fmean(at(r, s, "train_seconds") for r in runs) for s in steps]
    accs = [statistics.fmean(at(r, s, "acc") for r in runs) for s in steps]
    return steps, seconds, accs


def plot(runs: dict[str, list[dict]], out: str) -> None:
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for name, color in FRAMEWORKS:
        if name not in runs:
            continue
        for r in runs[name]:
            steps = [e["step"] for e in r["evals"]]
            by_step.plot(steps, [e["acc"] for e in r["evals"]], color=color, lw=0.7, alpha=0.45)
            by_time.plot([e["train_seconds"] for e in r["evals"]], [e["acc"] for e in r["evals"]],
                         color=color, lw=0.7, alpha=0.45)
        steps, seconds, accs = mean_curve(runs[name])
        label = f"{LABELS[name]} (mean of {len(runs[name])} seeds)"
        by_step.plot(steps, accs, color=color, lw=2.2, marker="o", ms=3, label=label)
        by_time.plot(seconds, accs, color=color, lw=2.2, marker="o", ms=3, label=label)
    first = next(iter(runs.values()))[0]
    by_step.set(xlabel="RL step (32 prompts x 8 samples)", ylabel="held-out greedy exact match",
                title="accuracy vs step")
    by_time.set(xlabel="training seconds (evaluation excluded; jrl includes compilation)",
                title=f"accuracy vs wall-clock ({first['host']['cpus']} CPU cores)")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle("GRPO on two-digit addition from the same warm start: jrl vs TRL "
                 f"(trl {first['versions'].get('trl')}, thin lines: seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    print(f"wrote {os.path.relpath(out, REPO)}")


def per_seed_rows(runs: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for name, _ in FRAMEWORKS:
        for r in sorted(runs.get(name, []), key=lambda r: r["seed"]):
            steps = r["step_seconds"]
            rows.append({
                "framework": name, "seed": r["seed"], "steps": r["steps"],
                "before": r["evals"][0]["acc"], "after": r["evals"][-1]["acc"],
                "best": max(e["acc"] for e in r["evals"]),
                "train_seconds": r["evals"][-1]["train_seconds"],
                "first_step_seconds": steps[0],
                "later_step_seconds_median": statistics.median(steps[1:]),
                "last_quarter": statistics.fmean(
                    e["acc"] for e in r["evals"] if e["step"] >= 0.75 * r["steps"]),
                "cpu_seconds": r["evals"][-1].get("cpu_seconds", float("nan")),
                "other_cores": r["evals"][-1].get("other_processes_cores", float("nan")),
                "after_hf_generate": r.get("final_acc_hf_generate"),
                "config_sha256": r["config_sha256"][:12],
            })
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| framework | seed | acc before | acc after | (HF generate) | last quarter "
             "| training s | first step s | later steps s (median) | CPU s | other procs (cores) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['framework']} | {r['seed']} | {r['before']:.3f} | {r['after']:.3f} | "
            f"{r['after_hf_generate']:.3f} | {r['last_quarter']:.3f} | "
            f"{r['train_seconds']:.1f} | {r['first_step_seconds']:.2f} | "
            f"{r['later_step_seconds_median']:.3f} | {r['cpu_seconds']:.1f} | "
            f"{r['other_cores']:.2f} |")
    return "\n".join(lines)


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summary(rows: list[dict]) -> tuple[str, dict]:
    lines = ["| framework | acc before | acc after | mean acc, last quarter of the steps "
             "| training s | CPU s |",
             "|---|---|---|---|---|---|"]
    numbers = {}
    for name, _ in FRAMEWORKS:
        mine = [r for r in rows if r["framework"] == name]
        if not mine:
            continue
        stats = {key: _mean_std([r[key] for r in mine])
                 for key in ("before", "after", "last_quarter", "train_seconds", "cpu_seconds")}
        numbers[name] = stats
        cells = [f"{stats[k][0]:.{p}f} ± {stats[k][1]:.{p}f}"
                 for k, p in (("before", 3), ("after", 3), ("last_quarter", 3),
                              ("train_seconds", 1), ("cpu_seconds", 1))]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines), numbers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default=os.path.join(REPO, "experiments", "results", "learning"))
    p.add_argument("--out", default=os.path.join(REPO, "docs", "learning.png"))
    args = p.parse_args()
    runs = load(args.results)
    if not runs:
        raise SystemExit(f"no *_seed*.json in {args.results}; run experiments/compare_trl.py")
    plot(runs, args.out)
    rows = per_seed_rows(runs)
    text, numbers = summary(rows)
    print(table(rows), "\n\nmean ± std over seeds\n", text, sep="\n")
    with open(os.path.join(args.results, "summary.json"), "w") as f:
        json.dump({"per_seed": rows, "mean_std": numbers}, f, indent=1)


if __name__ == "__main__":
    main()
