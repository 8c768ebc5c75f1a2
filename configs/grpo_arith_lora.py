"""GRPO with LoRA adapters on the arithmetic task of grpo_arith.

    python -m jrl.train --config=configs/grpo_arith_lora.py

The warm start trains the whole model as in grpo_arith; it then becomes the frozen
base (and the reference), and RL trains only rank-16 adapters on every projection.
Takes grpo_arith's variants except `lr`, whose default here is 1e-3 (adapters start
at zero and need a larger step than full fine-tuning).
"""

from jrl.config.defaults import parse_arg, sibling_config

grpo_arith = sibling_config(__file__, "grpo_arith")

# The variants `get_config(arg)` accepts, with their defaults.
ARG_DEFAULTS = {**grpo_arith.ARG_DEFAULTS, "lr": 1e-3, "rank": 16}


def get_config(arg: str | None = None):
    a = parse_arg(arg, **ARG_DEFAULTS)
    c = grpo_arith.get_config(f"n={a.n},lr={a.lr},steps={a.steps},seed={a.seed}")
    c.model.lora_rank = a.rank
    c.model.lora_alpha = 2.0 * a.rank
    c.model.target_modules = "all-linear"
    return c
