"""What a new user tries first, replayed through `python -m jrl.train`: each mistake
stops with one error (status 2, no traceback) that says what would work, and doing
what it says runs."""

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN = "--config=configs/grpo_arith.py"
# The main job's model made small, and its steps few, where a run must finish.
SMALL = ["--config.model.hidden_size=32", "--config.model.intermediate_size=64",
         "--config.model.num_heads=2", "--config.model.num_kv_heads=1",
         "--config.model.head_dim=16", "--config.sft.steps=2",
         "--config.trainer.total_training_steps=1", "--config.trainer.logger=('jsonl',)"]


def _train(*args, cwd=REPO):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "jrl.train", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def _rows_file(path, count):
    with open(path, "w") as f:
        for i in range(count):
            a, b = 10 + i, 21 + 2 * i
            f.write(json.dumps({"prompt": f"{a}+{b}=", "data_source": "synthetic/arithmetic",
                                "reward_model": {"ground_truth": str(a + b),
                                                 "style": "rule"}}) + "\n")
    return str(path)


def test_a_small_data_file_names_every_batch_size_and_the_flags_run(tmp_path):
    """Five rows under the main config's batch sizes: one error lists each size that
    does not fit (the warm start's too), before the workdir is claimed; the flags it
    gives then run to the end."""
    rows = _rows_file(tmp_path / "rows.jsonl", 5)
    workdir = tmp_path / "run"
    data = [f"--config.data.train_files={rows}", f"--config.data.val_files={rows}"]
    done = _train(MAIN, *data, f"--workdir={workdir}")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    message = done.stderr[done.stderr.index("error: "):]
    assert message.startswith("error: the batch sizes do not fit this run (5 training rows")
    for key in ("data.train_batch_size=32: more prompts than the 5 training rows",
                "sft.batch_size=128: more than the 5 training rows"):
        assert key in message, message
    fit = re.search(r"^these fit: (.*)$", message, re.M)
    assert fit, message
    flags = fit.group(1).split()
    assert "--config.data.train_batch_size=5" in flags and "--config.sft.batch_size=5" in flags
    assert not workdir.exists()  # nothing claimed

    ran = _train(MAIN, *data, *flags, *SMALL, f"--workdir={workdir}")
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "val-core/synthetic/arithmetic/acc/mean@1" in ran.stdout
    steps = [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")]
    assert max(steps) == 1


def test_rollout_n_on_the_command_line_names_the_variant_and_what_fits(tmp_path):
    """`--config.rollout.n=4` leaves the main config's micro-batch (128 sequences) above
    its mini-batch (16 x 4 = 64): the error gives the micro-batch that fits, and a note
    names the config's variant that sets both."""
    done = _train(MAIN, "--config.rollout.n=4", f"--workdir={tmp_path / 'run'}")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert ("note: --config.rollout.n=4 leaves what follows it in configs/grpo_arith.py as it "
            "was; configs/grpo_arith.py:n=4 sets it with actor.ppo_micro_batch_size=64"
            ) in done.stderr
    assert "actor.ppo_micro_batch_size=128: 128 sequences must divide the mini-batch of 64" \
        in done.stderr
    assert "these fit: --config.actor.ppo_micro_batch_size=64" in done.stderr


def test_no_config_is_one_line_and_help_lists_the_flags(tmp_path):
    done = _train(cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --config is required: give an experiment config file, e.g. "
        "--config=configs/grpo_arith.py (the files in configs/, or your own with a "
        "get_config() function); --help lists the flags"]
    shown = _train("--help", cwd=tmp_path)  # absl's usage (its exit status is 1)
    for flag in ("--config:", "--workdir:", "--[no]debug:"):
        assert flag in shown.stdout, shown.stdout


def test_every_size_is_checked_against_the_rows_before_the_settings_stop(tmp_path,
                                                                        monkeypatch):
    """In the process: a micro-batch that does not divide its mini-batch (which the
    settings stop at, before reading rows) and 5 rows under 8-prompt steps come in one
    error, before the workdir or the model; the warm start refuses a batch above its rows
    by itself."""
    from jrl import sft, train
    from jrl.app import experiment
    from jrl.errors import ConfigError
    from tests.tiny import tiny_config

    monkeypatch.setattr(experiment, "build_model", lambda *a, **k: 1 / 0)
    rows = _rows_file(tmp_path / "rows.jsonl", 5)
    config = tiny_config(**{"data.train_files": rows, "data.val_files": rows,
                            "data.max_prompt_length": 8, "data.train_batch_size": 8,
                            "actor.ppo_micro_batch_size": 3})
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError) as raised:
        train.run(config, str(workdir))
    assert str(raised.value).splitlines() == [
        "the batch sizes do not fit this run (5 training rows, each batch split over 1 "
        "device):",
        "  data.train_batch_size=8: more prompts than the 5 training rows",
        "  actor.ppo_micro_batch_size=3: 3 sequences must divide the mini-batch of 4 "
        "sequences (actor.ppo_mini_batch_size x rollout.n)",
        "these fit: --config.data.train_batch_size=5 --config.actor.ppo_mini_batch_size=1 "
        "--config.actor.ppo_micro_batch_size=2"]
    assert not workdir.exists()
    with pytest.raises(ConfigError) as raised:
        sft.train_sft(None, [{}] * 3, None, model=None, steps=1, batch_size=4, lr=1e-3,
                      max_prompt_length=4, max_response_length=4)
    assert str(raised.value) == (
        "sft.batch_size=4: more than the 3 training rows (the warm start draws a batch "
        "without replacement); set --config.sft.batch_size to at most 3")


