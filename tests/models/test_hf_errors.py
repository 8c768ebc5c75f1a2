"""load_pretrained fails early with messages that name the file, tensor or key."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jrl.models import ModelConfig, load_pretrained, save_pretrained
from jrl.models.hf import CheckpointError


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


def _edit_tensors(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_valid_checkpoint_loads(checkpoint):
    config, params = load_pretrained(checkpoint)
    assert config.family == "qwen2" and "lm_head" in params


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint directory .*nowhere.* does not exist"):
        load_pretrained(tmp_path / "nowhere")


def test_missing_config_json(broken):
    (broken / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config.json not found in .*ckpt"):
        load_pretrained(broken)


def test_missing_weight_files(broken):
    (broken / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no weight files .*expected model.safetensors"):
        load_pretrained(broken)


def test_index_names_missing_shard(broken):
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        load_pretrained(broken)


def test_missing_tensor(broken):
    _edit_tensors(broken, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_pretrained(broken)


def test_shape_mismatch(broken):
    _edit_config(broken, intermediate_size=100)
    with pytest.raises(
        CheckpointError,
        match=r"'model.layers.0.mlp.gate_proj.weight'.* shape \(128, 64\), expected \(100, 64\)",
    ):
        load_pretrained(broken)


def test_unsupported_architecture(broken):
    _edit_config(broken, architectures=["MistralForCausalLM"], model_type="mistral")
    with pytest.raises(ValueError, match=r"unsupported architecture.*MistralForCausalLM.*"
                                         r"LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_pretrained(broken)


def test_unsupported_model_type_without_architectures():
    with pytest.raises(ValueError,
                       match="unsupported model_type 'mamba'.*'llama', 'mixtral', 'qwen2'"):
        ModelConfig.from_hf({"model_type": "mamba"})


@pytest.mark.parametrize("family, keys, match", [
    ("qwen3_moe", {"mlp_only_layers": [0]}, "mlp_only_layers=\\[0\\].*every layer"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ("mixtral", {"sliding_window": 4096}, "sliding_window=4096"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
])
def test_moe_variants_jrl_does_not_model_are_named(family, keys, match):
    hf = {"model_type": family, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_experts": 4,
          "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
          "max_position_embeddings": 32768, **keys}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(hf)


def test_unsupported_rope_type(broken):
    _edit_config(broken, rope_scaling={"rope_type": "yarn", "factor": 4.0}, rope_parameters=None)
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'.*'llama3'"):
        load_pretrained(broken)


@pytest.mark.parametrize("where", ["top", "rope_parameters"])
def test_partial_rotary_factor_is_rejected(broken, where):
    if where == "top":
        _edit_config(broken, partial_rotary_factor=0.5)
    else:
        _edit_config(broken, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                              "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5"):
        load_pretrained(broken)


def test_sliding_window_is_rejected(broken):
    _edit_config(broken, use_sliding_window=True)
    with pytest.raises(ValueError, match="use_sliding_window=true"):
        load_pretrained(broken)


def test_tied_config_accepts_equal_head_and_rejects_different_one(broken):
    _edit_config(broken, tie_word_embeddings=True)
    _edit_tensors(broken, lambda t: t.update(
        {"lm_head.weight": t["model.embed_tokens.weight"].copy()}))
    config, params = load_pretrained(broken)
    assert config.tie_word_embeddings and "lm_head" not in params

    _edit_tensors(broken, lambda t: t.update(
        {"lm_head.weight": np.zeros_like(t["model.embed_tokens.weight"])}))
    with pytest.raises(CheckpointError, match="'lm_head.weight' differs from"):
        load_pretrained(broken)


def test_saving_a_critic_is_rejected(checkpoint, tmp_path):
    config, params = load_pretrained(checkpoint)
    critic = {**params, "value_head": {"kernel": np.zeros((64, 1)), "bias": np.zeros(1)}}
    with pytest.raises(ValueError, match="value_head"):
        save_pretrained(tmp_path, config, critic)
