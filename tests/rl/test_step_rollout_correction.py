"""Rollout correction inside `step.learn`: the sampler's log-probs against the trainer's.

Both places the correction can apply give the same update: with a separate
old-log-prob pass `learn` weights and rejects on the whole batch before the
advantages; an on-policy update does it from its own log-probs. Hand-made mismatches
check what the weights and rejections do: a uniform IS weight of 1/2 halves the policy
gradient, a rejected row leaves the update as if it had no tokens, and bypass mode is
the plain update with the rollout's log-probs as the old ones.
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import sharding
from jrl.config import settings
from jrl.errors import ConfigError
from jrl.rl import step
from tests.rl.test_step import (
    _ON_POLICY,
    RESPONSE_LENGTHS,
    _experience,
    _learn,
    _rollout,
    _setup,
    _state,
)

_C = "algorithm.rollout_correction"


def _forward(s, model, params, rollout):
    return jax.jit(lambda st, ro: step.forward(
        st, None, ro, settings=s, model_config=model))(
        _state(s, params), rollout)


def _with_rollout_log_probs(rollout, shift):
    """The rollout with the sampler's log-probs set to `old - shift` (old: -1, as
    `_experience` sets it), `shift` per row."""
    shift = jnp.asarray(shift, jnp.float32)[:, None]
    return rollout.replace(rollout_log_probs=(-1.0 - shift) * rollout.response_mask)


def test_on_policy_and_separate_pass_agree_on_mismatch_and_token_is():
    """The update's own log-probs give the same mismatch metrics, IS weights and new
    parameters as a separate old-log-prob pass (float noise apart)."""
    over = {**_ON_POLICY, f"{_C}.rollout_is": "token", f"{_C}.rollout_is_threshold": "1.5"}
    _, s, model, params = _setup(**over)
    _, s_pass, _, _ = _setup(**over, **{"actor.reuse_update_log_probs": False})
    assert s.actor.on_policy and not s_pass.actor.on_policy
    rollout = _rollout()
    old = _forward(s_pass, model, params, rollout).old_log_probs
    # The sampler saw each row's tokens as 1.3x (or 0.6x) likelier than the trainer does.
    shift = np.log([1.3, 0.6] * 4)
    rollout = rollout.replace(rollout_log_probs=(old + shift[:, None]) * rollout.response_mask)
    fields = {k: getattr(_experience(rollout), k) for k in ("token_level_scores", "uid")}
    results = []
    for s_ in (s, s_pass):
        exp = _forward(s_, model, params, rollout).replace(**fields)
        results.append(_learn(s_, model, _state(s_, params), exp))
    (new, m), (new_pass, m_pass) = results
    # KL(rollout || training) by k1: the token-weighted mean of the shift.
    lengths = np.asarray(RESPONSE_LENGTHS)
    assert m["rollout_corr/kl"] == pytest.approx((lengths * shift).sum() / lengths.sum(),
                                                 abs=1e-5)
    # Weights 1/1.3 and 1/0.6: the 9 tokens of the odd rows are above the threshold 1.5.
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(9 / 20, abs=1e-6)
    for key in ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/rollout_is_mean",
                "training/rollout_probs_diff_mean", "actor/pg_loss", "actor/grad_norm"):
        assert m[key] == pytest.approx(m_pass[key], rel=1e-4, abs=1e-6), key
    chex.assert_trees_all_close(new.actor.params, new_pass.actor.params, rtol=1e-5, atol=1e-6)


def test_a_uniform_is_weight_scales_the_policy_gradient():
    """rollout = old + log 2 on every token: each token's IS weight is exp(-log 2) = 1/2,
    so the policy loss and its gradient halve."""
    rollout = _with_rollout_log_probs(_rollout(), [-np.log(2.0)] * 8)
    _, s_plain, model, params = _setup()
    _, s_is, _, _ = _setup(**{f"{_C}.rollout_is": "token"})
    exp = _experience(rollout)
    _, plain = _learn(s_plain, model, _state(s_plain, params), exp)
    _, weighted = _learn(s_is, model, _state(s_is, params), exp)
    assert weighted["rollout_corr/rollout_is_mean"] == pytest.approx(0.5, rel=1e-6)
    assert weighted["actor/pg_loss"] == pytest.approx(0.5 * plain["actor/pg_loss"], rel=1e-5)
    assert weighted["actor/grad_norm"] == pytest.approx(0.5 * plain["actor/grad_norm"],
                                                        rel=1e-4)


def test_a_rejected_row_leaves_the_update():
    """Row 0's sequence ratio is e^(5 x 3 tokens): its seq_sum_k1 (-15) is far below
    log(1/2); the update is the one where row 0 has no response tokens at all."""
    rollout = _with_rollout_log_probs(_rollout(), [-5.0] + [0.0] * 7)
    _, s, model, params = _setup(**{f"{_C}.rollout_rs": "seq_sum_k1",
                                    f"{_C}.rollout_rs_threshold": "0.5_2"})
    _, s_plain, _, _ = _setup()
    new, m = _learn(s, model, _state(s, params), _experience(rollout))
    dropped = rollout.replace(response_mask=rollout.response_mask.at[0].set(0))
    exp = _experience(rollout).replace(response_mask=dropped.response_mask)
    new_plain, m_plain = _learn(s_plain, model, _state(s_plain, params), exp)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 8)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(3 / 20, rel=1e-5)
    assert m["actor/pg_loss"] == pytest.approx(m_plain["actor/pg_loss"], rel=1e-5, abs=1e-7)
    chex.assert_trees_all_close(new.actor.params, new_plain.actor.params, rtol=1e-6, atol=1e-7)


def test_a_rejected_token_stays_in_the_context_of_the_tokens_after_it():
    """Token-level rejection of row 0's first token takes it out of the loss, not out of
    the context: the update equals the plain one with that token's loss mask 0 and the
    row's attention unchanged, and not the one that drops it from the attention too."""
    rollout = _with_rollout_log_probs(_rollout(), [0.0] * 8)
    rollout = rollout.replace(rollout_log_probs=rollout.rollout_log_probs.at[0, 0].set(-5.0))
    _, s, model, params = _setup(**{f"{_C}.rollout_rs": "token_k1",
                                    f"{_C}.rollout_rs_threshold": "2.0"})
    _, s_plain, _, _ = _setup()
    new, m = _learn(s, model, _state(s, params), _experience(rollout))
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 20, rel=1e-5)
    kept = rollout.response_mask.at[0, 0].set(0)
    results = []
    for attention in (rollout.response_mask, kept):
        exp = _experience(rollout).replace(response_mask=kept, response_attention_mask=attention)
        results.append(_learn(s_plain, model, _state(s_plain, params), exp)[0].actor.params)
    chex.assert_trees_all_close(new.actor.params, results[0], rtol=1e-6, atol=1e-7)
    diff = jax.tree.leaves(jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), *results))
    assert max(float(d) for d in diff) > 1e-5


