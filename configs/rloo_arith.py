"""RLOO (leave-one-out baseline) on the arithmetic task of grpo_arith.

    python -m jrl.train --config=configs/rloo_arith.py
"""

from configs import grpo_arith


def get_config(arg: str | None = None):
    c = grpo_arith.get_config(arg)
    c.algorithm.adv_estimator = "rloo"
    return c
