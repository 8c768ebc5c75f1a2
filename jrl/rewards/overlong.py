"""DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", section 3.4).

Responses longer than `L_max - B` lose reward linearly over the last `B` tokens
of the length budget::

    expected = L_max - B
    penalty  = min(-(L - expected) / B * f, 0)

so a response of `expected` tokens or fewer is not penalised and one of `L_max`
tokens loses `f`. The penalty is added to the rule score (verl's DAPO reward
manager, `reward_model.overlong_buffer.{enable, len, penalty_factor, log}`).
"""

from __future__ import annotations

import numpy as np


def overlong_penalty(response_lengths: np.ndarray, max_response_length: int,
                     buffer_length: int, penalty_factor: float) -> np.ndarray:
    """Per-response penalty, zero or negative.

    Args:
      response_lengths: `[N]` valid response tokens `L` (EOS included).
      max_response_length: `L_max` (rollout.response_length).
      buffer_length: `B` (reward_model.overlong_buffer.len), 0 < B <= L_max.
      penalty_factor: `f` (reward_model.overlong_buffer.penalty_factor).

    Returns:
      float32 `[N]`: `min(-(L - (L_max - B)) / B * f, 0)`.

    Raises:
      ValueError: `buffer_length` outside (0, max_response_length], or a negative
        `penalty_factor` (named).
    """
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(
            f"reward_model.overlong_buffer.len={buffer_length} must be in (0, "
            f"rollout.response_length={max_response_length}]")
    if penalty_factor < 0:
        raise ValueError(f"reward_model.overlong_buffer.penalty_factor={penalty_factor} must be "
                         ">= 0 (a negative factor would penalise short responses)")
    lengths = np.asarray(response_lengths, np.float64)
    exceed = lengths - (max_response_length - buffer_length)
    return np.minimum(-exceed / buffer_length * penalty_factor, 0.0).astype(np.float32)


def overlong_extras(penalty: np.ndarray) -> dict[str, np.ndarray]:
    """verl's logged extras: `overlong_reward` (the penalty) and `overlong` (penalised)."""
    penalty = np.asarray(penalty, np.float32)
    return {"overlong_reward": penalty, "overlong": (penalty < 0).astype(np.float32)}
