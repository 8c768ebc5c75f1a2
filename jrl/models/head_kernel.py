"""The unembedding fused with the log-softmax: log-probs without logits in memory.

A response token's log-prob needs its log-normaliser over the whole vocabulary,
`log Z = log sum_v exp(z_v)` with `z = h W / temperature`, and the entropy needs
`sum_v p_v z_v`. Computed as a matmul followed by reductions, the `[T, V]` float32
logits are written to memory and read back two or three times (V = 151,936 for
Qwen: 0.6 MB a token). Here one Pallas/Triton kernel tiles the product `[T, V]`
into blocks of `block_t x block_v`, computes each block's logits on chip and
reduces them right there to four numbers per token and block (flash-attention's
running statistics):

    m = max_v z_v,  l = sum_v exp(z_v - m),  a = sum_v exp(z_v - m) z_v,
    zt = z_target if the target falls in the block (else 0),

written as `[V / block_v, T]`. A small XLA pass merges the blocks:
`log Z = M + log sum_j l_j exp(m_j - M)` with `M = max_j m_j`, the entropy
`log Z - (sum_j a_j exp(m_j - M)) / (sum_j l_j exp(m_j - M))`, and the target's
logit `sum_j zt_j`.

This is the forward pass only. The backward pass (`jrl.logprobs._fused_bwd`) still
recomputes each chunk's float32 logits in XLA: a kernel that recomputed a block's
logits and wrote `d loss / dz` straight away was no faster there (its Triton matmul
runs at about 450 TFLOP/s on an H200 against cuBLAS's ~620, which ate the memory
traffic it saved; docs/performance_history.md, round five).

`choose_impl("auto", ...)` takes the kernel on GPU (where jax has Pallas' Triton
backend, `triton_backend`) and the XLA reference (`jrl.logprobs`) elsewhere; CPU tests
run the kernel in Pallas' interpret mode against the reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from jrl import sharding
from jrl.models import triton_backend

plgpu = triton_backend.plgpu  # None where jax has no Triton backend (`_call` says so)

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile sizes and Triton settings: `t` tokens by `v` vocabulary entries per
    program, `k` hidden units per step of its matmul loop (each a power of two)."""

    t: int = 64
    v: int = 128
    k: int = 64
    warps: int = 4
    stages: int = 3


# Fastest of a sweep on an H200 (experiments/bench_head_kernel.py).
FORWARD = Blocks()
# `auto` takes the kernel up to this hidden size. Its matmul runs at ~70% of cuBLAS's
# rate, so it wins only while the float32 logits' memory passes it saves outweigh
# that: on an H200 with V = 151,936 the head's forward was 26% faster at D = 896, even
# at 1,536 and 2,048, and 3-36% slower at 3,584 (docs/performance_history.md,
# round five).
MAX_HIDDEN = 1024


def choose_impl(impl: str, hidden_size: int, with_entropy: bool = True) -> str:
    """`"pallas"` where the kernel applies and pays (GPU, Pallas' Triton backend
    installed, a pass that computes the entropy, a hidden size of whole `FORWARD.k`
    blocks up to `MAX_HIDDEN`, no `tensor` axis over 1 in the active mesh), else
    `"xla"`; a forced `impl` is returned as is (a forced `"pallas"` without the Triton
    backend stops with a ConfigError).

    Without the entropy XLA reads the logits twice rather than three times, and in the
    GRPO step the reference pass was no faster through the kernel (docs/performance_history.md,
    round five). Under tensor parallelism XLA splits the logits over the vocabulary,
    while the kernel would run the whole vocabulary on every device of a `tensor` group.
    """
    if impl not in ("auto", "xla", "pallas"):
        raise ValueError(f"log-prob impl must be 'auto', 'xla' or 'pallas', got {impl!r}")
    if impl == "pallas":
        triton_backend.require("model.logprob_impl")
    if impl != "auto":
        return impl
    sharder = sharding.active_sharder()
    tensor = 1 if sharder is None else sharder.mesh.shape.get("tensor", 1)
    ok = (jax.default_backend() == "gpu" and triton_backend.available() and with_entropy
          and hidden_size % FORWARD.k == 0 and hidden_size <= MAX_HIDDEN and tensor == 1)
    return "pallas" if ok else "xla"


