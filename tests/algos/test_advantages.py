"""Advantage estimators: hand-computed goldens, jit parity, GAE against a Python loop."""

import statistics

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.algos import advantages as adv_lib


def _outcome_rewards(scores, length=4):
    """Token-level rewards with each score at the last of `length` tokens."""
    r = np.zeros((len(scores), length), np.float32)
    r[:, -1] = scores
    return jnp.asarray(r), jnp.ones((len(scores), length), jnp.float32)


class GroupEstimatorTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_grpo_seed_example(self):
        # Group [1, 0, 1]: mean 2/3, unbiased std sqrt(1/3) -> +0.577, -1.155, +0.577.
        rewards, mask = _outcome_rewards([1.0, 0.0, 1.0])
        adv, ret = self.variant(adv_lib.grpo)(rewards, mask, jnp.array([5, 5, 5]))
        std = np.sqrt(1 / 3)
        expected = np.array([1 / 3, -2 / 3, 1 / 3]) / (std + 1e-6)
        np.testing.assert_allclose(adv, np.repeat(expected[:, None], 4, 1), rtol=1e-5)
        np.testing.assert_allclose(adv[:, 0], [0.57735, -1.1547, 0.57735], atol=1e-4)
        chex.assert_trees_all_close(adv, ret)

    @chex.variants(with_jit=True, without_jit=True)
    def test_grpo_interleaved_ids_and_singletons(self):
        # Groups: id 9 -> rows 0, 2 (scores 1, 3); id 2 -> rows 1, 3 (0, 0); id 4 -> row 4 alone.
        rewards, mask = _outcome_rewards([1.0, 0.0, 3.0, 0.0, 2.0])
        mask = mask.at[1, 2:].set(0.0)
        adv, _ = self.variant(adv_lib.grpo)(rewards, mask, jnp.array([9, 2, 9, 2, 4]))
        std9 = statistics.stdev([1.0, 3.0])
        expected = [-1 / (std9 + 1e-6), 0.0, 1 / (std9 + 1e-6), 0.0, 2.0 / (1 + 1e-6)]
        np.testing.assert_allclose(adv[:, 0], expected, rtol=1e-5)
        np.testing.assert_allclose(adv[1], [0.0, 0.0, 0.0, 0.0])  # masked tail stays 0

    @chex.variants(with_jit=True, without_jit=True)
    def test_dr_grpo_no_std(self):
        rewards, mask = _outcome_rewards([1.0, 0.0, 1.0])
        fn = lambda r, m, g: adv_lib.grpo(r, m, g, norm_adv_by_std_in_grpo=False)
        adv, _ = self.variant(fn)(rewards, mask, jnp.array([0, 0, 0]))
        np.testing.assert_allclose(adv[:, 0], [1 / 3, -2 / 3, 1 / 3], rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_rloo(self):
        rewards, mask = _outcome_rewards([1.0, 0.0, 1.0, 1.0, 5.0])
        adv, _ = self.variant(adv_lib.rloo)(rewards, mask, jnp.array([1, 1, 1, 1, 2]))
        # Leave-one-out: 1 - 2/3, 0 - 1, ...; the singleton keeps its score.
        np.testing.assert_allclose(adv[:, 0], [1 / 3, -1.0, 1 / 3, 1 / 3, 5.0], rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_grpo_passk(self):
        rewards, mask = _outcome_rewards([0.2, 0.9, 0.5, 1.0, 1.0])
        adv, _ = self.variant(adv_lib.grpo_passk)(rewards, mask, jnp.array([3, 3, 3, 8, 8]))
        best = (0.9 - 0.5) / (statistics.stdev([0.2, 0.9, 0.5]) + 1e-6)
        np.testing.assert_allclose(adv[:, 0], [0.0, best, 0.0, 0.0, 0.0], rtol=1e-5)

    def test_grpo_passk_needs_pairs(self):
        rewards, mask = _outcome_rewards([0.2, 0.9, 0.5])
        with pytest.raises(ValueError, match="at least 2 samples per group"):
            adv_lib.grpo_passk(rewards, mask, jnp.array([0, 0, 1]))

    @chex.variants(with_jit=True, without_jit=True)
    def test_opo(self):
        rewards = jnp.array([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
        mask = jnp.array([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
        adv, _ = self.variant(adv_lib.opo)(rewards, mask, jnp.array([0, 0]))
        # Baseline (2 * 1 + 4 * 0) / 6 = 1/3.
        np.testing.assert_allclose(adv, [[2 / 3, 2 / 3, 0, 0], [-1 / 3] * 4], rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_gpg(self):
        rewards, mask = _outcome_rewards([1.0, 0.0, 1.0, 0.0])
        adv, _ = self.variant(adv_lib.gpg)(rewards, mask, jnp.array([0, 0, 0, 0]))
        # alpha = 4 / 2 nonzero = 2; mean 0.5.
        np.testing.assert_allclose(adv[:, 0], [1.0, -1.0, 1.0, -1.0], rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_reinforce_plus_plus_baseline(self):
        rewards, mask = _outcome_rewards([1.0, 0.0], length=2)
        fn = self.variant(adv_lib.reinforce_plus_plus_baseline)
        adv, _ = fn(rewards, mask, jnp.array([0, 0]))
        # Centred scores +-0.5 on 4 tokens: mean 0, unbiased var 1/3.
        np.testing.assert_allclose(adv, np.array([[0.5, 0.5], [-0.5, -0.5]]) / np.sqrt(1 / 3),
                                   rtol=1e-5)


class ReturnEstimatorTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_gae_seed_example(self):
        # gamma = lam = 1 on 6 tokens: raw advantage = reward-to-go - V = returns - V.
        rewards = jnp.array([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
        values = jnp.array([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])
        mask = jnp.ones((1, 6))
        adv, ret = self.variant(adv_lib.gae)(rewards, mask, values, 1.0, 1.0)
        np.testing.assert_allclose(ret, np.ones((1, 6)), rtol=1e-6)
        raw = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
        whitened = (raw - 0.65) / np.sqrt(0.035 + 1e-8)  # unbiased var of raw = 0.175 / 5
        np.testing.assert_allclose(adv[0], whitened, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(ret - values)[0], raw, rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_reinforce_plus_plus(self):
        rewards = jnp.array([[0.0, 0.0, 1.0], [0.0, 1.0, 7.0]])
        mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
        adv, ret = self.variant(lambda r, m: adv_lib.reinforce_plus_plus(r, m, 0.5))(rewards, mask)
        # Row 0: 0.25, 0.5, 1. Row 1: the masked 7 is not carried back: 0.5, 1, 7.
        np.testing.assert_allclose(ret, [[0.25, 0.5, 1.0], [0.5, 1.0, 7.0]], rtol=1e-6)
        valid = np.array([0.25, 0.5, 1.0, 0.5, 1.0])
        white = (valid - valid.mean()) / np.sqrt(valid.var(ddof=1) + 1e-8)
        np.testing.assert_allclose(np.asarray(adv)[np.asarray(mask) > 0], white, rtol=1e-5)
        assert adv[1, 2] == 0.0

    @chex.variants(with_jit=True, without_jit=True)
    def test_remax(self):
        rewards = jnp.array([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
        mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
        adv, ret = self.variant(adv_lib.remax)(rewards, mask, jnp.array([0.4, 0.5]))
        np.testing.assert_allclose(ret, [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]], rtol=1e-6)
        np.testing.assert_allclose(adv, [[0.6, 0.6, 0.6], [1.5, 1.5, 0.0]], rtol=1e-6)


def _gae_reference(rewards, values, mask, gamma, lam):
    """Plain Python loop over time, written from the GAE recursion with masked skips."""
    b, t = rewards.shape
    adv = np.zeros((b, t))
    for i in range(b):
        next_value, last = 0.0, 0.0
        for j in reversed(range(t)):
            if mask[i, j]:
                delta = rewards[i, j] + gamma * next_value - values[i, j]
                last = delta + gamma * lam * last
                next_value = values[i, j]
            adv[i, j] = last
    returns = adv + values
    sel = mask > 0
    mean = adv[sel].mean()
    var = adv[sel].var(ddof=1)
    return (adv - mean) / np.sqrt(var + 1e-8), returns


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_python_loop_with_holes(seed):
    rng = np.random.default_rng(seed)
    b, t = 5, 9
    rewards = rng.normal(size=(b, t))
    values = rng.normal(size=(b, t))
    mask = (rng.random((b, t)) > 0.3).astype(np.float64)
    mask[:, 0] = 1.0
    mask[0, 3:6] = 0.0  # a hole in the middle
    mask[1, 5:] = 0.0  # right padding
    gamma, lam = 0.97, 0.9
    adv, ret = adv_lib.gae(jnp.asarray(rewards, jnp.float32), jnp.asarray(mask, jnp.float32),
                           jnp.asarray(values, jnp.float32), gamma, lam)
    ref_adv, ref_ret = _gae_reference(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(ret, ref_ret, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-4, atol=1e-4)


def test_gae_bootstraps_across_a_tool_block():
    """A multi-turn row: assistant tokens a1 a2, a tool block t1 t2 (loss mask 0, any
    values), assistant a3 with the reward, padding. As verl, the tool tokens are no steps:
    the returns are those of the row a1 a2 a3. By hand with gamma = lam = 0.5, V = 0.1,
    0.2, 0.5: A3 = 1 - 0.5 = 0.5; A2 = (0.5 * 0.5 - 0.2) + 0.25 * 0.5 = 0.175;
    A1 = (0.5 * 0.2 - 0.1) + 0.25 * 0.175 = 0.04375; returns A + V."""
    rewards = jnp.array([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    values = jnp.array([[0.1, 0.2, 5.0, -5.0, 0.5, 3.0]])
    mask = jnp.array([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0]])
    adv, ret = adv_lib.gae_returns(rewards, mask, values, gamma=0.5, lam=0.5)
    np.testing.assert_allclose(np.asarray(ret)[0, [0, 1, 4]], [0.14375, 0.375, 1.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(adv)[0, [0, 1, 4]], [0.04375, 0.175, 0.5], rtol=1e-6)


def test_registry_dispatch_and_errors():
    rewards, mask = _outcome_rewards([1.0, 0.0, 1.0])
    adv, _ = adv_lib.compute_advantages("grpo", rewards, mask, group_ids=jnp.array([0, 0, 0]))
    np.testing.assert_allclose(adv[:, 0], [0.57735, -1.1547, 0.57735], atol=1e-4)
    with pytest.raises(ValueError, match="adv_estimator='ppo'.*valid"):
        adv_lib.compute_advantages("ppo", rewards, mask)
    with pytest.raises(ValueError, match="needs `values`"):
        adv_lib.compute_advantages("gae", rewards, mask)
    assert adv_lib.get_estimator("gae").needs_values
    assert not adv_lib.get_estimator("grpo").needs_values


@pytest.mark.parametrize("name", sorted(adv_lib.ESTIMATORS))
def test_every_estimator_shapes_and_finite(name):
    rng = np.random.default_rng(0)
    rewards, mask = _outcome_rewards(rng.integers(0, 2, 8).astype(np.float32), length=5)
    mask = mask.at[::2, 3:].set(0.0)
    out = adv_lib.compute_advantages(
        name, rewards, mask, values=jnp.asarray(rng.normal(size=(8, 5)), jnp.float32),
        group_ids=jnp.repeat(jnp.arange(4), 2), reward_baselines=jnp.full((8,), 0.5),
        gamma=0.99, lam=0.95)
    chex.assert_shape(out, [(8, 5), (8, 5)])
    chex.assert_tree_all_finite(out)
