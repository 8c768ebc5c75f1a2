"""The decode step's gated up-projection in one kernel: `silu(x Wg) * (x Wu)`.

At a decode step the MLP's input is a few hundred rows at most, and its gate and up
projections read the layer's largest weights (Qwen2.5-0.5B: 17.4 MB of 29.7 MB). With
XLA they are a cuBLAS matmul writing `[N, 2, F]` in the compute dtype and a second
kernel reading it back for SwiGLU. Here one Pallas kernel (Mosaic GPU, Hopper) does
both: each program copies `[t, k]` tiles of x and the matching `[k, v]` tiles of the
gate's and the up projection's columns into swizzled shared memory with TMA, `stages`
steps ahead, multiplies them with `wgmma` into two float32 accumulators in registers,
and stores `silu(gate) * up` in the compute dtype: one kernel a layer-step fewer, the
intermediate neither written nor read, and the activation taken on float32 products
(XLA's path rounds them to the compute dtype first).

It takes the sampler's fused layout of the two kernels (`transformer.FUSED_GATE_UP`,
`[D, 2, F]`, gate first), viewed as `[D, 2F]`. Off a GPU it runs in Pallas' GPU interpret
mode, which is how the CPU tests check it against XLA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jrl.kernels import mosaic_backend

Array = jax.Array

_LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class MlpBlocks:
    """Tiles of `gated_up`: `t` rows a program (wgmma's M: 64 per warpgroup), `v`
    intermediate features a program (wgmma's N for each of the two accumulators, up to
    256, dividing F: whole `k`, as wgmma takes the weight's tiles swizzled as x's), `k`
    hidden units a pipeline step (64: the 128-byte swizzle's width at 16 bits), `stages`
    steps' tiles in flight. `consumers`: warpgroups that multiply, `t / consumers` rows
    each; above 1, one more warpgroup issues the copies (warp specialisation) and the
    consumers share each tile of the weights."""

    t: int = 64
    v: int = 64
    k: int = 64
    stages: int = 4
    consumers: int = 1

    def __post_init__(self):
        if (self.consumers < 1 or self.t % (64 * self.consumers) or self.v % self.k
                or not self.k <= self.v <= 256 or self.stages < 2):
            raise ValueError(f"MlpBlocks needs t a multiple of 64 per consumer, v a "
                             f"multiple of k up to 256 and stages >= 2, got {self}")


MLP_BLOCKS = MlpBlocks()


def supported(x_shape, w_shape, dtype, blocks: MlpBlocks = MLP_BLOCKS) -> bool:
    """Whether `gated_up` takes these shapes: a 16-bit dtype, the hidden size whole
    `k` steps and the intermediate size whole `v` blocks."""
    d, f = w_shape[0], w_shape[-1]
    return (jnp.dtype(dtype).itemsize == 2 and x_shape[-1] == d and d % blocks.k == 0
            and f % blocks.v == 0)


def _tiled(minor: int, itemsize: int):
    """SMEM transforms of a tile whose minor dimension holds `minor` elements."""
    mgpu = mosaic_backend.plgpu
    swizzle = mgpu.find_swizzle(minor * itemsize * 8)
    return mgpu.TilingTransform((8, swizzle // itemsize)), mgpu.SwizzleTransform(swizzle)


def _specs(x_gmem, w_gmem, *, features, blocks):
    """The pipeline over the hidden units of the program's tile: its in_specs (`[t, k]`
    tiles of x, `[k, v]` tiles of the gate's and the up projection's columns), their GMEM
    operands, and the wgmma groups a step leaves running (its two, while the next step's
    tiles arrive; its buffers then released one step later)."""
    mgpu = mosaic_backend.plgpu
    c0 = jax.lax.axis_index("f") * blocks.v
    t0 = jax.lax.axis_index("t") * blocks.t
    tiled = _tiled(blocks.k, jnp.dtype(x_gmem.dtype).itemsize)
    delay = int(x_gmem.shape[1] > blocks.k)
    spec = lambda shape, index: mgpu.BlockSpec(shape, index, transforms=tiled,
                                               delay_release=delay)
    specs = [spec((blocks.t, blocks.k), lambda s: (0, s)),
             spec((blocks.k, blocks.v), lambda s: (s, 0)),
             spec((blocks.k, blocks.v), lambda s: (s, 0))]
    operands = (x_gmem.at[pl.ds(t0, blocks.t)], w_gmem.at[:, pl.ds(c0, blocks.v)],
                w_gmem.at[:, pl.ds(features + c0, blocks.v)])
    return specs, operands, 2 * delay, t0, c0


def _step(gate_ref, up_ref, x_smem, gate_smem, up_smem, running):
    mgpu = mosaic_backend.plgpu
    mgpu.wgmma(gate_ref, x_smem, gate_smem)
    mgpu.wgmma(up_ref, x_smem, up_smem)
    mgpu.wgmma_wait(running)


def _store(gate, up, out_smem, out_gmem, r0, c0):
    """`silu(gate) * up` (float32 accumulators) to `out_gmem[r0:, c0:]` through SMEM."""
    mgpu = mosaic_backend.plgpu
    # silu(g) = g / (1 + e^-g), with the chip's base-2 exponential.
    out_smem[...] = (gate / (1.0 + jnp.exp2(gate * -_LOG2E)) * up).astype(out_smem.dtype)
    mgpu.commit_smem()
    rows, cols = out_smem.shape
    mgpu.copy_smem_to_gmem(out_smem, out_gmem.at[pl.ds(r0, rows), pl.ds(c0, cols)])
    mgpu.wait_smem_to_gmem(0)


def _kernel(x_gmem, w_gmem, out_gmem, out_smem, *, features, blocks):
    """One `[t, v]` tile of `silu(x Wg) * (x Wu)` on one warpgroup."""
    mgpu = mosaic_backend.plgpu
    specs, operands, running, t0, c0 = _specs(x_gmem, w_gmem, features=features,
                                              blocks=blocks)

    def compute(gate_ref, up_ref):
        step = lambda _, *tiles: _step(gate_ref, up_ref, *tiles, running)
        mgpu.emit_pipeline(step, grid=(x_gmem.shape[1] // blocks.k,), in_specs=specs,
                           max_concurrent_steps=blocks.stages)(*operands)
        return gate_ref[...], up_ref[...]

    acc = mgpu.ACC((blocks.t, blocks.v), jnp.float32)
    gate, up = pl.run_scoped(compute, acc, acc)
    _store(gate, up, out_smem, out_gmem, t0, c0)


def _kernel_specialized(x_gmem, w_gmem, out_gmem, *, features, blocks):
    """One `[t, v]` tile on `blocks.consumers` warpgroups, `t / consumers` rows each, fed
    by one more warpgroup that only issues the TMA copies (the weights' tiles shared by
    the consumers)."""
    mgpu = mosaic_backend.plgpu
    n, rows = blocks.consumers, blocks.t // blocks.consumers
    specs, operands, running, t0, c0 = _specs(x_gmem, w_gmem, features=features,
                                              blocks=blocks)
    pipeline = lambda body, context: mgpu.emit_pipeline_warp_specialized(
        body, grid=(x_gmem.shape[1] // blocks.k,), memory_registers=40, in_specs=specs,
        wg_axis="wg", num_compute_wgs=n, max_concurrent_steps=blocks.stages,
        compute_context=context)
    ignore = lambda *_, **__: None  # allocations depend on neither function

    def scoped(allocations, out_smem):
        wg = jax.lax.axis_index("wg")

        def context(run_pipeline):
            def with_accumulators(gate_ref, up_ref):
                run_pipeline((gate_ref, up_ref))
                _store(gate_ref[...], up_ref[...], out_smem.at[wg], out_gmem,
                       t0 + wg * rows, c0)
            acc = mgpu.ACC((rows, blocks.v), jnp.float32)
            pl.run_scoped(with_accumulators, acc, acc)

        def body(_, x_smem, gate_smem, up_smem, accumulators):
            _step(*accumulators, x_smem.at[pl.ds(wg * rows, rows)], gate_smem, up_smem,
                  running)
            return accumulators

        pipeline(body, context)(*operands, allocations=allocations)

    out_type = mgpu.SMEM((n, rows, blocks.v), out_gmem.dtype,
                         transforms=_tiled(min(blocks.v, blocks.k), out_gmem.dtype.itemsize))
    pl.run_scoped(scoped, pipeline(ignore, ignore).get_allocations(*operands), out_type,
                  collective_axes="wg")


def gated_up(x_nd: Array, gate_up_d2f: Array, *, blocks: MlpBlocks | None = None,
             interpret: bool = False) -> Array:
    """`silu(x Wg) * (x Wu)` in one Mosaic GPU kernel.

    Args:
      x_nd: `[N, D]` the normalised hidden states (16-bit on a GPU; float32 runs in
        interpret mode).
      gate_up_d2f: `[D, 2, F]` the gate's and the up projection's kernels, gate first,
        in `x_nd`'s dtype.
      blocks: the tiles (default `MLP_BLOCKS`); F must be whole `blocks.v`, D whole
        `blocks.k`.
      interpret: run in Pallas' GPU interpret mode (always off a GPU).

    Returns:
      `[N, F]` in `x_nd`'s dtype.
    """
    mosaic_backend.require("model.decode_mlp_impl")
    mgpu = mosaic_backend.plgpu
    blocks = blocks or MLP_BLOCKS
    n, d = x_nd.shape
    f = gate_up_d2f.shape[-1]
    if gate_up_d2f.shape != (d, 2, f) or d % blocks.k or f % blocks.v:
        raise ValueError(f"gated_up takes x [N, D] and gate/up [D, 2, F] with D whole "
                         f"{blocks.k}-wide steps and F whole {blocks.v}-wide blocks, got "
                         f"{x_nd.shape} and {gate_up_d2f.shape}")
    x = jnp.pad(x_nd, [(0, -n % blocks.t), (0, 0)])
    # Mosaic GPU takes operands at 256-byte aligned addresses; the barrier makes each
    # a buffer of its own (`logprob_head._launch` says why).
    x, w = jax.lax.optimization_barrier((x, gate_up_d2f.reshape(d, 2 * f)))
    itemsize = jnp.dtype(x.dtype).itemsize
    settings = dict(features=f, blocks=blocks)
    if blocks.consumers == 1:
        kernel = functools.partial(_kernel, **settings)
        threads = dict(scratch_types=[mgpu.SMEM(
            (blocks.t, blocks.v), x.dtype, transforms=_tiled(min(blocks.v, blocks.k), itemsize))])
    else:  # the consumers and one memory warpgroup
        kernel = functools.partial(_kernel_specialized, **settings)
        threads = dict(num_threads=blocks.consumers + 1, thread_name="wg")
    # The grid's last axis varies fastest: the programs running at once share a block of
    # the weights, read from memory once and from L2 by the others.
    out = mgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((x.shape[0], f), x.dtype),
        grid=(f // blocks.v, x.shape[0] // blocks.t), grid_names=("f", "t"),
        compiler_params=mosaic_backend.compiler_params(),
        interpret=mosaic_backend.interpret(force=bool(interpret)), **threads,
    )(x, w)
    return out[:n]


def reference(x_nd: Array, gate_up_d2f: Array) -> Array:
    """`gated_up` in XLA: float32 products, the activation on them, cast to `x_nd`'s
    dtype."""
    gate_up = jnp.einsum("nd,dkf->nkf", x_nd, gate_up_d2f,
                         preferred_element_type=jnp.float32)
    return (jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]).astype(x_nd.dtype)
