"""jrl vs transformers: logits, save/load round trips and reward-model scores (float32)."""

import copy
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jrl.models import (
    ModelConfig,
    forward,
    forward_logits,
    load_pretrained,
    save_pretrained,
    sequence_scores,
)

CAUSAL_CASES = [
    "llama_tied_llama3_rope",
    "llama_untied",
    "qwen2_tied",
    "qwen2_untied",
    "qwen3_tied",
    "qwen3_untied",
    "qwen3_moe",
    "qwen3_moe_unnormalised",
    "mixtral",
]
forward_logits_jit = jax.jit(forward_logits, static_argnames="config")
forward_jit = jax.jit(forward, static_argnames="config")


def _jrl_logits(params, config, batch):
    logits, _ = forward_logits_jit(
        params,
        jnp.asarray(batch["tokens"]),
        jnp.asarray(batch["positions"]),
        jnp.asarray(batch["mask"]),
        config=config,
    )
    return np.asarray(logits)


def _relative_error(actual, expected):
    return np.linalg.norm(actual - expected) / np.linalg.norm(expected)


@pytest.mark.parametrize("case", CAUSAL_CASES)
def test_logits_match_transformers_on_left_padded_batch(
    case, hf_checkpoint, ragged_batch, torch_forward
):
    path, model = hf_checkpoint(case)
    config, params = load_pretrained(path)
    valid = ragged_batch["mask"].astype(bool)

    expected = torch_forward(model, ragged_batch)[valid]
    actual = _jrl_logits(params, config, ragged_batch)[valid]

    assert _relative_error(actual, expected) < 1e-4
    assert config.tie_word_embeddings == ("lm_head" not in params)


@pytest.mark.parametrize("case", ["llama_tied_llama3_rope", "qwen3_untied", "qwen2_untied",
                                  "qwen3_moe", "mixtral"])
def test_save_pretrained_loads_in_transformers(
    case, hf_checkpoint, ragged_batch, random_params, tmp_path
):
    source, _ = hf_checkpoint(case)
    config = ModelConfig.from_hf(json.loads((source / "config.json").read_text()))
    params = random_params(config, seed=1)
    # A small shard limit forces the sharded layout with an index file.
    save_pretrained(tmp_path, config, params, max_shard_bytes=64 * 1024)
    assert (tmp_path / "model.safetensors.index.json").is_file()

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        expected = model(
            input_ids=torch.as_tensor(ragged_batch["tokens"], dtype=torch.long),
            attention_mask=torch.as_tensor(ragged_batch["mask"], dtype=torch.long),
            position_ids=torch.as_tensor(ragged_batch["positions"], dtype=torch.long),
        ).logits.numpy()
    valid = ragged_batch["mask"].astype(bool)
    actual = _jrl_logits(params, config, ragged_batch)
    assert _relative_error(actual[valid], expected[valid]) < 1e-4

    reloaded_config, reloaded = load_pretrained(tmp_path)
    assert reloaded_config == config
    jax.tree.map(np.testing.assert_array_equal, reloaded, params)


def test_reward_model_score_matches_transformers(hf_checkpoint, ragged_batch, tmp_path):
    path, model = hf_checkpoint("qwen2_reward")
    config, params = load_pretrained(path)
    assert params["score"]["kernel"].shape == (config.hidden_size, 1)
    with torch.no_grad():
        expected = model(
            input_ids=torch.as_tensor(ragged_batch["tokens"], dtype=torch.long),
            attention_mask=torch.as_tensor(ragged_batch["mask"], dtype=torch.long),
            position_ids=torch.as_tensor(ragged_batch["positions"], dtype=torch.long),
        ).logits[:, 0].numpy()

    mask = jnp.asarray(ragged_batch["mask"])
    hidden, _ = forward_jit(
        params, jnp.asarray(ragged_batch["tokens"]), jnp.asarray(ragged_batch["positions"]),
        mask, config=config,
    )
    scores = np.asarray(jax.jit(sequence_scores)(params, hidden, mask))
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-5)

    save_pretrained(tmp_path, config, params)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["Qwen2ForSequenceClassification"]
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        again = reloaded(
            input_ids=torch.as_tensor(ragged_batch["tokens"], dtype=torch.long),
            attention_mask=torch.as_tensor(ragged_batch["mask"], dtype=torch.long),
            position_ids=torch.as_tensor(ragged_batch["positions"], dtype=torch.long),
        ).logits[:, 0].numpy()
    np.testing.assert_allclose(again, expected, rtol=1e-6, atol=1e-7)


def test_bfloat16_load_casts_and_stays_close(hf_checkpoint, ragged_batch, torch_forward):
    path, model = hf_checkpoint("qwen2_tied")
    config, params = load_pretrained(path, dtype="bfloat16")
    assert (config.param_dtype, config.dtype) == ("bfloat16", "bfloat16")
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(params))

    valid = ragged_batch["mask"].astype(bool)
    expected = torch_forward(model, ragged_batch)[valid]
    actual = _jrl_logits(params, config, ragged_batch)
    assert actual.dtype == np.float32  # logits are float32 whatever the compute dtype
    assert _relative_error(actual[valid], expected) < 5e-2


def test_float32_params_with_bfloat16_compute(hf_checkpoint, ragged_batch, torch_forward):
    path, model = hf_checkpoint("qwen3_tied")
    config, params = load_pretrained(path, config_overrides={"dtype": "bfloat16"})
    assert params["embed"]["embedding"].dtype == jnp.float32
    config32 = dataclasses.replace(config, dtype="float32")

    valid = ragged_batch["mask"].astype(bool)
    expected = torch_forward(model, ragged_batch)[valid]
    assert _relative_error(_jrl_logits(params, config32, ragged_batch)[valid], expected) < 1e-4
    assert _relative_error(_jrl_logits(params, config, ragged_batch)[valid], expected) < 5e-2


def test_bfloat16_checkpoint_loads_as_float32(hf_checkpoint, ragged_batch, torch_forward, tmp_path):
    """Released checkpoints are stored in bfloat16; loading upcasts them exactly."""
    _, model = hf_checkpoint("qwen2_tied")
    bf16_model = copy.deepcopy(model).to(torch.bfloat16)
    bf16_model.save_pretrained(tmp_path)
    config, params = load_pretrained(tmp_path, dtype="float32")
    assert params["layers"]["attn"]["q_proj"]["kernel"].dtype == jnp.float32

    # The reference keeps float32 RoPE buffers (which .to(bfloat16) would round) and
    # takes the bfloat16-rounded weights.
    reference = copy.deepcopy(model)
    reference.load_state_dict({k: v.float() for k, v in bf16_model.state_dict().items()})
    valid = ragged_batch["mask"].astype(bool)
    expected = torch_forward(reference, ragged_batch)[valid]
    assert _relative_error(_jrl_logits(params, config, ragged_batch)[valid], expected) < 1e-4
