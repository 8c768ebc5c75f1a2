"""Metrics with verl's names, and where they go: console, JSONL, TensorBoard, wandb, a PNG.

Step metrics are flat dicts of Python floats. Writers: a progress bar on the
console (step, score, `ppo_kl`, seconds per step) with a line for each validation,
`metrics.jsonl` in the workdir, TensorBoard event files under `workdir/tensorboard`
(needs `tensorboardX`), and wandb when it is installed and enabled.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Peak dense bf16 FLOP/s per chip, for MFU (the first name found in the device kind
# wins, so each variant comes before the name it contains: "H100 PCIe" before "H100",
# "GH200" before "H200").
PEAK_FLOPS = {
    "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "GH200": 989e12,
    "H200": 989e12, "A100": 312e12,
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
    "TPU v6 lite": 918e12, "TPU v6e": 918e12,
}

# Peak HBM bandwidth per chip in GB/s, for a memory roofline (found as PEAK_FLOPS is).
PEAK_HBM_GBPS = {
    "H100 PCIe": 2000.0, "H100 NVL": 3900.0, "H100": 3350.0, "GH200": 4000.0,
    "H200": 4800.0, "A100": 2039.0,
    "TPU v4": 1228.0, "TPU v5 lite": 819.0, "TPU v5e": 819.0, "TPU v5p": 2765.0,
    "TPU v6 lite": 1640.0, "TPU v6e": 1640.0,
}


def _by_device(table: dict[str, float], device_kind: str) -> float | None:
    return next((value for name, value in table.items()
                 if name.lower() in device_kind.lower()), None)


def peak_flops(device_kind: str) -> float | None:
    """Dense bf16 FLOP/s of one chip of this kind (None when it is not in the table)."""
    return _by_device(PEAK_FLOPS, device_kind)


def peak_hbm_gbps(device_kind: str) -> float | None:
    """HBM bandwidth of one chip of this kind in GB/s (None when it is not in the table)."""
    return _by_device(PEAK_HBM_GBPS, device_kind)


def validation_metrics(data_sources: Sequence[str], prompt_index: Sequence[int],
                       values: dict[str, Sequence[float]], answers: Sequence[str], n: int) -> dict:
    """verl's validation metrics per data source and variable.

    `values` maps a variable ("reward", and what the reward function returned
    beside its score, e.g. "acc") to one number per sample. The core variable is
    "acc" when there is one, else "reward": `val-core/<source>/<var>/mean@n`; the
    others go under `val-aux/`. With n > 1 also `best@n/mean` (best sample per
    prompt) and `maj@n/mean` (the value of the prompt's most frequent answer).
    """
    core = "acc" if "acc" in values else "reward"
    out = {}
    for var, column in values.items():
        by_prompt = defaultdict(list)
        for src, idx, value, answer in zip(data_sources, prompt_index, column, answers,
                                           strict=True):
            by_prompt[(src, idx)].append((value, answer))
        per_source = defaultdict(lambda: defaultdict(list))
        for (src, _), samples in by_prompt.items():
            per_source[src]["mean"].append(np.mean([v for v, _ in samples]))
            if n > 1:
                per_source[src]["best"].append(np.max([v for v, _ in samples]))
                majority = Counter(a for _, a in samples).most_common(1)[0][0]
                per_source[src]["maj"].append(next(v for v, a in samples if a == majority))
        for src, stats in per_source.items():
            prefix = f"val-core/{src}/{var}" if var == core else f"val-aux/{src}/{var}"
            out[f"{prefix}/mean@{n}"] = float(np.mean(stats["mean"]))
            if n > 1:
                out[f"{prefix}/best@{n}/mean"] = float(np.mean(stats["best"]))
                out[f"{prefix}/maj@{n}/mean"] = float(np.mean(stats["maj"]))
    return out


class MetricsWriter:
    """Writes each step's metrics to the configured loggers (only on process 0).

    With "console" in `loggers` there is a progress bar, labelled as compiling until
    the first training step is written; its clock then restarts so that the rate and
    ETA leave out compilation. Each validation (the `val-core/` keys of a step,
    step 0 for the one before RL) also prints one line above the bar, e.g.
    `step 25: val-core/synthetic/arithmetic/acc/mean@1 = 0.914`. Without "console"
    nothing is printed.
    """

    def __init__(self, workdir: str, loggers: Sequence[str], total_steps: int,
                 config_dict: dict | None = None, start_step: int = 0, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._bar = self._tb = self._wandb = None
        self._start_step = start_step
        self._compiling = False
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        _truncate_after(self.path, start_step)
        if "console" in loggers:
            self._compiling = start_step < total_steps
            self._bar = _progress_bar(total_steps, start_step, self._compiling)
        if "tensorboard" in loggers:
            try:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
            except ImportError:
                logging.warning("trainer.logger has 'tensorboard' but tensorboardX is missing")
        if "wandb" in loggers:
            try:
                import wandb

                self._wandb = wandb.init(config=config_dict, dir=workdir, resume="allow")
            except ImportError:
                logging.warning("trainer.logger has 'wandb' but wandb is not installed")
        self._jsonl = "jsonl" in loggers

    def write(self, step: int, metrics: dict[str, float], run: int | None = None) -> None:
        """Writes a step's metrics; with `run` (one run of several, `jrl.rl.runs`) the
        record gets a `run` field and the TensorBoard / wandb keys a `run<r>/` prefix,
        and the console is left to `show`."""
        if not self.enabled:
            return
        record = {"step": step, **metrics} if run is None else {"step": step, "run": run,
                                                                 **metrics}
        if self._jsonl:
            with open(self.path, "a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
        prefix = "" if run is None else f"run{run}/"
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(prefix + key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({prefix + k: v for k, v in metrics.items()}, step=step)
        if run is None:
            self.show(step, metrics)

    def show(self, step: int, metrics: dict[str, float]) -> None:
        """Updates the console (progress bar, validation lines) alone."""
        if self.enabled and self._bar is not None:
            self._write_console(step, metrics)

    def _write_console(self, step: int, metrics: dict[str, float]) -> None:
        from tqdm import tqdm

        new_bar = self._compiling and step > self._start_step
        if new_bar:
            # The first training step compiled; a new bar times the rest from here.
            self._bar.leave = False
            self._bar.close()
            if "timing_s/compile" in metrics:  # compiled before the step, at once
                tqdm.write(f"step {step}: {metrics['timing_s/step']:.1f} s, after "
                           f"{metrics['timing_s/compile']:.1f} s compiling (or reading back) "
                           "its programs")
            elif "timing_s/step" in metrics:
                tqdm.write(f"step {step}: {metrics['timing_s/step']:.1f} s "
                           "(including compilation)")
            self._bar = _progress_bar(self._bar.total, step, compiling=False)
            self._compiling = False
        shown = {"score": "critic/score/mean", "ppo_kl": "actor/ppo_kl",
                 **_MULTI_TURN_SHOWN, "s/step": "timing_s/step"}
        self._bar.set_postfix({k: f"{metrics[v]:.3g}" for k, v in shown.items()
                               if v in metrics}, refresh=new_bar)
        self._bar.update(step - self._bar.n)
        if line := validation_line(step, metrics):
            tqdm.write(line)  # above the bar, which it redraws

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _progress_bar(total_steps: int, initial: int, compiling: bool):
    from tqdm import tqdm

    desc = "rl (compiling the first step)" if compiling else "rl"
    return tqdm(total=total_steps, initial=initial, desc=desc, dynamic_ncols=True,
                mininterval=1.0)


# A multi-turn run's console: (label, metric) of the progress bar, per step.
_MULTI_TURN_SHOWN = {"calls/row": "multi_turn/tool_calls/mean", "turns/row": "num_turns/mean",
                     "tool errors": "multi_turn/tool_errors"}


def validation_line(step: int, metrics: dict[str, float], max_keys: int = 3) -> str | None:
    """One line with a step's headline validation numbers, or None without validation.

    Shows the `val-core/.../mean@n` keys (one per data source), at most `max_keys`,
    and for multi-turn rollouts the validation's tool calls and turns per row and its
    tool errors.
    """
    keys = sorted(k for k in metrics if k.startswith("val-core/") and "/mean@" in k)
    if not keys:
        return None
    shown = ", ".join(f"{k} = {metrics[k]:.3f}" for k in keys[:max_keys])
    more = f" (+{len(keys) - max_keys} more)" if len(keys) > max_keys else ""
    turns = ", ".join(f"{label} {metrics['val-aux/' + key]:.3g}"
                      for label, key in _MULTI_TURN_SHOWN.items() if "val-aux/" + key in metrics)
    return f"step {step}: {shown}{more}" + (f"; {turns}" if turns else "")


def _truncate_after(path: str, step: int) -> None:
    """Drops the JSONL records that a run resuming from checkpoint `step` writes again.

    Those are the steps after `step` (written after that checkpoint was saved) and, for a
    start from step 0 (no checkpoint), every record, the before-RL validation included;
    a last line cut short by a kill is dropped too. So no step is ever logged twice.
    """
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if step > 0 and record["step"] <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
    with open(path, "w") as f:
        f.writelines(kept)


def write_samples(directory: str, step: int, columns: dict[str, Sequence]) -> str:
    """Writes `<directory>/<step>.jsonl`, one JSON object per sample, as verl writes its
    `trainer.rollout_data_dir` / `validation_data_dir` files; returns the path.

    Args:
      directory: created when missing (`~` allowed).
      step: the RL step (0: the validation before training).
      columns: one value per sample under each name: `input` (prompt text), `output`
        (response text), `gts` (ground truth), `score`, `step` and the reward
        function's extra values. Values JSON cannot write are written as strings.
    """
    directory = os.path.expanduser(directory)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{step}.jsonl")
    count = len(next(iter(columns.values()), ()))
    with open(path, "w", encoding="utf-8") as f:
        for i in range(count):
            sample = {name: values[i] for name, values in columns.items()}
            f.write(json.dumps(sample, ensure_ascii=False, default=str) + "\n")
    return path


def sample_lines(step: int, columns: dict[str, Sequence], count: int) -> list[str]:
    """The first `count` samples of `columns` (as `write_samples` takes them) as console
    lines: a header with the score, then the prompt and the response, indented."""
    total = len(columns.get("output", ()))
    lines = []
    for i in range(min(count, total)):
        lines.append(f"step {step}: validation sample {i + 1} of {total}, score "
                     f"{columns['score'][i]:.3g}, ground truth {columns['gts'][i]!r}")
        for name in ("input", "output"):
            label = "prompt:   " if name == "input" else "response: "
            text = str(columns[name][i]).splitlines() or [""]
            lines.append("  " + label + text[0])
            lines += ["  " + " " * len(label) + line for line in text[1:]]
    return lines


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curves(jsonl_path: str, png_path: str, val_key: str | None = None) -> str:
    """Training score and validation curves from `metrics.jsonl` into a PNG."""
    curves_figure(read_jsonl(jsonl_path), val_key).savefig(png_path, dpi=120)
    return png_path


def curves_figure(records: Sequence[dict], val_key: str | None = None) -> Figure:
    """A matplotlib Figure: the training score and the validation headline per RL step.

    One panel per kind of curve, each with its metric on the y-axis; accuracies on
    a 0-1 axis. `val_key` picks one validation key (default: every `val-core/` key).
    """
    # A bare Figure with an Agg canvas (no pyplot) draws off-screen without switching
    # the user's backend, so notebooks keep their inline plots.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    train = [(r["step"], r["critic/score/mean"]) for r in records if "critic/score/mean" in r]
    val_keys = sorted({k for r in records for k in r if k.startswith("val-core/")})
    val_keys = val_keys if val_key is None else [val_key]
    val = {k: [(r["step"], r[k]) for r in records if k in r] for k in val_keys}
    val = {k: points for k, points in val.items() if points}
    panels = int(bool(train)) + int(bool(val))
    fig = Figure(figsize=(5 * max(panels, 1), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(1, panels, squeeze=False, sharex=True)[0]) if panels else []
    if train:
        ax = axes.pop(0)
        ax.plot(*zip(*train, strict=True))
        ax.set_ylabel("training score (critic/score/mean)")
    if val:
        ax = axes.pop(0)
        for key, points in val.items():
            # Unclipped: accuracies of 0 or 1 sit on the axis limits.
            ax.plot(*zip(*points, strict=True), marker="o", clip_on=False,
                    label=key.removeprefix("val-core/"))
        variables = {_validation_variable(k) for k in val}
        if variables == {"acc"}:
            ax.set_ylim(0, 1)
            ax.set_ylabel("validation accuracy (val-core)")
        else:
            ax.set_ylabel(f"validation {', '.join(sorted(variables))} (val-core)")
        # Below the axes: the keys are long and would cover the curves.
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), fontsize="small")
    for ax in fig.axes:
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    return fig


def run_series(records: Sequence[dict]) -> dict[str, dict[int, list[tuple[int, float]]]]:
    """{curve: {run: [(step, value)]}} of records with a `run` field (`jrl.rl.runs`): the
    training score and each `val-core/` key."""
    runs = sorted({r["run"] for r in records if "run" in r})
    keys = ["critic/score/mean"] + sorted(
        {k for r in records for k in r if k.startswith("val-core/")})
    series = {}
    for key in keys:
        per_run = {run: sorted((r["step"], r[key]) for r in records
                               if r.get("run") == run and key in r) for run in runs}
        if any(per_run.values()):
            series[key] = per_run
    return series


def draw_runs(ax, key: str, per_run: dict[int, list], labels: Sequence[str] | None = None,
              groups: Sequence[str] | None = None):
    """One curve of several runs on `ax`: each run thin, their mean bold and the band
    between their min and max (at the steps every run has). With `groups` (a name per
    run, e.g. its learning rate in a sweep) each group gets its own colour, mean and band."""
    names = [None] * (max(per_run) + 1) if groups is None else list(groups)
    for index, name in enumerate(dict.fromkeys(names[run] for run in per_run)):
        members = {run: p for run, p in per_run.items() if names[run] == name}
        color = "black" if groups is None else f"C{index % 10}"
        for run, points in members.items():
            label = labels[run] if labels is not None and len(per_run) <= 8 else None
            ax.plot(*zip(*points, strict=True), lw=0.8, alpha=0.5, label=label,
                    color=None if groups is None else color)
        steps = sorted(set.intersection(*(set(s for s, _ in p) for p in members.values())))
        values = np.array([[dict(p)[s] for s in steps] for p in members.values()])
        prefix = "" if name is None else f"{name}: "
        ax.fill_between(steps, values.min(0), values.max(0), color="gray" if groups is None
                        else color, alpha=0.2, label=f"{prefix}min-max of {len(members)} runs")
        ax.plot(steps, values.mean(0), color=color, lw=2, label=f"{prefix}mean")
    ax.set_ylabel(key)
    if _validation_variable(key) == "acc":
        ax.set_ylim(0, 1)
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), fontsize="small", ncol=2)


def runs_figure(records: Sequence[dict], labels: Sequence[str] | None = None,
                groups: Sequence[str] | None = None) -> Figure:
    """A matplotlib Figure of several runs (records with a `run` field, `jrl.rl.runs`): a
    panel per curve (`run_series`), drawn by `draw_runs`. `labels`: each run's name
    (a legend of the runs when there are at most 8); `groups`: see `draw_runs`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = run_series(records)
    fig = Figure(figsize=(5 * max(len(series), 1), 4.5 + (groups is not None)),
                 layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, max(len(series), 1), squeeze=False)[0]
    for ax, (key, per_run) in zip(axes, series.items(), strict=False):
        draw_runs(ax, key, per_run, labels, groups)
    return fig


def _validation_variable(key: str) -> str:
    """The variable of a `val-*/<data_source>/<var>/<stat>@<n>[/mean]` key ("acc", ...)."""
    match = re.search(r"/([^/]+)/(?:mean|best|maj)@\d+(?:/mean)?$", key)
    return match.group(1) if match else key
