"""LoRA on the critic (adapters and a value head on the actor's frozen base), merged vs
unmerged LoRA rollouts, the new config keys' errors, and the LoRA base built in the
compute dtype.

Golden values come from independent computations: the plain model (no adapters) run on
the base, value heads applied in numpy, kernels merged by hand in numpy."""

import dataclasses
import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.app import experiment
from jrl.config import settings
from jrl.errors import ConfigError
from jrl.models import ModelConfig, init_params, lora, transformer
from jrl.rl import logprobs, step, types, update
from jrl.rl.trainer import RLTrainer
from jrl.rollout import sampler
from jrl.train import run
from tests.rl.test_trainer_lora import _LORA
from tests.rl.test_trainer_resume import _final_state, _metrics
from tests.tiny import tiny_config, tiny_hf_checkpoint, trainer_parts

# The critic's adapters target other projections, with another rank and alpha, than the
# actor's (all-linear, r = 4, alpha = 8): the critic's own settings must be the ones used.
_CRITIC_TARGETS = ("q_proj", "v_proj", "up_proj")
_CRITIC = {**_LORA, "algorithm.adv_estimator": "gae", "critic.model.lora_rank": 2,
           "critic.model.lora_alpha": 4.0,
           "critic.model.target_modules": ",".join(_CRITIC_TARGETS),
           "critic.optim.lr": 1e-2}


def _score(data_source, solution_str, ground_truth, extra_info=None):
    """A reward that varies between responses (so advantages and returns do)."""
    return float(len(solution_str) % 2) + 0.25 * solution_str.count("1")


def _np(tree):
    return jax.tree.map(lambda x: np.array(x), tree)


def _keys(tree, prefix=()):
    """Every leaf's path as a tuple of keys."""
    out = set()
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _keys(value, prefix + (key,))
        else:
            out.add(prefix + (key,))
    return out


def _critic_adapter_paths():
    groups = {"q_proj": "attn", "v_proj": "attn", "up_proj": "mlp"}
    return {("layers", groups[n], n + "_lora", w) for n in _CRITIC_TARGETS for w in ("a", "b")}


def _values_by_hand(base, value_head, model, prompt_ids, prompt_mask, responses,
                    response_mask):
    """The values of the frozen base's backbone through `value_head`, in numpy: the plain
    model (no adapters at all) gives the hidden states before each response token."""
    tokens = np.concatenate([prompt_ids, responses], 1)
    mask = np.concatenate([prompt_mask, response_mask], 1)
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    hidden, _ = transformer.forward(base, jnp.asarray(tokens, jnp.int32),
                                    jnp.asarray(positions, jnp.int32),
                                    jnp.asarray(mask, jnp.int32), config=lora.without(model))
    p, r = prompt_ids.shape[1], responses.shape[1]
    hidden = np.asarray(hidden, np.float64)[:, p - 1:p + r - 1]
    kernel = np.asarray(value_head["kernel"], np.float64)
    bias = np.asarray(value_head["bias"], np.float64)
    return (hidden @ kernel + bias)[..., 0]