def test_bypass_mode_takes_the_rollout_log_probs_as_old():
    """bypass_mode with ppo_clip is the plain update with old = the rollout's log-probs,
    and skips the old-log-prob pass; with reinforce the loss is -w A log pi."""
    rollout = _with_rollout_log_probs(_rollout(), np.linspace(-0.3, 0.3, 8))
    _, s, model, params = _setup(**{f"{_C}.bypass_mode": True})
    _, s_plain, _, _ = _setup()
    assert s.actor.skips_old_pass and not s.actor.on_policy
    assert _forward(s, model, params, rollout).old_log_probs is None
    exp = _experience(rollout, old_log_probs=None, entropy=None)
    new, m = _learn(s, model, _state(s, params), exp)
    plain = _experience(rollout, old_log_probs=rollout.rollout_log_probs)
    new_plain, m_plain = _learn(s_plain, model, _state(s_plain, params), plain)
    assert m["actor/pg_loss"] == pytest.approx(m_plain["actor/pg_loss"], rel=1e-5)
    chex.assert_trees_all_close(new.actor.params, new_plain.actor.params, rtol=1e-5, atol=1e-6)

    _, s_rf, _, _ = _setup(**{f"{_C}.bypass_mode": True, f"{_C}.loss_type": "reinforce",
                              f"{_C}.rollout_is": "token", "actor.ppo_mini_batch_size": 4,
                              "actor.ppo_micro_batch_size": 8})  # one micro-batch
    _, m_rf = _learn(s_rf, model, _state(s_rf, params), exp)
    # By hand: log pi from a separate pass at the same parameters, w = min(pi / rollout, 2).
    _, s_pass, _, _ = _setup(**{"actor.reuse_update_log_probs": False})
    log_pi = np.asarray(_forward(s_pass, model, params, rollout).old_log_probs)
    mask = np.asarray(rollout.response_mask, np.float64)
    w = np.minimum(np.exp(log_pi - np.asarray(rollout.rollout_log_probs)), 2.0) * mask
    rewards, _ = step.token_rewards(exp, 0.0, settings=s_rf)
    adv, _ = step.estimate_advantages(exp, rewards, settings=s_rf)
    expected = -(np.asarray(adv) * log_pi * w * mask).sum() / mask.sum()
    assert m_rf["actor/pg_loss"] == pytest.approx(expected, rel=1e-4)
    ppo_kl = ((np.asarray(rollout.rollout_log_probs) - log_pi) * mask).sum() / mask.sum()
    assert m_rf["actor/ppo_kl"] == pytest.approx(ppo_kl, rel=1e-4)


