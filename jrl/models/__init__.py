"""Decoder-only transformers (Llama 3 / Qwen2 / Qwen2.5 / Qwen3, Qwen3-MoE / Mixtral), heads,
KV cache, HF I/O.

Typical use::

    config, params = load_pretrained("/ckpt/Qwen2.5-0.5B", dtype="float32")
    hidden_btd, _ = forward(params, tokens_bt, positions_from_mask(mask_bt), mask_bt,
                            config=config)
    logits_btv = unembed(params, hidden_btd)

See docs/models.md for shapes, the cache contract and the options.
"""

from jrl.models import lora, moe
from jrl.models.cache import (
    CACHE_LOGICAL_AXES,
    KVCache,
    attention_mask,
    init_cache,
    positions_from_mask,
)
from jrl.models.config import PRESETS, ModelConfig, RopeScaling
from jrl.models.heads import (
    init_critic_params,
    init_value_head,
    sequence_scores,
    unembed,
    values,
)
from jrl.models.hf import load_pretrained, save_pretrained
from jrl.models.transformer import (
    Transformer,
    forward,
    forward_logits,
    forward_with_router,
    init_params,
    param_logical_axes,
)

__all__ = [
    "CACHE_LOGICAL_AXES",
    "PRESETS",
    "KVCache",
    "ModelConfig",
    "RopeScaling",
    "Transformer",
    "attention_mask",
    "forward",
    "forward_logits",
    "forward_with_router",
    "init_cache",
    "init_critic_params",
    "init_params",
    "init_value_head",
    "load_pretrained",
    "lora",
    "moe",
    "param_logical_axes",
    "positions_from_mask",
    "save_pretrained",
    "sequence_scores",
    "unembed",
    "values",
]