def _random_rollout(vocab, batch=4, prompt_len=4, response_len=3, seed=0):
    rng = np.random.default_rng(seed)
    # Two samples per prompt, as rollouts lay them out (consecutive rows, same prompt).
    prompt_ids = np.repeat(rng.integers(3, vocab, (batch // 2, prompt_len)), 2, 0).astype(np.int32)
    prompt_mask = np.ones((batch, prompt_len), np.int32)
    prompt_mask[2:4, :2] = 0  # left padding
    prompt_ids[2:4, :2] = 0
    responses = rng.integers(3, vocab, (batch, response_len)).astype(np.int32)
    response_mask = np.ones((batch, response_len), np.int32)
    response_mask[2, 2:] = 0  # right padding
    responses[2, 2:] = 0
    return prompt_ids, prompt_mask, responses, response_mask


# -- 1. critic LoRA ---------------------------------------------------------------------------


def test_critic_lora_state_is_adapters_and_a_value_head_on_the_frozen_base(tmp_path):
    config = tiny_config(**_CRITIC)
    s, model, params, tokenizer, _, _, sharder = trainer_parts(config)
    assert s.critic.lora_rank == 2 and s.critic.lora_alpha == 4.0
    assert s.critic.lora_targets == _CRITIC_TARGETS
    critic_model = step.critic_model(model, s)
    assert (critic_model.lora_rank, critic_model.lora_alpha, critic_model.lora_targets) == (
        2, 4.0, _CRITIC_TARGETS)
    assert lora.without(critic_model) == dataclasses.replace(lora.without(model), lora_alpha=4.0)
    trainer = RLTrainer(s, model, params, tokenizer, [], [], _score, str(tmp_path), 0,
                        sharder=sharder)
    try:
        base, _ = lora.split(params)
        chex.assert_trees_all_equal(trainer.frozen, base)
        critic = trainer.state.critic.params
        # Only the critic's adapters (its own targets and rank) and the value head train.
        assert set(critic) == {"layers", "value_head"}
        assert _keys(critic) == _critic_adapter_paths() | {("value_head", "kernel"),
                                                           ("value_head", "bias")}
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(critic))
        num_layers, d = model.num_layers, model.hidden_size
        q = critic["layers"]["attn"]["q_proj_lora"]
        assert q["a"].shape == (num_layers, d, 2)
        assert q["b"].shape == (num_layers, 2, model.num_heads, model.head_dim)
        assert critic["layers"]["mlp"]["up_proj_lora"]["b"].shape == (
            num_layers, 2, model.intermediate_size)
        assert critic["value_head"]["kernel"].shape == (d, 1)
        assert all(float(jnp.abs(v["b"]).max()) == 0
                   for g in critic["layers"].values() for v in g.values())
        # The optimizer state is over the trained part alone (no base kernels).
        opt_leaves = jax.tree.leaves(trainer.state.critic.opt_state)
        assert sum(x.size for x in opt_leaves) < 4 * sum(x.size for x in jax.tree.leaves(critic))

        # At init the critic's values are the frozen base's backbone through the value head.
        seq = _random_rollout(model.vocab_size)
        want = _values_by_hand(base, critic["value_head"], model, *seq)
        batch = types.Rollout(*(jnp.asarray(x) for x in seq))
        exp = trainer.programs.forward(trainer.state, trainer.ref_params, batch, trainer.frozen)
        np.testing.assert_allclose(np.asarray(exp.values), want, rtol=1e-5, atol=1e-5)
        # ...and do not depend on the actor's adapters (the critic is not on the actor).
        actor = _randomise_b(trainer.state.actor.params, seed=1)
        moved = dataclasses.replace(trainer.state, actor=dataclasses.replace(
            trainer.state.actor, params=actor))
        exp = trainer.programs.forward(moved, trainer.ref_params, batch, trainer.frozen)
        np.testing.assert_allclose(np.asarray(exp.values), want, rtol=1e-5, atol=1e-5)
        # With nonzero critic adapters, the values are those of the plain model whose
        # kernels are base + (alpha / r) A B (the critic's r and alpha, merged by hand).
        critic = _randomise_b(critic, seed=2)
        state = dataclasses.replace(trainer.state, critic=dataclasses.replace(
            trainer.state.critic, params=critic))
        exp = trainer.programs.forward(state, trainer.ref_params, batch, trainer.frozen)
        merged = _merge_by_hand(_np(base), critic, rank=2, alpha=4.0, targets=_CRITIC_TARGETS)
        adapted = _values_by_hand(merged, critic["value_head"], model, *seq)
        assert np.abs(adapted - want).max() > 1e-3  # the adapters matter
        np.testing.assert_allclose(np.asarray(exp.values), adapted, rtol=1e-4, atol=1e-5)
    finally:
        trainer.close()


def test_a_short_run_moves_the_critic_adapters_and_head_not_the_base(tmp_path):
    config = tiny_config(**_CRITIC)
    s, model, params, tokenizer, _, _, sharder = trainer_parts(config)
    train_rows, _ = experiment.build_data(settings.experiment_from_config(config), tokenizer)
    trainer = RLTrainer(s, model, params, tokenizer, train_rows, [], _score, str(tmp_path), 0,
                        sharder=sharder)
    try:
        critic = trainer.state.critic.params
        base_before = _np(trainer.frozen)
        head_before = _np(critic["value_head"])
        a_before = np.array(critic["layers"]["attn"]["q_proj_lora"]["a"])
        trainer.fit(val_batch_size=8)
        assert trainer.step == 2
        critic = trainer.state.critic.params
        assert _keys(critic) == _critic_adapter_paths() | {("value_head", "kernel"),
                                                           ("value_head", "bias")}
        for group in critic["layers"].values():
            for adapter in group.values():
                assert np.abs(np.asarray(adapter["b"])).max() > 0
        assert np.abs(np.asarray(critic["layers"]["attn"]["q_proj_lora"]["a"]) - a_before
                      ).max() > 0
        assert np.abs(np.asarray(critic["value_head"]["kernel"]) - head_before["kernel"]
                      ).max() > 0
        chex.assert_trees_all_equal(_np(trainer.frozen), base_before)
        # The actor trained its own adapters too.
        b = trainer.state.actor.params["layers"]["attn"]["q_proj_lora"]["b"]
        assert np.abs(np.asarray(b)).max() > 0
    finally:
        trainer.close()


# -- 2. resume with actor and critic LoRA -----------------------------------------------------


def test_ppo_resume_with_actor_and_critic_lora_is_bit_identical(tmp_path):
    config = tiny_config(**_CRITIC, **{"trainer.total_training_steps": 4,
                                       "trainer.save_freq": 2, "trainer.test_freq": 2})
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    run(config, straight)
    assert run(config, resumed, exit_after_steps=2)["step"] == 2
    second = run(config, resumed)
    assert second["resumed"] and second["step"] == 4
    final = _final_state(straight, 4)
    chex.assert_trees_all_equal(final, _final_state(resumed, 4))
    assert _metrics(straight) == _metrics(resumed)
    # The checkpoint holds the critic's adapters and value head, no base weights.
    critic = final["critic"]["params"]
    assert _keys(critic) == _critic_adapter_paths() | {("value_head", "kernel"),
                                                       ("value_head", "bias")}
    assert np.abs(np.asarray(critic["layers"]["mlp"]["up_proj_lora"]["b"])).max() > 0
    records = _metrics(straight)
    assert all(np.isfinite(r["critic/vf_loss"]) for r in records)


# -- 3. merged vs unmerged rollouts -----------------------------------------------------------


def _randomise_b(adapters, seed, scale=0.2):
    """Adapters with random `b` (a fresh adapter's is zero and would test nothing)."""
    rng = np.random.default_rng(seed)

    def fill(path, x):
        if path[-1].key == "b":
            return jnp.asarray(rng.normal(0, scale, x.shape), x.dtype)
        return x

    return jax.tree_util.tree_map_with_path(fill, adapters)


_GROUPS = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def _merge_by_hand(base, adapters, *, rank, alpha, targets):
    """numpy: each targeted kernel + (alpha / rank) A B (float64, cast back)."""
    out = jax.tree.map(lambda x: np.array(x), base)
    for name in targets:
        group = _GROUPS[name]
        kernel = out["layers"][group][name]["kernel"]
        ad = adapters["layers"][group][name + "_lora"]
        a, b = np.asarray(ad["a"], np.float64), np.asarray(ad["b"], np.float64)
        num_layers = a.shape[0]
        delta = np.stack([a[i].reshape(-1, rank) @ b[i].reshape(rank, -1)
                          for i in range(num_layers)]) * (alpha / rank)
        out["layers"][group][name]["kernel"] = (
            kernel.astype(np.float64) + delta.reshape(kernel.shape)).astype(kernel.dtype)
    return out


@pytest.fixture(scope="module")
def adapted():
    """A tiny float32 model with LoRA (r = 4, alpha = 8, all-linear) and random `b`."""
    model = ModelConfig.preset("tiny", lora_rank=4, lora_alpha=8.0, num_layers=2,
                               eos_token_ids=(2,), pad_token_id=0)
    params = jax.jit(init_params, static_argnums=0)(model, jax.random.key(0))
    base, adapters = lora.split(params)
    return model, base, _randomise_b(adapters, seed=0)


def test_merged_kernels_are_base_plus_scaled_a_b(adapted):
    model, base, adapters = adapted
    merged_model = dataclasses.replace(model, lora_rollout="merged")
    config, merged = step.sampling_params(lora.combine(base, adapters), merged_model)
    assert config.lora_rank == 0 and config.lora_targets == ()
    assert lora.split(merged)[1] == {}  # no adapters left
    want = _merge_by_hand(base, adapters, rank=4, alpha=8.0, targets=model.lora_targets)
    for name in model.lora_targets:
        group = _GROUPS[name]
        got = np.asarray(merged["layers"][group][name]["kernel"])
        before = np.asarray(base["layers"][group][name]["kernel"])
        assert np.abs(got - before).max() > 1e-3
        np.testing.assert_allclose(got, want["layers"][group][name]["kernel"],
                                   rtol=1e-6, atol=1e-6)
    # Everything else (embedding, norms, biases) is the base as is.
    chex.assert_trees_all_close(_np(merged), want, rtol=1e-6, atol=1e-6)
    untouched = lambda tree: {k: v for k, v in tree.items() if k != "layers"} | {
        "norms": (tree["layers"]["attn_norm"], tree["layers"]["mlp_norm"]),
        "biases": {n: tree["layers"]["attn"][n]["bias"] for n in ("q_proj", "k_proj", "v_proj")}}
    chex.assert_trees_all_equal(untouched(_np(merged)), untouched(_np(base)))
    # Unmerged: the same config and the adapters kept.
    unmerged_model = dataclasses.replace(model, lora_rollout="unmerged")
    config, params = step.sampling_params(lora.combine(base, adapters), unmerged_model)
    assert config is unmerged_model
    chex.assert_trees_all_equal(lora.split(params)[1], adapters)


def test_merged_and_unmerged_rollouts_sample_the_same_tokens_and_log_probs(adapted):
    model, base, adapters = adapted
    sampling = sampler.SamplingConfig(n=2, max_new_tokens=6, temperature=1.0,
                                      stop_token_ids=(), pad_token_id=0)
    prompt_ids, prompt_mask, _, _ = _random_rollout(model.vocab_size, prompt_len=5)
    key = jax.random.key(7)
    outs = {}
    for mode in ("merged", "unmerged"):
        m = dataclasses.replace(model, lora_rollout=mode)
        config, params = step.sampling_params(lora.combine(base, adapters), m)
        outs[mode] = sampler.generate(params, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask),
                                      key, sampling, config=config)
    merged, unmerged = outs["merged"], outs["unmerged"]
    np.testing.assert_array_equal(np.asarray(merged.responses), np.asarray(unmerged.responses))
    np.testing.assert_allclose(np.asarray(merged.rollout_log_probs),
                               np.asarray(unmerged.rollout_log_probs), rtol=0, atol=1e-4)
    # Both are the log-probs of the plain model with the kernels merged by hand.
    hand = _merge_by_hand(base, adapters, rank=4, alpha=8.0, targets=model.lora_targets)
    want, _ = logprobs.response_log_probs(
        hand, unmerged.prompt_ids, unmerged.prompt_mask, unmerged.responses,
        unmerged.response_mask, config=lora.without(model))
    np.testing.assert_allclose(np.asarray(unmerged.rollout_log_probs), np.asarray(want),
                               rtol=0, atol=1e-4)
    # The adapters matter: the base alone samples something else.
    plain = sampler.generate(base, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask), key,
                             sampling, config=lora.without(model))
    assert not np.array_equal(np.asarray(plain.rollout_log_probs),
                              np.asarray(unmerged.rollout_log_probs))


