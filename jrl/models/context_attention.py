"""Causal attention with each sequence split over the mesh's `context` axis (Ulysses).

In the training passes (no KV cache) a mesh with `context` = C > 1 holds every
sequence as C chunks of T / C tokens, one per device of a `context` group: the
projections, norms, MLP and head are per-token work and run on the chunks. Attention
is not: a query needs every earlier key. Ulysses sequence parallelism (Jacobs et al.
2023, https://arxiv.org/abs/2309.14509) trades the sequence split for a head split
around it, in a `shard_map` over the mesh:

    q [B, T/C, N, H], k/v [B, T/C, K, H]      each device: its chunk, all heads
      -> all_to_all over `context`             each device: all T tokens, N/C heads
      -> packed_attention.attend               (cuDNN, splash or XLA, with Gemma's
                                                window, soft-cap and query scale)
      -> all_to_all back                       each device: its chunk, all heads

so one layer moves the chunk's queries and outputs once each (`2 N' H T / C` values per
device and row, `N'` the query heads padded as below) and its keys and values traded
the same way (`2 K H T / C`) or gathered (`2 K H T (C - 1) / C`), and never holds a
`[T, T]` score matrix beyond what the local kernel does. The query heads must split C ways: when N
does not, zero heads pad it to N' (a multiple of C; their outputs are dropped). When
the key/value heads K do not split C ways either, the keys and values are gathered
whole over `context` (`K T` values a device and row, for Qwen2.5-0.5B's 2 heads at
C = 4 half of what the all-to-all of heads repeated up to N' would move) and each
device picks the heads its N'/C query heads read; where gathering would move more
(K C >= N'), the key/value heads are repeated up to N first, grouped-query attention
run as multi-head. Masks travel as segment ids (`packed_attention`), gathered over
`context`, so padded rows (one segment each) and packed rows take the same path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jrl import sharding
from jrl.kernels import packed_attention

AXIS = "context"


def context_size() -> int:
    """Devices of the active mesh's `context` axis (1: none, or no active `Sharder`)."""
    sharder = sharding.active_sharder()
    return 1 if sharder is None else sharder.context


def applies(length: int) -> bool:
    """Whether attention over rows of `length` tokens runs split over `context`: the
    active mesh has a `context` axis over 1, its rules split `length` over it, and it
    divides `length` (else the rows stay whole, as `Sharder.spec` leaves them, and
    attention is the plain one)."""
    sharder = sharding.active_sharder()
    return sharder is not None and sharder.spec(("length",), (length,))[0] == AXIS


def _specs(sharder: sharding.Sharder, q_btnh, k_btkh):
    """(q, kv, segment ids, offsets/lengths) `PartitionSpec`s: rows over the batch axes,
    tokens over `context`, heads over `tensor` where both head counts split."""
    batch = sharder.spec(("batch",), q_btnh.shape[:1])[0]
    heads = sharder.spec((None, None, "heads", None), q_btnh.shape)[2]
    kv_heads = sharder.spec((None, None, "kv_heads", None), k_btkh.shape)[2]
    if heads != kv_heads:  # e.g. 2 KV heads on tensor=4: heads whole inside
        heads = kv_heads = None
    return (P(batch, AXIS, heads, None), P(batch, AXIS, kv_heads, None), P(batch, AXIS),
            P(batch, None))


def _to_heads(x_btnh):
    """`[b, T/C, h, H]` (a chunk, all heads) -> `[b, T, h/C, H]` (all tokens, h/C heads)."""
    return jax.lax.all_to_all(x_btnh, AXIS, split_axis=2, concat_axis=1, tiled=True)


def _to_tokens(x_btnh):
    """The inverse of `_to_heads`."""
    return jax.lax.all_to_all(x_btnh, AXIS, split_axis=1, concat_axis=2, tiled=True)


def _gathered_heads(k_btkh, v_btkh, *, n: int, padded: int, size: int):
    """All T tokens of the keys and values this device's query heads read: the chunks
    gathered over `context`, then for each of its `padded / size` query heads (of `n`
    real ones padded to `padded`) the key/value head of its group (the last group's
    for the padding heads, whose outputs are dropped)."""
    k = k_btkh.shape[2]
    heads = padded // size
    first = jax.lax.axis_index(AXIS) * heads
    group = jnp.minimum(first + jnp.arange(heads), n - 1) // (n // k)
    return tuple(jnp.take(jax.lax.all_gather(x, AXIS, axis=1, tiled=True), group, axis=2)
                 for x in (k_btkh, v_btkh))


def _local(q_btnh, k_btkh, v_btkh, segment_ids_bt, offsets_bm, lengths_bm, *, size: int,
           impl: str, **options):
    """One device's part: its chunk of every row in, its chunk of the outputs out."""
    n, k = q_btnh.shape[2], k_btkh.shape[2]
    pad = -n % size
    widen = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) if pad else x
    if k % size and k * size < n + pad:  # gather the few key/value heads whole
        key, value = _gathered_heads(k_btkh, v_btkh, n=n, padded=n + pad, size=size)
        q = _to_heads(widen(q_btnh))
    else:
        if k % size:  # grouped-query heads cannot split C ways: as multi-head attention
            k_btkh, v_btkh = (jnp.repeat(x, n // k, axis=2) for x in (k_btkh, v_btkh))
            k_btkh, v_btkh = widen(k_btkh), widen(v_btkh)
        q, key, value = (_to_heads(x) for x in (widen(q_btnh), k_btkh, v_btkh))
    segment_ids_bt = jax.lax.all_gather(segment_ids_bt, AXIS, axis=1, tiled=True)
    segments = packed_attention.Segments(segment_ids_bt, offsets_bm, lengths_bm)
    out = packed_attention.attend(q, key, value, segments, impl, **options)
    return _to_tokens(out)[:, :, :n]


def attend(q_btnh, k_btkh, v_btkh, segments: packed_attention.Segments, impl: str = "auto",
           *, window: int | None = None, softcap: float | None = None,
           scale: float | None = None):
    """`packed_attention.attend` with the rows' tokens split over the active mesh's
    `context` axis (`applies(T)` must hold): queries `[B, T, N, H]`, keys/values
    `[B, T, K, H]` (K divides N), segments of `[B, T]` slots; outputs `[B, T, N, H]`,
    split as the queries. `window`, `softcap`, `scale`: `packed_attention.attend`'s,
    applied on each device's whole rows (all T tokens, its heads)."""
    sharder = sharding.active_sharder()
    size = sharder.context
    q_spec, kv_spec, token_spec, row_spec = _specs(sharder, q_btnh, k_btkh)

    def local(q, k, v, segment_ids, offsets, lengths):
        return _local(q, k, v, segment_ids, offsets, lengths, size=size, impl=impl,
                      window=window, softcap=softcap, scale=scale)

    return jax.shard_map(
        local, mesh=sharder.mesh,
        in_specs=(q_spec, kv_spec, kv_spec, token_spec, row_spec, row_spec),
        out_specs=q_spec, check_vma=False,
    )(q_btnh, k_btkh, v_btkh, segments.segment_ids_bt, segments.offsets_bm,
      segments.lengths_bm)
