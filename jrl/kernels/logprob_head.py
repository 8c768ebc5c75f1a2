"""The unembedding fused with the log-softmax: log-probs without logits in memory.

A response token's log-prob needs its log-normaliser over the whole vocabulary,
`log Z = log sum_v exp(z_v)` with `z = h W / temperature`, and the entropy needs
`sum_v p_v z_v`. Computed as a matmul followed by reductions, the `[T, V]` float32
logits are written to memory and read back two or three times (V = 151,936 for
Qwen: 0.6 MB a token). Here one Pallas kernel tiles the product `[T, V]`
into blocks of `block_t x block_v`, computes each block's logits on chip and
reduces them right there to four numbers per token and block (flash-attention's
running statistics):

    m = max_v z_v,  l = sum_v exp(z_v - m),  a = sum_v exp(z_v - m) z_v,
    zt = z_target if the target falls in the block (else 0),

written as `[V / block_v, T]`. A small XLA pass merges the blocks:
`log Z = M + log sum_j l_j exp(m_j - M)` with `M = max_j m_j`, the entropy
`log Z - (sum_j a_j exp(m_j - M)) / (sum_j l_j exp(m_j - M))`, and the target's
logit `sum_j zt_j`.

The backward pass (`jrl.rl.logprobs._fused_bwd`) needs `d loss / dz` for the two matmuls
of the chain rule (`dz W`, `dz^T h`, left to XLA). `grad_logits` forms it with the same
pipeline: each block's logits recomputed on chip and turned into `d loss / dz` on the
accumulator's registers (from the forward's `log Z` and entropy and the cotangents),
written once in the compute dtype, where XLA writes the chunk's float32 logits and
reads them back. Alone it takes 0.75x XLA's time (8,192 tokens of the Qwen2.5-0.5B
head, an H200); in the GRPO step it saves 1-2% of the update
(docs/performance.md, "Kernels on Mosaic GPU").

The kernel is written for Pallas' Mosaic GPU backend (Hopper: H100, H200): each
program copies `[t, k]` tiles of h and `[v, k]` tiles of W (tied embeddings; `[k, v]`
untied) into swizzled shared memory with TMA, `stages` steps ahead, multiplies them
with `wgmma` into a float32 accumulator in registers, reduces the accumulator to the
four statistics on its own layout and writes them out through shared memory (with
`MosaicBlocks.consumers=2`, two warpgroups do that for 64 tokens each while a third
issues the copies). On an H200 it runs the Qwen2.5-0.5B head at 500-560 TFLOP/s,
against 315-410 for the Triton kernel it replaced and 300-370 for XLA
(experiments/bench_head_kernel.py).

`choose_impl("auto", ...)` takes the kernel on a Hopper GPU and the XLA reference
(`jrl.rl.logprobs`) elsewhere; CPU tests run the kernel in Pallas' GPU interpret mode
against the reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from jrl import sharding
from jrl.errors import ConfigError
from jrl.kernels import mosaic_backend

Array = jax.Array


# `auto` takes the kernel up to this hidden size, where it was measured to pay (one H100;
# XLA's chunked logits against it): at D 896 (Qwen2.5-0.5B) XLA takes 1.5-1.7x its time;
# at Gemma-3-1B's D 1,152 (V 262,144) 1.77x the forward; at D 2,048 (V 151,936) 1.49x the
# forward, and Llama-3.2-1B's update (D 2,048) 1.04x. At D 3,584 the forward still pays
# (1.35x), but neither its backward nor a step has been measured there.
MAX_HIDDEN = 2048


@dataclasses.dataclass(frozen=True)
class MosaicBlocks:
    """Tiles of the Mosaic GPU kernel (`impl="mosaic"`): `t` tokens (64 per warpgroup
    matmul) by `v` vocabulary entries (wgmma's N, a multiple of 8
    up to 256) per program, `k` hidden units per pipeline step (the 128-byte swizzle's
    width: 64 for 16-bit inputs), `stages` steps' tiles in flight (TMA copies ahead of
    the wgmma). `overlap`: keep one wgmma in flight while the next step's tiles arrive
    (the pipeline then holds on to a step's buffers one step longer). `group`: token
    blocks per group of the launch order (at most; the largest divisor of the launch's
    token blocks): the programs run a group's token blocks against every vocabulary
    block before the next group's, so that W is read from memory once per group and a
    group's hidden states stay in L2 (0: one group). `consumers`: warpgroups that
    multiply and reduce, `t / consumers` tokens each; above 1, one more warpgroup issues
    the copies (warp specialisation), and the consumers share each tile of W."""

    t: int = 64
    v: int = 256
    k: int = 64
    stages: int = 4
    overlap: bool = True
    group: int = 32
    consumers: int = 1

    def __post_init__(self):
        if (self.consumers < 1 or self.t % (64 * self.consumers) or self.v % 8
                or not 8 <= self.v <= 256 or self.stages < 2):
            raise ValueError(f"MosaicBlocks needs t a multiple of 64 per consumer, v a "
                             f"multiple of 8 from 8 to 256 and stages >= 2, got {self}")


# Fastest of a sweep on an H200 (experiments/bench_head_kernel.py): two consumer
# warpgroups of 64 tokens each, 256 vocabulary entries, 3 stages; 8.52 ms for 16,384
# tokens of the Qwen2.5-0.5B head with the entropy (17.11 ms for 32,768), against the
# Triton kernel's 11.68 (28.30) and XLA's 14.73 (29.17).
MOSAIC_FORWARD = MosaicBlocks(t=128, v=256, k=64, stages=3, overlap=True, group=16,
                              consumers=2)


IMPLS = ("auto", "xla", "mosaic")


def choose_impl(impl: str, hidden_size: int, with_entropy: bool = True,
                dtype=jnp.bfloat16, key: str = "model.logprob_impl") -> str:
    """`"mosaic"` where the kernel applies (a Hopper GPU, jax with Pallas' Mosaic GPU
    backend, 16-bit operands (`dtype`, the compute dtype: wgmma transposes only 16-bit
    operands, and float32 tiles would not fit shared memory), a hidden size of whole
    `MOSAIC_FORWARD.k` steps up to `MAX_HIDDEN`, no `tensor` or `context` axis over 1
    in the active mesh), else `"xla"`; a forced `impl` is returned
    as is (a forced `"mosaic"` without Mosaic GPU stops with a ConfigError, and
    `"pallas"`, the Triton kernel this one replaced, with a ValueError naming the
    choices). `key`: the config key the errors name.

    The kernel is taken in every pass, with the entropy or without (XLA took 1.5-1.7x its
    time either way on an H200). Under tensor parallelism XLA splits the logits over
    the vocabulary, while the kernel would run the whole vocabulary on every device of a
    `tensor` group; under context parallelism its shard_map (rows over the batch axes)
    would gather each sequence's tokens, which XLA's head keeps split.
    """
    del with_entropy  # the kernel pays in the passes without the entropy too
    if impl not in IMPLS:
        raise ValueError(f"log-prob impl must be one of {', '.join(map(repr, IMPLS))}, "
                         f"got {impl!r}")
    half = jnp.dtype(dtype).itemsize == 2
    if impl == "mosaic":
        mosaic_backend.require(key)
        if not half and jax.default_backend() == "gpu":
            raise ConfigError(f"{key}='mosaic' needs a 16-bit compute dtype "
                              f"(model.dtype bfloat16 or float16), got {jnp.dtype(dtype).name}; "
                              "use 'auto' or 'xla'")
    if impl != "auto":
        return impl
    sharder = sharding.active_sharder()
    shape = {} if sharder is None else sharder.mesh.shape
    tensor, context = shape.get("tensor", 1), shape.get("context", 1)
    ok = (mosaic_backend.available() and mosaic_backend.on_hopper() and half
          and hidden_size % MOSAIC_FORWARD.k == 0 and hidden_size <= MAX_HIDDEN
          and tensor == 1 and context == 1)
    return "mosaic" if ok else "xla"


def pad_vocab(weight: Array, vocab_first: bool, blocks: MosaicBlocks | None = None) -> Array:
    """The unembedding (`[V, D]` if `vocab_first`, else `[D, V]`) with zero entries
    appended up to whole `blocks.v` blocks (the kernel masks them out); `blocks`
    defaults to `MOSAIC_FORWARD`."""
    blocks = blocks or MOSAIC_FORWARD
    axis = 0 if vocab_first else 1
    pad = (-weight.shape[axis]) % blocks.v
    widths = [(0, 0), (0, 0)]
    widths[axis] = (0, pad)
    return jnp.pad(weight, widths)


def _check_shapes(d, padded_vocab, vocab, blocks, key="model.logprob_impl"):
    if d % blocks.k:
        raise ValueError(f"the log-prob kernel needs a hidden size that is a multiple of "
                         f"{blocks.k} (MosaicBlocks.k), got {d}; use {key}='xla'")
    if padded_vocab % blocks.v or not 0 <= padded_vocab - vocab < blocks.v:
        raise ValueError(f"the unembedding has {padded_vocab} entries for a vocabulary of "
                         f"{vocab}; pad it with pad_vocab (to whole blocks of {blocks.v})")


_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453

def _load_rows(ref, emulated):
    """A `[t]` SMEM vector in the layout of the rows of a `[t, v]` wgmma accumulator."""
    if emulated:
        return ref[...]
    return mosaic_backend.load(ref, mosaic_backend.plgpu.Layout.WGMMA.reduce(1))


def _columns(shape, v0, emulated):
    """int32 `[t, v]`: each entry's vocabulary index, in the wgmma accumulator's layout."""
    if emulated:
        return jax.lax.broadcasted_iota(jnp.int32, shape, 1) + v0
    mgpu = mosaic_backend.plgpu
    return mgpu.broadcasted_iota(jnp.int32, shape, 1, layout=mgpu.Layout.WGMMA) + v0


def _pipeline_specs(h_gmem, w_gmem, t0, v0, *, vocab_first, blocks):
    """The pipeline over the hidden dimension of a `[t, v]` block at tokens `t0:` and
    vocabulary `v0:`: its in_specs (`[t, k]` tiles of h, `[v, k]` or `[k, v]` tiles of
    W, in swizzled SMEM), its GMEM operands and the wgmmas each step leaves in flight."""
    mgpu = mosaic_backend.plgpu
    itemsize = jnp.dtype(h_gmem.dtype).itemsize
    swizzle = mgpu.find_swizzle(blocks.k * itemsize * 8)
    tiled = (mgpu.TilingTransform((8, swizzle // itemsize)), mgpu.SwizzleTransform(swizzle))
    delay = int(blocks.overlap and h_gmem.shape[1] > blocks.k)  # one step: no overlap
    spec = lambda shape, index: mgpu.BlockSpec(shape, index, transforms=tiled,
                                               delay_release=delay)
    vocab_slice = pl.ds(v0, blocks.v)
    if vocab_first:  # W's `[v, k]` tile is wgmma's B operand transposed (K-major)
        w_spec, w_rows = spec((blocks.v, blocks.k), lambda k: (0, k)), w_gmem.at[vocab_slice]
    else:
        w_spec, w_rows = spec((blocks.k, blocks.v), lambda k: (k, 0)), w_gmem.at[:, vocab_slice]
    h_spec = spec((blocks.t, blocks.k), lambda k: (0, k))
    return [h_spec, w_spec], (h_gmem.at[pl.ds(t0, blocks.t)], w_rows), delay


def _wgmma_step(acc_ref, h_smem, w_smem, *, vocab_first, delay, emulated, w_kv=None):
    """`acc += h_smem @ W`'s tile (transposed where W is `[v, k]`), `delay` left running.

    The interpreter's wgmma takes no transposed operand: `emulated`, W's tile is copied
    transposed, to `w_kv` (a `[k, v]` SMEM ref; allocated here if None)."""
    mgpu = mosaic_backend.plgpu
    if not vocab_first:
        mgpu.wgmma(acc_ref, h_smem, w_smem)
    elif not emulated:
        mgpu.wgmma(acc_ref, h_smem, w_smem.transpose((1, 0)))
    else:
        def transposed(w_kv):
            w_kv[...] = w_smem[...].T
            mgpu.wgmma(acc_ref, h_smem, w_kv)
        if w_kv is None:
            pl.run_scoped(transposed, mgpu.SMEM(w_smem.shape[::-1], w_smem.dtype))
        else:
            transposed(w_kv)
    mgpu.wgmma_wait(delay)


def _mosaic_logits(h_gmem, w_gmem, t0, v0, *, vocab_first, blocks, emulated):
    """float32 `[t, v]` block of `h @ W` at tokens `t0:` and vocabulary `v0:`: TMA copies
    of its tiles into SMEM, `blocks.stages` deep, each step's wgmma accumulating into
    registers (one warpgroup issues both)."""
    mgpu = mosaic_backend.plgpu
    specs, operands, delay = _pipeline_specs(h_gmem, w_gmem, t0, v0, vocab_first=vocab_first,
                                             blocks=blocks)

    def compute(acc_ref):
        step = lambda _, h_smem, w_smem: _wgmma_step(
            acc_ref, h_smem, w_smem, vocab_first=vocab_first, delay=delay, emulated=emulated)
        mgpu.emit_pipeline(step, grid=(h_gmem.shape[1] // blocks.k,), in_specs=specs,
                           max_concurrent_steps=blocks.stages)(*operands)
        return acc_ref[...]

    # The accumulator alone in its scope (register and SMEM allocations do not mix).
    return pl.run_scoped(compute, mgpu.ACC((blocks.t, blocks.v), jnp.float32))


def _mosaic_statistics(z_tv, y_smem, out_smem, *, v0, vocab, scale, with_entropy, masked,
                       emulated):
    """Writes a block's `(m, l, zt[, a])` per token to `out_smem` from its accumulator
    `z_tv` (`h W` without the temperature). The logits are kept in base 2 (`z log2 e`:
    `exp2` is the chip's own exponential) and the statistics taken back to base e per
    token. `masked`: the block holds padding (entries from `vocab` on)."""
    z_tv = z_tv * scale  # log2(e) / temperature
    cols_tv = _columns(z_tv.shape, v0, emulated)
    if masked:
        valid_tv = cols_tv < vocab
        z_tv = jnp.where(valid_tv, z_tv, -jnp.inf)
    rows = lambda x_t: jax.lax.broadcast_in_dim(x_t, z_tv.shape, [0])
    m_t = jnp.max(z_tv, axis=1)
    e_tv = jnp.exp2(z_tv - rows(m_t))
    out_smem.at[0][...] = m_t * _LN2
    out_smem.at[1][...] = jnp.sum(e_tv, axis=1)
    hit_tv = cols_tv == rows(_load_rows(y_smem, emulated))
    out_smem.at[2][...] = jnp.sum(jnp.where(hit_tv, z_tv, 0.0), axis=1) * _LN2
    if with_entropy:  # padding: 0 * -inf, taken out
        ez_tv = jnp.where(valid_tv, e_tv * z_tv, 0.0) if masked else e_tv * z_tv
        out_smem.at[3][...] = jnp.sum(ez_tv, axis=1) * _LN2


def _sample_statistics(z_tv, y_smem, out_smem, *, v0, vocab, scale, parts, masked, emulated):
    """Writes a block's `(m, l_0, ..., l_{parts-1})` per token to `out_smem` from its
    accumulator `z_tv` (`h W` without the temperature): `m` the block's largest logit
    (base e, temperature applied) and `l_s = sum exp(z_v - m)` over the s-th of its
    `parts` equal column ranges, each range's mass relative to the block's largest
    (a range whose logits all lie 87 or more below it gets 0: a mass under 1e-38 of the
    block's, which no draw reaches). `y_smem` is unused. `masked`: the block holds
    padding (entries from `vocab` on)."""
    del y_smem
    z_tv = z_tv * scale  # log2(e) / temperature
    cols_tv = _columns(z_tv.shape, 0, emulated)
    if masked:
        z_tv = jnp.where(cols_tv < vocab - v0, z_tv, -jnp.inf)
    m_t = jnp.max(z_tv, axis=1)
    e_tv = jnp.exp2(z_tv - jax.lax.broadcast_in_dim(m_t, z_tv.shape, [0]))
    out_smem.at[0][...] = m_t * _LN2
    width = z_tv.shape[1] // parts
    for s in range(parts):
        inside_tv = (cols_tv >= s * width) & (cols_tv < (s + 1) * width)
        out_smem.at[1 + s][...] = jnp.sum(jnp.where(inside_tv, e_tv, 0.0), axis=1)


def _write_statistics(z_tv, y_smem, scratch, out_gmem, j, t0, *, vocab, blocks, emulated,
                      fill=_mosaic_statistics, **settings):
    """The forward kernels' epilogue: a block's statistics (`fill`, `_mosaic_statistics`
    or `_sample_statistics`, with `settings`; only the last vocabulary block masks
    padding) to `out_gmem[:, j, t0:]` through the `[stats, rows]` SMEM buffer
    `scratch[0]`; `y_smem` holds the tokens' per-token operand (the targets)."""
    mgpu = mosaic_backend.plgpu
    (out_smem,) = scratch
    stats = functools.partial(fill, z_tv, y_smem, out_smem, v0=j * blocks.v, vocab=vocab,
                              emulated=emulated, **settings)
    _per_block_mask(stats, j, vocab, blocks)
    mgpu.commit_smem()
    rows = out_smem.shape[1]
    for i in range(out_smem.shape[0]):
        mgpu.copy_smem_to_gmem(out_smem.at[i], out_gmem.at[i, j, pl.ds(t0, rows)])
    mgpu.wait_smem_to_gmem(0)


def _per_block_mask(fn, j, vocab, blocks):
    """`fn(masked=...)`: masked in the last vocabulary block where it holds padding."""
    if vocab % blocks.v:
        pl.when(j == vocab // blocks.v)(lambda: fn(masked=True))
        pl.when(j != vocab // blocks.v)(lambda: fn(masked=False))
    else:
        fn(masked=False)


def _write_grads(z_tv, vectors_smem, scratch, out_gmem, j, t0, *, vocab, blocks, scale,
                 entropy_grad, emulated):
    """The backward kernel's epilogue: `d loss / d z` of a `[rows, v]` block from its
    accumulator `z_tv` (`h W` without the temperature), stored in the gradient's dtype
    to `out_gmem[t0:, j v:]` through the SMEM tile `scratch[0]`. Per token (the rows of
    `vectors_smem`):
    the target, `log2 Z` (base 2), `a = g_lp / temperature`, `c = a + b H` and
    `b = g_ent / temperature`, so that with `p = 2^(z log2 e / temperature - log2 Z)`

        d loss / d z = a onehot(y) - p (c + b ln p)

    (`jrl.rl.logprobs._fused_bwd`'s formula); padding entries get 0."""
    mgpu = mosaic_backend.plgpu
    (tile_smem,) = scratch
    y_smem, log2_z_smem, a_smem, c_smem, b_smem = (vectors_smem.at[i] for i in range(5))
    rows = lambda ref: jax.lax.broadcast_in_dim(_load_rows(ref, emulated), z_tv.shape, [0])

    def grads(masked):
        log2_p = z_tv * scale - rows(log2_z_smem)
        p_tv = jnp.exp2(log2_p)
        coef_tv = rows(c_smem)
        if entropy_grad:
            coef_tv = coef_tv + rows(b_smem) * (log2_p * _LN2)
        g_tv = -p_tv * coef_tv
        cols_tv = _columns(z_tv.shape, j * blocks.v, emulated)
        hit_tv = cols_tv.astype(jnp.float32) == rows(y_smem)  # exact: `_EXACT_IDS`
        g_tv = jnp.where(hit_tv, g_tv + rows(a_smem), g_tv)
        if masked:  # padding: p 0, ln p -inf
            g_tv = jnp.where(cols_tv < vocab, g_tv, 0.0)
        tile_smem[...] = g_tv.astype(tile_smem.dtype)

    _per_block_mask(grads, j, vocab, blocks)
    mgpu.commit_smem()
    mgpu.copy_smem_to_gmem(tile_smem, out_gmem.at[pl.ds(t0, tile_smem.shape[0]),
                                                  pl.ds(j * blocks.v, blocks.v)])
    mgpu.wait_smem_to_gmem(0)


def _stage_tokens(x_gmem, x_smem, barrier, t0):
    """TMA copy of the `[..., T]` per-token operand's tokens from `t0` into `x_smem`."""
    tokens = (slice(None),) * (len(x_smem.shape) - 1) + (pl.ds(t0, x_smem.shape[-1]),)
    mosaic_backend.plgpu.copy_gmem_to_smem(x_gmem.at[tokens], x_smem, barrier)


def _block_start(blocks, group):
    """(vocabulary block, first token) of this program."""
    j = jax.lax.axis_index("v")
    t0 = (jax.lax.axis_index("g") * group + jax.lax.axis_index("t")) * blocks.t
    return j, t0


def _mosaic_kernel(h_gmem, w_gmem, x_gmem, out_gmem, x_smem, *refs, vocab_first, blocks,
                   group, emulated, epilogue):
    """One `[t, v]` block on one warpgroup: its logits (`_mosaic_logits`) handed to
    `epilogue(z_tv, x_smem, scratch, out_gmem, j, t0, emulated=...)` with the block's
    tokens of the per-token operand `x` in `x_smem` and the epilogue's `scratch` buffers
    (`refs` but the last, a barrier)."""
    mgpu = mosaic_backend.plgpu
    scratch, barrier = refs[:-1], refs[-1].at[0]
    j, t0 = _block_start(blocks, group)
    _stage_tokens(x_gmem, x_smem, barrier, t0)
    z_tv = _mosaic_logits(h_gmem, w_gmem, t0, j * blocks.v, vocab_first=vocab_first,
                          blocks=blocks, emulated=emulated)
    mgpu.barrier_wait(barrier)
    epilogue(z_tv, x_smem, scratch, out_gmem, j, t0, emulated=emulated)


def _mosaic_kernel_specialized(h_gmem, w_gmem, x_gmem, out_gmem, *, vocab_first, blocks,
                               group, emulated, epilogue, staged_type, scratch_types):
    """One `[t, v]` block on `blocks.consumers` warpgroups, each multiplying its
    `t / consumers` tokens and running `epilogue` on them (as `_mosaic_kernel`), fed by
    one more warpgroup that only issues the TMA copies (`emit_pipeline_warp_specialized`,
    the tiles of W shared by the consumers). `staged_type` / `scratch_types`: each
    consumer's SMEM buffer for its tokens of `x` and the epilogue's buffers, as
    `(shape, dtype, transforms)`."""
    mgpu = mosaic_backend.plgpu
    n, rows = blocks.consumers, blocks.t // blocks.consumers
    j, t0 = _block_start(blocks, group)
    specs, operands, delay = _pipeline_specs(h_gmem, w_gmem, t0, j * blocks.v,
                                             vocab_first=vocab_first, blocks=blocks)
    pipeline = lambda body, context: mgpu.emit_pipeline_warp_specialized(
        body, grid=(h_gmem.shape[1] // blocks.k,), memory_registers=40, in_specs=specs,
        wg_axis="wg", num_compute_wgs=n, max_concurrent_steps=blocks.stages,
        compute_context=context)
    ignore = lambda *_, **__: None  # allocations depend on neither function

    def scoped(allocations, w_kv, barriers, x_smem, *buffers):
        wg = jax.lax.axis_index("wg")
        mine = t0 + wg * rows
        x_smem, scratch = x_smem.at[wg], [b.at[wg] for b in buffers]

        def context(run_pipeline):
            _stage_tokens(x_gmem, x_smem, barriers.at[wg], mine)

            def with_accumulator(acc_ref):
                run_pipeline(acc_ref)
                z_tv = acc_ref[...]
                mgpu.barrier_wait(barriers.at[wg])
                epilogue(z_tv, x_smem, scratch, out_gmem, j, mine, emulated=emulated)
            pl.run_scoped(with_accumulator, mgpu.ACC((rows, blocks.v), jnp.float32))

        def body(_, h_smem, w_smem, acc_ref):
            _wgmma_step(acc_ref, h_smem.at[pl.ds(wg * rows, rows)], w_smem,
                        vocab_first=vocab_first, delay=delay, emulated=emulated,
                        w_kv=None if w_kv is None else w_kv.at[wg])
            return acc_ref

        pipeline(body, context)(*operands, allocations=allocations)

    # Interpreted, the transposed copies of W's tiles (`_wgmma_step`), allocated by all.
    w_kv = (mgpu.SMEM((n, blocks.k, blocks.v), w_gmem.dtype) if emulated and vocab_first
            else None)
    buffers = [mgpu.SMEM((n, *shape), dtype, transforms=transforms)
               for shape, dtype, transforms in (staged_type, *scratch_types)]
    pl.run_scoped(scoped, pipeline(ignore, ignore).get_allocations(*operands), w_kv,
                  mgpu.Barrier(num_barriers=n), *buffers, collective_axes="wg")


def _launch(h_td, w, x, *, out_type, epilogue, scratch_types, vocab_first, blocks,
            interpret):
    """The kernel over `h_td [T, D]` (T whole `blocks.t`) and W's vocabulary blocks,
    each block's logits handed to `epilogue` (`_mosaic_kernel`) with the block's tokens
    of the per-token operand `x [..., T]` staged in SMEM (one copy a block: Pallas' GPU
    interpreter hangs, most runs, when a consumer warpgroup issues two or more) and
    `scratch_types` (`(shape, dtype, transforms)` per consumer warpgroup) for its
    buffers; Pallas' GPU interpret mode where `interpret` or off a GPU. The grid: groups
    of token blocks, by vocabulary blocks, by a group's token blocks (the last axis
    varies fastest: the programs running at once share a block of W, and a group's
    hidden states are read again from L2)."""
    mosaic_backend.require("model.logprob_impl")
    mgpu = mosaic_backend.plgpu
    mode = mosaic_backend.interpret(force=bool(interpret))
    nv = (w.shape[0] if vocab_first else w.shape[1]) // blocks.v
    nt = h_td.shape[0] // blocks.t
    group = max(g for g in range(1, min(blocks.group or nt, nt) + 1) if nt % g == 0)
    settings = dict(vocab_first=vocab_first, blocks=blocks, group=group,
                    emulated=mode is not False, epilogue=epilogue)
    staged_type = ((*x.shape[:-1], blocks.t // blocks.consumers), x.dtype, ())
    if blocks.consumers == 1:
        kernel = functools.partial(_mosaic_kernel, **settings)
        threads = dict(scratch_types=[
            *(mgpu.SMEM(shape, dtype, transforms=t)
              for shape, dtype, t in (staged_type, *scratch_types)),
            mgpu.Barrier(num_barriers=1)])
    else:  # the consumers and one memory warpgroup
        kernel = functools.partial(_mosaic_kernel_specialized, staged_type=staged_type,
                                   scratch_types=scratch_types, **settings)
        threads = dict(num_threads=blocks.consumers + 1, thread_name="wg")
    # Mosaic GPU takes operands at 256-byte aligned addresses. Left to itself, XLA's GPU
    # compiler may hand a custom call a slice of a larger buffer by its address (targets
    # shifted by one token: 4 bytes in), which the kernel then refuses at run time; the
    # barrier makes each operand a buffer of its own.
    operands = jax.lax.optimization_barrier((h_td, w, x))
    return mgpu.kernel(
        kernel, out_type=out_type, grid=(nt // group, nv, group), grid_names=("g", "v", "t"),
        compiler_params=mgpu.CompilerParams(approx_math=True), interpret=mode, **threads,
    )(*operands)


def _mosaic_parts(h_td, w, y_t, *, vocab, vocab_first, temperature, with_entropy, blocks,
                  interpret):
    """The Mosaic GPU kernel's per-block statistics `(m, l, zt[, a])`, each `[V / v, T]`
    (`_write_statistics`)."""
    tp = h_td.shape[0]
    nv = (w.shape[0] if vocab_first else w.shape[1]) // blocks.v
    stats = 4 if with_entropy else 3
    epilogue = functools.partial(_write_statistics, vocab=vocab, blocks=blocks,
                                 scale=_LOG2E / temperature, with_entropy=with_entropy)
    out = _launch(h_td, w, y_t.astype(jnp.int32),
                  out_type=jax.ShapeDtypeStruct((stats, nv, tp), jnp.float32),
                  epilogue=epilogue,
                  scratch_types=[((stats, blocks.t // blocks.consumers), jnp.float32, ())],
                  vocab_first=vocab_first, blocks=blocks, interpret=interpret)
    return tuple(out)


def _mosaic_grads(h_td, w, y_t, log2_z_t, a_t, c_t, b_t, *, vocab, vocab_first, temperature,
                  entropy_grad, blocks, interpret):
    """The backward kernel: `d loss / d z` `[T, Vp]` in `h_td`'s dtype (`_write_grads`),
    each block's logits recomputed on chip."""
    mosaic_backend.require("model.logprob_impl")
    mgpu = mosaic_backend.plgpu
    vp = w.shape[0] if vocab_first else w.shape[1]
    itemsize = jnp.dtype(h_td.dtype).itemsize
    swizzle = mgpu.find_swizzle(min(blocks.v, 128 // itemsize) * itemsize * 8)
    tiled = (mgpu.TilingTransform((8, swizzle // itemsize)), mgpu.SwizzleTransform(swizzle))
    epilogue = functools.partial(_write_grads, vocab=vocab, blocks=blocks,
                                 scale=_LOG2E / temperature, entropy_grad=entropy_grad)
    # The five per-token vectors as one `[5, T]` operand (`_launch`: one copy a block).
    vectors = jnp.stack([x.astype(jnp.float32) for x in (y_t, log2_z_t, a_t, c_t, b_t)])
    return _launch(h_td, w, vectors,
                   out_type=jax.ShapeDtypeStruct((h_td.shape[0], vp), h_td.dtype),
                   epilogue=epilogue,
                   scratch_types=[((blocks.t // blocks.consumers, blocks.v), h_td.dtype, tiled)],
                   vocab_first=vocab_first, blocks=blocks, interpret=interpret)


def _merge(parts, with_entropy):
    """`(log_z, target_logit, entropy)`, each float32 `[T]`, from the per-block
    statistics `(m, l, zt[, a])`, each `[V / v, T]` (the module docstring)."""
    block_max, block_sum, block_target = parts[:3]
    top = jnp.max(block_max, axis=0)
    scale = jnp.exp(block_max - top)
    total = jnp.sum(block_sum * scale, axis=0)
    log_z = top + jnp.log(total)
    entropy = (log_z - jnp.sum(parts[3] * scale, axis=0) / total if with_entropy
               else jnp.zeros_like(top))
    return log_z, jnp.sum(block_target, axis=0), entropy


def _call(h_td, w, y_t, *, impl, **kwargs):
    """One kernel launch over `T` tokens (a multiple of `blocks.t`): the per-block
    statistics merged into `(log_z, target_logit, entropy)`, each float32 `[T]`."""
    del impl  # "mosaic", the one kernel
    return _merge(_mosaic_parts(h_td, w, y_t, **kwargs), kwargs["with_entropy"])


def _tokens(x, size):
    """`[B, T, ...]` as `[size, ...]`: the B T tokens in a row, zeros after them."""
    n = x.shape[0] * x.shape[1]
    return jnp.pad(x.reshape(n, *x.shape[2:]), [(0, size - n)] + [(0, 0)] * (x.ndim - 2))


def _rows(sharder, h_btd):
    """`ndim -> PartitionSpec` of an operand split by rows as the sharder splits
    `h_btd`'s (the kernels' `per_shard` specs)."""
    batch = sharder.spec(("batch",), h_btd.shape[:1])[0]
    return lambda ndim: P(batch, *([None] * (ndim - 1)))


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
    h_ctd = _tokens(h_btd, calls * per_call).reshape(calls, per_call, d)
    y_ct = _tokens(y_bt, calls * per_call).reshape(calls, per_call)
    stats = jax.lax.map(lambda xs: _call(xs[0], w, xs[1], blocks=blocks, **kwargs),
                        (h_ctd, y_ct))
    return tuple(x.reshape(-1)[:n].reshape(b, t) for x in stats)


def log_softmax_stats(h_btd: Array, weight: Array, targets_bt: Array, *, vocab: int,
                      vocab_first: bool, temperature: float = 1.0, with_entropy: bool = False,
                      impl: str = "mosaic", blocks: MosaicBlocks | None = None,
                      tokens_per_call: int = 32768, interpret: bool = False):
    """Log-normaliser, target logit and entropy of `softmax(h W / temperature)`.

    Args:
      h_btd: `[B, T, D]` hidden states (bf16 or float32); D a multiple of `blocks.k`.
      weight: `pad_vocab`'s unembedding, `[Vp, D]` if `vocab_first` else `[D, Vp]`,
        in `h_btd`'s dtype.
      targets_bt: int `[B, T]` token ids.
      vocab: the real vocabulary size V (entries from V on are padding).
      temperature: the logits are divided by it.
      with_entropy: also compute the entropy (else zeros).
      impl: "mosaic" (the one kernel, on Hopper GPUs).
      blocks: the tiles (default `MOSAIC_FORWARD`).
      tokens_per_call: tokens per kernel launch (a device's tokens are launched in
        turn): bounds the per-block statistics, `16 V / blocks.v` bytes a token.
      interpret: run in Pallas' GPU interpret mode (always off a GPU).

    Returns:
      `(log_z, target_logit, entropy)`, each float32 `[B, T]`; the log-prob is
      `target_logit - log_z`.

    Under a `Sharder` the kernel runs in a `shard_map` over the batch axes (XLA cannot
    split a custom call over devices), each device on its rows with the unembedding
    whole.
    """
    fn = functools.partial(_local_stats, vocab=vocab, vocab_first=vocab_first,
                           temperature=temperature, with_entropy=with_entropy, impl=impl,
                           blocks=blocks or MOSAIC_FORWARD,
                           tokens_per_call=tokens_per_call, interpret=interpret)
    def specs(sharder):
        rows = _rows(sharder, h_btd)
        return (rows(3), P(None, None), rows(2)), (rows(2),) * 3

    return sharding.per_shard(fn, specs, h_btd, weight, targets_bt)


# The sampler's tiles (`block_masses`, `sample_blocks`): blocks of 128 vocabulary entries,
# which divide the vocabularies of Qwen2/2.5/3 (151,936 and 152,064), Llama 3 (128,256)
# and Gemma (256,000 and 262,144) with no padded copy of the unembedding. Above
# `SAMPLE_FEW_ROWS` rows, 256 rows a program on two consumer warpgroups (W read once);
# up to it, 64 rows on one (less padding). The fastest of a sweep of the head alone at
# Qwen2.5-0.5B's (one H100, experiments/bench_decode_head.py): at 256 / 512 rows 195 /
# 310 us against 230 / 385 for 128 rows a program and 299 / 496 for XLA's logits; at
# 32 / 64 / 128 rows 146 / 148 / 155 us against 166 / 167 / 165 for 128 rows a program,
# 182 / 205 / 192 for 256, and 151 / 182 / 215 for XLA's.
SAMPLE_BLOCKS = MosaicBlocks(t=256, v=128, k=64, stages=3, overlap=True, group=16,
                             consumers=2)
SAMPLE_BLOCKS_FEW = MosaicBlocks(t=64, v=128, k=64, stages=4, overlap=True)
SAMPLE_FEW_ROWS = 128


def sample_blocks(rows: int) -> MosaicBlocks:
    """`block_masses`' tiles for `rows` rows a device (both settings' blocks of W are of
    one size, which the unembedding's padding follows)."""
    return SAMPLE_BLOCKS_FEW if rows <= SAMPLE_FEW_ROWS else SAMPLE_BLOCKS

# Column ranges of a block whose masses `block_masses` writes: the draw recomputes the
# logits of one range a row (`v / parts` rows of W gathered a row), so more parts
# gather less and reduce more on chip.
SAMPLE_PARTS = 2


def _local_masses(h_nd, w, *, vocab, vocab_first, temperature, parts, blocks, interpret):
    """`block_masses` on this device's `[N, D]` rows, in one launch."""
    n, d = h_nd.shape
    blocks = blocks or sample_blocks(n)
    _check_shapes(d, w.shape[0] if vocab_first else w.shape[1], vocab, blocks,
                  key="model.decode_head_impl")
    if blocks.v % parts or (blocks.v // parts) % 8:
        raise ValueError(f"block_masses splits blocks of {blocks.v} entries into {parts} "
                         "ranges: they must divide it into whole multiples of 8")
    h = jnp.pad(h_nd, [(0, -n % blocks.t), (0, 0)])
    nv = (w.shape[0] if vocab_first else w.shape[1]) // blocks.v
    epilogue = functools.partial(_write_statistics, vocab=vocab, blocks=blocks,
                                 fill=_sample_statistics, scale=_LOG2E / temperature,
                                 parts=parts)
    out = _launch(h, w, jnp.zeros(h.shape[:1], jnp.int32),
                  out_type=jax.ShapeDtypeStruct((1 + parts, nv, h.shape[0]), jnp.float32),
                  epilogue=epilogue,
                  scratch_types=[((1 + parts, blocks.t // blocks.consumers), jnp.float32, ())],
                  vocab_first=vocab_first, blocks=blocks, interpret=interpret)
    return out[0, :, :n], out[1:, :, :n]


def block_masses(h_nd: Array, weight: Array, *, vocab: int, vocab_first: bool,
                 temperature: float = 1.0, parts: int = SAMPLE_PARTS,
                 blocks: MosaicBlocks | None = None, interpret: bool = False):
    """The distribution `softmax(h W / temperature)` of each row by blocks of the
    vocabulary, for drawing from it without its logits in memory.

    Args:
      h_nd: `[N, D]` final hidden states (bf16, or float32 in interpret mode).
      weight: the unembedding in `h_nd`'s dtype, `[Vp, D]` if `vocab_first` else
        `[D, Vp]`, with whole `blocks.v` blocks (`pad_vocab`).
      vocab: the real vocabulary size V (entries from V on are padding).
      temperature: the logits are divided by it.
      parts: column ranges of a block (of `blocks.v / parts` entries, a multiple of 8).
      blocks: the tiles (default: `sample_blocks` of a device's rows).
      interpret: run in Pallas' GPU interpret mode (always off a GPU).

    Returns:
      `(block_max [Vp / v, N], masses [parts, Vp / v, N])`, float32: block j's largest
      logit, and `masses[s, j] = sum exp(z - block_max[j])` over the entries of its s-th
      range (padding 0). Range `(j, s)` holds entries from `(j parts + s) v / parts`.

    Under a `Sharder` the kernel runs per device's rows, as `log_softmax_stats`.
    """
    fn = functools.partial(_local_masses, vocab=vocab, vocab_first=vocab_first,
                           temperature=temperature, parts=parts, blocks=blocks,
                           interpret=interpret)

    def specs(sharder):
        batch = sharder.spec(("batch",), h_nd.shape[:1])[0]
        return (P(batch, None), P(None, None)), (P(None, batch), P(None, None, batch))

    return sharding.per_shard(fn, specs, h_nd, weight)


# The backward kernel's tiles: the forward's (`_write_grads` adds a `[64, 256]` tile per
# consumer: 208 KiB of Hopper's 227 KiB of shared memory). Alone, at 8,192 tokens of the
# Qwen2.5-0.5B head (experiments/bench_head_backward.py),
# 128 entries x 4 stages was faster (4.87 ms against 5.60; XLA 7.46), but in the GRPO
# step these tiles were (learn 1.502 against 1.519 s, XLA's backward 1.523 and 1.518;
# calls 12 and 13, one H200).
MOSAIC_BACKWARD = MOSAIC_FORWARD

# `_fused_bwd` (jrl.rl.logprobs) with `impl="mosaic"`: "mosaic" forms d(loss)/d(logits)
# with `grad_logits` (the logits recomputed on chip, written once in the compute
# dtype), "xla" recomputes each chunk's float32 logits in XLA (the benches' before).
BACKWARD = "mosaic"


_EXACT_IDS = 2 ** 24  # float32 holds every integer up to here


def _local_grads(h_btd, w, y_bt, log_z_bt, g_lp_bt, g_ent_bt, ent_bt, *, vocab, vocab_first,
                 temperature, entropy_grad, blocks, interpret):
    """`grad_logits` on this device's `[B, T]` tokens, in one launch."""
    b, t, d = h_btd.shape
    _check_shapes(d, w.shape[0] if vocab_first else w.shape[1], vocab, blocks)
    if vocab > _EXACT_IDS:
        raise ValueError(f"the log-prob backward kernel takes token ids as float32, exact "
                         f"up to {_EXACT_IDS}; got a vocabulary of {vocab}; use "
                         "model.logprob_impl='xla'")
    n = b * t
    flat = functools.partial(_tokens, size=n + -n % blocks.t)
    a_t = flat(g_lp_bt.astype(jnp.float32)) / temperature
    b_t = (flat(g_ent_bt.astype(jnp.float32)) / temperature if entropy_grad
           else jnp.zeros_like(a_t))
    c_t = a_t + b_t * flat(ent_bt.astype(jnp.float32))
    grads = _mosaic_grads(flat(h_btd), w, flat(y_bt), flat(log_z_bt) * _LOG2E, a_t, c_t, b_t,
                          vocab=vocab, vocab_first=vocab_first, temperature=temperature,
                          entropy_grad=entropy_grad, blocks=blocks, interpret=interpret)
    return grads[:n].reshape(b, t, -1)


def grad_logits(h_btd: Array, weight: Array, targets_bt: Array, log_z_bt: Array,
                g_lp_bt: Array, g_ent_bt: Array, ent_bt: Array, *, vocab: int,
                vocab_first: bool, temperature: float = 1.0, entropy_grad: bool = True,
                blocks: MosaicBlocks | None = None, interpret: bool = False) -> Array:
    """`d loss / d z` for the logits `z = h W / temperature`, `[B, T, Vp]` in `h_btd`'s
    dtype, from the forward pass's `log Z` and entropy and the cotangents of the
    log-probs (`g_lp`) and the entropies (`g_ent`, ignored unless `entropy_grad`):

        g_lp (onehot(y) - p) - g_ent p (ln p + H),  divided by the temperature,

    each block of logits recomputed on chip by the forward kernel's pipeline and the
    gradient formed on its registers (no float32 logits in memory). `weight` is
    `pad_vocab`'s unembedding; the padding entries' gradients are 0. The chain rule
    through the unembedding (`grad @ W`, `grad^T @ h`) is left to XLA's matmuls. Under
    a `Sharder`, per device's rows as `log_softmax_stats`."""
    fn = functools.partial(_local_grads, vocab=vocab, vocab_first=vocab_first,
                           temperature=temperature, entropy_grad=entropy_grad,
                           blocks=blocks or MOSAIC_BACKWARD, interpret=interpret)

    def specs(sharder):
        rows = _rows(sharder, h_btd)
        return (rows(3), P(None, None), *(rows(2),) * 5), rows(3)

    return sharding.per_shard(fn, specs, h_btd, weight, targets_bt, log_z_bt, g_lp_bt,
                              g_ent_bt, ent_bt)
