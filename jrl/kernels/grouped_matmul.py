"""Grouped matmuls of mixture-of-experts layers: rows sorted by expert times each row's
expert's weights, `out[i] = x[i] @ w[g(i)]` (`jax.lax.ragged_dot`'s contract).

XLA lowers `ragged_dot` on a GPU to a dense computation over every group (a `[M, G, K]`
intermediate: 64 GiB for one Qwen3-30B-A3B projection of 16k tokens), so on Hopper GPUs
the grouped matmuls run as Pallas kernels on the Mosaic GPU backend instead, from JAX's
own: `ragged_dot_mgpu.ragged_dot` for the forward and the input gradient (the weights
transposed), `transposed_ragged_dot_mgpu.transposed_ragged_dot` for the weight gradient
(a per-group `x_g^T dy_g`). Elsewhere, and for operands the kernels do not take (float32,
widths that are not multiples of their tiles), `jax.lax.ragged_dot`.

Rows past the sum of `group_sizes` are the caller's to ignore (the kernels leave them
unwritten, XLA zero).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jrl.kernels import mosaic_backend

IMPLS = ("auto", "xla", "mosaic")


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The kernels' tiles (JAX's kernels' own parameters); `block_m` and `block_n` are
    the largest of 128 and 64 that divide the widths they tile (`for_widths`)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 1


def _block(width: int) -> int:
    return 128 if width % 128 == 0 else 64


def for_widths(m: int, n: int) -> Tiles:
    """Tiles for output widths m (rows of the weight gradient: K) and n."""
    return Tiles(block_m=_block(m), block_n=_block(n))


def choose_impl(impl: str, x_md: jax.Array, w_gkn: jax.Array) -> str:
    """"mosaic" on a Hopper GPU for half-precision operands whose widths K and N are
    multiples of 64 ("auto"), else "xla"."""
    if impl != "auto":
        return impl
    k, n = w_gkn.shape[1:]
    half = x_md.dtype in (jnp.bfloat16, jnp.float16) and x_md.dtype == w_gkn.dtype
    fits = k % 64 == 0 and n % 64 == 0
    return "mosaic" if half and fits and mosaic_backend.on_hopper() else "xla"


def grouped_matmul(x_md: jax.Array, w_gkn: jax.Array, group_sizes: jax.Array,
                   impl: str = "auto") -> jax.Array:
    """`[M, N]`: row i of `x_md [M, K]` times `w_gkn[g] [K, N]` for the group g it is in
    (`group_sizes [G]` consecutive rows each), in the operands' dtype."""
    if choose_impl(impl, x_md, w_gkn) == "xla":
        return lax.ragged_dot(x_md, w_gkn, group_sizes.astype(jnp.int32),
                              preferred_element_type=x_md.dtype)
    return _mosaic(x_md, w_gkn, group_sizes.astype(jnp.int32))


def _kernels():
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    return ragged_dot_mgpu, transposed_ragged_dot_mgpu


def _forward(x_md, w_gkn, group_sizes, transpose_rhs=False):
    ragged, _ = _kernels()
    k, n = w_gkn.shape[1:]
    t = for_widths(k, k if transpose_rhs else n)
    return ragged.ragged_dot(x_md, w_gkn, group_sizes=group_sizes, block_m=t.block_m,
                             block_n=t.block_n, block_k=t.block_k,
                             max_concurrent_steps=t.max_concurrent_steps,
                             grid_block_n=t.grid_block_n, transpose_rhs=transpose_rhs)


@jax.custom_vjp
def _mosaic(x_md, w_gkn, group_sizes):
    return _forward(x_md, w_gkn, group_sizes)


def _mosaic_fwd(x_md, w_gkn, group_sizes):
    return _forward(x_md, w_gkn, group_sizes), (x_md, w_gkn, group_sizes)


def _mosaic_bwd(residuals, d_out):
    x_md, w_gkn, group_sizes = residuals
    _, transposed = _kernels()
    t = for_widths(*w_gkn.shape[1:])
    d_out = d_out.astype(x_md.dtype)
    # dx = dy w_g^T (the weights read transposed); dw_g = x_g^T dy_g over group g's rows.
    d_x = _forward(d_out, w_gkn, group_sizes, transpose_rhs=True)
    d_w = transposed.transposed_ragged_dot(
        x_md, d_out, group_sizes=group_sizes, block_m=t.block_m, block_n=t.block_n,
        block_k=t.block_k, max_concurrent_steps=t.max_concurrent_steps,
        grid_block_n=t.grid_block_n)
    # Rows past the groups carry no gradient (the kernel leaves theirs unwritten).
    rows = jnp.arange(x_md.shape[0]) < jnp.sum(group_sizes)
    d_x = jnp.where(rows[:, None], d_x, 0)
    return d_x.astype(x_md.dtype), d_w.astype(w_gkn.dtype), None


_mosaic.defvjp(_mosaic_fwd, _mosaic_bwd)