def test_step_generate_merged_equals_unmerged(adapted):
    """The trainer's program (`step.generate` on a state of adapters over a frozen base)."""
    model, base, adapters = adapted
    sampling = sampler.SamplingConfig(n=2, max_new_tokens=6, stop_token_ids=(2,),
                                      pad_token_id=0)
    prompt_ids, prompt_mask, _, _ = _random_rollout(model.vocab_size, prompt_len=5, seed=4)
    state = types.TrainState(step=jnp.int32(0), actor=update.ModelState(adapters, ()),
                             critic=None, kl=None)
    got = {}
    for mode in ("merged", "unmerged"):
        generate = jax.jit(functools.partial(
            step.generate, sampling=sampling,
            model_config=dataclasses.replace(model, lora_rollout=mode)))
        got[mode] = generate(state, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask),
                             jax.random.key(11), base)
    # The same tokens; the sampler's log-probs up to the merge's rounding.
    merged, unmerged = (got[m].replace(rollout_log_probs=None) for m in ("merged", "unmerged"))
    chex.assert_trees_all_equal(merged, unmerged)
    chex.assert_trees_all_close(got["merged"].rollout_log_probs,
                                got["unmerged"].rollout_log_probs, atol=1e-5)


def test_merged_rollout_run_matches_unmerged(tmp_path):
    """A LoRA run with model.lora_rollout=merged repeats the unmerged one (float32)."""
    records = {}
    for mode in ("merged", "unmerged"):
        config = tiny_config(**_LORA, **{"model.lora_rollout": mode,
                                         "trainer.total_training_steps": 3})
        run(config, str(tmp_path / mode))
        records[mode] = _metrics(str(tmp_path / mode))
    assert len(records["merged"]) == 3
    for got, want in zip(records["merged"], records["unmerged"], strict=True):
        assert got.keys() == want.keys()
        for key in ("response_length/mean", "critic/score/mean", "actor/pg_loss",
                    "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            if key in want:
                np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-5,
                                           err_msg=key)


