"""Bad input stops before anything compiles, with one readable line: every data row is
checked at load, misspelled keys name the nearest valid key, and the command-line entry
points print config / data / run-directory errors without a traceback."""

import json
import os
import re
import subprocess
import sys

import pytest

from jrl import train
from jrl.app import experiment
from jrl.config.settings import experiment_from_config
from jrl.data.tokenizers import CharTokenizer
from jrl.errors import CheckpointError, DataError
from tests.tiny import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _row(prompt="1+2=", source="synthetic/arithmetic", truth="3"):
    row = {"prompt": prompt, "data_source": source}
    if truth is not ...:
        row["reward_model"] = {"ground_truth": truth, "style": "rule"}
    return row


def _files(tmp_path, bad_row, bad_index=2):
    good = [_row() for _ in range(4)]
    train_rows = good[:bad_index] + [bad_row] + good[bad_index:]
    paths = {}
    for split, rows in (("train", train_rows), ("val", good)):
        paths[split] = str(tmp_path / f"{split}.jsonl")
        with open(paths[split], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return paths


def _config(paths, **kw):
    return tiny_config(**{"data.train_files": paths["train"], "data.val_files": paths["val"],
                          "data.max_prompt_length": 8, **kw})


def _build_data(config):
    """`experiment.build_data` of `config` with its tokenizer."""
    experiment_settings = experiment_from_config(config)
    return experiment.build_data(experiment_settings,
                                 experiment.build_tokenizer(experiment_settings))


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if the run gets as far as building (and compiling) a model."""
    def refuse(*args, **kwargs):
        raise AssertionError("the input error was not found before the model was built")
    monkeypatch.setattr(experiment, "build_model", refuse)


@pytest.mark.parametrize("bad_row, message", [
    (_row(prompt=""), r"train.jsonl: row 3: field 'prompt' must be .*; it is empty"),
    (_row(prompt=[{"role": "user", "content": "  "}]), r"row 3: field 'prompt' .* it is empty"),
    (_row(source="my_task"), r"train.jsonl: row 3: field 'data_source' is 'my_task', which has "
     r"no reward function; known: \[.*'synthetic/arithmetic'.*\]\. Set reward.custom_fn"),
    (_row(truth=...), r"train.jsonl: row 3: field 'reward_model.ground_truth' must be a "
     r"non-empty string or a number .*; got nothing"),
    (_row(truth={"answer": "3"}), r"row 3: field 'reward_model.ground_truth' .* got dict"),
    (_row(truth=""), r"row 3: field 'reward_model.ground_truth' .* got str ''"),
    (_row(prompt="123456789+1="), r"train.jsonl: row 3: the prompt '123456789\+1=' has 12 "
     r"tokens, more than data.max_prompt_length=8"),
])
def test_bad_row_stops_before_the_model_is_built(tmp_path, no_model, bad_row, message):
    with pytest.raises(DataError, match=message):
        train.run(_config(_files(tmp_path, bad_row)), str(tmp_path / "run"))


def test_every_bad_row_is_listed_in_one_error_numbered_as_the_file_lines(tmp_path, no_model):
    """Three defects, one run: rows numbered from 1 as the lines of the .jsonl file (a
    blank line keeps its number), invalid JSON among them."""
    paths = _files(tmp_path, _row())
    good = json.dumps(_row())
    lines = [good, json.dumps(_row(prompt="")), "", "{not json", good,
             json.dumps(_row(source="my_task")), good]
    with open(paths["train"], "w") as f:
        f.write("\n".join(lines) + "\n")
    with pytest.raises(DataError) as err:
        train.run(_config(paths), str(tmp_path / "run"))
    message = str(err.value).splitlines()
    assert message[0] == (f"{paths['train']}: 3 bad rows (numbered from 1; row N of a .jsonl "
                          "file is its line N):")
    assert [line.split(":")[0] for line in message[1:]] == ["  row 2", "  row 4", "  row 6"]
    assert message[1].startswith("  row 2: field 'prompt' must be")
    assert message[2].startswith("  row 4: not valid JSON (")
    assert message[3].startswith("  row 6: field 'data_source' is 'my_task', which has no")


def test_bad_rows_of_the_training_and_validation_files_come_in_one_error(tmp_path, no_model):
    paths = _files(tmp_path, _row(prompt=""))
    with open(paths["val"], "a") as f:
        f.write(json.dumps(_row(truth="")) + "\n")
    with pytest.raises(DataError) as err:
        train.run(_config(paths), str(tmp_path / "run"))
    assert str(err.value).splitlines() == [
        f"{paths['train']}: row 3: field 'prompt' must be a string or a non-empty list of "
        "{'role': str, 'content': str} messages; it is empty (no text to condition on)",
        f"{paths['val']}: row 5: field 'reward_model.ground_truth' must be a non-empty string "
        "or a number (the answer the 'synthetic/arithmetic' reward compares with); got str ''"]


def test_a_file_without_the_prompt_column_as_both_splits_is_one_line(tmp_path, no_model):
    path = str(tmp_path / "rows.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps({"question": "1+2=", "data_source": "synthetic/arithmetic"})
                     + "\n" for _ in range(64))
    with pytest.raises(DataError) as err:
        train.run(_config({"train": path, "val": path}), str(tmp_path / "run"))
    assert str(err.value) == (
        f"{path}: the column 'prompt' named by data.prompt_key is missing from every row; the "
        "file's columns are ['data_source', 'question']; set data.prompt_key to the column "
        "holding the prompts")


def test_an_unsupported_checkpoint_stops_before_the_workdir_is_claimed(tmp_path, no_model):
    checkpoint = tmp_path / "bert"
    checkpoint.mkdir()
    # The character tokenizer's vocabulary, so that only the architecture is wrong.
    vocab = CharTokenizer().vocab_size
    (checkpoint / "config.json").write_text(json.dumps({"architectures": ["BertModel"],
                                                        "vocab_size": vocab}))
    workdir = tmp_path / "run"
    with pytest.raises(CheckpointError, match=rf"^model.path: '{re.escape(str(checkpoint))}/"
                       r"config.json': unsupported architecture \['BertModel'\]; supported "):
        train.run(tiny_config(**{"model.path": str(checkpoint)}), str(workdir))
    assert not workdir.exists()


def test_bad_rows_past_twenty_are_counted_not_listed(tmp_path):
    paths = _files(tmp_path, _row())
    with open(paths["train"], "w") as f:
        f.writelines(json.dumps(_row(prompt="")) + "\n" for _ in range(25))
    config = _config(paths)
    with pytest.raises(DataError) as err:
        _build_data(config)
    message = str(err.value).splitlines()
    assert message[0].endswith("25 bad rows (numbered from 1; row N of a .jsonl file is its "
                               "line N); the first 20 are listed:")
    assert len(message) == 21 and message[-1].startswith("  row 20: ")


def test_rows_a_custom_reward_scores_are_not_held_to_the_built_in_rewards(tmp_path):
    rows = _files(tmp_path, _row(source="my_task", truth=...))
    config = _config(rows, **{"reward.custom_fn": "x.py:score"})
    train_rows, _ = _build_data(config)
    assert len(train_rows) == 5
    # A numeric ground truth is fine for the built-in scorers (they compare str(truth)).
    rows = _files(tmp_path, _row(truth=3))
    config = _config(rows)
    assert len(_build_data(config)[0]) == 5


def test_too_long_synthetic_prompt_stops_before_the_warm_start(tmp_path, no_model):
    config = tiny_config(**{"data.digits": 2, "data.max_prompt_length": 3, "sft.steps": 5})
    with pytest.raises(DataError) as err:
        train.run(config, str(tmp_path))
    lines = str(err.value).splitlines()
    # Every row is too long: all are counted, the first 20 listed, numbered from 1.
    assert re.fullmatch(r"data.task='arithmetic' \(train\), data.task='arithmetic' \(val\): "
                        r"\d+ bad rows \(numbered from 1; row N of a .jsonl file is its line N\); "
                        r"the first 20 are listed:", lines[0]), lines[0]
    assert len(lines) == 21
    assert re.fullmatch(r"  data.task='arithmetic' \(train\): row 1: the prompt '\d\d\+\d\d=' "
                        r"has 6 tokens, more than data.max_prompt_length=3; raise "
                        r"data.max_prompt_length", lines[1]), lines[1]


def _cli(module, *args, cwd=REPO):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def test_misspelled_key_names_its_path_and_the_nearest_key(tmp_path):
    done = _cli("jrl.train", "--config=configs/grpo_arith.py", "--config.actor.optim.lrr=1e-5",
                f"--workdir={tmp_path}")
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: --config.actor.optim.lrr: the config has no key "
                                   "actor.optim.lrr; the nearest valid key is actor.optim.lr")
    assert not os.listdir(tmp_path)


def test_cli_prints_a_data_error_as_one_line_and_the_traceback_with_debug(tmp_path):
    paths = _files(tmp_path, _row(prompt=""))
    args = ["--config=configs/grpo_arith.py", f"--config.data.train_files={paths['train']}",
            f"--config.data.val_files={paths['val']}", f"--workdir={tmp_path / 'run'}"]
    done = _cli("jrl.train", *args)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: {paths['train']}: row 3: field 'prompt' must be")
    assert not any("Traceback" in line for line in lines)
    debug = _cli("jrl.train", *args, "--debug")
    assert debug.returncode == 2 and "Traceback" in debug.stderr


def test_cli_run_directory_error_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"seed": 7}))
    done = _cli("jrl.train", "--config=configs/grpo_arith.py", f"--workdir={tmp_path}")
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: {tmp_path} holds a run started with another config")
    assert "  seed: 7 -> 0" in done.stderr
    assert "Traceback" not in done.stderr


def test_sft_cli_reuses_or_refuses_a_warm_start(tmp_path):
    args = ["--config=configs/grpo_arith.py", "--config.sft.steps=2", "--config.sft.batch_size=4",
            "--config.model.hidden_size=32", "--config.model.intermediate_size=64",
            "--config.model.num_heads=2", "--config.model.num_kv_heads=1",
            "--config.model.head_dim=16", f"--workdir={tmp_path}"]
    first = _cli("jrl.sft", *args)
    assert first.returncode == 0, first.stderr
    assert f"saved the warm-started parameters under {tmp_path}/sft" in first.stdout
    again = _cli("jrl.sft", *args)
    assert again.returncode == 0, again.stderr
    assert f"{tmp_path}/sft already holds this warm start; nothing to train" in again.stdout
    changed = _cli("jrl.sft", *args, "--config.sft.steps=3")
    assert changed.returncode == 2
    assert "  sft.steps: 2 -> 3" in changed.stderr and "Traceback" not in changed.stderr


def test_bad_config_variant_is_one_line(tmp_path):
    done = _cli("jrl.train", "--config=configs/grpo_arith.py:n=16,lrr=3", f"--workdir={tmp_path}")
    assert done.returncode == 2
    assert done.stderr.strip().startswith("error: config arg 'lrr=3': unknown name 'lrr'")
    assert "Traceback" not in done.stderr


def test_default_workdir_names_the_variant():
    from absl import flags

    from jrl import cli

    try:
        flags.FLAGS(["prog", "--config=configs/grpo_arith.py:n=16,lr=3e-4"], known_only=True)
        assert cli.config_name() == "grpo_arith-n=16_lr=3e-4"
    finally:
        flags.FLAGS.unparse_flags()