def pad_vocab(weight: Array, vocab_first: bool, blocks: Blocks | None = None) -> Array:
    """The unembedding (`[V, D]` if `vocab_first`, else `[D, V]`) with zero entries
    appended up to whole `blocks.v` blocks (the kernel masks them out); `blocks`
    defaults to `FORWARD`."""
    blocks = blocks or FORWARD
    axis = 0 if vocab_first else 1
    pad = (-weight.shape[axis]) % blocks.v
    widths = [(0, 0), (0, 0)]
    widths[axis] = (0, pad)
    return jnp.pad(weight, widths)


def _tile_logits(h_ref, w_ref, t0, v0, depth, vocab_first, blocks):
    """float32 `[t, v]` block of `h @ W` at tokens `t0:` and vocabulary `v0:`."""
    def step(i, acc_tv):
        k0 = pl.multiple_of(i * blocks.k, blocks.k)
        h = h_ref[pl.ds(t0, blocks.t), pl.ds(k0, blocks.k)]
        if vocab_first:
            w = w_ref[pl.ds(v0, blocks.v), pl.ds(k0, blocks.k)]
            return acc_tv + plgpu.dot(h, w, trans_b=True)
        w = w_ref[pl.ds(k0, blocks.k), pl.ds(v0, blocks.v)]
        return acc_tv + plgpu.dot(h, w)

    zero = jnp.zeros((blocks.t, blocks.v), jnp.float32)
    return jax.lax.fori_loop(0, depth // blocks.k, step, zero)


def _stats_kernel(h_ref, w_ref, y_ref, m_ref, l_ref, zt_ref, a_ref=None, *, vocab, depth,
                  vocab_first, inv_temperature, blocks):
    t0 = pl.program_id(0) * blocks.t
    v0 = pl.program_id(1) * blocks.v
    z_tv = _tile_logits(h_ref, w_ref, t0, v0, depth, vocab_first, blocks) * inv_temperature
    cols_v = v0 + jnp.arange(blocks.v)
    valid_1v = (cols_v < vocab)[None, :]
    z_tv = jnp.where(valid_1v, z_tv, -jnp.inf)
    m_t = jnp.max(z_tv, axis=1)
    e_tv = jnp.exp(z_tv - m_t[:, None])
    m_ref[...] = m_t
    l_ref[...] = jnp.sum(e_tv, axis=1)
    hit_tv = cols_v[None, :] == y_ref[...][:, None]
    zt_ref[...] = jnp.sum(jnp.where(hit_tv, z_tv, 0.0), axis=1)
    if a_ref is not None:  # the entropy's: sum of exp(z - m) z over the real entries
        a_ref[...] = jnp.sum(jnp.where(valid_1v, e_tv * z_tv, 0.0), axis=1)


def _check_shapes(d, padded_vocab, vocab, blocks):
    if d % blocks.k:
        raise ValueError(f"the log-prob kernel needs a hidden size that is a multiple of "
                         f"{blocks.k} (Blocks.k), got {d}; use model.logprob_impl='xla'")
    if padded_vocab % blocks.v or not 0 <= padded_vocab - vocab < blocks.v:
        raise ValueError(f"the unembedding has {padded_vocab} entries for a vocabulary of "
                         f"{vocab}; pad it with pad_vocab (to whole blocks of {blocks.v})")


def _call(h_td, w, y_t, *, vocab, vocab_first, temperature, with_entropy, blocks, interpret):
    """One kernel launch over `T` tokens (a multiple of `blocks.t`): the per-block
    statistics merged into `(log_z, target_logit, entropy)`, each float32 `[T]`."""
    triton_backend.require("model.logprob_impl")
    tp, d = h_td.shape
    nv = (w.shape[0] if vocab_first else w.shape[1]) // blocks.v
    kernel = functools.partial(_stats_kernel, vocab=vocab, depth=d, vocab_first=vocab_first,
                               inv_temperature=1.0 / temperature, blocks=blocks)
    outputs = 4 if with_entropy else 3
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))
    parts = pl.pallas_call(
        kernel, out_shape=[jax.ShapeDtypeStruct((nv, tp), jnp.float32)] * outputs,
        grid=(tp // blocks.t, nv),
        in_specs=[whole(h_td.shape), whole(w.shape),
                  pl.BlockSpec((blocks.t,), lambda i, j: (i,))],
        out_specs=[pl.BlockSpec((None, blocks.t), lambda i, j: (j, i))] * outputs,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.warps,
                                             num_stages=blocks.stages),
        interpret=interpret or jax.default_backend() != "gpu",
        name="log_softmax_stats",
    )(h_td, w, y_t.astype(jnp.int32))
    block_max, block_sum, block_target = parts[:3]
    top = jnp.max(block_max, axis=0)
    scale = jnp.exp(block_max - top)
    total = jnp.sum(block_sum * scale, axis=0)
    log_z = top + jnp.log(total)
    entropy = (log_z - jnp.sum(parts[3] * scale, axis=0) / total if with_entropy
               else jnp.zeros_like(top))
    return log_z, jnp.sum(block_target, axis=0), entropy