# -- 4. config errors named before anything is built ------------------------------------------


def _settings(config):
    tokenizer = experiment.build_tokenizer(settings.experiment_from_config(config))
    return settings.from_config(config, stop_token_ids=tokenizer.eos_token_ids,
                                pad_token_id=tokenizer.pad_token_id, num_train_rows=64)


@pytest.mark.parametrize("overrides,message", [
    ({"model.lora_rank": 0}, "critic.model.lora_rank: is 2 but model.lora_rank is 0"),
    ({"model.lora_rollout": "bogus"},
     "model.lora_rollout: 'bogus' is not valid; choose one of ['merged', 'unmerged']"),
    ({"critic.model.target_modules": "q_proj,qkv"}, "critic.model.target_modules: qkv; choose"),
    ({"critic.model.lora_rank": -1}, "critic.model.lora_rank: must be an integer >= 0"),
    ({"critic.model.lora_alpha": 0.0}, "critic.model.lora_alpha: must be > 0"),
])
def test_bad_critic_lora_and_rollout_keys_are_named(overrides, message):
    config = tiny_config(**{**_CRITIC, **overrides})
    with pytest.raises(ConfigError, match=re.escape(message)):
        _settings(config)


def test_lora_rollout_is_checked_without_lora_and_read_into_the_model():
    with pytest.raises(ConfigError, match=re.escape("model.lora_rollout: 'bogus'")):
        _settings(tiny_config(**{"model.lora_rollout": "bogus"}))
    config = tiny_config(**_LORA, **{"model.lora_rollout": "merged"})
    _settings(config)
    experiment_settings = settings.experiment_from_config(config)
    model, _ = experiment.build_model(experiment_settings,
                                      experiment.build_tokenizer(experiment_settings))
    assert model.lora_rollout == "merged"
    with pytest.raises(ConfigError, match="lora_rollout='bogus' is not supported"):
        dataclasses.replace(model, lora_rollout="bogus")


