"""RL with LoRA: only the adapters train, the reference is the frozen base with adapters
off (no second copy), checkpoints hold the adapters alone, resume is bit-identical, and
the config keys are checked before anything is built."""


import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.errors import ConfigError
from jrl.models import lora
from jrl.rl import logprobs
from jrl.rl.trainer import RLTrainer
from jrl.train import run
from tests.rl.test_trainer_resume import _final_state, _metrics
from tests.tiny import tiny_config, tiny_hf_checkpoint, trainer_parts

_LORA = {"model.lora_rank": 4, "model.lora_alpha": 8.0, "actor.optim.lr": 1e-2,
         "actor.use_kl_loss": True, "actor.kl_loss_coef": 0.01}


def _alternating_reward(data_source, solution_str, ground_truth, extra_info):
    """1 for responses of even length, else 0: rewards that vary within a group, so the
    advantages (and the adapters' gradients) are not zero."""
    return float(len(solution_str) % 2 == 0)


def test_only_the_adapters_train_and_the_reference_is_the_base(tmp_path):
    config = tiny_config(**_LORA, **{"trainer.total_training_steps": 3, "trainer.save_freq": 3})
    summary = run(config, str(tmp_path), reward_fn=_alternating_reward)
    assert summary["step"] == 3
    state = _final_state(str(tmp_path), 3)
    # The checkpoint holds the adapters (and their optimizer state), no base weights.
    actor = state["actor"]["params"]
    assert set(actor) == {"layers"}
    assert set(actor["layers"]["attn"]) == {"q_proj_lora", "k_proj_lora", "v_proj_lora",
                                            "o_proj_lora"}
    leaves = jax.tree.leaves(actor)
    assert all(k.endswith("_lora") for group in actor["layers"].values() for k in group)
    # b started at zero; after three updates the adapters moved.
    b = np.asarray(actor["layers"]["attn"]["q_proj_lora"]["b"])
    assert np.abs(b).max() > 0
    assert len(leaves) == 2 * 7
    records = _metrics(str(tmp_path))
    assert all(np.isfinite(r["actor/pg_loss"]) and np.isfinite(r["actor/kl_loss"])
               for r in records)


def test_trainer_keeps_one_base_and_its_reference_log_probs_are_the_base_models(tmp_path):
    config = tiny_config(**_LORA)
    s, model, params, tokenizer, _, _, sharder = trainer_parts(config)
    trainer = RLTrainer(s, model, params, tokenizer, [], [], lambda *a, **k: 0.0,
                        str(tmp_path), 0, sharder=sharder)
    try:
        base, adapters = lora.split(params)
        assert trainer.ref_params is trainer.frozen  # one copy
        chex.assert_trees_all_equal_structs(trainer.frozen, base)
        chex.assert_trees_all_equal_structs(trainer.state.actor.params, adapters)
        # The reference log-probs are those of the base model without adapters.
        rng = np.random.default_rng(0)
        ids = jnp.asarray(rng.integers(3, model.vocab_size, (2, 4)), jnp.int32)
        resp = jnp.asarray(rng.integers(3, model.vocab_size, (2, 3)), jnp.int32)
        ones4, ones3 = jnp.ones((2, 4), jnp.int32), jnp.ones((2, 3), jnp.int32)
        plain = lora.without(model)
        want, _ = logprobs.response_log_probs(base, ids, ones4, resp, ones3, config=plain)
        got, _ = logprobs.response_log_probs(trainer.ref_params, ids, ones4, resp, ones3,
                                             config=plain)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        # Fresh adapters: the actor is the base.
        actor, _ = logprobs.response_log_probs(trainer.actor_params(), ids, ones4, resp,
                                               ones3, config=model)
        np.testing.assert_allclose(actor, want, rtol=1e-5, atol=1e-5)
    finally:
        trainer.close()


def test_resume_with_lora_is_bit_identical(tmp_path):
    config = tiny_config(**_LORA, **{"trainer.total_training_steps": 4,
                                     "trainer.save_freq": 2, "trainer.test_freq": 2})
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    run(config, straight)
    assert run(config, resumed, exit_after_steps=2)["step"] == 2
    assert run(config, resumed)["step"] == 4
    chex.assert_trees_all_equal(_final_state(straight, 4), _final_state(resumed, 4))
    assert _metrics(straight) == _metrics(resumed)


@pytest.mark.parametrize("key,value,message", [
    ("model.lora_rank", -2, "model.lora_rank: must be an integer >= 0"),
    ("model.lora_alpha", 0.0, "model.lora_alpha: must be > 0"),
    ("model.target_modules", "q_proj,attn", "model.target_modules: attn; choose"),
])
def test_bad_lora_keys_are_named(tmp_path, key, value, message):
    config = tiny_config(**{**_LORA, key: value})
    with pytest.raises(ConfigError, match=message):
        trainer_parts(config)


def test_lora_run_from_a_hf_checkpoint_exports_merged_weights_and_a_peft_adapter(tmp_path):
    """From a HF checkpoint (no adapters in it: fresh ones, B = 0) a LoRA run exports the
    merged model and the adapters; the merged weights equal base + A B alpha / r."""
    from jrl.models import hf

    source = tmp_path / "source"
    model, params = tiny_hf_checkpoint(source)
    summary = run(tiny_config(**_LORA, **{"model.path": str(source)}), str(tmp_path / "run"),
                  reward_fn=_alternating_reward)
    _, exported = hf.load_pretrained(summary["hf_export"])
    adapter_config, adapters = lora.load_peft(summary["peft_adapter"], model)
    assert adapter_config.lora_rank == 4 and adapter_config.lora_alpha == 8.0
    up = adapters["layers"]["mlp"]["up_proj_lora"]
    delta = np.einsum("ldr,lrf->ldf", np.asarray(up["a"]), np.asarray(up["b"])) * 8.0 / 4
    assert np.abs(delta).max() > 1e-4  # the adapters trained
    before = np.asarray(params["layers"]["mlp"]["up_proj"]["kernel"])
    after = np.asarray(exported["layers"]["mlp"]["up_proj"]["kernel"])
    # The base is kept in the compute dtype (float32 here), so the merge is exact to rounding.
    np.testing.assert_allclose(after, before + delta, rtol=1e-5, atol=1e-6)
