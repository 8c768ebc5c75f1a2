"""GRPO on the arithmetic task of grpo_arith, with a Gemma 2-style decoder.

The model is `tiny-gemma` at grpo_arith's width: sandwich norms, GeGLU, scaled
embeddings, attention and final-logit soft-caps (50 and 30), and a sliding window of 8
tokens on every other layer, shorter than the task's rows (up to 8 prompt and 5
response tokens), so the warm start, the sampler and the updates all run the window
and the caps. Everything else is grpo_arith's.

    python -m jrl.train --config=configs/grpo_arith_gemma.py

Takes grpo_arith's variants: `--config=configs/grpo_arith_gemma.py:n=16,seed=1`.
Seeds side by side in one program, with the reward computed on the device:

    python -m jrl.train --config=configs/grpo_arith_gemma.py \
        --config.reward.in_graph_fn=exact_match --config.trainer.runs=3
"""

from jrl.config.defaults import sibling_config

grpo_arith = sibling_config(__file__, "grpo_arith")

# The variants `get_config(arg)` accepts (passed on to grpo_arith), with their defaults.
ARG_DEFAULTS = grpo_arith.ARG_DEFAULTS


def get_config(arg: str | None = None):
    c = grpo_arith.get_config(arg)
    c.model.preset = "tiny-gemma"
    # grpo_arith's width and heads; head_dim stays the preset's 16, which its
    # query_pre_attn_scalar (16) matches, as in the released Gemma 2 2B and 9B.
    c.model.head_dim = None
    return c
