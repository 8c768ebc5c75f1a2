"""Decoder-only transformer of the Llama 3 / Qwen2 / Qwen2.5 / Qwen3 and Gemma 2 / 3 families
and the mixture-of-experts Qwen3-MoE and Mixtral (Flax Linen).

One layer is `x += Attn(RMSNorm(x)); x += SwiGLU(RMSNorm(x))`; the layers are one
`nn.scan`, so their parameters are stacked on a leading `layers` axis and the
layer is compiled once. Gemma's layer is `x += Norm(Attn(Norm(x))); x +=
Norm(GeGLU(Norm(x)))` with soft-capping and sliding-window layers (`jrl.models.gemma`).

Parameter tree (shapes with L layers, V vocab, D hidden, F mlp, N/K query/kv heads,
H head_dim; logical axis names in brackets):

    embed/embedding                 [V, D]        (vocab, embed)
    layers/attn_norm/scale          [L, D]        (layers, embed)
    layers/attn/q_proj/kernel       [L, D, N, H]  (layers, embed, heads, head_dim)
    layers/attn/q_proj/bias         [L, N, H]     qwen2 only
    layers/attn/k_proj/kernel       [L, D, K, H]  (layers, embed, kv_heads, head_dim)
    layers/attn/k_proj/bias         [L, K, H]     qwen2 only
    layers/attn/v_proj/kernel       [L, D, K, H]
    layers/attn/v_proj/bias         [L, K, H]     qwen2 only
    layers/attn/q_norm/scale        [L, H]        qwen3 only
    layers/attn/k_norm/scale        [L, H]        qwen3 only
    layers/attn/o_proj/kernel       [L, N, H, D]  (layers, heads, head_dim, embed)
    layers/mlp_norm/scale           [L, D]
    layers/mlp/gate_proj/kernel     [L, D, F]     (layers, embed, mlp)
    layers/mlp/up_proj/kernel       [L, D, F]
    layers/mlp/down_proj/kernel     [L, F, D]     (layers, mlp, embed)
    layers/post_attn_norm/scale     [L, D]        gemma only (HF: post_attention_layernorm)
    layers/post_mlp_norm/scale      [L, D]        gemma only (HF: post_feedforward_layernorm;
                                                  its pre_feedforward_layernorm is mlp_norm)
    final_norm/scale                [D]
    lm_head/kernel                  [D, V]        untied LM only (see heads.py)

An MoE family's `layers/mlp` is `jrl.models.moe.MoeMlp`'s instead (router and the
experts' kernels, `[L, E, ...]`).

`forward` serves training (no cache; the layers as one scan), prefill and decode
(the layers applied one by one, each on its own cache buffers); see
`jrl.models.cache` for the cache contract. It returns hidden states; `heads.unembed` turns them into
float32 logits, so log-probs can be computed in chunks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jrl import sharding
from jrl.kernels import decode_attention as decode_lib
from jrl.kernels import packed_attention
from jrl.models import cache as cache_lib
from jrl.models import context_attention, gemma, moe, rope
from jrl.models import heads as heads_lib
from jrl.models.cache import KVCache, PagedCache, RowCache, attention_mask
from jrl.models.config import ModelConfig
from jrl.sharding import constrain

Params = Mapping[str, Any]
# Logical axes of activations (`jrl.sharding.constrain`): batch split over the data
# axes, tokens over `context` (training passes; `jrl.models.context_attention`), heads
# and MLP width over `tensor`, the hidden (embed) dimension whole.
_HIDDEN = ("batch", "length", None)
_HEADS = ("batch", "length", "heads", None)
_KV_HEADS = ("batch", "length", "kv_heads", None)
_MLP = ("batch", "length", "mlp")
_GATE_UP = ("batch", "length", None, "mlp")
# `dots_saveable` keeps every matmul's output; the MoE block's grouped matmuls are
# kernels, not dots, and keep theirs by name (`moe.SAVED_NAMES`).
_policies = jax.checkpoint_policies
_REMAT_POLICIES = {"full": None, "dots_saveable": _policies.save_from_both_policies(
    _policies.dots_saveable, _policies.save_only_these_names(*moe.SAVED_NAMES))}
# With LoRA, `dots_saveable` would keep both halves of every adapted projection (`x W`
# and `(x A) B`, each as wide as the output). Saving by name instead keeps what the
# plain model keeps (each projection's output, here the sum) plus the rank-r `x A`.
_PROJ_OUT, _LORA_LOW = "proj_out", "lora_low"
_LORA_DOTS_SAVEABLE = _policies.save_only_these_names(_PROJ_OUT, _LORA_LOW, *moe.SAVED_NAMES)


class RMSNorm(nn.Module):
    """`x / sqrt(mean(x^2) + eps) * scale`, statistics in float32 (Zhang & Sennrich 2019)."""

    eps: float
    axis_name: str
    dtype: str
    param_dtype: str
    recompute: bool = False  # the backward pass recomputes from `x` (`_rms_norm`)
    unit_offset: bool = False  # Gemma's: the scale is 1 + weight (`gemma.rms_norm`)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        # A scale of 1 either way: Gemma stores it as 1 + weight, with weight 0.
        unit = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        init = nn.with_logical_partitioning(unit, (self.axis_name,))
        scale = self.param("scale", init, (x.shape[-1],), self.param_dtype)
        norm = functools.partial(gemma.rms_norm if self.unit_offset else _rms_norm,
                                 eps=self.eps, dtype=self.dtype)
        return (jax.checkpoint(norm) if self.recompute else norm)(x, scale)


def _rms_norm(x, scale, *, eps: float, dtype: str) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    # Cast before scaling, as the HF checkpoints were trained.
    return normed.astype(dtype) * scale.astype(dtype)


def _norm(config: ModelConfig, axis_name: str, name: str, recompute: bool = False) -> RMSNorm:
    return RMSNorm(config.rms_norm_eps, axis_name, config.dtype, config.param_dtype,
                   recompute, gemma.is_gemma(config), name=name)


def _recomputes_in_backward(config: ModelConfig) -> bool:
    """Whether a layer's norms (q/k norms too; and, with gate and up joined, the MLP's
    hidden values, `_gated_down`) are recomputed in the backward pass from their input:
    in a rolled scan with nothing rematerialised (the trainer's default), where autodiff
    would otherwise stack per layer a norm's input in float32 and its normalised values
    before and after the scale (8 bytes an element a norm, each stack filled and
    written), against the 2 of the input that this keeps."""
    return config.remat == "none" and not config.scan_unroll


def _dense(
    config: ModelConfig, features, axes: tuple[str, ...], name: str, *, axis=-1, bias=False
) -> nn.DenseGeneral:
    """A projection whose kernel carries logical axis names `axes` (inputs first)."""
    num_in = 1 if isinstance(axis, int) else len(axis)
    normal = nn.initializers.normal(config.initializer_range)
    return nn.DenseGeneral(
        features=features,
        axis=axis,
        use_bias=bias,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        kernel_init=nn.with_logical_partitioning(normal, axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[num_in:]),
        name=name,
    )


class Lora(nn.Module):
    """A LoRA adapter's output `(x A) B * alpha / r`, added to a projection's.

    `a [in..., r]` starts uniform in `±1/sqrt(fan_in)` and `b [r, out...]` at zero
    (PEFT's default), so a fresh adapter changes nothing. Each carries its base
    kernel's logical axes for the dimensions they share; the rank is replicated.
    """

    features: tuple[int, ...]
    in_axes: tuple[str, ...]
    out_axes: tuple[str, ...]
    rank: int
    alpha: float
    dtype: str
    param_dtype: str

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        num_in = len(self.in_axes)
        in_shape = x.shape[x.ndim - num_in:]
        bound = 1.0 / math.sqrt(math.prod(in_shape))
        uniform = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)
        a = self.param("a", nn.with_logical_partitioning(uniform, (*self.in_axes, None)),
                       (*in_shape, self.rank), self.param_dtype)
        b = self.param("b", nn.with_logical_partitioning(nn.initializers.zeros,
                                                          (None, *self.out_axes)),
                       (self.rank, *self.features), self.param_dtype)
        x, a, b = (t.astype(self.dtype) for t in (x, a, b))
        contract = tuple(range(x.ndim - num_in, x.ndim))
        low = lax.dot_general(x, a, ((contract, tuple(range(num_in))), ((), ())))
        low = checkpoint_name(low, _LORA_LOW)
        out = lax.dot_general(low, b, (((low.ndim - 1,), (0,)), ((), ())))
        return out * jnp.asarray(self.alpha / self.rank, self.dtype)


def _project(config: ModelConfig, features, axes: tuple[str, ...], name: str, x: jax.Array,
             *, axis=-1, bias=False) -> jax.Array:
    """The projection `name` of `x` (`_dense`), plus its LoRA adapter where configured."""
    out = _dense(config, features, axes, name, axis=axis, bias=bias)(x)
    if not config.lora_rank:
        return out
    if name not in config.lora_targets:
        return checkpoint_name(out, _PROJ_OUT)
    num_in = 1 if isinstance(axis, int) else len(axis)
    features = tuple(features) if isinstance(features, (tuple, list)) else (features,)
    lora = Lora(features, axes[:num_in], axes[num_in:], config.lora_rank, config.lora_alpha,
                config.dtype, config.param_dtype, name=f"{name}_lora")
    return checkpoint_name(out + lora(x).astype(out.dtype), _PROJ_OUT)


def _attention_impl(config: ModelConfig, dtype, num_queries: int, num_keys: int) -> str:
    """cuDNN flash attention where it applies, else XLA.

    cuDNN needs a GPU, half precision and a head_dim it takes
    (`packed_attention.cudnn_head_dim`: up to 256 on Hopper); with a
    mask (which it turns into a bias) its backward pass also needs even T and S. It has
    no soft-cap (a forced "cudnn" with one is refused by `gemma.check`).
    """
    if config.attention_impl == "splash" or config.attn_logit_softcapping is not None:
        return "xla"  # splash takes segment ids only (`packed_attention`)
    if config.attention_impl != "auto":
        return config.attention_impl
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    head_dim_ok = packed_attention.cudnn_head_dim(config.head_dim)
    even = num_queries % 2 == 0 and num_keys % 2 == 0
    on_gpu = jax.default_backend() == "gpu"
    return "cudnn" if on_gpu and half and head_dim_ok and even else "xla"


class DecodeStep(NamedTuple):
    """A decode step's "mask" for `decode_attention.append_and_attend`: row b's real
    tokens fill slots `start_b[b]` through the slot being written."""

    start_b: jax.Array


class SharedPromptMask(NamedTuple):
    """Attention masks of the shared-prompt layout (`forward(..., mask=SharedPrompt)`):
    each row of `[G, P + k R]` holds one prompt and the k responses sampled from it.

    Attributes:
      prompt_g1pp: bool `[G, 1, P, P]`, the prompts' own causal mask.
      response_b1rs: bool `[G k, 1, R, P + R]`, each response's queries over its prompt
        and itself (the last R query rows of the plain `[P + R]` layout's mask).
    """

    prompt_g1pp: jax.Array
    response_b1rs: jax.Array


class SharedPrompt(NamedTuple):
    """The masks `forward` takes for the shared-prompt layout, in place of `[B, T]`.

    Attributes:
      prompt_mask_gp: `[G, P]` validity of each group's (left-padded) prompt.
      row_mask_bs: `[G k, P + R]` validity of each row in the plain layout (its
        prompt, then its response).
    """

    prompt_mask_gp: jax.Array
    row_mask_bs: jax.Array

    def attention_masks(self) -> SharedPromptMask:
        p = self.prompt_mask_gp.shape[1]
        rows = attention_mask(self.row_mask_bs, self.row_mask_bs.shape[1], None)
        return SharedPromptMask(attention_mask(self.prompt_mask_gp, p, None), rows[:, :, p:])


def _attend(config: ModelConfig, q_btnh, k_bskh, v_bskh, mask_b1ts, rows=None):
    """Attention over keys/values `[B, S, K, H]` (no cache): cuDNN or XLA by `_attention_impl`.
    With `rows` (a `RowCache`) q, k and v are its rows, the mask the batch's."""
    impl = _attention_impl(config, q_btnh.dtype, q_btnh.shape[1], k_bskh.shape[1])
    scale = gemma.query_scale(config)
    if impl == "xla":
        return decode_lib.grouped_attention(q_btnh, jnp.swapaxes(k_bskh, 1, 2),
                                            jnp.swapaxes(v_bskh, 1, 2), mask_b1ts, rows,
                                            scale=scale,
                                            softcap=config.attn_logit_softcapping)
    if rows is not None:
        mask_b1ts = rows.to_cache_rows(mask_b1ts, ("batch", None, None, None))
    if impl == "cudnn":
        k_bskh, v_bskh = packed_attention.heads_split_alike(q_btnh, k_bskh, v_bskh)
    return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, mask=mask_b1ts, scale=scale,
                                        implementation=impl)


def _shared_prompt_attention(config: ModelConfig, q_btnh, k_btkh, v_btkh,
                             mask: SharedPromptMask):
    """Attention of the shared-prompt layout: queries, keys and values `[G, P + k R, ...]`.

    The prompt columns attend among themselves. Each response's R columns become a row
    of its own, `[G k, R]`, whose keys are its group's prompt keys (repeated k times,
    as the plain layout holds them) followed by its own: the plain layout's attention,
    row for row, with the prompt's projections computed once per group.
    """
    p = mask.prompt_g1pp.shape[-1]
    b, _, r, _ = mask.response_b1rs.shape
    out_p = _attend(config, q_btnh[:, :p], k_btkh[:, :p], v_btkh[:, :p], mask.prompt_g1pp)

    def rows(x):  # [G, k R, ...] -> [G k, R, ...]
        return x[:, p:].reshape(b, r, *x.shape[2:])

    k = b // q_btnh.shape[0]
    keys, values = (jnp.concatenate([jnp.repeat(x[:, :p], k, axis=0), rows(x)], axis=1)
                    for x in (k_btkh, v_btkh))
    out_r = _attend(config, rows(q_btnh), keys, values, mask.response_b1rs)
    out_r = out_r.reshape(q_btnh.shape[0], k * r, *out_r.shape[2:])
    return jnp.concatenate([out_p, out_r], axis=1)


def _packed_attention(c: ModelConfig, q_btnh, k_btkh, v_btkh, segments, local):
    """Attention over rows given as segments (`packed_attention`), split over the mesh's
    `context` axis where it divides T (`context_attention`), with Gemma's soft-cap and
    query scale; a sliding layer's (`local`) with its window.

    A kernel's mask is fixed when it is traced, so under the scan's traced `local` one
    `lax.cond` runs the windowed or the global variant: selecting between both, as
    `gemma.for_layer` does for dense masks, would run the attention twice.
    """
    attend = (context_attention.attend if context_attention.applies(q_btnh.shape[1])
              else packed_attention.attend)

    def with_window(window):
        return functools.partial(attend, impl=c.attention_impl, window=window,
                                 softcap=c.attn_logit_softcapping, scale=gemma.query_scale(c))

    operands = (q_btnh, k_btkh, v_btkh, segments)
    if local is None or gemma.SLIDING not in c.layer_types:
        return with_window(None)(*operands)
    if gemma.FULL not in c.layer_types:
        return with_window(c.sliding_window)(*operands)
    return lax.cond(local, with_window(c.sliding_window), with_window(None), *operands)


def _rotate_and_attend(c: ModelConfig, q_btnh, k_btkh, v_btkh, sin_btk, cos_btk, mask_b1ts,
                       cache, layer, write_index, local=None):
    """RoPE, then attention by layout (with the cache write where there is a cache);
    packed rows (and padded rows, as one segment each) by `_packed_attention`. `local`:
    whether this is a sliding-window layer (None: the config has no `layer_types`)."""
    q_btnh = constrain(rope.apply_rope(q_btnh, sin_btk, cos_btk), _HEADS)
    k_btkh = constrain(rope.apply_rope(k_btkh, sin_btk, cos_btk), _KV_HEADS)
    v_btkh = constrain(v_btkh, _KV_HEADS)
    if isinstance(mask_b1ts, SharedPromptMask):
        return _shared_prompt_attention(c, q_btnh, k_btkh, v_btkh, mask_b1ts), cache
    if isinstance(mask_b1ts, packed_attention.Segments):
        return _packed_attention(c, q_btnh, k_btkh, v_btkh, mask_b1ts, local), cache
    if cache is None:
        return _attend(c, q_btnh, k_btkh, v_btkh, mask_b1ts), cache
    if isinstance(cache, PagedCache):  # each row at its own slots, read through its pages
        cache = cache.write(layer, write_index, k_btkh, v_btkh)
        if isinstance(mask_b1ts, DecodeStep):  # a kernel reads the rows' pages in place
            q_bnh, slot_b = q_btnh[:, 0], write_index - cache.shift  # physical slots
            if paged_kernel(c, cache.page_size) == "tpu":
                out_bnh = decode_lib.tpu_paged_attention(
                    q_bnh, *cache.layer(layer), cache.block_table, slot_b + 1,
                    scale=gemma.query_scale(c), softcap=c.attn_logit_softcapping)
            else:
                out_bnh = decode_lib.paged_attention(
                    q_bnh, *cache.layer(layer), cache.block_table,
                    mask_b1ts.start_b - cache.shift, slot_b)
            return out_bnh[:, None], cache
        k_bksh, v_bksh = (t.astype(c.dtype) for t in cache.view(layer))
        return _attend(c, q_btnh, jnp.swapaxes(k_bksh, 1, 2), jnp.swapaxes(v_bksh, 1, 2),
                       mask_b1ts), cache
    if cache.layer(layer)[0].shape[2] < mask_b1ts.shape[-1]:  # a ring buffer
        return _ring_attend(c, q_btnh, k_btkh, v_btkh, mask_b1ts, cache, layer, write_index)
    rows = isinstance(cache, RowCache)
    if rows:  # rotated on the batch's rows, attended on the cache's
        q_btnh, k_btkh, v_btkh = (cache.to_cache_rows(x, axes) for x, axes in (
            (q_btnh, _HEADS), (k_btkh, _KV_HEADS), (v_btkh, _KV_HEADS)))
    # The cache's heads-first layout (XLA cancels the transposes on its path).
    cache = cache.write(layer, write_index, k_btkh, v_btkh)
    k_bksh, v_bksh = (t.astype(c.dtype) for t in cache.layer(layer))
    out_btnh = _attend(c, q_btnh, jnp.swapaxes(k_bksh, 1, 2), jnp.swapaxes(v_bksh, 1, 2),
                       mask_b1ts, cache if rows else None)
    return (cache.to_batch_rows(out_btnh, _HEADS) if rows else out_btnh), cache


def _ring_attend(c: ModelConfig, q_btnh, k_btkh, v_btkh, mask_b1ts, cache, layer, write_index):
    """Attention of a sliding-window layer whose cache is a ring buffer of W slots
    (`cache_lib.init_cache(ring=True)`), over what the ring holds and the new tokens,
    each key masked as its slot's column of `mask_b1ts` `[B, 1, T, S]`.

    A decode step (T = 1) writes its token first and attends to the ring: the window's
    keys are the W slots up to the query's. Longer writes (the prefill) attend to the
    ring as it was and the T new tokens, then keep the last W of them."""
    if isinstance(cache, RowCache):
        raise ValueError("a ring-buffer cache layer cannot take a RowCache's rows")
    num = q_btnh.shape[1]
    slots = cache.layer(layer)[0].shape[2]
    if num == 1:
        cache = cache.write_ring(layer, write_index, k_btkh, v_btkh)
        k_bksh, v_bksh = (t.astype(c.dtype) for t in cache.layer(layer))
        key_slots = cache_lib.ring_slots(write_index, slots)
        keys, values = jnp.swapaxes(k_bksh, 1, 2), jnp.swapaxes(v_bksh, 1, 2)
    else:
        held = (jnp.swapaxes(t, 1, 2).astype(c.dtype) for t in cache.layer(layer))
        keys, values = (jnp.concatenate([old, new.astype(c.dtype)], axis=1)
                        for old, new in zip(held, (k_btkh, v_btkh), strict=True))
        key_slots = jnp.concatenate([cache_lib.ring_slots(write_index - 1, slots),
                                     write_index + jnp.arange(num, dtype=jnp.int32)])
        cache = cache.write_ring(layer, write_index, k_btkh, v_btkh)
    columns = jnp.take(mask_b1ts, jnp.maximum(key_slots, 0), axis=3)
    out_btnh = _attend(c, q_btnh, keys, values, columns & (key_slots >= 0))
    return out_btnh, cache


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE, optional qkv bias and q/k norm, and a KV cache."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x_btd, sin_btk, cos_btk, mask_b1ts, cache, layer, write_index,
                 local=None):
        c = self.config
        heads = (c.num_heads, c.head_dim)
        kv_heads = (c.num_kv_heads, c.head_dim)
        fused_layout = self.has_variable("params", FUSED_QKV)  # the sampler's
        fused = (c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        kernel_step = isinstance(mask_b1ts, DecodeStep) and not isinstance(cache, PagedCache)
        paged_step = isinstance(mask_b1ts, DecodeStep) and paged_fused(c, cache)
        if fused_layout and (paged_step or (kernel_step and not c.qk_norm)):
            # The kernel takes the projection's output as it is and adds the bias itself.
            qkv_btjh = _dense(c, fused, ("embed", None, "head_dim"), FUSED_QKV)(x_btd)
            bias_jh = self.variables["params"][FUSED_QKV]["bias"] if c.qkv_bias else None
            if bias_jh is not None and self.has_variable("params", KERNEL_BIAS):
                made = self.variables["params"][KERNEL_BIAS]
                bias_jh = decode_lib.KernelBias(bias_jh, {int(p): x for p, x in made.items()})
            if paged_step:  # each row's key and value written at its page, read in place
                # (physical slots: a row's pages start at its first real token)
                out_bnh, k_pool, v_pool = decode_lib.append_and_attend_qkv_paged(
                    qkv_btjh[:, 0], bias_jh, sin_btk[:, 0], cos_btk[:, 0], *cache.layer(layer),
                    cache.block_table, mask_b1ts.start_b - cache.shift,
                    write_index - cache.shift, num_heads=c.num_heads)
                return (self._output(out_bnh[:, None]),
                        cache.replace_layer(layer, k_pool, v_pool))
            qkv_bjh, sin_bk, cos_bk = _to_cache_rows(
                cache, (constrain(qkv_btjh[:, 0], ("batch", None, None)), ("batch", None, None)),
                (sin_btk[:, 0], ("batch", None)), (cos_btk[:, 0], ("batch", None)))
            out_bnh, k_bksh, v_bksh = decode_lib.append_and_attend_qkv(
                qkv_bjh,
                bias_jh,
                sin_bk, cos_bk, *cache.layer(layer), mask_b1ts.start_b,
                write_index, num_heads=c.num_heads, impl="mosaic",
                tiles=_decode_tiles(cache))
            cache = cache.replace_layer(layer, k_bksh, v_bksh)
            return self._output(_to_batch_rows(cache, out_bnh)[:, None]), cache
        if fused_layout:
            qkv = _dense(c, fused, ("embed", None, "head_dim"), FUSED_QKV,
                         bias=c.qkv_bias)(x_btd)
            q_btnh, k_btkh, v_btkh = jnp.split(
                qkv, [c.num_heads, c.num_heads + c.num_kv_heads], axis=2)
        else:
            q_btnh = _project(c, heads, ("embed", "heads", "head_dim"), "q_proj", x_btd,
                              bias=c.qkv_bias)
            kv_axes = ("embed", "kv_heads", "head_dim")
            k_btkh = _project(c, kv_heads, kv_axes, "k_proj", x_btd, bias=c.qkv_bias)
            v_btkh = _project(c, kv_heads, kv_axes, "v_proj", x_btd, bias=c.qkv_bias)
        if c.qk_norm:
            # Recomputed in the backward pass as the layer's other norms are: autodiff
            # keeps two float32 copies of q and k otherwise.
            recompute = _recomputes_in_backward(c)
            q_btnh = _norm(c, "head_dim", "q_norm", recompute)(q_btnh)
            k_btkh = _norm(c, "head_dim", "k_norm", recompute)(k_btkh)
        if kernel_step:  # one kernel: RoPE, the cache write, attention
            q_btnh, k_btkh, v_btkh = (constrain(x, axes) for x, axes in (
                (q_btnh, _HEADS), (k_btkh, _KV_HEADS), (v_btkh, _KV_HEADS)))
            operands = _to_cache_rows(cache, *((x, (axes[0], *axes[2:])) for x, axes in (
                (q_btnh[:, 0], _HEADS), (k_btkh[:, 0], _KV_HEADS), (v_btkh[:, 0], _KV_HEADS),
                (sin_btk[:, 0], ("batch", "length", None)),
                (cos_btk[:, 0], ("batch", "length", None)))))
            out_bnh, k_bksh, v_bksh = decode_lib.append_and_attend(
                *operands, *cache.layer(layer), mask_b1ts.start_b, write_index,
                impl="mosaic", tiles=_decode_tiles(cache))
            cache = cache.replace_layer(layer, k_bksh, v_bksh)
            out_btnh = _to_batch_rows(cache, out_bnh)[:, None]
        else:
            out_btnh, cache = _rotate_and_attend(c, q_btnh, k_btkh, v_btkh, sin_btk, cos_btk,
                                                 mask_b1ts, cache, layer, write_index, local)
        return self._output(out_btnh), cache

    def _output(self, out_btnh):
        """The output projection of the heads' outputs `[B, T, N, H]`."""
        out_btnh = constrain(out_btnh, _HEADS)
        o_axes = ("heads", "head_dim", "embed")
        return _project(self.config, self.config.hidden_size, o_axes, "o_proj", out_btnh,
                        axis=(-2, -1))


def _to_cache_rows(cache, *operands) -> tuple[jax.Array, ...]:
    """A decode step's per-row attention operands `(x, logical axes)`, each `[B, ...]`,
    as the cache's rows where the cache has rows of its own (`RowCache`), else as they
    are."""
    if isinstance(cache, RowCache):
        return tuple(cache.to_cache_rows(x, axes) for x, axes in operands)
    return tuple(x for x, _ in operands)


def _to_batch_rows(cache, out_bnh: jax.Array) -> jax.Array:
    """The attention output `[C, N, H]` of a `RowCache`'s rows as the batch's (zeros for
    rows with no cache row); as it is for any other cache."""
    if isinstance(cache, RowCache):
        return cache.to_batch_rows(out_bnh, ("batch", "heads", None))
    return out_bnh


# The MLP projections `Mlp` may apply as one matmul, in this order (gate first).
GATE_UP = moe.GATE_UP


def _joins_gate_up(module: nn.Module, config: ModelConfig) -> bool:
    """Whether `Mlp` computes gate and up as one matmul of the two kernels stacked:
    applied (not at init, which creates the two projections' parameters), with neither
    carrying a LoRA adapter, in a rolled scan over layers. There the backward pass reads
    one stacked buffer of the pair's outputs (`swiglu`'s or `geglu`'s residual) instead of several
    equal-shaped ones, which XLA fills once and copies into each: the docs workload's
    update at the default settings 4.6% faster and 5.6 GiB lighter on an H200. Unrolled,
    the joined form made the update 3.7% slower, so the two matmuls stay
    (`experiments/results/grpo_defaults/unrolled_h200/`)."""
    if module.is_initializing() or config.scan_unroll:
        return False
    return all(module.has_variable("params", n) and n not in config.lora_targets
               for n in GATE_UP)


class Mlp(nn.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))` (Shazeer 2020, https://arxiv.org/abs/2002.05202);
    Gemma's GeGLU, `down(gelu_tanh(gate(x)) * up(x))`, the same way (`_gated`)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x_btd: jax.Array) -> jax.Array:
        c = self.config
        f = c.intermediate_size
        gated = _gated(c)
        if self.has_variable("params", FUSED_GATE_UP):  # the sampler's fused layout
            gate_up = _dense(c, (2, f), ("embed", None, "mlp"), FUSED_GATE_UP)(x_btd)
        elif _joins_gate_up(self, c):  # the two kernels stacked (the sampler's layout)
            kernels = [nn.unbox(self.get_variable("params", n)["kernel"]) for n in GATE_UP]
            kernel = jnp.stack([k.astype(c.dtype) for k in kernels], axis=1)
            gate_up = jnp.einsum("btd,dkf->btkf", x_btd.astype(c.dtype), kernel)
            if c.lora_rank:  # as `_project` names an adapter-free projection's output
                gate_up = checkpoint_name(gate_up, _PROJ_OUT)
        else:
            gate_btf = constrain(_project(c, f, ("embed", "mlp"), "gate_proj", x_btd), _MLP)
            up_btf = constrain(_project(c, f, ("embed", "mlp"), "up_proj", x_btd), _MLP)
            hidden_btf = (constrain(gemma.gelu_tanh(gate_btf) * up_btf, _MLP)
                          if gemma.is_gemma(c) else nn.silu(gate_btf) * up_btf)
            return _project(c, c.hidden_size, ("mlp", "embed"), "down_proj", hidden_btf)
        gate_up = constrain(gate_up, _GATE_UP)
        if _recomputes_in_backward(c) and "down_proj" not in c.lora_targets:
            kernel = nn.unbox(self.get_variable("params", "down_proj")["kernel"])
            # A fresh callable for each trace: `jax.checkpoint` caches its trace by the
            # function, and the trace's `constrain` pins to the mesh active when it was
            # made, which a sampling group on other devices must not inherit.
            down = jax.checkpoint(functools.partial(_gated_down, gated))
            out_btd = down(gate_up, kernel.astype(c.dtype))
            return checkpoint_name(out_btd, _PROJ_OUT) if c.lora_rank else out_btd
        hidden_btf = constrain(gated(gate_up), _MLP)
        return _project(c, c.hidden_size, ("mlp", "embed"), "down_proj", hidden_btf)


def _gated(config: ModelConfig):
    """The gated activation of `gate_up [..., 2, F]`: `geglu` for Gemma, else `swiglu`.
    Both keep only `gate_up` for the backward pass: autodiff of the tanh GELU would keep
    eight `[B, T, F]` values a layer (gate, up and six of the GELU's), most of the update's
    memory for Gemma's wide MLPs (Gemma-3-1B: 6,912 a token)."""
    return geglu if gemma.is_gemma(config) else swiglu


def _gated_down(gated, gate_up: jax.Array, kernel_fd: jax.Array) -> jax.Array:
    """`down(gated(gate_up))`; under `jax.checkpoint` its backward pass recomputes
    `gated(gate_up)` from the one array the layer keeps: a rolled scan with nothing
    rematerialised (the trainer's default) then stacks no `[L, B, T, F]` buffer of the
    MLP's hidden values (1.4 GiB at the docs workload's micro-batch) to fill and write."""
    hidden_btf = constrain(gated(gate_up), _MLP)
    return jnp.einsum("btf,fd->btd", hidden_btf, kernel_fd)


@jax.custom_vjp
def swiglu(gate_up: jax.Array) -> jax.Array:
    """`silu(gate) * up` of `gate_up [..., 2, F]` (gate first).

    Its backward pass keeps `gate_up` alone, one array, and recomputes the products
    (`_joins_gate_up` says why)."""
    gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
    return nn.silu(gate) * up


def _swiglu_fwd(gate_up):
    return swiglu(gate_up), gate_up


def _gated_backward(gate_up, d_out, grads):
    """The gradient `[..., 2, F]` of a gated unit's `gate_up` from the one array kept:
    `grads(gate, up, d_out)` gives the two halves' in float32 (`[..., 1, F]` each).

    Each element comes from the pair it belongs to, chosen by its index on the pair's
    axis: one elementwise pass (XLA fuses it into one loop), where stacking the two
    halves kept the activation's terms in float32 between two passes (a concatenation
    2.4x slower on an H200)."""
    gate, up = (gate_up[..., i:i + 1, :].astype(jnp.float32) for i in range(2))
    d_gate, d_up = grads(gate, up, d_out[..., None, :].astype(jnp.float32))
    which = lax.broadcasted_iota(jnp.int32, gate_up.shape, gate_up.ndim - 2)
    return (jnp.where(which == 0, d_gate, d_up).astype(gate_up.dtype),)


def _swiglu_bwd(gate_up, d_out):
    def grads(gate, up, d_out):
        sig = jax.nn.sigmoid(gate)
        # d silu(g) / dg = s (1 + g (1 - s))
        return d_out * up * sig * (1 + gate * (1 - sig)), d_out * gate * sig

    return _gated_backward(gate_up, d_out, grads)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@jax.custom_vjp
def geglu(gate_up: jax.Array) -> jax.Array:
    """`gelu_tanh(gate) * up` of `gate_up [..., 2, F]` (gate first), Gemma's GeGLU.

    Its backward pass keeps `gate_up` alone, as `swiglu`'s does, and recomputes the
    GELU's terms in float32 (autodiff of `gelu_tanh` keeps six `[..., F]` values)."""
    gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
    return gemma.gelu_tanh(gate) * up


def _geglu_fwd(gate_up):
    return geglu(gate_up), gate_up


def _geglu_bwd(gate_up, d_out):
    def grads(gate, up, d_out):
        # gelu_tanh(g) = g c(g), c = (1 + tanh(u)) / 2, u = sqrt(2 / pi) (g + 0.044715 g^3):
        # d/dg = c + g (1 - tanh(u)^2) / 2 * sqrt(2 / pi) (1 + 3 * 0.044715 g^2).
        t = jnp.tanh(_SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate))
        cdf = 0.5 * (1.0 + t)
        d_gelu = cdf + 0.5 * gate * (1.0 - t * t) * _SQRT_2_OVER_PI * (
            1.0 + 3.0 * 0.044715 * gate * gate)
        return d_out * up * d_gelu, d_out * gate * cdf

    return _gated_backward(gate_up, d_out, grads)


geglu.defvjp(_geglu_fwd, _geglu_bwd)


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer; the scan body (carry = (hidden, cache))."""

    config: ModelConfig

    @nn.compact
    def __call__(self, carry, layer, sin_btk, cos_btk, mask_b1ts, write_index, valid_bt=None,
                 forced_btk=None, local=None):
        """`valid_bt`, `forced_btk`: an MoE layer's token weights for its router statistics
        and its replayed experts (`moe.MoeMlp`). `local`: this layer is a sliding-window
        one (a scanned bool where the config has `layer_types`), which picks its mask and
        RoPE tables (`gemma.for_layer`), or for rows given as segments its kernel's
        window (`_packed_attention`)."""
        x_btd, cache = carry
        c = self.config
        if local is not None:
            sin_btk, cos_btk, mask_b1ts = gemma.for_layer(local, sin_btk, cos_btk, mask_b1ts)
        recompute = _recomputes_in_backward(c)
        attn_in = _norm(c, "embed", "attn_norm", recompute)(x_btd)
        attn_out, cache = Attention(c, name="attn")(
            attn_in, sin_btk, cos_btk, mask_b1ts, cache, layer, write_index, local
        )
        if gemma.is_gemma(c):  # sandwich norms: each branch's output normalised too
            attn_out = _norm(c, "embed", "post_attn_norm", recompute)(attn_out)
        x_btd = x_btd + attn_out
        mlp_in = _norm(c, "embed", "mlp_norm", recompute)(x_btd)
        if c.is_moe:
            mlp_out = moe.MoeMlp(c, name="mlp")(mlp_in, valid_bt, forced_btk)
        else:
            mlp_out = Mlp(c, name="mlp")(mlp_in)
        if gemma.is_gemma(c):
            mlp_out = _norm(c, "embed", "post_mlp_norm", recompute)(mlp_out)
        x_btd = x_btd + mlp_out
        return (constrain(x_btd, _HIDDEN), cache), None


def _layer_stack(config: ModelConfig) -> nn.Module:
    """The L layers as one `nn.scan` (optionally rematerialised), params stacked on axis 0."""
    layer_cls = DecoderLayer
    if config.remat != "none":
        # prevent_cse=False is safe (and faster) inside a rolled scan. Unrolled, it lets
        # XLA merge the backward's recomputation with the forward (for dots_saveable,
        # the attention is then not run twice: faster, more memory held); under "full"
        # remat, chosen to save memory, CSE is prevented so nothing extra is held.
        policy = _REMAT_POLICIES[config.remat]
        if config.lora_rank and config.remat == "dots_saveable":
            policy = _LORA_DOTS_SAVEABLE
        prevent_cse = config.scan_unroll and config.remat == "full"
        layer_cls = nn.remat(DecoderLayer, policy=policy, prevent_cse=prevent_cse)
    return nn.scan(
        layer_cls,
        # The MoE layers' router statistics (`moe.ROUTER_COLLECTION`) and chosen experts
        # (`moe.RECORD_COLLECTION`) stack like the params.
        variable_axes={"params": 0, moe.ROUTER_COLLECTION: 0, moe.RECORD_COLLECTION: 0},
        split_rngs={"params": True},
        # (layer, sin, cos, mask, write_index, valid tokens, each layer's replayed experts
        # [, local]): `local` per layer with layer_types.
        in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, 0)
        + ((0,) if config.layer_types else ()),
        length=config.num_layers,
        unroll=config.num_layers if config.scan_unroll else 1,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(config, name="layers")


class Transformer(nn.Module):
    """Backbone (embedding, scanned layers, final norm); creates `head`'s params at init.

    Attributes:
      config: the architecture.
      head: "lm", "value", "score" or "none": which head parameters `init` creates.
        The head is applied by the functions in `jrl.models.heads`.
    """

    config: ModelConfig
    head: str = "lm"

    @nn.compact
    def __call__(self, tokens_bt, positions_bt, mask, routing_btlk=None):
        c = self.config
        normal = nn.initializers.normal(c.initializer_range)
        x_btd = nn.Embed(
            c.vocab_size, c.hidden_size, dtype=c.dtype, param_dtype=c.param_dtype,
            embedding_init=nn.with_logical_partitioning(normal, ("vocab", "embed")),
            name="embed",
        )(tokens_bt)
        if gemma.is_gemma(c):
            x_btd = x_btd * gemma.embed_scale(c)
        x_btd = constrain(x_btd, _HIDDEN)
        sin_btk, cos_btk = rope.sin_cos_by_layer_type(positions_bt, c)
        if isinstance(mask, SharedPrompt):
            mask_b1ts = mask.attention_masks()
        elif isinstance(mask, packed_attention.Segments):
            mask_b1ts = mask  # attention reads the segment ids themselves
        elif (packed_attention.choose_impl(c.attention_impl, c.dtype, c.head_dim,
                                           tokens_bt.shape[1]) == "splash"
              or context_attention.applies(tokens_bt.shape[1])):
            # A padded row's real tokens are contiguous (left-padded prompt, then the
            # response): one segment, and splash attention (or attention split over
            # `context`) needs no dense mask.
            mask_b1ts = packed_attention.segments(mask.astype(jnp.int32), 1)
        else:
            mask_b1ts = attention_mask(mask, tokens_bt.shape[1], None)
        layers = jnp.arange(c.num_layers)
        valid_bt = _valid_tokens(mask) if c.is_moe else None
        forced_lbtk = None if routing_btlk is None else jnp.moveaxis(routing_btlk, 2, 0)
        local = ()
        if c.layer_types:
            local = (gemma.local_flags(c),)
            mask_b1ts = _windowed_masks(c, mask, mask_b1ts, positions_bt, positions_bt)
        (x_btd, _), _ = _layer_stack(c)((x_btd, None), layers, sin_btk, cos_btk, mask_b1ts, None,
                                        valid_bt, forced_lbtk, *local)
        hidden_btd = _norm(c, "embed", "final_norm")(x_btd)
        if self.is_initializing():
            self._create_head(hidden_btd)
        return hidden_btd

    def _create_head(self, hidden_btd: jax.Array) -> None:
        c = self.config
        kwargs = dict(stddev=c.initializer_range, param_dtype=c.param_dtype)
        if self.head == "lm" and not c.tie_word_embeddings:
            heads_lib.Head(c.vocab_size, False, "vocab", name="lm_head", **kwargs)(hidden_btd)
        elif self.head == "value":
            heads_lib.Head(1, True, None, name="value_head", **kwargs)(hidden_btd)
        elif self.head == "score":
            heads_lib.Head(1, False, None, name="score", **kwargs)(hidden_btd)


def _valid_tokens(mask) -> jax.Array:
    """Each token's weight in the router statistics of MoE layers, `[B, T]`: 1 for a real
    token, 0 for padding; in the shared-prompt layout a prompt token counts once for each
    row that shares it, as in the plain layout, where each row holds its copy."""
    if isinstance(mask, SharedPrompt):
        groups, p = mask.prompt_mask_gp.shape
        rows = mask.row_mask_bs.shape[0] // groups
        responses = mask.row_mask_bs[:, p:].reshape(groups, -1)
        return jnp.concatenate([mask.prompt_mask_gp * rows, responses], axis=1)
    if isinstance(mask, packed_attention.Segments):
        return mask.segment_ids_bt > 0
    return mask


# Names of the fused projections a layer may carry instead of its separate ones
# (`fuse_projections`): the sampler's layout, never trained or saved.
FUSED_QKV, FUSED_GATE_UP = "qkv_proj", moe.GATE_UP_JOINED
# The fused decode kernel's bias operands, by plain-tile parts (`with_kernel_bias`).
KERNEL_BIAS = "qkv_kernel_bias"


def fuse_projections(layer_params: dict, config: ModelConfig) -> dict:
    """One layer's parameters with `q/k/v_proj` as one `qkv_proj` (`[D, N + 2K, H]`,
    query heads, then key, then value heads) and `gate/up_proj` as one `gate_up_proj`
    (`[D, 2, F]` in a dense model; an MoE layer's experts `[E, D, 2F]`, one grouped
    matmul, `moe.join_gate_up`, where `moe.JOIN_GATE_UP`): one matmul each instead of
    three and two, for decoding. Projections with an unmerged LoRA adapter stay
    separate."""
    attn, mlp = dict(layer_params["attn"]), dict(layer_params["mlp"])
    if not any(f"{n}_lora" in attn for n in ("q_proj", "k_proj", "v_proj")):
        parts = [attn.pop(n) for n in ("q_proj", "k_proj", "v_proj")]
        attn[FUSED_QKV] = {"kernel": jnp.concatenate([p["kernel"] for p in parts], axis=1)}
        if config.qkv_bias:
            attn[FUSED_QKV]["bias"] = jnp.concatenate([p["bias"] for p in parts], axis=0)
    if not any(f"{n}_lora" in mlp for n in GATE_UP) and (not config.is_moe
                                                         or _joins_experts(config)):
        if config.is_moe:
            mlp = moe.join_gate_up(mlp)
        else:
            parts = [mlp.pop(n)["kernel"] for n in GATE_UP]
            mlp[FUSED_GATE_UP] = {"kernel": jnp.stack(parts, axis=1)}
    return {**layer_params, "attn": attn, "mlp": mlp}


def with_kernel_bias(layer_params: dict, config: ModelConfig) -> dict:
    """One layer's parameters (fused by `fuse_projections`) with the fused decode
    kernel's bias operand made from `qkv_proj`'s bias ahead of the decode loop
    (`KERNEL_BIAS`, `decode_attention.kernel_bias`), where the kernel may read it: a
    qkv bias, no q/k norm and the Mosaic GPU decode attention. A decode step otherwise
    makes it at every layer (24 gathers a step at Qwen2.5-0.5B)."""
    attn = layer_params["attn"]
    if not (config.qkv_bias and not config.qk_norm and FUSED_QKV in attn
            and decode_lib.choose_impl(config.decode_attention_impl, config.head_dim,
                                       dtype=config.dtype) == "mosaic"):
        return layer_params
    made = decode_lib.kernel_bias(attn[FUSED_QKV]["bias"], num_heads=config.num_heads,
                                  num_kv=config.num_kv_heads, dtype=config.dtype)
    return {**layer_params, "attn": {**attn, KERNEL_BIAS: {str(parts): x for parts, x
                                                           in made.by_parts.items()}}}


def _joins_experts(config: ModelConfig) -> bool:
    """Whether `fuse_projections` joins an MoE layer's experts' gate and up: asked for
    (`moe.JOIN_GATE_UP`), and no mesh axis splits the experts' width F, which would put
    a joined kernel's gate and up columns on different devices."""
    sharder = sharding.active_sharder()
    shape = (config.num_experts, config.hidden_size, config.moe_intermediate_size)
    return moe.JOIN_GATE_UP and (sharder is None or sharder.spec(
        ("experts", "embed", "mlp"), shape)[2] is None)


def _cached_forward(params, tokens_bt, positions_bt, mask, cache, write_index, config,
                    record: bool = False):
    """`forward` with a cache: the same layers as `Transformer`, applied one by one; with
    `record` (an MoE model), also each token's experts in every layer, `[B, T, L, k]`.

    Layer l reads its keys/values as the cache's own buffers `k[l]`, `v[l]` and its
    weights as static slices of the stacked parameters (or, when `params["layers"]`
    is a sequence of per-layer trees, as the sampler passes it, as element l), so a
    decode step copies neither (as a scan over layers would, through per-iteration
    dynamic slices).
    """
    c = config
    embedding = params["embed"]["embedding"]
    x_btd = jnp.take(embedding, tokens_bt, axis=0).astype(c.dtype)
    if gemma.is_gemma(c):
        x_btd = x_btd * gemma.embed_scale(c)
    x_btd = constrain(x_btd, _HIDDEN)
    sin_btk, cos_btk = rope.sin_cos_by_layer_type(positions_bt, c)
    mask_b1ts = _attention_mask(c, mask, tokens_bt.shape[1], cache, write_index)
    if c.layer_types:  # the keys' positions: valid slots before each (the cache contract)
        mask_b1ts = _windowed_masks(c, mask, mask_b1ts, positions_bt,
                                    cache_lib.positions_from_mask(mask))

    # Under a trace, one jitted function for every layer, made afresh for this trace:
    # traced and lowered once per call of `_cached_forward` instead of once per layer
    # (the sampler's decode buckets each trace a decode step), called with the layer's
    # own cache buffers as a one-layer cache; XLA inlines the calls, so the program is
    # the same. Fresh, so that no trace outlives the mesh (`constrain`) it was made
    # under; not jitted when called eagerly, where it would compile at every call.
    def apply_layer(layer_params, x_btd, one_layer, sin_btk, cos_btk, mask_b1ts, write_index):
        out = DecoderLayer(c).apply(
            {"params": layer_params}, (x_btd, one_layer), 0, sin_btk, cos_btk, mask_b1ts,
            write_index, mutable=[moe.RECORD_COLLECTION] if record else False)
        ((x_btd, one_layer), _), recorded = out if record else (out, None)
        experts = (recorded[moe.RECORD_COLLECTION]["mlp"][moe.RECORD_NAME][0] if record
                   else None)
        return x_btd, one_layer, experts

    if isinstance(x_btd, jax.core.Tracer):
        apply_layer = jax.jit(apply_layer)

    stacked = not isinstance(params["layers"], (list, tuple))
    experts = []
    for i in range(c.num_layers):
        layer_params = (jax.tree.map(lambda w, i=i: w[i], params["layers"]) if stacked
                        else params["layers"][i])
        local = bool(c.layer_types) and c.layer_types[i] == gemma.SLIDING
        x_btd, one_layer, chosen = apply_layer(layer_params, x_btd, cache.replace(
            k=(cache.k[i],), v=(cache.v[i],)), *gemma.for_layer(local, sin_btk, cos_btk, mask_b1ts),
            write_index)
        cache = cache.replace_layer(i, *one_layer.layer(0))
        experts.append(chosen)
    final_norm = RMSNorm(c.rms_norm_eps, "embed", c.dtype, c.param_dtype,
                         unit_offset=gemma.is_gemma(c))
    hidden_btd = final_norm.apply({"params": params["final_norm"]}, x_btd)
    if record:
        return hidden_btd, cache, jnp.stack(experts, axis=2)
    return hidden_btd, cache


def _windowed_masks(config: ModelConfig, mask, mask_b1ts, query_pos_bt, key_pos_bs):
    """The layers' masks as a `gemma.LayerTypes` pair: as they are for the global layers,
    with `config.sliding_window` applied for the sliding ones. `mask` is `forward`'s
    (the shared-prompt layout's positions come from its own masks). Segments stay one:
    the kernels take the window as an option (`_packed_attention`)."""
    if gemma.SLIDING not in config.layer_types or isinstance(
            mask_b1ts, packed_attention.Segments):
        return mask_b1ts
    window = config.sliding_window
    if isinstance(mask, SharedPrompt):
        sliding = gemma.window_shared_prompt(
            mask_b1ts, cache_lib.positions_from_mask(mask.prompt_mask_gp),
            cache_lib.positions_from_mask(mask.row_mask_bs), window)
    else:
        sliding = gemma.windowed(mask_b1ts, query_pos_bt, key_pos_bs, window)
    return gemma.LayerTypes(mask_b1ts, sliding)


def _decode_tiles(cache):
    """The decode kernel's settings: its defaults (None), except that a kernel on a
    `RowCache` chooses its blocks (and parts) as it would on the single sampling
    program's cache (the batch's rows a shard, its slots), so the segments give that
    program's bits."""
    if not isinstance(cache, RowCache):
        return None
    like = (cache.cache_rows.shape[1], max(cache.softmax_slots, cache.max_len))
    return dataclasses.replace(decode_lib.MOSAIC_TILES, split_like=like)


def paged_kernel(config: ModelConfig, page_size: int) -> str | None:
    """The kernel a paged cache's decode steps read its pages in place with: "tpu" on a
    TPU (Pallas' paged attention, `decode_attention.tpu_paged_attention`), "mosaic" where
    `choose_impl` takes the Mosaic GPU kernel and it takes pages of `page_size` slots
    (`decode_attention.paged_attention`); None (a gathered copy attended in XLA)
    elsewhere, with `decode_attention_impl="xla"` and for sliding-window layers."""
    if config.decode_attention_impl == "xla" or gemma.SLIDING in (config.layer_types or ()):
        return None
    if decode_lib.on_tpu():
        return "tpu"
    impl = decode_lib.choose_impl(config.decode_attention_impl, config.head_dim,
                                  dtype=config.dtype)
    mosaic = (impl == "mosaic" and decode_lib.paged_applies(page_size, config.head_dim)
              and config.attn_logit_softcapping is None and gemma.query_scale(config) is None)
    return "mosaic" if mosaic else None


def paged_fused(config: ModelConfig, cache) -> bool:
    """Whether a decode step over a paged cache takes the fused Mosaic GPU kernel
    (`decode_attention.append_and_attend_qkv_paged`: the cache write, RoPE and the bias
    in the kernel) rather than the XLA write and `paged_attention`: where
    the Mosaic GPU kernel reads the pages (`paged_kernel`), the heads have no q/k norm
    (the kernel rotates the projection's output itself), one device runs the step (the
    kernel writes the pools in place), and by `decode_attention.PAGED_FUSED`: "off"
    never, "always", or "auto" where `PAGED_FUSED_TILES` take it for these rows and
    slots (`MosaicTiles.takes_fused`: the fused kernel keeps a (row, key/value head)
    pair in one program, so at few rows over long caches it leaves the GPU idle where
    the unfused one splits the pair's slots)."""
    mode = decode_lib.PAGED_FUSED
    if mode not in decode_lib.PAGED_FUSED_MODES:
        raise ValueError(f"decode_attention.PAGED_FUSED must be one of "
                         f"{decode_lib.PAGED_FUSED_MODES}; got {mode!r}")
    sharder = sharding.active_sharder()
    if mode == "off" or not (isinstance(cache, PagedCache) and not config.qk_norm
                             and paged_kernel(config, cache.page_size) == "mosaic"
                             and (sharder is None or sharder.mesh.size == 1)):
        return False
    if mode == "always":
        return True
    rows, pages_per_row = cache.block_table.shape
    return decode_lib.PAGED_FUSED_TILES.takes_fused(rows, config.num_kv_heads,
                                                    pages_per_row * cache.page_size)


def _attention_mask(config: ModelConfig, mask, num_queries, cache, write_index):
    """The layers' attention mask: bool `[B, 1, T, S]`, or for a decode step run by a
    Pallas kernel (on its Mosaic GPU backend), each row's first filled slot (`DecodeStep`;
    the row's slots are contiguous by the cache contract: left padding, then tokens up
    to the one being written)."""
    if isinstance(cache, PagedCache) and num_queries == 1:
        if paged_kernel(config, cache.page_size):  # the rows' own slots, read in place
            return DecodeStep(jnp.argmax(mask.astype(bool), axis=1).astype(jnp.int32))
    elif cache is not None and num_queries == 1:
        impl = decode_lib.choose_impl(config.decode_attention_impl, config.head_dim,
                                      cache.max_len, config.dtype)
        if impl == "mosaic":
            if isinstance(cache, RowCache):  # the kernel runs on the cache's rows
                mask = cache.to_cache_rows(mask, ("batch", None))
            return DecodeStep(jnp.argmax(mask.astype(bool), axis=1).astype(jnp.int32))
    return attention_mask(mask, num_queries, write_index)


def _init_variables(config: ModelConfig, rng: jax.Array, head: str):
    if head not in heads_lib.HEADS:
        raise ValueError(f"unknown head {head!r}; choose one of {list(heads_lib.HEADS)}")
    tokens = jnp.zeros((1, 1), jnp.int32)
    # The same parameters either way; the unrolled scan only makes the init program
    # slower to compile (0.5B: 26.6 s against 3.3 s on XLA:CPU).
    config = dataclasses.replace(config, scan_unroll=False)
    return Transformer(config, head).init(rng, tokens, tokens, jnp.ones((1, 1), jnp.int32))


def init_params(config: ModelConfig, rng: jax.Array, head: str = "lm") -> dict:
    """Randomly initialised parameters (plain arrays; see the module docstring for the tree).

    Args:
      config: the architecture.
      rng: PRNG key.
      head: "lm" (causal LM), "value" (PPO critic), "score" (reward model) or "none".

    Returns:
      The parameter dict, in `config.param_dtype`.
    """
    return nn.meta.unbox(_init_variables(config, rng, head)["params"])


def param_logical_axes(config: ModelConfig, head: str = "lm") -> dict:
    """`PartitionSpec`s of logical axis names, one per parameter (no compute, no memory)."""
    boxed = jax.eval_shape(lambda: _init_variables(config, jax.random.key(0), head))
    return nn.get_partition_spec(boxed)["params"]


def forward(
    params: Params,
    tokens_bt: jax.Array,
    positions_bt: jax.Array,
    mask: jax.Array,
    cache: KVCache | None = None,
    write_index: jax.Array | int | None = None,
    *,
    config: ModelConfig,
    routing: jax.Array | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Runs the backbone: training forward (no cache), prefill or decode step.

    Args:
      params: model parameters (extra head entries are ignored).
      tokens_bt: int32 `[B, T]` token ids.
      positions_bt: int32 `[B, T]` RoPE positions (`cache.positions_from_mask`).
      mask: without a cache, `[B, T]` token validity, a `SharedPrompt` for the
        shared-prompt layout (each row of `tokens_bt` one prompt followed by the k
        responses sampled from it), or `packed_attention.Segments` for packed rows
        (several sequences end to end, `jrl.rl.packing`); with a cache, `[B, S]` slot
        validity including the slots written by this call (1 = valid).
      cache: `KVCache` of S slots, or None.
      write_index: slot of `tokens_bt[:, 0]` (scalar, shared by all rows; with a
        `PagedCache`, `[B]`, one per row); required with a cache, must be None without one.
      config: the architecture (static under jit).
      routing: an MoE model's replayed experts, int `[B, T, L, k]` in the layout of
        `tokens_bt` (`moe.NOT_RECORDED` where a token routes itself), for a forward
        without a cache; None: every token routes itself.

    Returns:
      (hidden_btd, cache): final hidden states `[B, T, D]` after the final norm, in
      `config.dtype`, and the updated cache (None without one).
    """
    _check_forward_args(tokens_bt, mask, cache, write_index)
    if cache is not None:
        if routing is not None:
            raise ValueError("routing replay is for forwards without a cache")
        return _cached_forward(params, tokens_bt, positions_bt, mask, cache, write_index,
                               config)
    hidden_btd = Transformer(config, head="none").apply(
        {"params": params}, tokens_bt, positions_bt, mask, routing)
    return hidden_btd, None


def forward_recording(params: Params, tokens_bt: jax.Array, positions_bt: jax.Array,
                      mask: jax.Array, cache: KVCache, write_index, *, config: ModelConfig
                      ) -> tuple[jax.Array, KVCache, jax.Array]:
    """`forward` with a cache (prefill or decode) of an MoE model, with each token's
    experts in every layer, int32 `[B, T, L, k]` (the sampler's record for routing
    replay)."""
    if not config.is_moe:
        raise ValueError(f"recording experts needs an MoE model; family is {config.family!r}")
    _check_forward_args(tokens_bt, mask, cache, write_index)
    return _cached_forward(params, tokens_bt, positions_bt, mask, cache, write_index, config,
                           record=True)


def forward_with_router(params: Params, tokens_bt: jax.Array, positions_bt: jax.Array, mask,
                        *, config: ModelConfig, routing: jax.Array | None = None,
                        record: bool = False):
    """The training forward of an MoE model (`forward` without a cache; `routing` as
    there): `(hidden, stats)`, with its layers' router statistics, `[L, ...]`
    (`moe.load_balancing_loss`, `moe.load_metrics`); with `record`, also each token's
    experts in every layer, int32 `[B, T, L, k]`, in the layout of `tokens_bt`."""
    if not config.is_moe:
        raise ValueError(f"forward_with_router needs an MoE model; family is {config.family!r}")
    _check_forward_args(tokens_bt, mask, None, None)
    collections = [moe.ROUTER_COLLECTION] + ([moe.RECORD_COLLECTION] if record else [])
    hidden_btd, collected = Transformer(config, head="none").apply(
        {"params": params}, tokens_bt, positions_bt, mask, routing, mutable=collections)
    (stats,) = collected[moe.ROUTER_COLLECTION]["layers"]["mlp"][moe.ROUTER_NAME]
    if not record:
        return hidden_btd, stats
    (experts_lbtk,) = collected[moe.RECORD_COLLECTION]["layers"]["mlp"][moe.RECORD_NAME]
    return hidden_btd, stats, jnp.moveaxis(experts_lbtk, 0, 2)


def forward_logits(
    params: Params,
    tokens_bt: jax.Array,
    positions_bt: jax.Array,
    mask: jax.Array,
    cache: KVCache | None = None,
    write_index: jax.Array | int | None = None,
    *,
    config: ModelConfig,
) -> tuple[jax.Array, KVCache | None]:
    """`forward` followed by `heads.unembed` (soft-capped where the config says): float32
    logits `[B, T, V]` and the cache."""
    hidden_btd, cache = forward(
        params, tokens_bt, positions_bt, mask, cache, write_index, config=config
    )
    return heads_lib.unembed(params, hidden_btd, softcap=config.final_logit_softcapping), cache


def _check_forward_args(tokens_bt, mask, cache, write_index) -> None:
    """Shape checks that fail before tracing reaches the layers."""
    batch, num_tokens = tokens_bt.shape
    if isinstance(mask, SharedPrompt):
        _check_shared_prompt(tokens_bt, mask, cache)
        return
    if isinstance(mask, packed_attention.Segments):
        if cache is not None or mask.segment_ids_bt.shape != tokens_bt.shape:
            raise ValueError("packed rows take no cache and segment ids shaped as the tokens "
                             f"{tuple(tokens_bt.shape)}; got {mask.segment_ids_bt.shape}")
        return
    if cache is None:
        if write_index is not None:
            raise ValueError("write_index is only meaningful with a cache; pass cache= too")
        expected = (batch, num_tokens)
    else:
        if write_index is None:
            raise ValueError("forward with a cache needs write_index (the slot of token 0)")
        expected = (batch, cache.max_len)
        if isinstance(write_index, int) and write_index + num_tokens > cache.max_len:
            raise ValueError(
                f"write_index {write_index} + {num_tokens} tokens exceeds the cache's "
                f"{cache.max_len} slots"
            )
    if tuple(mask.shape) != expected:
        what = "[B, S] over cache slots" if cache is not None else "[B, T] over tokens"
        raise ValueError(f"mask must be {what}, i.e. {expected}; got {tuple(mask.shape)}")


def _check_shared_prompt(tokens_gt, mask: SharedPrompt, cache) -> None:
    if cache is not None:
        raise ValueError("the shared-prompt layout is for training forwards, without a cache")
    groups, num_tokens = tokens_gt.shape
    (g, p), (rows, s) = mask.prompt_mask_gp.shape, mask.row_mask_bs.shape
    k, rem = divmod(rows, groups)
    if g != groups or rem or num_tokens != p + k * (s - p):
        raise ValueError(
            f"shared-prompt layout: tokens [G, P + k R] = {tuple(tokens_gt.shape)} do not "
            f"match prompt_mask [G, P] = {(g, p)} and row_mask [G k, P + R] = {(rows, s)}")
