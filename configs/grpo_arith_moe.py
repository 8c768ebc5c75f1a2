"""GRPO on grpo_arith's task with a small mixture-of-experts model (Qwen3-MoE layout).

    python -m jrl.train --config=configs/grpo_arith_moe.py

The model is grpo_arith's, each layer's MLP replaced by 8 SwiGLU experts of width 256
with 2 routed per token (the active MLP width is grpo_arith's 512). The warm start and
GRPO are grpo_arith's; the actor's loss adds the router's load-balancing term
(`actor.router_aux_loss_coef`, the preset's 0.001), and the update logs the experts'
load (`actor/moe/*`, `actor/router_aux_loss`). Takes grpo_arith's variants.
"""

from jrl.config.defaults import parse_arg, sibling_config

grpo_arith = sibling_config(__file__, "grpo_arith")

# The variants `get_config(arg)` accepts, with their defaults.
ARG_DEFAULTS = dict(grpo_arith.ARG_DEFAULTS)


def get_config(arg: str | None = None):
    a = parse_arg(arg, **ARG_DEFAULTS)
    c = grpo_arith.get_config(f"n={a.n},lr={a.lr},steps={a.steps},seed={a.seed}")
    c.model.preset = "tiny-moe"
    c.model.num_experts = 8
    c.model.num_experts_per_tok = 2
    c.model.moe_intermediate_size = 256
    return c
