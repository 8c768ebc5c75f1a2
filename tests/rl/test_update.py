"""The actor update: micro-batch invariance and the non-finite guard."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.config import settings
from jrl.data.tokenizers import CharTokenizer
from jrl.models.config import ModelConfig
from jrl.models.transformer import init_params
from jrl.optim import make_optimizer
from jrl.rl import update
from jrl.train import run
from tests.tiny import tiny_config

_MODEL = ModelConfig.preset("tiny", vocab_size=40, hidden_size=32, intermediate_size=64,
                            num_layers=1, head_dim=8)


def _actor_settings(micro, agg="token-mean"):
    tok = CharTokenizer()
    config = tiny_config(**{"data.train_batch_size": 4, "rollout.n": 2,
                            "actor.ppo_mini_batch_size": 2, "actor.ppo_micro_batch_size": micro,
                            "actor.entropy_coeff": 0.01, "actor.use_kl_loss": True,
                            "actor.loss_agg_mode": agg})
    return settings.from_config(config, stop_token_ids=tok.eos_token_ids,
                                pad_token_id=tok.pad_token_id, num_train_rows=90).actor


def _batch(seed=0, b=8, p=4, r=5):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, r + 1, b)
    response_mask = (np.arange(r)[None] < lengths[:, None]).astype(np.int32)
    prompt_mask = (np.arange(p)[None] >= rng.integers(0, 3, b)[:, None]).astype(np.int32)
    return {
        "prompt_ids": jnp.asarray(rng.integers(3, 40, (b, p)) * prompt_mask, jnp.int32),
        "prompt_mask": jnp.asarray(prompt_mask),
        "responses": jnp.asarray(rng.integers(3, 40, (b, r)) * response_mask, jnp.int32),
        "response_mask": jnp.asarray(response_mask),
        "old_log_probs": jnp.asarray(-rng.random((b, r)) * 3, jnp.float32),
        "ref_log_probs": jnp.asarray(-rng.random((b, r)) * 3, jnp.float32),
        "advantages": jnp.asarray(np.repeat(rng.normal(size=(b, 1)), r, 1), jnp.float32),
    }


def _update(micro, batch, agg="token-mean"):
    actor = _actor_settings(micro, agg)
    params = init_params(_MODEL, jax.random.key(0))
    optimizer = make_optimizer(actor.optim)
    loss_fn = functools.partial(update.actor_loss, model_config=_MODEL, actor=actor,
                                temperature=1.0, chunk_size=2)
    state = update.ModelState(params, optimizer.init(params))
    fn = jax.jit(functools.partial(update.run_updates, loss_fn=loss_fn, optimizer=optimizer,
                                   update=actor.update))
    return fn(state, batch, jax.random.key(1), actor.optim.lr)[:2]


@pytest.mark.parametrize("agg", ["token-mean", "token-sum"])
@pytest.mark.parametrize("micro", [2, 1])
def test_micro_batch_split_gives_same_parameters(micro, agg):
    """Mini-batches of 4 sequences as 1 (micro 4), 2 (micro 2) or 4 (micro 1) micro-batches."""
    batch = _batch()
    whole, whole_metrics = _update(4, batch, agg)
    split, split_metrics = _update(micro, batch, agg)
    chex.assert_trees_all_close(split.params, whole.params, atol=1e-6, rtol=0)
    np.testing.assert_allclose(split_metrics["pg_loss"], whole_metrics["pg_loss"], rtol=1e-5)
    np.testing.assert_allclose(split_metrics["kl_loss"], whole_metrics["kl_loss"], rtol=1e-5)
    # And the update did change the parameters.
    before = init_params(_MODEL, jax.random.key(0))
    assert not np.allclose(before["layers"]["mlp"]["up_proj"]["kernel"],
                           whole.params["layers"]["mlp"]["up_proj"]["kernel"])


def test_non_finite_update_is_skipped():
    batch = _batch()
    batch["advantages"] = batch["advantages"].at[0, 0].set(jnp.nan)
    state, metrics = _update(4, batch)
    before = init_params(_MODEL, jax.random.key(0))
    # The NaN sits in one of the two mini-batches of each epoch: exactly that update is skipped.
    assert float(metrics["nan_skipped"]) == 1.0
    chex.assert_tree_all_finite(state.params)
    assert not jax.tree.all(jax.tree.map(np.array_equal, before, state.params))
    batch["advantages"] = jnp.full_like(batch["advantages"], jnp.inf)
    state, metrics = _update(4, batch)
    assert float(metrics["nan_skipped"]) == 2.0
    chex.assert_trees_all_equal(state.params, before)


def _nan_token_scores(scores, response_mask):
    # Reward functions returning NaN are rejected by the scorer; poison the token scores.
    return np.full(np.shape(response_mask), np.nan, np.float32)


def test_trainer_nan_policy(tmp_path, monkeypatch):
    from jrl.rewards import responses

    monkeypatch.setattr(responses, "place_scores", _nan_token_scores)
    summary = run(tiny_config(), str(tmp_path / "skip"))
    assert summary["step"] == 2
    from jrl.metrics import read_jsonl

    records = read_jsonl(str(tmp_path / "skip" / "metrics.jsonl"))
    assert all(r["actor/nan_skipped_updates"] == 2 for r in records)
    from jrl.rl.trainer import NonFiniteUpdateError

    with pytest.raises(NonFiniteUpdateError, match="step 0: non-finite actor"):
        run(tiny_config(**{"trainer.nan_policy": "raise"}), str(tmp_path / "raise"))


def _packed(actor, budget):
    """The actor's settings with token-budget micro-batches of `budget` tokens."""
    import dataclasses
    return dataclasses.replace(actor, update=dataclasses.replace(actor.update,
                                                                  max_token_len=budget))


