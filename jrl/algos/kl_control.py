"""KL controllers as pure `state -> state` functions, and the KL-in-reward penalty.

The controller's coefficient `beta` lives in a `KLControlState` so it can be
carried through jit, checkpointed and restored. The adaptive rule is Ziegler et
al. 2019 (1909.08593), as verl applies it once per training step:

    e = clip(kl / target_kl - 1, -0.2, 0.2);   beta <- beta * (1 + e * n / horizon)

where `n` is the number of sequences in the batch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jrl.algos import losses, masks

Array = jax.Array

KL_CONTROLLERS = ("fixed", "adaptive")


class KLControlState(NamedTuple):
    value: Array  # scalar float32: the current coefficient beta


def init_kl_controller(kl_coef: float) -> KLControlState:
    return KLControlState(value=jnp.asarray(kl_coef, jnp.float32))


def update_kl_controller(
    state: KLControlState,
    current_kl: Array,
    n_steps: int | Array,
    kind: str = "fixed",
    target_kl: float = 0.1,
    horizon: float = 10000.0,
) -> KLControlState:
    """Returns the controller state after observing `current_kl` over `n_steps` samples."""
    if kind == "fixed":
        return state
    if kind != "adaptive":
        raise ValueError(f"algorithm.kl_ctrl.type must be one of {KL_CONTROLLERS}, got {kind!r}")
    if not horizon > 0:
        raise ValueError(f"algorithm.kl_ctrl.horizon must be > 0, got {horizon}")
    error = jnp.clip(current_kl / target_kl - 1.0, -0.2, 0.2)
    return KLControlState(value=state.value * (1.0 + error * n_steps / horizon))


def apply_kl_penalty(
    token_level_scores: Array,
    old_log_probs: Array,
    ref_log_probs: Array,
    response_mask: Array,
    beta: Array | float,
    kind: str = "kl",
) -> tuple[Array, Array]:
    """Subtracts `beta * KL` from the token-level scores (`use_kl_in_reward`).

    Args:
      token_level_scores: `[B, T]` reward at the last valid token, zeros elsewhere.
      old_log_probs, ref_log_probs: `[B, T]` behaviour and reference log-probs.
      response_mask: `[B, T]`.
      beta: KL coefficient (the controller's value).
      kind: KL estimator name (`algorithm.kl_penalty`), see `losses.kl_penalty`.

    Returns:
      `(token_level_rewards [B, T], current_kl)`, where `current_kl` is the mean
      over sequences of each sequence's token-mean KL (what verl logs as
      `actor/reward_kl_penalty` and feeds to the adaptive controller).
    """
    mask = jnp.asarray(response_mask, token_level_scores.dtype)
    kld = losses.kl_penalty(old_log_probs, ref_log_probs, kind) * mask
    rewards = token_level_scores - beta * kld
    current_kl = jnp.mean(masks.masked_mean(kld, mask, axis=-1))
    return rewards, current_kl
