"""One line per run of experiments/learning_tool_rewards.sh, from the runs' metrics.jsonl.

    python experiments/tool_rewards_table.py RUNS_DIR [NAME ...] [--steps 0 5 10 15 20]

Each line: the run's name, its held-out greedy accuracy (`val-core/<source>/acc/mean@1`)
at the given steps ("-" where it was not validated), the last validation's tool use
(`val-aux/multi_turn/tool_calls/mean`, calls per held-out row) and, over the training
steps, the means of the sampled rows' tool use (`multi_turn/tool_calls/mean`), the
training score (`critic/score/mean`: with tool rewards on, the answer's reward plus
the tool's) and the answer's own reward (`reward_extra/score/mean`, logged only with
tool rewards on). Runs without a metrics.jsonl are listed as missing. Without names,
every directory of RUNS_DIR is a run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

_VAL_ACC = re.compile(r"^val-core/.+/acc/mean@1$")


def read_records(path: str) -> list[dict]:
    """The records of a metrics.jsonl; a line cut by a killed run is skipped."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def _mean(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if key in r]
    return sum(values) / len(values) if values else None


def summary(records: list[dict], steps: list[int]) -> dict:
    """{"acc": {step: accuracy}, "val_tool_calls", "tool_calls", "score", "answer_score"}."""
    acc, val_calls = {}, None
    for r in records:
        for key, value in r.items():
            if _VAL_ACC.match(key) and r.get("step") in steps:
                acc[r["step"]] = value
        val_calls = r.get("val-aux/multi_turn/tool_calls/mean", val_calls)
    train = [r for r in records if "critic/score/mean" in r]
    return {"acc": acc, "val_tool_calls": val_calls,
            "tool_calls": _mean(train, "multi_turn/tool_calls/mean"),
            "score": _mean(train, "critic/score/mean"),
            "answer_score": _mean(train, "reward_extra/score/mean")}


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def table(runs_dir: str, names: list[str], steps: list[int]) -> list[str]:
    """The header and one line per run."""
    lines = ["run | " + " | ".join(f"acc@{s}" for s in steps)
             + " | val tool calls | train tool calls | train score | answer score"]
    for name in names:
        path = os.path.join(runs_dir, name, "metrics.jsonl")
        if not os.path.isfile(path):
            lines.append(f"{name} | missing ({path})")
            continue
        s = summary(read_records(path), steps)
        cells = [_cell(s["acc"].get(step)) for step in steps]
        cells += [_cell(s[k]) for k in ("val_tool_calls", "tool_calls", "score", "answer_score")]
        lines.append(f"{name} | " + " | ".join(cells))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs_dir")
    parser.add_argument("names", nargs="*", help="run directories (default: all)")
    parser.add_argument("--steps", type=int, nargs="+", default=[0, 5, 10, 15, 20])
    args = parser.parse_args(argv)
    if not os.path.isdir(args.runs_dir):
        print(f"error: {args.runs_dir!r} is not a directory", file=sys.stderr)
        return 2
    names = args.names or sorted(d for d in os.listdir(args.runs_dir)
                                 if os.path.isdir(os.path.join(args.runs_dir, d)))
    print("\n".join(table(args.runs_dir, names, args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