@pytest.mark.parametrize("agg,budget", [
    ("token-mean", 9), ("token-mean", 72), ("token-sum", 16), ("seq-mean-token-sum", 16),
    ("seq-mean-token-mean", 16), ("seq-mean-token-sum-norm", 16)])
def test_packed_micro_batches_give_padded_parameters(agg, budget):
    """Token-budget micro-batches (a sequence of 4 + 5 tokens per row at 9, several per
    row at 16, the whole mini-batch in one row at 72) give the padded update's
    parameters, loss terms and per-token log-probs, for every loss aggregation."""
    batch = _batch(3)
    actor = _actor_settings(2, agg)
    params = init_params(_MODEL, jax.random.key(0))
    optimizer = make_optimizer(actor.optim)

    def run_with(settings_):
        loss_fn = functools.partial(update.actor_loss, model_config=_MODEL, actor=settings_,
                                    temperature=1.0, chunk_size=2)
        state = update.ModelState(params, optimizer.init(params))
        fn = jax.jit(functools.partial(update.run_updates, loss_fn=loss_fn,
                                       optimizer=optimizer, update=settings_.update))
        return fn(state, batch, jax.random.key(1), actor.optim.lr)

    padded_state, padded_metrics, _ = run_with(actor)
    packed_state, packed_metrics, _ = run_with(_packed(actor, budget))
    chex.assert_trees_all_close(packed_state.params, padded_state.params, atol=2e-6, rtol=2e-5)
    for key in ("pg_loss", "kl_loss", "entropy_loss", "grad_norm"):
        np.testing.assert_allclose(packed_metrics[key], padded_metrics[key], rtol=2e-5,
                                   err_msg=key)


def test_packed_critic_update_equals_padded():
    """The critic's update over token-budget micro-batches, on-policy (values and GAE
    returns from its own pass, per-token values returned) and off-policy."""
    import dataclasses

    from jrl.models.heads import init_critic_params
    from tests.tiny import tiny_config as config_of

    tok = CharTokenizer()
    config = config_of(**{"data.train_batch_size": 4, "rollout.n": 2,
                          "algorithm.adv_estimator": "gae", "critic.ppo_mini_batch_size": 4,
                          "critic.ppo_micro_batch_size": 4})
    critic = settings.from_config(config, stop_token_ids=tok.eos_token_ids,
                                  pad_token_id=tok.pad_token_id, num_train_rows=90).critic
    batch = _batch(4)
    rng = np.random.default_rng(0)
    batch["token_level_rewards"] = jnp.asarray(rng.normal(size=batch["advantages"].shape),
                                               jnp.float32)
    batch["values"] = jnp.asarray(rng.normal(size=batch["advantages"].shape), jnp.float32)
    batch["returns"] = jnp.asarray(rng.normal(size=batch["advantages"].shape), jnp.float32)
    params = init_critic_params(init_params(_MODEL, jax.random.key(0)), jax.random.key(2))
    optimizer = make_optimizer(critic.optim)
    for on_policy in (True, False):
        base = dataclasses.replace(critic, on_policy=on_policy)
        outs = []
        for budget in (None, 12):
            c = dataclasses.replace(base, update=dataclasses.replace(base.update,
                                                                     max_token_len=budget))
            loss_fn = functools.partial(update.critic_loss, model_config=_MODEL, critic=c,
                                        gamma=0.9, lam=0.8)
            fn = jax.jit(functools.partial(update.run_updates, loss_fn=loss_fn,
                                           optimizer=optimizer, update=c.update))
            outs.append(fn(update.ModelState(params, optimizer.init(params)), batch,
                           jax.random.key(1), c.optim.lr))
        (padded, padded_m, padded_t), (packed, packed_m, packed_t) = outs
        chex.assert_trees_all_close(packed.params, padded.params, atol=2e-6, rtol=2e-5)
        np.testing.assert_allclose(packed_m["vf_loss"], padded_m["vf_loss"], rtol=2e-5)
        mask = np.asarray(batch["response_mask"]) > 0
        if on_policy:
            np.testing.assert_allclose(np.asarray(packed_t["values"])[mask],
                                       np.asarray(padded_t["values"])[mask], rtol=2e-5,
                                       atol=2e-6)
