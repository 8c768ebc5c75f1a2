"""Optimisers from settings: AdamW with warmup + constant/cosine decay and global-norm clipping."""

from __future__ import annotations

import optax

from jrl.settings import OptimSettings


def learning_rate_schedule(s: OptimSettings) -> optax.Schedule:
    """Linear warmup over `warmup_steps`, then constant or cosine down to `min_lr_ratio * lr`."""
    warmup = max(s.warmup_steps, 0)
    if s.lr_scheduler == "constant":
        after = optax.constant_schedule(s.lr)
    else:
        after = optax.cosine_decay_schedule(
            s.lr, decay_steps=max(s.total_steps - warmup, 1), alpha=s.min_lr_ratio
        )
    if warmup == 0:
        return after
    ramp = optax.linear_schedule(0.0, s.lr, transition_steps=warmup)
    return optax.join_schedules([ramp, after], boundaries=[warmup])


def make_optimizer(s: OptimSettings, updates_per_step: int = 1) -> optax.GradientTransformation:
    """`clip_by_global_norm(grad_clip)` (when > 0) then AdamW.

    The learning rate advances once per training step (as verl steps its
    scheduler once per `update_actor`), although the optimizer updates once per
    mini-batch: `updates_per_step` = ppo_epochs x mini-batches per step.
    """
    schedule = learning_rate_schedule(s)
    per_step = lambda count: schedule(count // updates_per_step)
    adamw = optax.adamw(per_step, b1=s.betas[0], b2=s.betas[1], weight_decay=s.weight_decay)
    if s.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(s.grad_clip), adamw)
    return adamw
