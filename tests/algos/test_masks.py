"""Masked statistics and loss aggregation: hand-computed goldens, micro-batch invariance."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from jrl.algos import masks


class MaskedStatsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_mean_var_whiten_goldens(self):
        values = jnp.array([[1.0, 2.0, 100.0], [3.0, 4.0, -7.0]])
        mask = jnp.array([[1, 1, 0], [1, 1, 0]])
        # Unmasked: 1, 2, 3, 4 -> mean 2.5, unbiased var = (2.25+.25+.25+2.25)/3 = 5/3.
        mean = self.variant(masks.masked_mean)(values, mask)
        var = self.variant(masks.masked_var)(values, mask)
        np.testing.assert_allclose(mean, 2.5, rtol=1e-6)
        np.testing.assert_allclose(var, 5.0 / 3.0, rtol=1e-6)
        biased = self.variant(lambda v, m: masks.masked_var(v, m, unbiased=False))(values, mask)
        np.testing.assert_allclose(biased, 1.25, rtol=1e-6)
        white = self.variant(masks.masked_whiten)(values, mask)
        expected = (np.array([1.0, 2.0, 3.0, 4.0]) - 2.5) / np.sqrt(5 / 3 + 1e-8)
        np.testing.assert_allclose(np.asarray(white)[:, :2].reshape(-1), expected, rtol=1e-5)
        unshifted = self.variant(lambda v, m: masks.masked_whiten(v, m, shift_mean=False))(
            values, mask
        )
        np.testing.assert_allclose(np.asarray(unshifted)[0, 0], expected[0] + 2.5, rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_row_mean(self):
        values = jnp.array([[1.0, 3.0], [5.0, 9.0]])
        mask = jnp.array([[1.0, 1.0], [0.0, 1.0]])
        out = self.variant(lambda v, m: masks.masked_mean(v, m, axis=-1))(values, mask)
        np.testing.assert_allclose(out, [2.0, 9.0], rtol=1e-6)

    def test_var_of_one_element_is_nan(self):
        assert np.isnan(masks.masked_var(jnp.array([1.0, 2.0]), jnp.array([1, 0])))


# loss [[1, 2, 3], [4, 5, 6]], mask [[1, 1, 0], [1, 0, 0]] -> tokens 1, 2 | 4.
_LOSS = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
_MASK = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
_GOLDEN = {
    "token-mean": (1 + 2 + 4) / 3,
    "token-sum": 1 + 2 + 4,
    "seq-mean-token-sum": (3 + 4) / 2,
    "seq-mean-token-mean": (1.5 + 4) / 2,
    "seq-mean-token-sum-norm": (3 + 4) / 2 / 3,
}


class AggLossTest(chex.TestCase, parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*masks.LOSS_AGG_MODES)
    def test_golden(self, mode):
        out = self.variant(lambda x, m: masks.agg_loss(x, m, mode))(_LOSS, _MASK)
        np.testing.assert_allclose(out, _GOLDEN[mode], rtol=1e-6)

    def test_empty_rows_are_not_counted(self):
        loss = jnp.concatenate([_LOSS, jnp.ones((1, 3))])
        mask = jnp.concatenate([_MASK, jnp.zeros((1, 3))])
        for mode in masks.LOSS_AGG_MODES:
            np.testing.assert_allclose(masks.agg_loss(loss, mask, mode), _GOLDEN[mode], rtol=1e-6)

    def test_scale_factor(self):
        out = masks.agg_loss(_LOSS, _MASK, "seq-mean-token-sum-norm", scale_factor=7.0)
        np.testing.assert_allclose(out, 3.5 / 7.0, rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_token_sum_has_no_normaliser(self):
        # Rows split into two micro-batches: row 0 sums to 1 + 2 = 3, row 1 to 4; whatever
        # the counts passed in, the parts add up to the whole batch's 7.
        norm = masks.LossNormalizer(num_tokens=jnp.float32(100.0), num_seqs=jnp.float32(50.0))
        fn = self.variant(lambda x, m: masks.agg_loss(x, m, "token-sum", norm))
        np.testing.assert_allclose(fn(_LOSS[:1], _MASK[:1]), 3.0, rtol=1e-6)
        np.testing.assert_allclose(fn(_LOSS[1:], _MASK[1:]), 4.0, rtol=1e-6)
        np.testing.assert_allclose(fn(_LOSS, _MASK), 7.0, rtol=1e-6)

    def test_unknown_mode(self):
        with pytest.raises(ValueError, match="loss_agg_mode"):
            masks.agg_loss(_LOSS, _MASK, "mean")


def _random_batch(seed, b=8, t=6):
    rng = np.random.default_rng(seed)
    loss = jnp.asarray(rng.normal(size=(b, t)), jnp.float32)
    lengths = rng.integers(1, t + 1, size=b)
    mask = jnp.asarray(np.arange(t)[None, :] < lengths[:, None], jnp.float32)
    return loss, mask


@pytest.mark.parametrize("mode", masks.LOSS_AGG_MODES)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_micro_batches_sum_to_mini_batch(mode, k):
    """Splitting into k micro-batches with the global normaliser changes nothing."""
    loss, mask = _random_batch(0)
    weights = jnp.linspace(0.5, 1.5, loss.shape[1])

    def full(w):
        return masks.agg_loss(loss * w, mask, mode)

    norm = masks.loss_normalizer(mask)

    def split(w):
        parts = zip(jnp.split(loss, k), jnp.split(mask, k), strict=True)
        return sum(masks.agg_loss(x * w, m, mode, norm) for x, m in parts)

    np.testing.assert_allclose(split(weights), full(weights), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(split)(weights), jax.grad(full)(weights), rtol=1e-5)
