"""KL controllers and the KL-in-reward penalty."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.algos import kl_control


class KLControlTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_adaptive_rule(self):
        state = kl_control.init_kl_controller(0.1)
        update = lambda s, kl: kl_control.update_kl_controller(
            s, kl, 256, kind="adaptive", target_kl=0.1, horizon=10000)
        # KL twice the target: error clipped to +0.2 -> beta * (1 + 0.2 * 256 / 10000).
        up = self.variant(update)(state, jnp.float32(0.2))
        np.testing.assert_allclose(up.value, 0.1 * 1.00512, rtol=1e-6)
        # KL 0.09: error -0.1 -> beta * (1 - 0.1 * 0.0256).
        down = self.variant(update)(state, jnp.float32(0.09))
        np.testing.assert_allclose(down.value, 0.1 * (1 - 0.00256), rtol=1e-5)

    def test_fixed_is_identity_and_errors(self):
        state = kl_control.init_kl_controller(0.3)
        assert kl_control.update_kl_controller(state, 5.0, 10).value == state.value
        with pytest.raises(ValueError, match="kl_ctrl.type"):
            kl_control.update_kl_controller(state, 5.0, 10, kind="pid")
        with pytest.raises(ValueError, match="horizon"):
            kl_control.update_kl_controller(state, 5.0, 10, kind="adaptive", horizon=0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_apply_kl_penalty(self):
        scores = jnp.array([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
        old = jnp.array([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
        ref = jnp.array([[-1.5, -2.0, -9.0], [-1.0, -0.5, -1.0]])
        mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
        fn = lambda *a: kl_control.apply_kl_penalty(*a, beta=0.1, kind="k1")
        rewards, kl = self.variant(fn)(scores, old, ref, mask)
        # k1 = old - ref, masked: [[.5, 1, 0], [0, -.5, 0]].
        np.testing.assert_allclose(rewards, [[-0.05, 0.9, 0.0], [0.0, 0.05, 2.0]], rtol=1e-6)
        np.testing.assert_allclose(kl, ((0.5 + 1.0) / 2 + (-0.5) / 3) / 2, rtol=1e-5)

    def test_state_is_a_pytree(self):
        state = kl_control.init_kl_controller(0.1)
        leaves = jax.tree_util.tree_leaves(state)
        assert len(leaves) == 1 and leaves[0].dtype == jnp.float32
