"""The run directory owns its run: config.json, resume / finished / changed-key decisions,
`trainer.resume_mode`, the lock, the warm start's settings, and metrics.jsonl without
repeated steps."""

import json
import os
import socket
import subprocess
import sys

import pytest

from jrl import sft, train
from jrl.app import experiment, rundir
from jrl.config.settings import experiment_from_config
from jrl.errors import RunDirError
from jrl.metrics import read_jsonl
from jrl.rl.checkpoint import Checkpointer
from tests.tiny import tiny_config


def _config(**kw):
    return tiny_config(**{"trainer.total_training_steps": 2, "trainer.save_freq": 1,
                          "trainer.test_freq": 2, "trainer.val_before_train": True, **kw})


def _steps(workdir):
    return [r["step"] for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_first_start_records_the_config(tmp_path):
    workdir = str(tmp_path)
    train.run(_config(), workdir)
    with open(tmp_path / rundir.CONFIG_FILE) as f:
        stored = json.load(f)
    assert stored["actor.optim.lr"] == 1e-3
    assert stored["trainer.total_training_steps"] == 2
    assert json.loads((tmp_path / rundir.FINISHED_FILE).read_text())["step"] == 2
    assert not (tmp_path / rundir.LOCK_FILE).exists()


def test_finished_run_is_reported_not_rerun(tmp_path, capsys):
    workdir = str(tmp_path)
    first = train.run(_config(), workdir)
    before = (tmp_path / "metrics.jsonl").read_text()
    capsys.readouterr()
    again = train.run(_config(), workdir)
    out = capsys.readouterr().out
    assert f"{workdir} holds a finished run (step 2 of 2, same config)" in out
    assert "--config.trainer.resume_mode=disable" in out
    assert again["finished"] and again["step"] == 2
    assert again["final"] == first["final"]
    assert (tmp_path / "metrics.jsonl").read_text() == before  # nothing trained or logged


def test_changed_key_stops_with_old_and_new_values(tmp_path):
    workdir = str(tmp_path)
    train.run(_config(), workdir)
    changed = _config(**{"actor.optim.lr": 1e-5, "seed": 1})
    with pytest.raises(RunDirError) as err:
        train.run(changed, workdir)
    message = str(err.value)
    assert "actor.optim.lr: 0.001 -> 1e-05" in message
    assert "seed: 0 -> 1" in message
    assert "trainer.resume_mode=disable" in message and "new --workdir" in message
    assert not (tmp_path / rundir.LOCK_FILE).exists()  # released on the error path


def test_control_keys_may_change(tmp_path):
    workdir = str(tmp_path)
    train.run(_config(), workdir)
    again = train.run(_config(**{"trainer.logger": ("jsonl", "console")}), workdir)
    assert again["finished"]


def test_killed_run_resumes_and_logs_each_step_once(tmp_path, capsys):
    workdir = str(tmp_path)
    train.run(_config(**{"trainer.total_training_steps": 3}), workdir, exit_after_steps=1)
    assert not (tmp_path / rundir.FINISHED_FILE).exists()
    capsys.readouterr()
    summary = train.run(_config(**{"trainer.total_training_steps": 3}), workdir)
    assert "resumed from step 1 (of 3)" in capsys.readouterr().out
    assert summary["resumed"] and summary["step"] == 3
    assert _steps(workdir) == [0, 1, 2, 3]


def test_restart_before_the_first_checkpoint_does_not_repeat_step_0(tmp_path):
    workdir = str(tmp_path)
    # A run killed before its first checkpoint: metrics.jsonl holds step 0 (and a line
    # cut short), the checkpoints directory nothing.
    train.run(_config(**{"trainer.save_freq": 0, "trainer.total_training_steps": 3}), workdir,
              exit_after_steps=1)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "critic/sco')
    train.run(_config(**{"trainer.save_freq": 0, "trainer.total_training_steps": 3}), workdir)
    assert _steps(workdir) == [0, 1, 2, 3]


def test_resume_mode_disable_starts_over(tmp_path, capsys):
    workdir = str(tmp_path)
    train.run(_config(), workdir)
    capsys.readouterr()
    summary = train.run(_config(**{"actor.optim.lr": 1e-5, "trainer.resume_mode": "disable"}),
                        workdir)
    out = capsys.readouterr().out
    assert "trainer.resume_mode=disable: removed the previous run's checkpoints" in out
    assert not summary["resumed"] and summary["step"] == 2
    assert json.loads((tmp_path / rundir.CONFIG_FILE).read_text())["actor.optim.lr"] == 1e-5
    assert _steps(workdir) == [0, 1, 2]


def test_resume_path_continues_with_changed_keys(tmp_path, capsys):
    workdir = str(tmp_path)
    train.run(_config(), workdir)
    checkpoint = os.path.join(workdir, "checkpoints", "2")
    capsys.readouterr()
    summary = train.run(_config(**{"trainer.total_training_steps": 3,
                                   "trainer.resume_mode": "resume_path",
                                   "trainer.resume_from_path": checkpoint}), workdir)
    out = capsys.readouterr().out
    assert "trainer.total_training_steps: 2 -> 3" in out
    assert f"resumed from step 2 (of 3) ({checkpoint})" in out
    assert summary["step"] == 3
    assert _steps(workdir) == [0, 1, 2, 3]


def test_resume_path_must_name_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="trainer.resume_from_path: .* is not a checkpoint"):
        train.run(_config(**{"trainer.resume_mode": "resume_path",
                             "trainer.resume_from_path": str(tmp_path)}), str(tmp_path / "w"))
    with pytest.raises(ValueError, match="needs trainer.resume_from_path"):
        train.run(_config(**{"trainer.resume_mode": "resume_path"}), str(tmp_path / "w"))
    with pytest.raises(ValueError, match="trainer.resume_mode: 'later' is not valid"):
        train.run(_config(**{"trainer.resume_mode": "later"}), str(tmp_path / "w"))


