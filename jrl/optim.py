"""Optimisers from settings: AdamW with warmup + constant/cosine decay and global-norm clipping."""

from __future__ import annotations

from typing import Protocol

import optax

# `*.optim.lr_scheduler_type`: the decay after the warmup (`jrl.config.settings` checks the key
# against this list; this module needs nothing of `jrl.config.settings`).
LR_SCHEDULERS = ("constant", "cosine")


class Hyperparameters(Protocol):
    """What the optimiser reads of a role's settings (`jrl.config.settings.OptimSettings`)."""

    lr: float
    weight_decay: float
    betas: tuple[float, float]
    warmup_steps: int
    lr_scheduler_type: str  # one of LR_SCHEDULERS
    min_lr_ratio: float
    grad_clip: float
    total_steps: int


def learning_rate_schedule(s: Hyperparameters) -> optax.Schedule:
    """Linear warmup over `warmup_steps`, then constant or cosine down to `min_lr_ratio * lr`."""
    warmup = max(s.warmup_steps, 0)
    if s.lr_scheduler_type == "constant":
        after = optax.constant_schedule(s.lr)
    else:
        after = optax.cosine_decay_schedule(
            s.lr, decay_steps=max(s.total_steps - warmup, 1), alpha=s.min_lr_ratio
        )
    if warmup == 0:
        return after
    ramp = optax.linear_schedule(0.0, s.lr, transition_steps=warmup)
    return optax.join_schedules([ramp, after], boundaries=[warmup])


def make_optimizer(s: Hyperparameters) -> optax.GradientTransformation:
    """`clip_by_global_norm(grad_clip)` (when > 0), Adam moments, decoupled weight decay.

    The result is AdamW's update direction without the learning rate: the update
    multiplies it by `-lr` for the current training step (`learning_rate_schedule`),
    so the rate advances once per RL step as verl's scheduler does, and a skipped
    (non-finite) update does not shift the schedule.
    """
    parts = [optax.clip_by_global_norm(s.grad_clip)] if s.grad_clip > 0 else []
    parts += [optax.scale_by_adam(b1=s.betas[0], b2=s.betas[1]),
              optax.add_decayed_weights(s.weight_decay)]
    return optax.chain(*parts)