def test_settings_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"^algorithm\.rollout_correction: needs the "):
        _setup(**{f"{_C}.rollout_is": "token", "rollout.do_sample": False})
    with pytest.raises(ConfigError, match=r"^algorithm\.rollout_correction\.rollout_is: per"):
        _setup(**{f"{_C}.rollout_is": "token", "actor.policy_loss.loss_mode": "geo_mean"})
    with pytest.raises(ConfigError, match=r"^rollout\.staleness: must be 0 or 1"):
        _setup(**{"rollout.staleness": 2})
    with pytest.raises(ConfigError, match=r"^rollout\.devices: .*remax"):
        _setup(**{"rollout.devices": 1, "algorithm.adv_estimator": "remax"})
    with pytest.raises(ConfigError, match=r"^rollout\.devices=1: a sampling group needs"):
        sharding.split_devices(1)  # one CPU device here: none would be left to train
    # Rejections and batch normalisation need the whole batch: no on-policy shortcut.
    for key, value in (("rollout_rs", "token_k1"), ("rollout_is_batch_normalize", True)):
        extra = {f"{_C}.rollout_rs_threshold": "2.0"} if key == "rollout_rs" else {}
        s = _setup(**_ON_POLICY, **{f"{_C}.{key}": value}, **extra)[1]
        assert not s.actor.on_policy, key
    assert settings.on_policy(_setup(**_ON_POLICY, **{f"{_C}.rollout_is": "token"})[1])
    s = _setup()[1]
    assert dataclasses.replace(s, staleness=1).staleness == 1


def test_a_preset_fills_the_keys_left_at_their_defaults():
    """`preset` gives verl's named settings; a key set away from its default wins."""
    c = _setup(**{f"{_C}.preset": "bypass_pg_token_icepop"})[1].actor.correction
    assert (c.rollout_is, c.rollout_is_threshold, c.bypass_mode, c.loss_type) == (
        "token", "0.5_5.0", True, "reinforce")
    c = _setup(**{f"{_C}.preset": "decoupled_k3_rs_token_tis",
                  f"{_C}.rollout_rs_threshold": "0.05"})[1].actor.correction
    assert (c.rollout_is, c.rollout_rs, c.rollout_rs_threshold) == ("token", "seq_mean_k3", "0.05")
    with pytest.raises(ConfigError, match=r"^algorithm\.rollout_correction\.preset: 'tis' is "):
        _setup(**{f"{_C}.preset": "tis"})
    with pytest.raises(ConfigError, match=r"^algorithm\.rollout_correction\.rollout_rs: "
                                          r"'sequence' is now 'seq_sum_k1'"):
        _setup(**{f"{_C}.rollout_rs": "sequence", f"{_C}.rollout_rs_threshold": "2.0"})


def test_a_command_line_threshold_stays_a_string(tmp_path):
    """`--config...rollout_rs_threshold=0.5_2` arrives as the string "0.5_2" (Python would
    read the literal 0.5_2 as 0.52): broadcast to a k3 option it is refused by name."""
    import os
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)
    out = subprocess.run(
        [sys.executable, "-m", "jrl.train", "--config=configs/grpo_arith.py",
         f"--workdir={tmp_path}/run", f"--config.{_C}.rollout_rs=token_k1,token_k3",
         f"--config.{_C}.rollout_rs_threshold=0.5_2"],
        cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: {_C}.rollout_rs_threshold: token_k3: '0.5_2': a k2 or k3 option takes one "
        "upper bound, without '_'")
