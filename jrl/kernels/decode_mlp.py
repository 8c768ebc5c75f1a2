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
    steps' tiles in flight."""

    t: int = 64
    v: int = 64
    k: int = 64
    stages: int = 4

    def __post_init__(self):
        if self.t % 64 or self.v % self.k or not self.k <= self.v <= 256 or self.stages < 2:
            raise ValueError(f"MlpBlocks needs t a multiple of 64, v a multiple of k up "
                             f"to 256 and stages >= 2, got {self}")


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


def _kernel(x_gmem, w_gmem, out_gmem, out_smem, *, features, blocks):
    """One `[t, v]` tile of `silu(x Wg) * (x Wu)`: rows `t0:`, features `c0:`."""
    mgpu = mosaic_backend.plgpu
    c0 = jax.lax.axis_index("f") * blocks.v
    t0 = jax.lax.axis_index("t") * blocks.t
    itemsize = jnp.dtype(x_gmem.dtype).itemsize
    steps = x_gmem.shape[1] // blocks.k
    # Each step's two wgmmas left running while the next step's tiles arrive, its
    # buffers then released one step later.
    delay = int(steps > 1)
    x_spec = mgpu.BlockSpec((blocks.t, blocks.k), lambda s: (0, s),
                            transforms=_tiled(blocks.k, itemsize), delay_release=delay)
    w_spec = mgpu.BlockSpec((blocks.k, blocks.v), lambda s: (s, 0),
                            transforms=_tiled(blocks.k, itemsize), delay_release=delay)
    operands = (x_gmem.at[pl.ds(t0, blocks.t)], w_gmem.at[:, pl.ds(c0, blocks.v)],
                w_gmem.at[:, pl.ds(features + c0, blocks.v)])

    def compute(gate_ref, up_ref):
        def step(_, x_smem, gate_smem, up_smem):
            mgpu.wgmma(gate_ref, x_smem, gate_smem)
            mgpu.wgmma(up_ref, x_smem, up_smem)
            mgpu.wgmma_wait(2 * delay)

        mgpu.emit_pipeline(step, grid=(steps,), in_specs=[x_spec, w_spec, w_spec],
                           max_concurrent_steps=blocks.stages)(*operands)
        return gate_ref[...], up_ref[...]

    acc = mgpu.ACC((blocks.t, blocks.v), jnp.float32)
    gate, up = pl.run_scoped(compute, acc, acc)
    # silu(g) = g / (1 + e^-g), with the chip's base-2 exponential.
    out_smem[...] = (gate / (1.0 + jnp.exp2(gate * -_LOG2E)) * up).astype(out_smem.dtype)
    mgpu.commit_smem()
    mgpu.copy_smem_to_gmem(out_smem, out_gmem.at[pl.ds(t0, blocks.t), pl.ds(c0, blocks.v)])
    mgpu.wait_smem_to_gmem(0)


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
    out = mgpu.kernel(
        functools.partial(_kernel, features=f, blocks=blocks),
        out_type=jax.ShapeDtypeStruct((x.shape[0], f), x.dtype),
        grid=(f // blocks.v, x.shape[0] // blocks.t), grid_names=("f", "t"),
        scratch_types=[mgpu.SMEM((blocks.t, blocks.v), x.dtype,
                                 transforms=_tiled(min(blocks.v, blocks.k), itemsize))],
        compiler_params=mosaic_backend.compiler_params(),
        interpret=mosaic_backend.interpret(force=bool(interpret)),
    )(x, w)
    return out[:n]


def reference(x_nd: Array, gate_up_d2f: Array) -> Array:
    """`gated_up` in XLA: float32 products, the activation on them, cast to `x_nd`'s
    dtype."""
    gate_up = jnp.einsum("nd,dkf->nkf", x_nd, gate_up_d2f,
                         preferred_element_type=jnp.float32)
    return (jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]).astype(x_nd.dtype)
