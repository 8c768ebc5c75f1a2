"""Draws docs/rl_step.png from the benchmark results in experiments/results/.

Left: one GRPO step (Qwen2.5-0.5B shape, 64 x 8, 128 + 256 tokens) on one H100,
jrl's phases next to TRL's. Right: data-parallel scaling on 1, 2 and 4 GPUs.

    python experiments/plot_rl_step.py
"""

from __future__ import annotations

import json
import os

from matplotlib.figure import Figure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results")


def _load(*parts):
    with open(os.path.join(RESULTS, *parts)) as f:
        return json.load(f)


def main() -> None:
    jrl = {r["algo"]: r for r in _load("rl_step", "jrl_forced.json")["results"]}
    trl = _load("rl_step", "trl_grpo.json")["result"]["phases_s"]
    fig = Figure(figsize=(11, 4))
    left, right = fig.subplots(1, 2)

    phases = ("gen", "old_log_prob", "ref", "values", "update_critic", "update_actor")
    bars = {"jrl GRPO": jrl["grpo"]["phases_s"], "jrl PPO": jrl["ppo"]["phases_s"],
            "TRL GRPO": {"gen": trl["gen"], "ref": trl["gen_ref_reward"] - trl["gen"],
                         "update_actor": trl["update"]}}
    for i, times in enumerate(bars.values()):
        bottom = 0.0
        for j, phase in enumerate(phases):
            value = times.get(phase, 0.0)
            left.bar(i, value, bottom=bottom, color=f"C{j}", label=phase if i == 0 else None)
            bottom += value
        left.text(i, bottom, f"{bottom:.2f} s", ha="center", va="bottom")
    left.set_xticks(range(len(bars)), list(bars))
    left.set_ylabel("seconds per step (one H100)")
    left.set_title("RL step, Qwen2.5-0.5B shape, 64 prompts x 8, 128 + 256 tokens")
    left.legend(fontsize=8)

    gpus = (1, 2, 4)
    weak = [_load("scaling", f"dp_{g}gpu.json")["results"][0] for g in gpus]
    base = weak[0]["throughput_tokens_per_s_per_device"]
    right.plot(gpus, [r["throughput_tokens_per_s_per_device"] / base for r in weak],
               marker="o", label="64 prompts x 8 per GPU")
    strong = [weak[0]] + [_load("scaling", f"strong_{g}gpu.json")["results"][0]
                          for g in gpus[1:]]
    right.plot(gpus, [weak[0]["phases_s"]["step"] / r["phases_s"]["step"] / g
                      for r, g in zip(strong, gpus, strict=True)],
               marker="s", label="64 prompts x 8 in all")
    right.axhline(0.85, color="grey", linestyle=":", label="85%")
    right.set_ylim(0, 1.05)
    right.set_xticks(gpus)
    right.set_xlabel("GPUs (data parallel, one host)")
    right.set_ylabel("scaling efficiency")
    right.set_title("GRPO step, data parallelism (4 x H200)")
    right.legend(fontsize=8)
    fig.tight_layout()
    out = os.path.join(ROOT, "docs", "rl_step.png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