def test_second_run_into_a_locked_workdir_stops(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = {"pid": holder.pid, "host": socket.gethostname(), "started": "2026-11-26T10:00"}
        (tmp_path / rundir.LOCK_FILE).write_text(json.dumps(lock))
        with pytest.raises(RunDirError, match=f"is in use by pid {holder.pid} on this host since "
                           "2026-11-26T10:00"):
            train.run(_config(), str(tmp_path))
        assert json.loads((tmp_path / rundir.LOCK_FILE).read_text())["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_lock_of_another_host_is_not_taken(tmp_path):
    lock = {"pid": 1, "host": "elsewhere", "started": "2026-11-26T10:00"}
    (tmp_path / rundir.LOCK_FILE).write_text(json.dumps(lock))
    with pytest.raises(RunDirError, match="host elsewhere .* delete the lock file"):
        rundir.acquire_lock(str(tmp_path))


def test_stale_lock_is_taken_over(tmp_path, capsys):
    pid = _dead_pid()
    lock = {"pid": pid, "host": socket.gethostname(), "started": "2026-11-26T09:00"}
    (tmp_path / rundir.LOCK_FILE).write_text(json.dumps(lock))
    summary = train.run(_config(), str(tmp_path))
    assert f"taking over the stale lock of pid {pid}" in capsys.readouterr().out
    assert summary["step"] == 2
    assert not (tmp_path / rundir.LOCK_FILE).exists()


def test_lock_is_exclusive_within_one_host(tmp_path):
    path = rundir.acquire_lock(str(tmp_path))
    try:
        with pytest.raises(RunDirError, match=f"in use by pid {os.getpid()}"):
            rundir.acquire_lock(str(tmp_path))
    finally:
        rundir.release_lock(path)
    assert not os.path.exists(path)


def _warm_start(config, workdir):
    experiment_settings = experiment_from_config(config)
    tokenizer = experiment.build_tokenizer(experiment_settings)
    rows, _ = experiment.build_data(experiment_settings, tokenizer)
    model, params = experiment.build_model(experiment_settings, tokenizer)
    return sft.warm_start(experiment_settings, workdir, model, params, tokenizer, rows,
                          config_keys=rundir.warm_start_settings(config))


def test_warm_start_is_reused_only_with_its_own_settings(tmp_path, capsys):
    workdir = str(tmp_path)
    _warm_start(_config(**{"sft.steps": 2, "sft.batch_size": 4}), workdir)
    capsys.readouterr()
    # An RL-only key does not touch the warm start.
    _warm_start(_config(**{"sft.steps": 2, "sft.batch_size": 4, "actor.optim.lr": 1e-5}), workdir)
    assert "sft: reusing the warm start" in capsys.readouterr().out
    with pytest.raises(RunDirError, match="sft.steps: 2 -> 3"):
        _warm_start(_config(**{"sft.steps": 3, "sft.batch_size": 4}), workdir)
    with pytest.raises(RunDirError, match="seed: 0 -> 1"):
        _warm_start(_config(**{"sft.steps": 2, "sft.batch_size": 4, "seed": 1}), workdir)


def test_warm_start_saved_without_settings_is_checked_by_its_steps(tmp_path):
    config = _config(**{"sft.steps": 2, "sft.batch_size": 4})
    experiment_settings = experiment_from_config(config)
    tokenizer = experiment.build_tokenizer(experiment_settings)
    model, params = experiment.build_model(experiment_settings, tokenizer)
    ckpt = Checkpointer(os.path.join(tmp_path, "sft"))
    ckpt.save(25, params, {"steps": 25})
    ckpt.close()
    with pytest.raises(RunDirError, match="sft.steps: 25 -> 2"):
        _warm_start(config, str(tmp_path))


def test_warm_start_settings_hold_what_the_demonstrations_depend_on():
    """The tool config decides multi-turn prompts (its schemas go through the chat
    template), so it is a warm-start key; the RL-only keys are not."""
    config = _config()
    config.rollout.multi_turn.tool_config_path = "configs/tools/calculator.yaml"
    settings = rundir.warm_start_settings(config)
    assert settings["rollout.multi_turn.tool_config_path"] == "configs/tools/calculator.yaml"
    assert settings["rollout.response_length"] == config.rollout.response_length
    assert "data.train_batch_size" not in settings and "actor.optim.lr" not in settings
