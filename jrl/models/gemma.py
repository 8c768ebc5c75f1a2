"""What Gemma 2 and Gemma 3 (text) add to the decoder, as options of the one model.

A Gemma layer is the Llama layer with these differences (transformers'
`modeling_gemma2.py` / `modeling_gemma3.py`, which the HF parity tests match):

- RMSNorm scales by `1 + weight` (weights stored as HF stores them, so a fresh norm is
  zeros), multiplies in float32 and casts afterwards (`rms_norm`).
- Sandwich norms: the attention's and the MLP's outputs are normalised again before
  they join the residual stream (`post_attn_norm`, `post_mlp_norm`).
- GeGLU MLP: `down(gelu_tanh(gate(x)) * up(x))`.
- The embeddings are multiplied by `sqrt(hidden_size)`, rounded to the compute dtype
  first as HF rounds it to the weights' dtype.
- Attention scores are scaled by `query_pre_attn_scalar ** -0.5` rather than
  `head_dim ** -0.5`; Gemma 2 soft-caps them (`cap * tanh(s / cap)`) before the mask,
  and both families may soft-cap the final logits.
- Sliding-window layers (`layer_types`): a query sees the keys less than
  `sliding_window` tokens behind it (`q - k < window`, HF's `sliding_window_overlay`).
  Gemma 3's sliding layers also have their own RoPE base (`rope_local_base_freq`);
  its global layers may scale RoPE linearly (factor 8 in the 4B and 12B).

The layers stay one `nn.scan` with stacked parameters: the per-layer differences
travel as a scanned bool per layer (`local_flags`), which picks between two variants
of the mask and of the RoPE tables (`LayerTypes`, `for_layer`). Rows given as segment
ids (packed rows; padded rows on splash or under `mesh.context`) form no mask: the
attention kernels take the window, soft-cap and query scale as options
(`packed_attention.attend`), and the flag picks the kernel's variant.

This module imports nothing of `jrl.models`: `config.py` imports it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jrl.errors import ConfigError

FAMILIES = ("gemma2", "gemma3")
FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
# The MLP activation of every Gemma 2 / 3 checkpoint (HF's `hidden_activation`).
ACTIVATION = "gelu_pytorch_tanh"
# Gemma checkpoints with more than the text decoder.
_MULTIMODAL = {"Gemma3ForConditionalGeneration", "Gemma3Model"}


def is_gemma(config) -> bool:
    return config.family in FAMILIES


def layer_types(num_layers: int, pattern: int) -> tuple[str, ...]:
    """HF's default `layer_types`: every `pattern`-th layer global, the others sliding
    (Gemma 2: 2, alternating from a sliding first layer; Gemma 3: 6, five local to one
    global)."""
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


def local_flags(config) -> jax.Array:
    """bool `[L]`: which layers attend through a sliding window (the scan's input)."""
    return jnp.asarray([t == SLIDING for t in config.layer_types], bool)


def query_scale(config) -> float | None:
    """The scores' scale, `query_pre_attn_scalar ** -0.5`; None for the usual
    `head_dim ** -0.5`."""
    if config.query_pre_attn_scalar is None:
        return None
    return float(config.query_pre_attn_scalar) ** -0.5


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """`cap * tanh(x / cap)` (Gemma 2's soft-capping); `x` unchanged when `cap` is None."""
    if cap is None:
        return x
    return jnp.tanh(x / cap) * cap


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU with the tanh approximation (HF's `gelu_pytorch_tanh`)."""
    return jax.nn.gelu(x, approximate=True)


def rms_norm(x, weight, *, eps: float, dtype: str) -> jax.Array:
    """Gemma's RMSNorm: `x / rms(x) * (1 + weight)` in float32, then cast (HF's
    Gemma2RMSNorm multiplies before the cast, unlike Llama's, which casts first)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * (1.0 + weight.astype(jnp.float32))).astype(dtype)


def embed_scale(config) -> jax.Array:
    """`sqrt(hidden_size)` as HF applies it: a float32 number rounded to the activations'
    dtype (sqrt(2304) = 48.0 in float32 and bfloat16 alike; sqrt(3072) = 55.43 becomes
    55.5 in bfloat16)."""
    return jnp.asarray(np.float32(math.sqrt(config.hidden_size))).astype(config.dtype)


class LayerTypes(NamedTuple):
    """One input in its two variants, for global and for sliding-window layers (a mask,
    a RoPE table, or a pytree of them)."""

    full: Any
    sliding: Any


def for_layer(local, *inputs):
    """The `inputs` for one layer: each `LayerTypes` resolved to its variant, by a
    Python bool (the cache's layer-by-layer forward) or a traced one (the scan, where
    both variants are computed and one is selected per layer); others as they are."""
    def pick(x):
        if not isinstance(x, LayerTypes):
            return x
        if isinstance(local, bool):
            return x.sliding if local else x.full
        return jax.tree.map(lambda s, f: jnp.where(local, s, f), x.sliding, x.full)

    return tuple(pick(x) for x in inputs)


def windowed(mask_b1ts: jax.Array, query_pos_bt: jax.Array, key_pos_bs: jax.Array,
             window: int) -> jax.Array:
    """`mask_b1ts` with the keys `window` or more tokens behind their query masked.

    Distances are counted in tokens of the row (RoPE positions: valid tokens before),
    not slots, so a cache row with masked slots between its tokens (a multi-turn row
    that waited) keeps HF's window. Where a row's tokens are contiguous, as in HF's
    padded batches, the two agree: HF keeps key k for query q when `q - k < window`.
    A query always keeps its own slot (`cache.attention_mask`'s rule for padding).
    """
    distance_bts = query_pos_bt[:, :, None] - key_pos_bs[:, None, :]
    return mask_b1ts & (distance_bts < window)[:, None]


def window_shared_prompt(masks, prompt_pos_gp, row_pos_bs, window: int):
    """`windowed` for the shared-prompt layout's masks (`transformer.SharedPromptMask`):
    the prompts' own, and each response's queries (the last R of its row) over its
    prompt and itself."""
    p = prompt_pos_gp.shape[1]
    return masks._replace(
        prompt_g1pp=windowed(masks.prompt_g1pp, prompt_pos_gp, prompt_pos_gp, window),
        response_b1rs=windowed(masks.response_b1rs, row_pos_bs[:, p:], row_pos_bs, window))


# --------------------------------------------------------------------------- config


def check(config) -> dict[str, Any]:
    """Checks a `ModelConfig`'s Gemma fields; returns the fields to set on it.

    Lists from JSON become tuples (hashable). An "auto" kernel choice for a config a
    kernel cannot serve resolves to "xla" here, once for every caller (the Mosaic GPU
    decode-attention kernel has no soft-cap and no window; the log-prob head's kernel no
    final soft-cap); a forced kernel stops with an error. The training attention's
    "auto" stays: with an attention soft-cap it takes splash on a TPU and XLA elsewhere,
    never cuDNN, which has none (`packed_attention.choose_impl`), and a forced "cudnn"
    stops here.
    """
    linear = config.rope_scaling is not None and not hasattr(config.rope_scaling,
                                                             "low_freq_factor")
    if linear != (config.rope_scaling is not None and config.family == "gemma3"):
        raise ConfigError(f"rope_scaling={config.rope_scaling!r}: family {config.family!r} "
                          "takes " + ("linear scaling only" if config.family == "gemma3" else
                                      "no linear scaling (Gemma 3 alone has it)"))
    fields = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
              "sliding_window", "rope_local_base_freq")
    if not is_gemma(config):
        set_fields = [f for f in fields if getattr(config, f) is not None]
        if config.layer_types:
            set_fields.append("layer_types")
        if set_fields:
            raise ConfigError(f"{', '.join(set_fields)}: Gemma options; family "
                              f"{config.family!r} does not have them (use 'gemma2' or 'gemma3')")
        return {}
    types = tuple(config.layer_types)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ConfigError(f"layer_types: {unknown} not supported; choose from {list(LAYER_TYPES)}")
    if types and len(types) != config.num_layers:
        raise ConfigError(f"layer_types has {len(types)} entries for num_layers="
                          f"{config.num_layers}; give one per layer")
    if SLIDING in types and not (isinstance(config.sliding_window, int)
                                 and config.sliding_window > 0):
        raise ConfigError(f"sliding_window must be a positive integer for the "
                          f"'{SLIDING}' layers, got {config.sliding_window!r}")
    for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
        value = getattr(config, name)
        if value is not None and not value > 0:
            raise ConfigError(f"{name} must be > 0 (or None), got {value!r}")
    if config.attn_logit_softcapping is not None and config.attention_impl == "cudnn":
        raise ConfigError("attention_impl='cudnn' has no soft-capping, which this Gemma "
                          "config needs (attn_logit_softcapping); use 'auto' (splash on a "
                          "TPU, else XLA), 'splash' or 'xla'")
    kernels = {"decode_attention_impl": SLIDING in types
               or config.attn_logit_softcapping is not None,
               "logprob_impl": config.final_logit_softcapping is not None,
               "decode_head_impl": config.final_logit_softcapping is not None}
    updates: dict[str, Any] = {"layer_types": types}
    for key, unsupported in kernels.items():
        if not unsupported:
            continue
        impl = getattr(config, key)
        if impl == "auto":
            updates[key] = "xla"
        elif impl != "xla":
            raise ConfigError(f"{key}={impl!r} has no soft-capping or sliding window, which "
                              "this Gemma config needs; use 'auto' or 'xla'")
    return updates


def hf_fields(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The Gemma `ModelConfig` fields of a HF `config.json` dict (transformers 4 and 5
    keys), after checking the switches jrl does not model; the global layers' linear
    RoPE factor (or None) as `linear_rope_factor`, for `config.py` to make its
    `LinearRopeScaling`."""
    act = hf_config.get("hidden_activation") or hf_config.get("hidden_act") or ACTIVATION
    if act != ACTIVATION:
        raise ConfigError(f"unsupported hidden_activation {act!r}; Gemma checkpoints use "
                          f"{ACTIVATION!r} (GeGLU with tanh GELU), the only one jrl supports")
    if hf_config.get("use_bidirectional_attention"):
        raise ConfigError("config.json sets use_bidirectional_attention=true (an encoder "
                          "variant); jrl supports causal Gemma only")
    family = "gemma3" if hf_config.get("model_type") == "gemma3_text" or any(
        a.startswith("Gemma3") for a in hf_config.get("architectures") or []) else "gemma2"
    num_layers = hf_config["num_hidden_layers"]
    types = hf_config.get("layer_types")
    if types is None:  # transformers 4 configs: the pattern as a number
        pattern = hf_config.get("sliding_window_pattern") or (6 if family == "gemma3" else 2)
        types = layer_types(num_layers, int(pattern))
    rope = hf_config.get("rope_parameters") or {}
    if family == "gemma2":
        attn_cap = hf_config.get("attn_logit_softcapping", 50.0)  # HF's defaults
        final_cap = hf_config.get("final_logit_softcapping", 30.0)
        full = rope if "rope_theta" in rope else {}
        local = full
    else:
        # HF's Gemma3Attention does not pass attn_logit_softcapping to its attention (it
        # is null in the released configs): jrl follows the code, not the key.
        attn_cap = None
        final_cap = hf_config.get("final_logit_softcapping")
        full = dict(rope.get(FULL) or {})
        local = dict(rope.get(SLIDING) or {})
        if not full and hf_config.get("rope_scaling"):
            full = dict(hf_config["rope_scaling"])
    theta = full.get("rope_theta", hf_config.get("rope_theta")) or (
        1e6 if family == "gemma3" else 10000.0)
    local_theta = local.get("rope_theta", hf_config.get("rope_local_base_freq"))
    if family == "gemma3" and local_theta is None:
        local_theta = 10000.0  # HF's default
    factor = None
    kind = full.get("rope_type", full.get("type", "default"))
    if kind == "linear":
        factor = float(full["factor"])
    elif kind != "default":
        raise ConfigError(f"unsupported rope_type {kind!r} for the global layers; Gemma "
                          "supports 'default' and 'linear'")
    local_kind = local.get("rope_type", local.get("type", "default"))
    if local_kind != "default":
        raise ConfigError(f"unsupported rope_type {local_kind!r} for the sliding layers; jrl "
                          "supports 'default' there")
    return dict(
        family=family,
        rope_theta=float(theta),
        linear_rope_factor=factor,
        rope_local_base_freq=None if family == "gemma2" else float(local_theta),
        attn_logit_softcapping=None if attn_cap is None else float(attn_cap),
        final_logit_softcapping=None if final_cap is None else float(final_cap),
        query_pre_attn_scalar=hf_config.get("query_pre_attn_scalar", 256),
        sliding_window=hf_config.get("sliding_window", 4096),
        layer_types=tuple(types),
        # Gemma ties the LM head to the embedding unless the config says otherwise.
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", True)),
    )


def to_hf(config) -> dict[str, Any]:
    """The Gemma keys of `config.json` (transformers 5's names, with the transformers 4
    ones it also reads), on top of the shared keys `ModelConfig.to_hf` writes."""
    scaling = config.rope_scaling
    full = {"rope_type": "default", "rope_theta": config.rope_theta}
    if scaling is not None:
        full.update(rope_type="linear", factor=scaling.factor)
    hf = {
        "hidden_activation": ACTIVATION,
        "hidden_act": ACTIVATION,
        "attention_bias": False,
        "attn_logit_softcapping": config.attn_logit_softcapping,
        "final_logit_softcapping": config.final_logit_softcapping,
        "query_pre_attn_scalar": config.query_pre_attn_scalar,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types) or [FULL] * config.num_layers,
        "use_bidirectional_attention": False,
    }
    if config.family == "gemma2":
        hf.update(rope_parameters=full, rope_scaling=None)
    else:
        local = {"rope_type": "default", "rope_theta": config.rope_local_base_freq}
        hf.update(rope_parameters={FULL: full, SLIDING: local},
                  rope_local_base_freq=config.rope_local_base_freq,
                  rope_scaling=None if scaling is None else {"rope_type": "linear",
                                                             "factor": scaling.factor})
    return hf


def unsupported_architecture(hf_config: Mapping[str, Any]) -> str | None:
    """The error for a Gemma checkpoint jrl does not load (the multimodal Gemma 3), or
    None."""
    architectures = set(hf_config.get("architectures") or [])
    multimodal = sorted(architectures & _MULTIMODAL)
    if multimodal or (not architectures and hf_config.get("model_type") == "gemma3"):
        what = f"architectures {multimodal}" if multimodal else "model_type 'gemma3'"
        return (f"{what}: the multimodal Gemma 3 (vision tower and projector) is not "
                "supported; jrl loads the text model, Gemma3ForCausalLM (model_type "
                "'gemma3_text', e.g. google/gemma-3-1b-pt), and Gemma2ForCausalLM")
    return None
