"""DAPO-style GRPO on the arithmetic task of grpo_arith: clip-higher, token-mean
aggregation, no KL term (Yu et al. 2025, arXiv:2503.14476).

Dynamic sampling and overlong shaping are off here; turn them on with
`--config.algorithm.filter_groups.enable=True` (and `data.gen_batch_size`) and
`--config.reward_model.overlong_buffer.enable=True` (and `.len`).

    python -m jrl.train --config=configs/dapo_arith.py

Takes grpo_arith's variants: `--config=configs/dapo_arith.py:n=16,seed=1`.
"""

from jrl.config.defaults import sibling_config

grpo_arith = sibling_config(__file__, "grpo_arith")

# The variants `get_config(arg)` accepts (passed on to grpo_arith), with their defaults.
ARG_DEFAULTS = grpo_arith.ARG_DEFAULTS


def get_config(arg: str | None = None):
    c = grpo_arith.get_config(arg)
    c.algorithm.adv_estimator = "grpo"
    c.actor.clip_ratio_low = 0.2
    c.actor.clip_ratio_high = 0.28
    c.actor.loss_agg_mode = "token-mean"
    c.actor.use_kl_loss = False
    c.algorithm.use_kl_in_reward = False
    return c
