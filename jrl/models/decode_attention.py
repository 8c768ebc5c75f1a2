"""Attention of one new token per row over the filled slots of a KV cache.

A decode step's queries `[B, N, H]` attend to the cache's keys and values
`[B, K, S, H]` (the cache's heads-before-slots layout), where row b's real tokens
fill the contiguous slots `start[b] <= s < end`: left padding before them, slots
not yet written after. Two implementations:

- `"pallas"` (GPU): JAX's Pallas/Triton decode-attention kernel
  (`jax.experimental.pallas.ops.gpu.decode_attention`), one fused pass that reads
  only the blocks of `[start, end)` — split over the slots for parallelism, then
  merged — instead of every slot with a mask.
- `"xla"`: `grouped_attention` over all S slots with the equivalent mask; it runs
  on every backend and is the reference the kernel is tested against (on CPU in
  Pallas' interpret mode).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jrl import sharding

# Cache slots per kernel block (a power of two, as Triton wants); a cache of S slots
# is split into S / _BLOCK blocks, each a program of the grid.
_BLOCK = 64


def choose_impl(impl: str, head_dim: int, num_slots: int | None = None) -> str:
    """`"pallas"` where the kernel applies (GPU, power-of-two head_dim and, when
    given, a cache of whole blocks), else `"xla"`; a forced `impl` is returned as is."""
    if impl != "auto":
        return impl
    ok = (jax.default_backend() == "gpu" and head_dim >= 16
          and head_dim & (head_dim - 1) == 0
          and (num_slots is None or num_slots % _BLOCK == 0))
    return "pallas" if ok else "xla"


def cache_slots(impl: str, head_dim: int, needed: int) -> int:
    """Slots to allocate for `needed` tokens: rounded up to whole kernel blocks when
    the decode steps will run the kernel."""
    if choose_impl(impl, head_dim) != "pallas":
        return needed
    return -(-needed // _BLOCK) * _BLOCK


def decode_attention(q_bnh, k_bksh, v_bksh, start_b, end, *, impl: str = "xla",
                     interpret: bool = False):
    """Softmax attention of one query per row and head over the slots `[start, end)`.

    Args:
      q_bnh: `[B, N, H]` queries (N = K * G query heads).
      k_bksh, v_bksh: `[B, K, S, H]` cached keys and values.
      start_b: int `[B]`, each row's first real slot.
      end: int scalar, one past the last filled slot (shared by all rows).
      impl: "xla" or "pallas" (see the module docstring).
      interpret: run the Pallas kernel in interpret mode (always off a GPU, so
        CPU tests run the kernel's own code).

    Returns:
      `[B, N, H]` in the queries' dtype.
    """
    if impl == "pallas":
        return _sharded(functools.partial(_pallas, interpret=interpret),
                        q_bnh, k_bksh, v_bksh, start_b, end)
    if impl != "xla":
        raise ValueError(f"decode attention impl must be 'xla' or 'pallas', got {impl!r}")
    slots = jnp.arange(k_bksh.shape[2])[None, :]
    mask_bs = (slots >= start_b[:, None]) & (slots < end)
    out_b1nh = grouped_attention(q_bnh[:, None], k_bksh, v_bksh, mask_bs[:, None, None])
    return out_b1nh[:, 0]


def _sharded(kernel, q_bnh, k_bksh, v_bksh, start_b, end):
    """Runs `kernel` on each device's rows (and heads) under the active mesh.

    XLA cannot split a custom call over devices: left to itself it would gather
    the whole cache onto every device. Under a `Sharder` the kernel runs in a
    `shard_map` over the batch axes and, when both the query and the key/value heads
    divide over `tensor` (so each device keeps whole query groups), over heads too.
    """
    sharder = sharding.active_sharder()
    if sharder is None or sharder.mesh.size == 1:
        return kernel(q_bnh, k_bksh, v_bksh, start_b, end)
    batch = sharder.spec(("batch",), start_b.shape)[0]
    heads = sharder.spec((None, "heads", None), q_bnh.shape)[1]
    kv_heads = sharder.spec((None, "kv_heads", None, None), k_bksh.shape)[1]
    if heads != kv_heads:
        heads = kv_heads = None
    q_spec, kv_spec = P(batch, heads, None), P(batch, kv_heads, None, None)
    return jax.shard_map(kernel, mesh=sharder.mesh,
                         in_specs=(q_spec, kv_spec, kv_spec, P(batch), P()),
                         out_specs=q_spec, check_vma=False)(q_bnh, k_bksh, v_bksh, start_b, end)


def _pallas(q_bnh, k_bksh, v_bksh, start_b, end, interpret):
    from jax.experimental.pallas.ops.gpu import decode_attention as kernels

    b, _, s, h = k_bksh.shape
    interpret = interpret or jax.default_backend() != "gpu"
    if s % _BLOCK:
        raise ValueError(f"the Pallas decode attention needs a multiple of {_BLOCK} cache "
                         f"slots, got {s}")
    # `gqa` takes keys slots-first and moves them heads-first inside; the two
    # transposes cancel in XLA, so the cache is read in place.
    k_bskh, v_bskh = (jnp.swapaxes(t, 1, 2) for t in (k_bksh, v_bksh))
    end_b = jnp.broadcast_to(jnp.asarray(end, jnp.int32), (b,))
    out_bnh = kernels.gqa(q_bnh, k_bskh, v_bskh, start_idx=start_b.astype(jnp.int32),
                          kv_seq_len=end_b, sm_scale=1.0 / math.sqrt(h), block_k=_BLOCK,
                          k_splits=s // _BLOCK, interpret=interpret)
    # The merge of the blocks' partial results runs in float32.
    return out_bnh.astype(q_bnh.dtype)


def grouped_attention(q_btnh, k_bksh, v_bksh, mask_b1ts):
    """Softmax attention with the queries of a key/value head grouped, in float32.

    `N = K * G` query heads share K key/value heads. The queries are viewed as
    `[B, T, K, G, H]` so each cached key and value is read once for its G queries,
    never repeated to N heads, and keys/values come heads-first (the cache's
    layout), so each (row, head) is one contiguous `[S, H]` operand.

    Args:
      q_btnh: `[B, T, N, H]` queries.
      k_bksh, v_bksh: `[B, K, S, H]` keys and values.
      mask_b1ts: bool `[B, 1, T, S]`, True where a query may attend to a key.

    Returns:
      `[B, T, N, H]` in the queries' dtype.
    """
    b, t, n, h = q_btnh.shape
    k = k_bksh.shape[1]
    q_bkgth = q_btnh.reshape(b, t, k, n // k, h).transpose(0, 2, 3, 1, 4)
    logits = jnp.einsum("bkgth,bksh->bkgts", q_bkgth, k_bksh,
                        preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(h))
    logits = jnp.where(mask_b1ts[:, :, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v_bksh.dtype)
    out_bkgth = jnp.einsum("bkgts,bksh->bkgth", probs, v_bksh,
                           preferred_element_type=jnp.float32)
    return out_bkgth.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q_btnh.dtype)

