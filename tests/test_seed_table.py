"""`python -m jrl.seed_table`: the commands it runs, its table and its PNG, with `jrl.train`
replaced by a stand-in that writes two runs' metrics (no training)."""

import json
import os
import sys

from jrl import seed_table

VAL_KEY = "val-core/synthetic/arithmetic/acc/mean@1"


def _fake_train(commands):
    """A `subprocess.run` that records the command and writes its workdir's metrics: run r
    starts at 0.25 and ends at 0.5 + r / 4 (PPO one hundredth higher)."""

    def run(cmd, check):
        assert check
        commands.append(cmd)
        workdir = next(a.split("=", 1)[1] for a in cmd if a.startswith("--workdir="))
        shift = 0.01 if workdir.endswith("ppo") else 0.0
        os.makedirs(workdir)
        with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
            for run_index in range(2):
                for step, value in ((0, 0.25), (50, 0.4), (100, 0.5 + run_index / 4 + shift)):
                    f.write(json.dumps({"run": run_index, "step": step, VAL_KEY: value,
                                        "critic/score/mean": value}) + "\n")
    return run


def test_seed_table_runs_both_algorithms_and_prints_their_table(tmp_path, monkeypatch, capsys):
    commands = []
    monkeypatch.setattr(seed_table.subprocess, "run", _fake_train(commands))
    seed_table.main(["--workdir", str(tmp_path), "--runs", "2", "--", "--config.a=1"])
    assert [c[:3] for c in commands] == [[sys.executable, "-m", "jrl.train"]] * 2
    assert commands[0][3:] == [
        "--config=configs/grpo_arith.py", f"--workdir={tmp_path}/grpo",
        "--config.reward.in_graph_fn=exact_match", "--config.trainer.runs=2",
        "--config.trainer.steps_per_call=25", "--config.a=1"]
    assert commands[1][3] == "--config=configs/ppo_arith.py"
    out = capsys.readouterr().out
    assert out.split("\n\n", 1)[1] == (
        "| seed | GRPO before → after | PPO before → after |\n"
        "|---|---|---|\n"
        "| 0 | 0.250 → 0.500 (+25.0) | 0.250 → 0.510 (+26.0) |\n"
        "| 1 | 0.250 → 0.750 (+50.0) | 0.250 → 0.760 (+51.0) |\n"
        f"curves: {tmp_path}/seeds.png\n")
    assert (tmp_path / "seeds.png").stat().st_size > 0
