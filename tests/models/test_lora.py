"""LoRA adapters: config checks, split/combine, a fresh adapter changes nothing, merging,
and PEFT files that `peft` loads onto the transformers base with jrl's logits (float32)."""

import dataclasses
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jrl.errors import CheckpointError, ConfigError
from jrl.models import ModelConfig, forward_logits, init_params, load_pretrained, lora
from jrl.models import hf as hf_lib

forward_logits_jit = jax.jit(forward_logits, static_argnames="config")


def _logits(params, config, batch):
    logits, _ = forward_logits_jit(params, jnp.asarray(batch["tokens"]),
                                   jnp.asarray(batch["positions"]),
                                   jnp.asarray(batch["mask"]), config=config)
    return np.asarray(logits)


def _randomise_b(params, seed, scale=0.2):
    """The adapters' `b` drawn at random (a fresh adapter's is zero and would test nothing)."""
    base, adapters = lora.split(params)
    rng = np.random.default_rng(seed)

    def fill(path, x):
        if path[-1].key == "b":
            return jnp.asarray(rng.normal(0, scale, x.shape), x.dtype)
        return x

    return lora.combine(base, jax.tree_util.tree_map_with_path(fill, adapters))


def test_config_checks_and_targets():
    base = ModelConfig.preset("tiny")
    assert base.lora_rank == 0 and base.lora_targets == ()
    assert dataclasses.replace(base, lora_rank=8).lora_targets == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert dataclasses.replace(base, lora_rank=8, lora_targets="v_proj, q_proj").lora_targets \
        == ("v_proj", "q_proj")
    with pytest.raises(ConfigError, match="lora_targets: qkv_proj; choose 'all-linear'"):
        dataclasses.replace(base, lora_rank=8, lora_targets=("q_proj", "qkv_proj"))
    with pytest.raises(ConfigError, match="lora_rank must be an integer >= 0"):
        dataclasses.replace(base, lora_rank=-1)
    with pytest.raises(ConfigError, match="lora_alpha must be > 0"):
        dataclasses.replace(base, lora_rank=4, lora_alpha=0.0)


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.preset("tiny", lora_rank=4, lora_alpha=8.0)
    return config, jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))


def test_split_combine_and_fresh_adapters(tiny):
    config, params = tiny
    base, adapters = lora.split(params)
    plain = dataclasses.replace(config, lora_rank=0)
    shapes_of = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
    # The base is exactly the tree of the same model without adapters...
    plain_tree = jax.eval_shape(lambda: init_params(plain, jax.random.key(0)))
    assert shapes_of(base) == shapes_of(plain_tree)
    # ...and init_adapters makes the adapters init_params makes.
    assert shapes_of(adapters) == shapes_of(lora.init_adapters(config, jax.random.key(1)))
    assert set(adapters["layers"]["attn"]) == {"q_proj_lora", "k_proj_lora", "v_proj_lora",
                                               "o_proj_lora"}
    assert adapters["layers"]["attn"]["o_proj_lora"]["a"].shape == (2, 4, 16, 4)
    chex.assert_trees_all_equal(lora.combine(base, adapters), params)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(adapters))
    b_leaves = [v["b"] for group in adapters["layers"].values() for v in group.values()]
    assert all(float(jnp.abs(b).max()) == 0 for b in b_leaves)


def test_fresh_adapter_changes_nothing_and_merge_matches(tiny, ragged_batch):
    config, params = tiny
    base, _ = lora.split(params)
    plain = dataclasses.replace(config, lora_rank=0)
    np.testing.assert_array_equal(_logits(params, config, ragged_batch),
                                  _logits(base, plain, ragged_batch))
    trained = _randomise_b(params, seed=1)
    adapted = _logits(trained, config, ragged_batch)
    assert np.abs(adapted - _logits(base, plain, ragged_batch)).max() > 1e-2
    merged_config, merged = lora.merge(trained, config)
    assert merged_config.lora_rank == 0 and not lora.split(merged)[1]
    np.testing.assert_allclose(_logits(merged, merged_config, ragged_batch), adapted,
                               rtol=1e-5, atol=1e-5)


