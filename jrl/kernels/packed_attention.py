"""Causal attention over packed rows: several sequences laid end to end in one row.

A packed row `[L]` holds sequences one after another, each a run of slots with one
segment id (1, 2, ...; 0 marks the unused slots at the row's end). A query attends to
the keys of its own segment at or before its slot, never across a boundary, and each
sequence's RoPE positions restart at 0 (`jrl.rl.packing`). No `[B, 1, L, L]` mask is
formed on the accelerators:

- "cudnn" (GPU, Hopper or later): cuDNN's flash attention in its packed ("THD")
  layout, each row given by its segments' offsets and lengths. The kernel treats each
  segment as a sequence of its own, so the blocks that causality or another segment
  masks are skipped, not computed and masked.
- "splash" (TPU): JAX's Pallas splash attention with a causal (or local) mask and
  segment ids.
- "xla": the reference, a dense mask from the segment ids (CPU, tests).

Gemma's options travel as arguments (`attend`): a sliding window W (a query sees the
keys fewer than W slots behind it; within a segment slots count the sequence's
tokens, so this is HF's `q - k < W` in positions), a soft-cap of the scores and
another query scale. cuDNN has no soft-cap, so `choose_impl` never picks it for one.

`choose_impl` picks by backend; each kernel is compared with the reference in tests.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jrl import sharding
from jrl.kernels import decode_attention as decode_lib

IMPLS = ("auto", "xla", "cudnn", "splash")


class Segments(NamedTuple):
    """The `mask` `transformer.forward` takes for packed rows (`segments` makes one).

    Attributes:
      segment_ids_bt: int32 `[B, L]`, the sequence each slot belongs to (1, 2, ...
        within a row, contiguous runs), 0 for unused slots.
      offsets_bm: int32 `[B, M + 1]`, each segment's first slot, -1 past the row's
        segments (M: a bound on the segments of a row).
      lengths_bm: int32 `[B, M]`, each segment's length, -1 past the row's segments.
    """

    segment_ids_bt: jax.Array
    offsets_bm: jax.Array
    lengths_bm: jax.Array


def segments(segment_ids_bt: jax.Array, max_segments: int) -> Segments:
    """The `Segments` of packed rows with at most `max_segments` sequences each."""
    return Segments(segment_ids_bt, *segment_offsets(segment_ids_bt, max_segments))


def dense_mask(segment_ids_bt: jax.Array, window: int | None = None) -> jax.Array:
    """bool `[B, 1, L, L]`: a query sees the keys of its segment at or before its slot,
    and with a `window` W only those fewer than W slots behind it (`q - k < W`).

    An unused slot sees only itself, so no query row is all masked (its output is
    never read)."""
    seg = segment_ids_bt
    slot = jnp.arange(seg.shape[1])
    causal_tt = slot[None, :] <= slot[:, None]
    if window is not None:
        causal_tt &= slot[:, None] - slot[None, :] < window
    same_btt = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    return ((same_btt & causal_tt[None]) | jnp.eye(seg.shape[1], dtype=bool)[None])[:, None]


def segment_offsets(segment_ids_bt: jax.Array, max_segments: int):
    """cuDNN's description of packed rows: `(offsets [B, M + 1], lengths [B, M])`, int32.

    `offsets[b, i]` is the first slot of row b's i-th segment and `lengths[b, i]` its
    length; entries past the row's segments are -1 (M = `max_segments`).
    """
    seg = segment_ids_bt
    prev = jnp.pad(seg, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]
    nxt = jnp.pad(seg, ((0, 0), (0, 1)), constant_values=-1)[:, 1:]
    starts_bt = (seg > 0) & (seg != prev)
    ends_bt = (seg > 0) & (seg != nxt)
    first = lambda flags: jnp.nonzero(flags, size=max_segments + 1, fill_value=-1)[0]
    offsets_bm = jax.vmap(first)(starts_bt).astype(jnp.int32)
    last_bm = jax.vmap(first)(ends_bt)[:, :max_segments].astype(jnp.int32)
    lengths_bm = jnp.where(last_bm >= 0, last_bm - offsets_bm[:, :max_segments] + 1, -1)
    # The (M + 1)-th offset is never a segment's: the bound M holds every row's count.
    return offsets_bm.at[:, max_segments].set(-1), lengths_bm


def choose_impl(impl: str, dtype, head_dim: int, length: int, softcap: bool = False) -> str:
    """The kernel for this backend ('auto') or the one asked for, for rows of `length`
    slots: splash's blocks are multiples of 128 slots, so other rows take the reference.
    With a `softcap` 'auto' never takes cuDNN, which has none."""
    if impl == "auto":
        half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        backend = jax.default_backend()
        if backend == "tpu" and head_dim % 128 == 0:
            impl = "splash"
        elif backend == "gpu" and half and not softcap and _hopper() and cudnn_head_dim(head_dim):
            impl = "cudnn"
        else:
            impl = "xla"
    return "xla" if impl == "splash" and length % 128 else impl


def cudnn_head_dim(head_dim: int) -> bool:
    """Whether cuDNN's flash attention takes `head_dim`, forward and backward: a multiple
    of 8, at most 256 on Hopper and later GPUs (Gemma's 256 included), 128 before them."""
    return head_dim % 8 == 0 and head_dim <= (256 if _hopper() else 128)


def _hopper() -> bool:
    """A CUDA GPU of compute capability 9 or later (False elsewhere: other backends, and
    GPUs whose capability is no CUDA version, as ROCm's `gfx...`)."""
    major = str(getattr(jax.devices()[0], "compute_capability", "0")).split(".")[0]
    return major.isdigit() and int(major) >= 9


def attend(q_btnh, k_btkh, v_btkh, segments: Segments, impl: str = "auto", *,
           window: int | None = None, softcap: float | None = None,
           scale: float | None = None):
    """Packed causal attention.

    Args:
      q_btnh: `[B, L, N, H]` queries.
      k_btkh, v_btkh: `[B, L, K, H]` keys and values (K divides N).
      segments: the rows' `Segments`.
      impl: one of `IMPLS` (`choose_impl`).
      window: None, or W: a query sees only the keys fewer than W slots behind it
        (Gemma's sliding layers; static, as the kernels' masks are).
      softcap: None, or the cap c of Gemma 2's soft-capping: scores `s` become
        `c * tanh(s / c)` after scaling and before the mask (not on cuDNN).
      scale: the scores' scale (None: `H ** -0.5`).

    Returns:
      `[B, L, N, H]` in the queries' dtype.
    """
    impl = choose_impl(impl, q_btnh.dtype, q_btnh.shape[-1], q_btnh.shape[1],
                       softcap=softcap is not None)
    if impl == "cudnn":
        if softcap is not None:
            raise ValueError("cuDNN's attention has no soft-cap; use impl 'auto', 'splash' "
                             "or 'xla'")
        return _cudnn(q_btnh, k_btkh, v_btkh, segments, window=window, scale=scale)
    if impl == "splash":
        return _splash_per_shard(q_btnh, k_btkh, v_btkh, segments.segment_ids_bt,
                                 window=window, softcap=softcap, scale=scale)
    if impl != "xla":
        raise ValueError(f"packed attention impl must be one of {IMPLS}, got {impl!r}")
    return decode_lib.grouped_attention(q_btnh, jnp.swapaxes(k_btkh, 1, 2),
                                        jnp.swapaxes(v_btkh, 1, 2),
                                        dense_mask(segments.segment_ids_bt, window),
                                        scale=scale, softcap=softcap)


def heads_split_alike(q_btnh, k_btkh, v_btkh):
    """Keys and values `[B, L, K, H]` whose heads the active mesh splits as the queries'
    `[B, L, N, H]`: cuDNN's partitioner refuses operands split otherwise, and `tensor`
    splits the N query heads but not the K key/value heads when it divides N only
    (Qwen2.5-3B's 16 / 2 at tensor 4). Then the key/value heads are repeated up to N
    (grouped-query attention run as multi-head) and split as the queries are."""
    sharder = sharding.active_sharder()
    if sharder is None or jax.sharding.get_abstract_mesh().manual_axes:
        return k_btkh, v_btkh  # inside a shard_map (`context_attention`): local heads
    n, k = q_btnh.shape[2], k_btkh.shape[2]
    heads = sharder.spec(("batch", "length", "heads", None), q_btnh.shape)[2]
    kv_heads = sharder.spec(("batch", "length", "kv_heads", None), k_btkh.shape)[2]
    if heads == kv_heads or n == k:
        return k_btkh, v_btkh
    return tuple(sharding.constrain(jnp.repeat(x, n // k, axis=2),
                                    ("batch", "length", "heads", None))
                 for x in (k_btkh, v_btkh))


def _cudnn(q_btnh, k_btkh, v_btkh, segments: Segments, *, window: int | None = None,
           scale: float | None = None):
    """cuDNN's packed layout. Its `sliding_window_length` L keeps a query at `pos` the
    keys in `(pos - L, pos]` of its segment (`q - k < L`, the rule of JAX's docstring and
    of `jax.nn.dot_product_attention`, which hands it `l + 1` for a left window `l` whose
    XLA path keeps `q - k <= l`), so Gemma's window W passes as it is."""
    # jax.nn.dot_product_attention does not take segments; its cuDNN backend does.
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    k_btkh, v_btkh = heads_split_alike(q_btnh, k_btkh, v_btkh)
    offsets, lengths = segments.offsets_bm, segments.lengths_bm
    if offsets.shape[1] == 2:
        # One segment a row (padded rows under `context`): JAX hands cuDNN the offsets
        # only for two or more segments a row, and without them cuDNN would take each
        # row's tokens as starting at slot 0. An empty second segment keeps them.
        offsets, lengths = (jnp.pad(x, ((0, 0), (0, 1)), constant_values=-1)
                            for x in (offsets, lengths))
    scale = 1.0 / float(q_btnh.shape[-1]) ** 0.5 if scale is None else scale
    # Unused slots belong to no segment: cuDNN writes neither their outputs nor their
    # gradients (memory is left as it was). Selecting around the call makes both zero.
    used = (segments.segment_ids_bt > 0)[:, :, None, None]
    q_btnh, k_btkh, v_btkh = (jnp.where(used, x, jnp.zeros((), x.dtype))
                              for x in (q_btnh, k_btkh, v_btkh))
    out = cudnn.dot_product_attention(
        q_btnh, k_btkh, v_btkh, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
        kv_offsets=offsets, scale=scale, mask_type=cudnn.MaskType.PADDING_CAUSAL,
        sliding_window_length=window)
    return jnp.where(used, out, jnp.zeros((), out.dtype))


def _splash_per_shard(q_btnh, k_btkh, v_btkh, segment_ids_bt, **options):
    """`splash` on each device's rows (and heads, where both head counts split over
    `tensor`): XLA cannot split a Mosaic TPU call over devices and refuses to lower one
    that spans several. Inside a `shard_map` (`context_attention`) it is the call itself."""
    fn = functools.partial(splash, interpret=jax.default_backend() != "tpu", **options)
    if jax.sharding.get_abstract_mesh().manual_axes:
        return fn(q_btnh, k_btkh, v_btkh, segment_ids_bt)

    def specs(sharder):
        batch = sharder.spec(("batch",), q_btnh.shape[:1])[0]
        heads = sharder.spec((None, None, "heads", None), q_btnh.shape)[2]
        kv_heads = sharder.spec((None, None, "kv_heads", None), k_btkh.shape)[2]
        if heads != kv_heads:
            heads = kv_heads = None
        q, kv = P(batch, None, heads, None), P(batch, None, kv_heads, None)
        return (q, kv, kv, P(batch, None)), q

    return sharding.per_shard(fn, specs, q_btnh, k_btkh, v_btkh, segment_ids_bt)


def splash(q_btnh, k_btkh, v_btkh, segment_ids_bt, *, window: int | None = None,
           softcap: float | None = None, scale: float | None = None,
           interpret: bool = False, block: int = 512):
    """JAX's Pallas TPU splash attention with a causal mask and segment ids (`interpret`:
    run in Pallas' TPU interpret mode, as the CPU tests do). L must be a multiple of 128
    (blocks of `gcd(L, block)` slots); the queries of a key/value head share it
    (grouped-query). `window`, `softcap`, `scale`: as `attend`'s; a window is splash's
    local mask, whose left size W - 1 keeps `q - W + 1 <= k`, so the blocks wholly
    outside it are skipped."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as mask_lib,
    )

    b, length, n, h = q_btnh.shape
    k = k_btkh.shape[2]
    size = math.gcd(length, block)
    block_sizes = kernel.BlockSizes(
        block_q=size, block_kv=size, block_kv_compute=size, block_q_dkv=size,
        block_kv_dkv=size, block_kv_dkv_compute=size, block_q_dq=size, block_kv_dq=size)
    if window is None:
        causal = mask_lib.CausalMask((length, length))
    else:
        causal = mask_lib.LocalMask((length, length), window_size=(window - 1, 0), offset=0)
    multi = mask_lib.MultiHeadMask([causal] * (n // k))
    mha = kernel.make_splash_mqa(multi, block_sizes=block_sizes, head_shards=1,
                                 q_seq_shards=1, attn_logits_soft_cap=softcap,
                                 interpret=interpret)
    # Each unused slot is a segment of its own (-1 - slot): no query row is empty.
    seg = jnp.where(segment_ids_bt > 0, segment_ids_bt, -1 - jnp.arange(length))
    ids = kernel.SegmentIds(q=seg, kv=seg)
    q_bkgth = q_btnh.reshape(b, length, k, n // k, h).transpose(0, 2, 3, 1, 4)
    scale = 1.0 / h ** 0.5 if scale is None else scale
    q_bkgth = q_bkgth * jnp.asarray(scale, q_bkgth.dtype)
    k_bkth, v_bkth = (jnp.swapaxes(x, 1, 2) for x in (k_btkh, v_btkh))
    per_head = jax.vmap(mha, in_axes=(0, 0, 0, None))  # over K: [G, L, H] queries each
    out = jax.vmap(per_head)(q_bkgth, k_bkth, v_bkth, ids)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, length, n, h).astype(q_btnh.dtype)
