"""Policy/value losses, entropy and KL estimators against hand-computed values."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from jrl.algos import losses, masks
from jrl.algos.losses import PolicyLossConfig


def _tokens(ratios, advantages, logp=None):
    """One row of tokens with the given ratios r = exp(logp - logp_old)."""
    logp = jnp.full((1, len(ratios)), -1.0) if logp is None else jnp.asarray([logp])
    old = logp - jnp.log(jnp.asarray([ratios], jnp.float32))
    return old, logp, jnp.asarray([advantages], jnp.float32), jnp.ones((1, len(ratios)))


class VanillaTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_clip_and_dual_clip(self):
        # (r, A): (1.5, +1) clipped to 1.2 -> -1.2; (0.5, +1) unclipped -> -0.5;
        # (0.5, -1) clipped to 0.8 -> 0.8; (5, -1) dual-clipped at c=3 -> 3; (2, -1) -> 2.
        old, logp, adv, mask = _tokens([1.5, 0.5, 0.5, 5.0, 2.0], [1, 1, -1, -1, -1])
        cfg = PolicyLossConfig()
        loss, m = self.variant(lambda *a: losses.vanilla(*a, cfg))(old, logp, adv, mask)
        np.testing.assert_allclose(loss, (-1.2 - 0.5 + 0.8 + 3.0 + 2.0) / 5, rtol=1e-5)
        np.testing.assert_allclose(m["actor/pg_clipfrac"], 2 / 5, rtol=1e-6)
        np.testing.assert_allclose(m["actor/pg_clipfrac_lower"], 1 / 5, rtol=1e-6)
        ppo_kl = -sum(math.log(r) for r in [1.5, 0.5, 0.5, 5.0, 2.0]) / 5
        np.testing.assert_allclose(m["actor/ppo_kl"], ppo_kl, rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_clip_higher(self):
        old, logp, adv, mask = _tokens([1.5, 0.7], [1, -1])
        cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28)
        loss, _ = self.variant(lambda *a: losses.vanilla(*a, cfg))(old, logp, adv, mask)
        np.testing.assert_allclose(loss, (-1.28 + 0.8) / 2, rtol=1e-5)

    def test_gradient_is_zero_where_clipped(self):
        old, logp, adv, mask = _tokens([1.5, 1.1], [1, 1])
        cfg = PolicyLossConfig()
        grad = jax.grad(lambda lp: losses.vanilla(old, lp, adv, mask, cfg)[0])(logp)
        # Token 0 clipped: no gradient. Token 1: d(-A r)/dlogp / N = -1.1 / 2.
        np.testing.assert_allclose(grad, [[0.0, -0.55]], rtol=1e-5)


class OtherPolicyLossesTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_gspo(self):
        # One sequence, log ratios 0.4 and 0 -> sequence ratio exp(0.2) = 1.2214 > 1.2.
        old = jnp.array([[-1.4, -1.0]])
        logp = jnp.array([[-1.0, -1.0]])
        adv = jnp.array([[1.0, 1.0]])
        cfg = PolicyLossConfig()
        loss, m = self.variant(lambda *a: losses.gspo(*a, cfg))(old, logp, adv, jnp.ones((1, 2)))
        np.testing.assert_allclose(loss, -1.2, rtol=1e-5)
        np.testing.assert_allclose(m["actor/pg_clipfrac"], 1.0)
        grad = jax.grad(lambda lp: losses.gspo(old, lp, adv, jnp.ones((1, 2)), cfg)[0])(logp)
        np.testing.assert_allclose(grad, [[0.0, 0.0]], atol=1e-7)

    def test_gspo_gradient_unclipped(self):
        # Sequence ratio exp(0.05): each token's gradient is -A * s / (T) per seq-mean-token-mean.
        old = jnp.array([[-1.1, -1.0]])
        logp = jnp.array([[-1.0, -1.0]])
        adv = jnp.array([[2.0, 2.0]])
        grad = jax.grad(
            lambda lp: losses.gspo(old, lp, adv, jnp.ones((1, 2)), PolicyLossConfig())[0])(logp)
        np.testing.assert_allclose(grad, [[-2 * math.exp(0.05) / 2] * 2], rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(
        # Ratios are 1 (s = 1, unclipped), so each token's loss is -A: row 0 (1 valid token,
        # A = 1): [-1]; row 1 (2 tokens, A = -2): [2, 2]. Token sums: -1 and 4.
        # (mode, loss, d loss / d logp): d(-A s_t)/d logp_t = -A (s_t = 1), times the
        # mode's weight of the token.
        ("token-mean", (-1 + 4) / 3, [[-1 / 3, 0.0], [2 / 3, 2 / 3]]),
        ("token-sum", -1 + 4, [[-1.0, 0.0], [2.0, 2.0]]),
        ("seq-mean-token-mean", (-1 / 1 + 4 / 2) / 2, [[-0.5, 0.0], [0.5, 0.5]]),
        ("seq-mean-token-sum", (-1 + 4) / 2, [[-0.5, 0.0], [1.0, 1.0]]),
        # seq-mean-token-sum divided again by T = 2 (the default divisor).
        ("seq-mean-token-sum-norm", (-1 + 4) / 2 / 2, [[-0.25, 0.0], [0.5, 0.5]]),
    )
    def test_gspo_aggregates_by_the_configured_mode(self, agg, expected_loss, expected_grad):
        # verl 0.9's compute_policy_loss_gspo hands its per-token losses to agg_loss with
        # the configured loss_agg_mode.
        logp = jnp.array([[-1.0, -0.5], [-2.0, -0.7]])
        adv = jnp.array([[1.0, 1.0], [-2.0, -2.0]])
        mask = jnp.array([[1.0, 0.0], [1.0, 1.0]])
        cfg = PolicyLossConfig(loss_mode="gspo", loss_agg_mode=agg)
        fn = self.variant(lambda lp: losses.gspo(logp, lp, adv, mask, cfg)[0])
        np.testing.assert_allclose(fn(logp), expected_loss, rtol=1e-6)
        grad = self.variant(jax.grad(lambda lp: losses.gspo(logp, lp, adv, mask, cfg)[0]))(logp)
        np.testing.assert_allclose(grad, expected_grad, rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_cispo(self):
        old, logp, adv, mask = _tokens([1.5, 1.0], [1, -2], logp=[-0.5, -2.0])
        cfg = PolicyLossConfig()
        fn = lambda *a: losses.cispo(*a, cfg)
        loss, m = self.variant(fn)(old, logp, adv, mask)
        # -sg(clip r) A logp: -1.2 * 1 * -0.5 = 0.6; -1 * -2 * -2 = -4.
        np.testing.assert_allclose(loss, (0.6 - 4.0) / 2, rtol=1e-5)
        np.testing.assert_allclose(m["actor/pg_clipfrac"], 0.5)
        grad = jax.grad(lambda lp: fn(old, lp, adv, mask)[0])(logp)
        np.testing.assert_allclose(grad, [[-1.2 / 2, 2.0 / 2]], rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_sapo(self):
        old, logp, adv, mask = _tokens([1.0, 2.0], [1.0, -1.0])
        cfg = PolicyLossConfig(tau_pos=1.0, tau_neg=2.0)
        loss, _ = self.variant(lambda *a: losses.sapo(*a, cfg))(old, logp, adv, mask)
        gate0 = 4.0 * 0.5  # r = 1, tau = 1: sigmoid(0) * 4
        gate1 = 2.0 / (1 + math.exp(-2.0))  # r = 2, tau = 2: sigmoid(2) * 4 / 2
        np.testing.assert_allclose(loss, (-gate0 + gate1) / 2, rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_gpg(self):
        old, logp, adv, mask = _tokens([1.0, 1.0], [2.0, -1.0], logp=[-0.5, -3.0])
        loss, _ = self.variant(lambda *a: losses.gpg(*a, PolicyLossConfig()))(old, logp, adv, mask)
        np.testing.assert_allclose(loss, (1.0 - 3.0) / 2, rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_geo_mean(self):
        # Row 0 (A = +1): log r = 0.5 clipped to 0.2 and 0.1 -> exp(0.15).
        # Row 1 (A = -1): log r = -0.5 clipped to -0.2 and 0 -> exp(-0.1).
        old = jnp.array([[-1.5, -1.1], [-0.5, -1.0]])
        logp = jnp.array([[-1.0, -1.0], [-1.0, -1.0]])
        adv = jnp.array([[1.0, 1.0], [-1.0, -1.0]])
        cfg = PolicyLossConfig()
        fn = self.variant(lambda *a: losses.geo_mean(*a, cfg))
        loss, m = fn(old, logp, adv, jnp.ones((2, 2)))
        np.testing.assert_allclose(loss, (-math.exp(0.15) + math.exp(-0.1)) / 2, rtol=1e-5)
        np.testing.assert_allclose(m["actor/pg_clipfrac"], 0.25)
        np.testing.assert_allclose(m["actor/pg_clipfrac_lower"], 0.25)

    def test_kl_cov_penalises_top_covariance_token(self):
        # 4 valid tokens, ratio 1; covariance largest at token 0 (A and logp both high).
        logp = jnp.array([[-0.1, -2.0, -1.0, -1.5]])
        old = logp - jnp.array([[0.3, 0.0, 0.0, 0.0]])
        adv = jnp.array([[2.0, -1.0, 0.5, 0.0]])
        cfg = PolicyLossConfig(loss_mode="kl_cov", kl_cov_ratio=0.25, ppo_kl_coef=0.5)
        loss, m = losses.kl_cov(old, logp, adv, jnp.ones((1, 4)), cfg)
        per_token = [-2.0 * math.exp(0.3) + 0.5 * 0.3, 1.0, -0.5, 0.0]
        np.testing.assert_allclose(loss, sum(per_token) / 4, rtol=1e-5)
        np.testing.assert_allclose(m["actor/ppo_kl"], 0.3 / 4, rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_kl_cov_abs_gradient_is_zero_on_policy(self):
        # Same tokens; covariance (A - 0.375)(logp + 1.15) is largest at token 0
        # (1.625 * 1.05), so token 0 carries 0.5 * |log r|. Per-token gradient of
        # -A exp(log r) is -A r; token-mean divides by 4.
        logp = jnp.array([[-0.1, -2.0, -1.0, -1.5]])
        adv = jnp.array([[2.0, -1.0, 0.5, 0.0]])
        cfg = PolicyLossConfig(loss_mode="kl_cov", kl_cov_ratio=0.25, ppo_kl_coef=0.5)

        def grad_at(log_r0):
            old = logp - jnp.array([[log_r0, 0.0, 0.0, 0.0]])
            fn = lambda lp: losses.kl_cov(old, lp, adv, jnp.ones((1, 4)), cfg)[0]
            return self.variant(jax.grad(fn))(logp)

        # log r = 0 everywhere (first update): |log r| adds no gradient, as torch's abs.
        # [-2, 1, -0.5, 0] / 4.
        np.testing.assert_allclose(grad_at(0.0), [[-0.5, 0.25, -0.125, 0.0]], atol=1e-6)
        # log r0 = 0.3: token 0 gets (-2 e^0.3 + 0.5 * 1) / 4; log r0 = -0.3: (-2 e^-0.3 - 0.5) / 4.
        np.testing.assert_allclose(grad_at(0.3)[0, 0], (-2 * math.exp(0.3) + 0.5) / 4, rtol=1e-5)
        np.testing.assert_allclose(grad_at(-0.3)[0, 0], (-2 * math.exp(-0.3) - 0.5) / 4,
                                   rtol=1e-5)

    def test_clip_cov_drops_eligible_tokens(self):
        # Only token 0 has covariance in (1, 5) and is not clipped: it is dropped.
        logp = jnp.array([[-1.0, -3.0, -3.0, -3.0]])  # cov: 3 * 1.5 = 4.5; others 0.5
        old = logp
        adv = jnp.array([[3.0, -1.0, -1.0, -1.0]])
        cfg = PolicyLossConfig(loss_mode="clip_cov", clip_cov_ratio=0.25)
        loss, m = losses.clip_cov(old, logp, adv, jnp.ones((1, 4)), cfg, rng=jax.random.key(0))
        np.testing.assert_allclose(loss, 3.0 / 4, rtol=1e-5)  # tokens 1-3: -A r = 1 each
        np.testing.assert_allclose(m["actor/pg_clipfrac"], 0.25)
        with pytest.raises(ValueError, match="rng"):
            losses.clip_cov(old, logp, adv, jnp.ones((1, 4)), cfg)


# clip_cov and kl_cov select a share of each micro-batch's tokens by definition.
_ADDITIVE_LOSSES = sorted(set(losses.POLICY_LOSSES) - {"clip_cov", "kl_cov"})


@pytest.mark.parametrize("mode", _ADDITIVE_LOSSES)
@pytest.mark.parametrize("agg", masks.LOSS_AGG_MODES)
def test_micro_batch_invariance_of_every_loss(mode, agg):
    """Loss and gradient of the mini-batch = sum over micro-batches (k = 1, 2, 4)."""
    rng = np.random.default_rng(1)
    b, t = 8, 5
    logp = jnp.asarray(-rng.random((b, t)) * 2, jnp.float32)
    old = logp + jnp.asarray(rng.normal(size=(b, t)) * 0.3, jnp.float32)
    adv = jnp.asarray(np.repeat(rng.normal(size=(b, 1)), t, 1), jnp.float32)
    mask = jnp.asarray(np.arange(t)[None] < rng.integers(1, t + 1, (b, 1)), jnp.float32)
    cfg = PolicyLossConfig(loss_mode=mode, loss_agg_mode=agg)
    norm = masks.loss_normalizer(mask)

    def total(lp, k):
        parts = zip(*(jnp.split(x, k) for x in (old, lp, adv, mask)), strict=True)
        return sum(losses.policy_loss(*part, cfg, norm)[0] for part in parts)

    whole = losses.policy_loss(old, logp, adv, mask, cfg)[0]
    grad_whole = jax.grad(lambda lp: losses.policy_loss(old, lp, adv, mask, cfg)[0])(logp)
    for k in (1, 2, 4):
        np.testing.assert_allclose(total(logp, k), whole, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(jax.grad(total)(logp, k), grad_whole, rtol=1e-5, atol=1e-7)


class ValueEntropyTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_value_loss(self):
        vpreds = jnp.array([[1.0, 0.0, 2.0]])
        values = jnp.array([[0.0, 0.0, 2.0]])
        returns = jnp.array([[2.0, 1.0, 2.0]])
        # Token 0: clip(1, -0.5, 0.5) = 0.5 -> max(1, 2.25) = 2.25 (clipped wins);
        # token 1: (0-1)^2 = 1 both; token 2: 0.
        fn = lambda v, r, o, m: losses.value_loss(v, r, o, m, 0.5)
        loss, clipfrac = self.variant(fn)(vpreds, returns, values, jnp.ones((1, 3)))
        np.testing.assert_allclose(loss, 0.5 * (2.25 + 1.0) / 3, rtol=1e-6)
        np.testing.assert_allclose(clipfrac, 1 / 3, rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_entropy(self):
        logits = jnp.array([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9]])
        out = self.variant(losses.entropy_from_logits)(logits)
        # Uniform over 4: ln 4. Probabilities (1/4, 3/4): -(.25 ln .25 + .75 ln .75).
        np.testing.assert_allclose(
            out, [math.log(4), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))], rtol=1e-5)


# log r = logp - ref at two points: +1 and -1.
_KL_GOLDEN = {
    "k1": (1.0, -1.0), "kl": (1.0, -1.0),
    "abs": (1.0, 1.0),
    "k2": (0.5, 0.5), "mse": (0.5, 0.5),
    "k3": (math.exp(-1) + 1 - 1, math.exp(1) - 1 - 1),
    "low_var_kl": (math.exp(-1), math.exp(1) - 2),
}


class KLTest(chex.TestCase, parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*sorted(_KL_GOLDEN))
    def test_estimators_at_two_points(self, kind):
        logp = jnp.array([-1.0, -2.0])
        ref = jnp.array([-2.0, -1.0])
        out = self.variant(lambda a, b: losses.kl_penalty(a, b, kind))(logp, ref)
        np.testing.assert_allclose(out, _KL_GOLDEN[kind], rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters("k1", "k2", "k3", "low_var_kl", "abs")
    def test_straight_through_value_and_gradient(self, base):
        logp = jnp.array([-1.0, -2.0, -0.3])
        ref = jnp.array([-2.0, -1.0, -0.3])
        plus = lambda lp: losses.kl_penalty(lp, ref, base + "+")
        np.testing.assert_allclose(self.variant(plus)(logp), losses.kl_penalty(logp, ref, base),
                                   rtol=1e-6)
        # Gradient of k2 = (logp - ref), per element.
        grad = self.variant(jax.grad(lambda lp: jnp.sum(plus(lp))))(logp)
        np.testing.assert_allclose(grad, [1.0, -1.0, 0.0], atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_abs_gradient_is_zero_where_logp_equals_ref(self):
        # d|d|/dlogp = sign(d) with d = logp - ref: +1 at d = 1, -1 at d = -1, and 0 at
        # d = 0 (torch's abs; e.g. the first update, when the actor is the reference).
        logp = jnp.array([-1.0, -2.0, -0.3])
        ref = jnp.array([-2.0, -1.0, -0.3])
        fn = lambda lp: losses.kl_penalty(lp, ref, "abs")
        np.testing.assert_allclose(self.variant(fn)(logp), [1.0, 1.0, 0.0], atol=1e-6)
        grad = self.variant(jax.grad(lambda lp: jnp.sum(fn(lp))))(logp)
        np.testing.assert_array_equal(grad, [1.0, -1.0, 0.0])

    def test_k3_clamps(self):
        out = losses.kl_penalty(jnp.array([-50.0]), jnp.array([0.0]), "k3")
        np.testing.assert_allclose(out, [10.0])

    def test_unknown_estimator(self):
        with pytest.raises(ValueError, match="kl estimator"):
            losses.kl_penalty(jnp.zeros(2), jnp.zeros(2), "k4")


def test_config_validation_names_keys():
    with pytest.raises(ValueError, match="loss_mode='ppo2'"):
        PolicyLossConfig(loss_mode="ppo2").validate()
    with pytest.raises(ValueError, match="actor.loss_agg_mode"):
        PolicyLossConfig(loss_agg_mode="sum").validate()
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        PolicyLossConfig(clip_ratio_c=0.5).validate()
    PolicyLossConfig().validate()