# -- 5. the LoRA base in the compute dtype ----------------------------------------------------


def _dtypes(tree):
    return {x.dtype for x in jax.tree.leaves(tree)}


def test_build_model_makes_the_lora_base_in_the_compute_dtype():
    bf16 = {"model.dtype": "bfloat16"}
    config = tiny_config(**_LORA, **bf16)
    experiment_settings = settings.experiment_from_config(config)
    tokenizer = experiment.build_tokenizer(experiment_settings)
    model, params = experiment.build_model(experiment_settings, tokenizer)
    base, adapters = lora.split(params)
    assert model.dtype == "bfloat16" and model.param_dtype == "float32"
    assert _dtypes(base) == {jnp.dtype(jnp.bfloat16)}
    assert _dtypes(adapters) == {jnp.dtype(jnp.float32)}
    # The base is the float32 model's (same seed, no LoRA) rounded to bfloat16.
    _, full = experiment.build_model(settings.experiment_from_config(tiny_config(**bf16)),
                                     tokenizer)
    assert _dtypes(full) == {jnp.dtype(jnp.float32)}
    chex.assert_trees_all_equal(
        _np(base), jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16)), full))
    # A float32 compute dtype keeps a float32 base.
    _, params32 = experiment.build_model(
        settings.experiment_from_config(tiny_config(**_LORA)), tokenizer)
    assert _dtypes(params32) == {jnp.dtype(jnp.float32)}
    # An SFT warm start trains the whole model first: its base stays float32.
    _, sft = experiment.build_model(
        settings.experiment_from_config(tiny_config(**_LORA, **bf16, **{"sft.steps": 2})),
        tokenizer)
    assert _dtypes(sft) == {jnp.dtype(jnp.float32)}


