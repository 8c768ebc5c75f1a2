"""`hf.check_files`: a checkpoint directory's files are checked before a run claims its
workdir, without reading tensors; each problem names the file with its path."""

import json
import os
import re

import pytest

from jrl.models import ModelConfig, save_pretrained
from jrl.models.hf import CheckpointError, check_files, read_supported_config


def test_valid_checkpoint_passes(checkpoint):
    check_files(checkpoint)


def test_truncated_weights_name_the_file(broken):
    weights = broken / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, size - 1)
    with pytest.raises(CheckpointError) as err:
        check_files(broken)
    assert str(err.value) == (
        f"model.path: '{weights}' is not a complete safetensors file: it has {size - 1} bytes, "
        f"but its header lists tensors up to byte {size}: it is truncated; copy or download "
        "it again")


@pytest.mark.parametrize("keep", [0, 5, 20])
def test_header_cut_short(broken, keep):
    weights = broken / "model.safetensors"
    os.truncate(weights, keep)
    with pytest.raises(CheckpointError, match=rf"'{weights}' is not a complete safetensors "
                       r"file: its header is (cut short or corrupt|not valid safetensors JSON)"):
        check_files(broken, "reward_model.model.path")


def test_missing_weights_and_directory_name_the_key(broken, tmp_path):
    (broken / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"^model.path: no weight files in .*ckpt"):
        check_files(broken)
    with pytest.raises(FileNotFoundError, match=r"^model.path: checkpoint directory .*nowhere"):
        check_files(tmp_path / "nowhere")


def test_unreadable_config_json(broken):
    config = broken / "config.json"
    config.write_text('{\n  "vocab_size": 99,\n  oops\n}')
    with pytest.raises(CheckpointError) as err:
        check_files(broken)
    assert str(err.value) == (f"model.path: '{config}' is not valid JSON: Expecting property "
                              "name enclosed in double quotes at line 3 column 3")
    # The run reads config.json first for the tokenizer check: the same error there.
    with pytest.raises(CheckpointError, match=r"^model.path: .*config.json' is not valid JSON"):
        read_supported_config(broken, "model.path")
    config.write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"config.json' holds a JSON list; expected an "
                       "object"):
        check_files(broken)


def test_unsupported_architecture_names_the_key_and_file(broken):
    config = broken / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()),
                                  "architectures": ["BertModel"]}))
    with pytest.raises(CheckpointError, match=rf"^model.path: '{re.escape(str(config))}': "
                       r"unsupported architecture \['BertModel'\]; supported architectures are \[.*"
                       "'Qwen2ForCausalLM'"):
        check_files(broken)
    with pytest.raises(CheckpointError, match=r"^reward_model.model.path: .*BertModel"):
        read_supported_config(broken, "reward_model.model.path")


def test_missing_config_json_names_the_key(broken):
    (broken / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"^model.path: config.json not found in "
                       r"checkpoint directory .*ckpt' \(found: \['model.safetensors'\]\)"):
        read_supported_config(broken, "model.path")


def test_sharded_checkpoint_checks_every_shard(checkpoint, tmp_path, random_params):
    path = tmp_path / "sharded"
    config = ModelConfig.preset("tiny", tie_word_embeddings=False)
    save_pretrained(path, config, random_params(config), max_shard_bytes=20_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    check_files(path)
    os.truncate(path / shards[-1], 100)
    with pytest.raises(CheckpointError, match=shards[-1]):
        check_files(path)