def test_peft_loads_jrl_adapters_onto_the_transformers_base(hf_checkpoint, ragged_batch,
                                                            torch_forward, tmp_path):
    """jrl's exported adapter, loaded by `peft` onto the HF base, gives jrl's logits."""
    peft = pytest.importorskip("peft")
    path, _ = hf_checkpoint("qwen2_untied")
    config, base = load_pretrained(path)
    config = dataclasses.replace(config, lora_rank=4, lora_alpha=16.0,
                                 lora_targets=("q_proj", "v_proj", "o_proj", "down_proj"))
    params = _randomise_b(lora.combine(base, lora.init_adapters(config, jax.random.key(2))),
                          seed=3)
    lora.save_peft(params, config, tmp_path / "adapter", base_model_name_or_path=str(path))
    spec = json.loads((tmp_path / "adapter" / lora.ADAPTER_CONFIG).read_text())
    assert spec["r"] == 4 and spec["lora_alpha"] == 16.0 and spec["peft_type"] == "LORA"

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(model, tmp_path / "adapter").eval()
    valid = ragged_batch["mask"].astype(bool)
    expected = torch_forward(peft_model, ragged_batch)[valid]
    actual = _logits(params, config, ragged_batch)[valid]
    rel = np.linalg.norm(actual - expected) / np.linalg.norm(expected)
    assert rel < 1e-4, rel
    base_logits = _logits(base, dataclasses.replace(config, lora_rank=0), ragged_batch)[valid]
    assert np.linalg.norm(base_logits - expected) / np.linalg.norm(expected) > 1e-2

    # And back: load_peft gives the same config and adapters.
    loaded_config, adapters = lora.load_peft(tmp_path / "adapter",
                                             dataclasses.replace(config, lora_rank=0))
    assert loaded_config == config
    chex.assert_trees_all_close(adapters, lora.split(params)[1], rtol=0, atol=0)


def test_bad_peft_directories_and_unmerged_saves_are_refused(tiny, tmp_path):
    config, params = tiny
    with pytest.raises(FileNotFoundError, match="adapter_config.json does not exist"):
        lora.load_peft(tmp_path, config)
    lora.save_peft(params, config, tmp_path / "a")
    spec_path = tmp_path / "a" / lora.ADAPTER_CONFIG
    spec = json.loads(spec_path.read_text())
    spec_path.write_text(json.dumps({**spec, "use_dora": True}))
    with pytest.raises(CheckpointError, match="use_dora .* is not supported"):
        lora.load_peft(tmp_path / "a", config)
    spec_path.write_text(json.dumps({**spec, "target_modules": ["q_proj", "lm_head"]}))
    with pytest.raises(CheckpointError, match="target_modules .*lm_head"):
        lora.load_peft(tmp_path / "a", config)
    spec_path.write_text(json.dumps({**spec, "r": 8}))
    with pytest.raises(CheckpointError, match=r"lora_A.weight has shape \(4, 64\), expected"):
        lora.load_peft(tmp_path / "a", config)
    with pytest.raises(ValueError, match="LoRA adapters; merge them"):
        hf_lib.save_pretrained(tmp_path / "hf", config, params)


def test_restart_folds_the_adapters_in_and_starts_fresh_ones(tiny, ragged_batch):
    """After a warm start that trained adapters too, `restart` keeps the function and
    zeroes the adapters, so the frozen base (the reference) is the warm-started model."""
    config, params = tiny
    trained = _randomise_b(params, seed=4)
    restarted = lora.restart(trained, config, jax.random.key(5))
    np.testing.assert_allclose(_logits(restarted, config, ragged_batch),
                               _logits(trained, config, ragged_batch), rtol=1e-5, atol=1e-5)
    base, adapters = lora.split(restarted)
    assert all(float(jnp.abs(v["b"]).max()) == 0
               for group in adapters["layers"].values() for v in group.values())
    np.testing.assert_allclose(_logits(base, lora.without(config), ragged_batch),
                               _logits(trained, config, ragged_batch), rtol=1e-5, atol=1e-5)


def test_lora_dots_saveable_keeps_one_output_per_projection(tiny, ragged_batch, monkeypatch):
    """With LoRA, `remat="dots_saveable"` saves each projection's summed output and the
    rank-r `x A` (not `x W` and `(x A) B` apart): same gradients as no remat, and less
    scratch memory than the generic dots policy on the same model."""
    from jrl.models import transformer

    config, params = tiny
    trained = _randomise_b(params, seed=2)
    base, adapters = lora.split(trained)
    batch = {k: jnp.asarray(np.tile(v, (4, 1))) for k, v in ragged_batch.items()}

    def grad_fn(remat):
        cfg = dataclasses.replace(config, remat=remat)

        def loss(adapters):
            logits, _ = forward_logits(lora.combine(base, adapters), batch["tokens"],
                                       batch["positions"], batch["mask"], config=cfg)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 3] * batch["mask"])

        return jax.jit(jax.grad(loss))

    want = grad_fn("none")(adapters)
    chex.assert_trees_all_close(grad_fn("dots_saveable")(adapters), want, rtol=1e-5, atol=1e-7)

    def scratch_bytes():
        return grad_fn("dots_saveable").lower(adapters).compile().memory_analysis() \
            .temp_size_in_bytes

    by_name = scratch_bytes()
    monkeypatch.setattr(transformer, "_LORA_DOTS_SAVEABLE", jax.checkpoint_policies.dots_saveable)
    generic = scratch_bytes()
    assert by_name < generic