def test_build_model_reads_a_lora_base_in_the_compute_dtype(tmp_path):
    source = tmp_path / "source"
    _, saved = tiny_hf_checkpoint(source)
    config = tiny_config(**_LORA, **{"model.dtype": "bfloat16", "model.path": str(source)})
    experiment_settings = settings.experiment_from_config(config)
    model, params = experiment.build_model(experiment_settings,
                                           experiment.build_tokenizer(experiment_settings))
    assert model.param_dtype == "float32" and model.dtype == "bfloat16"
    base, adapters = lora.split(params)
    assert _dtypes(base) == {jnp.dtype(jnp.bfloat16)}
    assert _dtypes(adapters) == {jnp.dtype(jnp.float32)}
    chex.assert_trees_all_equal(
        _np(base), jax.tree.map(lambda x: np.asarray(jnp.asarray(x).astype(jnp.bfloat16)),
                                saved))


def test_trainer_keeps_a_bfloat16_base_and_float32_adapters_for_actor_and_critic(tmp_path):
    config = tiny_config(**_CRITIC, **{"model.dtype": "bfloat16"})
    s, model, params, tokenizer, _, _, sharder = trainer_parts(config)
    base, _ = lora.split(params)
    trainer = RLTrainer(s, model, params, tokenizer, [], [], _score, str(tmp_path), 0,
                        sharder=sharder)
    try:
        assert _dtypes(trainer.frozen) == {jnp.dtype(jnp.bfloat16)}
        chex.assert_trees_all_equal(_np(trainer.frozen), _np(base))
        assert _dtypes(trainer.state.actor.params) == {jnp.dtype(jnp.float32)}
        assert _dtypes(trainer.state.critic.params) == {jnp.dtype(jnp.float32)}
        seq = _random_rollout(model.vocab_size)
        exp = trainer.programs.forward(trainer.state, trainer.ref_params,
                               types.Rollout(*(jnp.asarray(x) for x in seq)), trainer.frozen)
        # The golden: the float32 plain model on the (bfloat16-rounded) base weights; the
        # critic computes in bfloat16, hence the tolerance.
        want = _values_by_hand(jax.tree.map(lambda x: x.astype(jnp.float32), base),
                               trainer.state.critic.params["value_head"],
                               dataclasses.replace(model, dtype="float32"), *seq)
        assert np.abs(want).max() > 0.05
        np.testing.assert_allclose(np.asarray(exp.values), want, rtol=0, atol=4e-3)
    finally:
        trainer.close()