def _local_stats(h_btd, w, y_bt, *, tokens_per_call, blocks, **kwargs):
    """`_call` over this device's `[B, T]` tokens, `tokens_per_call` at a time (its
    per-block statistics take `4 V / blocks.v` floats a token), outputs `[B, T]`."""
    b, t, d = h_btd.shape
    _check_shapes(d, w.shape[0] if kwargs["vocab_first"] else w.shape[1], kwargs["vocab"],
                  blocks)
    n = b * t
    whole_blocks = lambda x: -(-x // blocks.t) * blocks.t
    per_call = min(whole_blocks(n), whole_blocks(tokens_per_call))
    calls = -(-n // per_call)
    pad = lambda x: jnp.pad(x.reshape(n, *x.shape[2:]),
                            [(0, calls * per_call - n)] + [(0, 0)] * (x.ndim - 2))
    h_ctd = pad(h_btd).reshape(calls, per_call, d)
    y_ct = pad(y_bt).reshape(calls, per_call)
    stats = jax.lax.map(lambda xs: _call(xs[0], w, xs[1], blocks=blocks, **kwargs),
                        (h_ctd, y_ct))
    return tuple(x.reshape(-1)[:n].reshape(b, t) for x in stats)


def log_softmax_stats(h_btd: Array, weight: Array, targets_bt: Array, *, vocab: int,
                      vocab_first: bool, temperature: float = 1.0, with_entropy: bool = False,
                      blocks: Blocks | None = None, tokens_per_call: int = 32768,
                      interpret: bool = False):
    """Log-normaliser, target logit and entropy of `softmax(h W / temperature)`.

    Args:
      h_btd: `[B, T, D]` hidden states (bf16 or float32); D a multiple of `blocks.k`.
      weight: `pad_vocab`'s unembedding, `[Vp, D]` if `vocab_first` else `[D, Vp]`,
        in `h_btd`'s dtype.
      targets_bt: int `[B, T]` token ids.
      vocab: the real vocabulary size V (entries from V on are padding).
      temperature: the logits are divided by it.
      with_entropy: also compute the entropy (else zeros).
      blocks: the tiles (default `FORWARD`).
      tokens_per_call: tokens per kernel launch (a device's tokens are launched in
        turn): bounds the per-block statistics, `16 V / blocks.v` bytes a token.
      interpret: run in Pallas' interpret mode (always off a GPU).

    Returns:
      `(log_z, target_logit, entropy)`, each float32 `[B, T]`; the log-prob is
      `target_logit - log_z`.

    Under a `Sharder` the kernel runs in a `shard_map` over the batch axes (XLA cannot
    split a custom call over devices), each device on its rows with the unembedding
    whole.
    """
    fn = functools.partial(_local_stats, vocab=vocab, vocab_first=vocab_first,
                           temperature=temperature, with_entropy=with_entropy,
                           blocks=blocks or FORWARD, tokens_per_call=tokens_per_call,
                           interpret=interpret)
    def specs(sharder):
        batch = sharder.spec(("batch",), h_btd.shape[:1])[0]
        rows = lambda ndim: P(batch, *([None] * (ndim - 1)))
        return (rows(3), P(None, None), rows(2)), (rows(2),) * 3

    return sharding.per_shard(fn, specs, h_btd, weight, targets_bt)
