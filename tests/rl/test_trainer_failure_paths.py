"""Starts that fail or are stopped: nothing claims the workdir before every check has
passed, a start that wrote no output leaves no trace, keys that cannot change what the
steps computed may change on resume, a raising reward function is one line with the
`reward.on_error` hint, a NaN warm-start loss stops at once, and a signal stops the run
between steps with a checkpoint that resumes exactly."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from jrl import sft, train
from jrl.app import experiment, interrupt, rundir
from jrl.config.settings import experiment_from_config
from jrl.errors import CheckpointError, ConfigError, RewardError, RunDirError
from jrl.metrics import read_jsonl
from jrl.rewards import default_compute_score
from tests.tiny import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_VOLATILE = ("timing_s/", "perf/")


def _config(**kw):
    return tiny_config(**{"trainer.total_training_steps": 3, "trainer.test_freq": 3, **kw})


def _metrics(workdir):
    return [{k: v for k, v in r.items() if not k.startswith(_VOLATILE)}
            for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


def _reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def score(data_source, solution_str, ground_truth, extra_info):\n"
                    "    return float(int(solution_str) == int(ground_truth))\n")
    return path


# ----------------------------------------------------------------------------- not claimed


def test_failed_check_leaves_no_workdir(tmp_path, monkeypatch):
    monkeypatch.setattr(experiment, "build_model", lambda *a, **k: pytest.fail("built"))
    workdir = tmp_path / "run"
    config = _config(**{"reward.custom_fn": f"{_reward_file(tmp_path)}:scor"})
    with pytest.raises(ConfigError, match=r"defines no 'scor'; its public callables are "
                       r"\['score'\]"):
        train.run(config, str(workdir))
    assert not workdir.exists()


def test_failure_before_any_output_removes_config_and_the_new_workdir(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise CheckpointError("model.path: weights unreadable")

    monkeypatch.setattr(experiment, "build_model", broken)
    fresh, existing = tmp_path / "fresh", tmp_path / "existing"
    existing.mkdir()
    for workdir in (fresh, existing):
        with pytest.raises(CheckpointError):
            train.run(_config(), str(workdir))
    assert not fresh.exists()
    assert existing.exists() and not os.listdir(existing)  # not made by the start: kept


def test_stop_after_the_warm_start_keeps_the_run(tmp_path, monkeypatch):
    # Stopped during the first step's compilation: the warm start is an output to keep.
    workdir = tmp_path / "run"

    def stop_on_fit(*args, **kwargs):
        raise interrupt.Stopped(signal.SIGINT, 0)

    monkeypatch.setattr(train.RLTrainer, "fit", stop_on_fit)
    with pytest.raises(interrupt.Stopped):
        train.run(_config(**{"sft.steps": 2, "sft.batch_size": 4}), str(workdir))
    assert (workdir / rundir.CONFIG_FILE).exists() and (workdir / "sft").is_dir()
    assert not (workdir / rundir.LOCK_FILE).exists()


def test_unwritable_workdir_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(experiment, "build_model", lambda *a, **k: pytest.fail("built"))
    (tmp_path / "file").write_text("")
    with pytest.raises(RunDirError, match=r"--workdir .*file/run: .*file is a file"):
        train.run(_config(), str(tmp_path / "file" / "run"))
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(RunDirError, match=r"--workdir .*/run: its parent .* is not writable"):
        train.run(_config(), str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- resume keys


def test_keys_that_may_change_on_resume():
    old = rundir.flatten(_config())
    changed = lambda **kw: rundir.run_changes(old, rundir.flatten(_config(**kw)))
    assert changed(**{"reward.on_error": "score", "reward.error_score": -1.0,
                      "trainer.save_freq": 5, "trainer.test_freq": 1,
                      "trainer.nan_policy": "raise", "trainer.logger": ("console",)}) == []
    assert changed(**{"trainer.total_training_steps": 10}) == []  # constant lr: a longer run
    assert changed(**{"trainer.total_training_steps": 2}) == [
        ("trainer.total_training_steps", 3, 2)]
    cosine = rundir.flatten(_config(**{"actor.optim.lr_scheduler_type": "cosine"}))
    longer = rundir.flatten(_config(**{"actor.optim.lr_scheduler_type": "cosine",
                                       "trainer.total_training_steps": 10}))
    assert rundir.run_changes(cosine, longer) == [("trainer.total_training_steps", 3, 10)]
    # error_score changed what was learned if errors were scored before.
    scored = rundir.flatten(_config(**{"reward.on_error": "score"}))
    assert rundir.run_changes(scored, rundir.flatten(_config(**{
        "reward.on_error": "score", "reward.error_score": -1.0}))) == [
        ("reward.error_score", 0.0, -1.0)]
    assert changed(**{"actor.optim.lr": 1e-4}) == [("actor.optim.lr", 1e-3, 1e-4)]
    # rollout.decode_buckets' default (None) and the number it stands for are one setting:
    # 4 below 4,096 response tokens, 8 from there (a run directory written before the
    # default became None holds the number).
    at = lambda buckets, length: rundir.flatten(_config(**{
        "rollout.decode_buckets": buckets, "rollout.response_length": length}))
    assert rundir.run_changes(at(4, 64), at(None, 64)) == []
    assert rundir.run_changes(at(None, 4096), at(8, 4096)) == []
    assert rundir.run_changes(at(4, 64), at(2, 64)) == [("rollout.decode_buckets", 4, 2)]
    assert rundir.run_changes(at(4, 4096), at(None, 4096)) == [
        ("rollout.decode_buckets", 4, None)]


def test_finished_run_extended_resumes_from_its_last_checkpoint(tmp_path, capsys):
    workdir = str(tmp_path)
    train.run(_config(**{"trainer.save_freq": 3}), workdir)
    capsys.readouterr()
    summary = train.run(_config(**{"trainer.save_freq": 3, "trainer.total_training_steps": 4}),
                        workdir)
    out = capsys.readouterr().out
    assert "trainer.total_training_steps: 3 -> 4: continuing the finished run" in out
    assert "resumed from step 3 (of 4)" in out
    assert summary["resumed"] and summary["step"] == 4
    assert json.loads((tmp_path / rundir.FINISHED_FILE).read_text())["step"] == 4
    assert [r["step"] for r in _metrics(workdir)] == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- reward errors


def test_reward_error_is_one_line_with_the_hint_and_on_error_may_then_change(tmp_path):
    path = _reward_file(tmp_path)
    workdir = str(tmp_path / "run")
    config = _config(**{"reward.custom_fn": f"{path}:score"})
    with pytest.raises(RewardError) as err:
        train.run(config, workdir)  # the untrained model's responses are not numbers
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("reward function failed on sample ")
    assert "ValueError: invalid literal for int() with base 10: " in message
    assert message.endswith("(my_reward.py:2); set reward.on_error=score to give such "
                            "samples reward.error_score=0 and go on")
    # The workdir keeps nothing of that start; with reward.on_error=score it runs.
    summary = train.run(_config(**{"reward.custom_fn": f"{path}:score",
                                   "reward.on_error": "score"}), workdir)
    assert summary["step"] == 3
    assert all(r["reward/num_errors"] > 0 for r in _metrics(workdir) if r["step"] > 0)


def test_reward_fn_raising_on_the_demonstrations_stops_before_the_warm_start(tmp_path,
                                                                              monkeypatch):
    monkeypatch.setattr(experiment, "build_model", lambda *a, **k: pytest.fail("built"))
    path = tmp_path / "hashes.py"
    path.write_text("def score(data_source, solution_str, ground_truth, extra_info):\n"
                    "    return float(solution_str.split('####')[1] == ground_truth)\n")
    config = _config(**{"reward.custom_fn": f"{path}:score", "sft.steps": 2})
    with pytest.raises(RewardError, match=r"^before the warm start, on the demonstrations of "
                       r"the first training rows as responses: reward function failed on "
                       r"sample 0 \(data_source='synthetic/arithmetic'\): IndexError: list "
                       r"index out of range \(hashes.py:2\); set reward.on_error=score"):
        train.run(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    # Without a warm start the rows' bare answers are not responses it teaches: a
    # function that does not parse them is not stopped for it (here: at its first step).
    with pytest.raises(pytest.fail.Exception, match="built"):
        train.run(_config(**{"reward.custom_fn": f"{path}:score"}), str(tmp_path / "run2"))


def test_a_filter_metric_the_reward_does_not_return_stops_before_anything_is_built(
        tmp_path, monkeypatch):
    """With a warm start the rule reward's fields are read off the demonstrations (the
    first responses RL scores): a dynamic-sampling metric among none of them stops the
    run before the model or its programs (else at the first step's scoring, after
    compiling)."""
    monkeypatch.setattr(experiment, "build_model", lambda *a, **k: pytest.fail("built"))
    config = _config(**{"algorithm.filter_groups.enable": True, "sft.steps": 2,
                        "algorithm.filter_groups.metric": "accuracy"})
    with pytest.raises(ConfigError, match=r"^algorithm\.filter_groups\.metric='accuracy' is "
                       r"not among the reward's fields \['score', 'seq_reward', 'acc'"):
        train.run(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_reward_trial_skips_rows_without_a_demonstration():
    def fails(data_source, solution_str, ground_truth, extra_info):
        raise ValueError(f"cannot parse {solution_str!r}")

    unanswered = [{"prompt": "1+2=", "data_source": "mine"}]
    multi_turn = [{"prompt": "1+2=", "data_source": "mine",
                   "extra_info": {"demonstration": [{"role": "assistant", "content": "3"}]}}]
    train._try_reward_fn(fails, unanswered + multi_turn)  # nothing to try: no error
    answered = {"prompt": "1+2=", "data_source": "mine", "reward_model": {"ground_truth": 3}}
    with pytest.raises(RewardError, match=r"sample 0 \(data_source='mine'\): ValueError: "
                       r"cannot parse '3' \(test_trainer_failure_paths.py:\d+\)"):
        train._try_reward_fn(fails, [*unanswered, answered])


# ----------------------------------------------------------------------------- warm start NaN


def test_nan_warm_start_loss_stops_at_that_step():
    config = _config()
    experiment_settings = experiment_from_config(config)
    tokenizer = experiment.build_tokenizer(experiment_settings)
    rows, _ = experiment.build_data(experiment_settings, tokenizer)
    model, params = experiment.build_model(experiment_settings, tokenizer)
    with pytest.raises(sft.NonFiniteLossError, match=r"^sft step 2 of 5: the loss is nan; the "
                       r"warm start stopped\. Check that the tokenizer matches the model"):
        # The first step's loss is finite; its update makes every parameter NaN.
        sft.train_sft(params, rows, tokenizer, model=model, steps=5, batch_size=4, lr=np.nan,
                      max_prompt_length=4, max_response_length=3)


# ----------------------------------------------------------------------------- signals


def _stopped_by_signal(config, workdir, signum, at_call):
    """`train.run` with `signum` arriving at the reward function's `at_call`-th call;
    the `interrupt.Stopped` it raised."""
    calls = []

    def reward(data_source, solution_str, ground_truth, extra_info):
        calls.append(1)
        if len(calls) == at_call:
            interrupt._received.append(signum)
        return default_compute_score(data_source, solution_str, ground_truth, extra_info)

    with pytest.raises(interrupt.Stopped) as err:
        try:
            train.run(config, workdir, reward_fn=reward)
        finally:
            interrupt.reset()
    return err.value


def test_signal_between_steps_saves_stops_and_resumes_exactly(tmp_path):
    straight, stopped = str(tmp_path / "straight"), str(tmp_path / "stopped")
    config = _config(**{"trainer.save_freq": 0, "algorithm.adv_estimator": "gae"})
    train.run(config, straight)
    # During step 2 (8 samples a step; no validation before).
    err = _stopped_by_signal(config, stopped, signal.SIGTERM, at_call=9)
    assert err.step == 2 and err.exit_code == 143
    assert sorted(os.listdir(os.path.join(stopped, "checkpoints"))) == ["2"]  # save_freq=0
    assert not os.path.exists(os.path.join(stopped, rundir.LOCK_FILE))
    summary = train.run(config, stopped)
    assert summary["resumed"] and summary["step"] == 3
    assert _metrics(stopped) == _metrics(straight)


def test_a_resume_path_run_stopped_after_a_later_step_says_to_resume_from_its_workdir(tmp_path):
    # The same command (resume_path) would refuse the workdir's later step; auto takes it.
    config = _config(**{"trainer.save_freq": 0, "algorithm.adv_estimator": "gae"})
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    train.run(_config(**{"trainer.save_freq": 1, "algorithm.adv_estimator": "gae"}), first,
              exit_after_steps=1)
    from_path = _config(**{"trainer.save_freq": 0, "algorithm.adv_estimator": "gae",
                           "trainer.resume_mode": "resume_path",
                           "trainer.resume_from_path": os.path.join(first, "checkpoints", "1")})
    # During step 2, the first after the one resumed from.
    err = _stopped_by_signal(from_path, second, signal.SIGINT, at_call=1)
    assert str(err) == ("stopped at step 2; run the same command with "
                        "--config.trainer.resume_mode=auto to resume")
    assert sorted(os.listdir(os.path.join(second, "checkpoints"))) == ["2"]
    with pytest.raises(CheckpointError, match="already go on to step 2"):
        train.run(from_path, second)
    config.trainer.resume_mode = "auto"
    summary = train.run(config, second)
    assert summary["resumed"] and summary["step"] == 3


def test_resume_command_names_auto_only_once_a_later_step_is_saved():
    assert rundir.resume_command(None, 4) == "run the same command"
    assert rundir.resume_command("/runs/a/checkpoints/4", 4) == "run the same command"
    assert rundir.resume_command("/runs/a/checkpoints/4", 5) == (
        "run the same command with --config.trainer.resume_mode=auto")


def test_cli_malformed_float_is_one_line(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, "-m", "jrl.train", "--config=configs/grpo_arith.py",
                           "--config.actor.optim.lr=1e-4x", f"--workdir={tmp_path / 'run'}"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert done.returncode == 2
    assert done.stderr == ("error: --config.actor.optim.lr=1e-4x: could not convert string to "
                           "float: '1e-4x'\n")
    assert not (tmp_path / "run").exists()
