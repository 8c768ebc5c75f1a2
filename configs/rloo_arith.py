"""RLOO (leave-one-out baseline) on the arithmetic task of grpo_arith.

    python -m jrl.train --config=configs/rloo_arith.py

Takes grpo_arith's variants: `--config=configs/rloo_arith.py:n=16,seed=1`.
"""

from jrl.config.defaults import sibling_config

grpo_arith = sibling_config(__file__, "grpo_arith")

# The variants `get_config(arg)` accepts (passed on to grpo_arith), with their defaults.
ARG_DEFAULTS = grpo_arith.ARG_DEFAULTS


def get_config(arg: str | None = None):
    c = grpo_arith.get_config(arg)
    c.algorithm.adv_estimator = "rloo"
    return c