def test_variant_notes_and_the_missing_config_error_in_the_process():
    from absl import flags

    from jrl import cli
    from jrl.errors import ConfigError

    spec = os.path.join(REPO, "configs", "grpo_arith.py")
    assert cli.variant_notes(spec, {"rollout.n": "4"}) == [
        f"note: --config.rollout.n=4 leaves what follows it in {spec} as it was; "
        f"{spec}:n=4 sets it with actor.ppo_micro_batch_size=64"]
    # Nothing follows the seed; a micro-batch given along with n is the user's; a variant
    # on the command line already is the variant.
    assert cli.variant_notes(spec, {"seed": "3"}) == []
    assert cli.variant_notes(spec, {"rollout.n": "4", "actor.ppo_micro_batch_size": "32"}) == []
    assert cli.variant_notes(spec + ":n=4", {"rollout.n": "4"}) == []
    try:
        flags.FLAGS(["prog"], known_only=True)
        with pytest.raises(ConfigError, match="--config is required: give an experiment "
                                              "config file"):
            cli.required_config()
    finally:
        flags.FLAGS.unparse_flags()


@pytest.mark.parametrize(("key", "hint"), [
    ("data.max_response_length", "verl's data.max_response_length is rollout.response_length "
                                 "here"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
     "verl's actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu is "
     "actor.ppo_micro_batch_size here (counted in sequences over all devices, not per GPU: "
     "verl's value times the number of GPUs)"),
    ("actor_rollout_ref.actor.optim.lr", "verl's actor_rollout_ref.actor.optim.lr is "
                                         "actor.optim.lr here"),
    ("actor_rollout_ref.rollout.temperature", "verl's actor_rollout_ref.rollout.temperature "
                                              "is rollout.temperature here"),
    ("actor.optim.lrr", "the nearest valid key is actor.optim.lr"),
])
def test_a_verl_key_names_the_jrl_key(key, hint):
    """verl's names for keys jrl names otherwise get the jrl key (docs/from_verl.md's
    map), not the nearest spelling; a misspelling still gets the nearest key."""
    from jrl import cli
    from jrl.config.defaults import base_config
    from jrl.errors import ConfigError

    with pytest.raises(ConfigError) as raised:
        cli.check_override_keys(base_config(), [key])
    assert str(raised.value) == f"--config.{key}: the config has no key {key}; {hint}"


def test_every_verl_rename_points_at_a_jrl_key_in_the_docs_map():
    from jrl.app import rundir
    from jrl.config import verl_names
    from jrl.config.defaults import base_config

    known = rundir.flatten(base_config())
    with open(os.path.join(REPO, "docs", "from_verl.md")) as f:
        docs = f.read()
    for verl, (ours, _) in verl_names.RENAMED.items():
        assert ours == "--workdir" or ours in known, (verl, ours)
        assert verl not in known, verl
        assert f"`{verl}" in docs, verl  # "`key`" or "`key=value`" in the map


def test_a_config_file_without_get_config_is_one_line(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text("LR = 1e-6\n")
    done = _train(f"--config={path}", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: --config: '{path}' has no get_config() function; a config file defines "
        "get_config() returning an ml_collections.ConfigDict (see configs/grpo_arith.py)"]


def test_preprocess_of_a_missing_dataset_is_one_line(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, "-m", "jrl.data.preprocess", "gsm8k",
                           "--local_dir", str(tmp_path / "nowhere"), "--output_dir",
                           str(tmp_path / "out")], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "nowhere" in lines[0], lines
