"""experiments/tool_rewards_table.py: the table of experiments/learning_tool_rewards.sh,
from hand-written metrics.jsonl files."""

import importlib.util
import json
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def _table_module():
    spec = importlib.util.spec_from_file_location("tool_rewards_table",
                                                  EXPERIMENTS / "tool_rewards_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ACC = "val-core/synthetic/tool_multiplication/acc/mean@1"


def _write_run(runs, name, records, cut_line=False):
    (runs / name).mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in records)
    (runs / name / "metrics.jsonl").write_text(text + ('{"step": 9, "crit' if cut_line else ""))


def test_one_line_per_run(tmp_path, capsys):
    runs = tmp_path / "runs"
    _write_run(runs, "grpo_on_seed0", [
        {"step": 0, _ACC: 0.0, "val-aux/multi_turn/tool_calls/mean": 0.0},
        {"step": 1, "critic/score/mean": 0.5, "reward_extra/score/mean": 0.25,
         "multi_turn/tool_calls/mean": 0.5},
        {"step": 2, "critic/score/mean": 1.0, "reward_extra/score/mean": 0.75,
         "multi_turn/tool_calls/mean": 1.0, _ACC: 0.875,
         "val-aux/multi_turn/tool_calls/mean": 1.0}], cut_line=True)
    _write_run(runs, "grpo_off_seed0", [{"step": 0, _ACC: 0.125},
                                        {"step": 1, "critic/score/mean": 0.25}])
    assert _table_module().main([str(runs), "--steps", "0", "2"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "run | acc@0 | acc@2 | val tool calls | train tool calls | train score | answer score",
        # Sorted names; "-": not validated at step 2, no tool calls or own score logged.
        "grpo_off_seed0 | 0.125 | - | - | - | 0.250 | -",
        # Means over steps 1-2: tool calls (0.5 + 1) / 2, scores (0.5 + 1) / 2 and
        # (0.25 + 0.75) / 2; the last validation's tool calls; the cut line skipped.
        "grpo_on_seed0 | 0.000 | 0.875 | 1.000 | 0.750 | 0.750 | 0.500"]
    assert _table_module().main([str(runs), "ppo_on_seed0", "--steps", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        f"ppo_on_seed0 | missing ({runs}/ppo_on_seed0/metrics.jsonl)")
