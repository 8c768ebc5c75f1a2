"""Grouped matmuls of mixture-of-experts layers: rows sorted by expert times each row's
expert's weights, `out[i] = x[i] @ w[g(i)]` (`jax.lax.ragged_dot`'s contract).

XLA lowers `ragged_dot` to a computation over every group (on a GPU a `[M, G, K]`
intermediate: 64 GiB for one Qwen3-30B-A3B projection of 16k tokens), so

- on Hopper GPUs the grouped matmuls run as Pallas kernels on the Mosaic GPU backend,
  from JAX's own: `ragged_dot_mgpu.ragged_dot` for the forward and the input gradient
  (the weights transposed), `transposed_ragged_dot_mgpu.transposed_ragged_dot` for the
  weight gradient (a per-group `x_g^T dy_g`);
- elsewhere, and for operands the kernels do not take ("tiles"), each group's rows are
  padded to whole tiles of T rows, so that a tile holds one group's rows, and the tiles
  run as one batched matmul with each tile's group's weights: about `M + G T` rows of
  work instead of `G M`, for a `[M / T + G, K, N]` copy of the weights;
- "xla" is `jax.lax.ragged_dot` itself (the tests' reference).

Rows past the sum of `group_sizes` are the caller's to ignore (the kernels leave them
unwritten, XLA zero).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jrl.kernels import mosaic_backend

IMPLS = ("auto", "xla", "tiles", "mosaic")


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The kernels' tiles (JAX's kernels' own parameters); `block_m` and `block_n` are
    the largest of 128 and 64 that divide the widths they tile, `grid_block_n` as
    `for_widths` says."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 1


def _block(width: int) -> int:
    return 128 if width % 128 == 0 else 64


# Rows a group has on average from which the forward kernel computes two column blocks
# a grid step: it then reads each row block once for both, which pays where groups are
# many blocks tall (an update's micro-batch: 1.13-1.28x at 768 rows a group on an H100,
# `experiments/bench_grouped_matmul.py`), and halves the parallel steps, which does not
# where groups are a block or less (a decode step).
_WIDE_GRID_ROWS = 256


def for_widths(m: int, n: int, rows_per_group: int = 0) -> Tiles:
    """Tiles for output widths m (rows of the weight gradient: K) and n; two column
    blocks a grid step (the forward kernel's) from `_WIDE_GRID_ROWS` rows a group where
    n holds an even number of blocks."""
    block_n = _block(n)
    wide = rows_per_group >= _WIDE_GRID_ROWS and n % (2 * block_n) == 0
    return Tiles(block_m=_block(m), block_n=block_n, grid_block_n=2 if wide else 1)


def choose_impl(impl: str, x_md: jax.Array, w_gkn: jax.Array) -> str:
    """"mosaic" on a Hopper GPU for half-precision operands whose widths K and N are
    multiples of 64 ("auto"), else "tiles"."""
    if impl != "auto":
        return impl
    k, n = w_gkn.shape[1:]
    half = x_md.dtype in (jnp.bfloat16, jnp.float16) and x_md.dtype == w_gkn.dtype
    fits = k % 64 == 0 and n % 64 == 0
    return "mosaic" if half and fits and mosaic_backend.on_hopper() else "tiles"


def grouped_matmul(x_md: jax.Array, w_gkn: jax.Array, group_sizes: jax.Array,
                   impl: str = "auto", rows_per_group: int | None = None) -> jax.Array:
    """`[M, N]`: row i of `x_md [M, K]` times `w_gkn[g] [K, N]` for the group g it is in
    (`group_sizes [G]` consecutive rows each), in the operands' dtype.

    `rows_per_group`: the rows a group has on average, which picks the kernels' grid
    (`for_widths`); None: M / G. A caller whose groups hold only some of the M rows
    (expert parallelism: the others are other devices') says how many."""
    impl = choose_impl(impl, x_md, w_gkn)
    if impl == "xla":
        return lax.ragged_dot(x_md, w_gkn, group_sizes.astype(jnp.int32),
                              preferred_element_type=x_md.dtype)
    if impl == "tiles":
        return _tiles(x_md, w_gkn, group_sizes.astype(jnp.int32))
    rows_per_group = x_md.shape[0] // w_gkn.shape[0] if rows_per_group is None else rows_per_group
    return _mosaic(x_md, w_gkn, group_sizes.astype(jnp.int32), int(rows_per_group))


def _tile_rows(m: int, g: int) -> int:
    """T: a power of two near the rows a group has on average, from 8 to 128 (larger
    tiles waste more padding, smaller ones copy the weights more often)."""
    return int(min(128, max(8, 2 ** math.ceil(math.log2(max(1, m // max(g, 1)))))))


def _tiles(x_md, w_gkn, group_sizes):
    """`grouped_matmul` with each group's rows padded to whole tiles (module docstring);
    rows past the groups come out zero."""
    m, k = x_md.shape
    g, _, n = w_gkn.shape
    t = _tile_rows(m, g)
    num_tiles = m // t + g  # bounds sum_g ceil(size_g / t)
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    padded = -(-group_sizes // t) * t
    padded_starts = jnp.cumsum(padded) - padded
    rows = jnp.arange(m, dtype=jnp.int32)
    group = jnp.searchsorted(ends, rows, side="right")  # g past the groups
    valid = group < g
    group = jnp.minimum(group, g - 1)
    slot = jnp.where(valid, padded_starts[group] + rows - starts[group], num_tiles * t)
    # Each row's slot is its own (rows past the groups dropped): declared unique, as a GPU
    # scatter otherwise writes each element by an atomic (`cache.PagedCache.write`).
    x_tiles = jnp.zeros((num_tiles * t, k), x_md.dtype).at[slot].set(x_md, mode="drop",
                                                                     unique_indices=True)
    tile_group = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(num_tiles) * t, side="right")
    w_tiles = jnp.take(w_gkn, jnp.minimum(tile_group, g - 1), axis=0)
    out = jnp.einsum("tmk,tkn->tmn", x_tiles.reshape(num_tiles, t, k), w_tiles,
                     preferred_element_type=x_md.dtype).reshape(num_tiles * t, n)
    return jnp.where(valid[:, None], jnp.take(out, jnp.minimum(slot, num_tiles * t - 1),
                                              axis=0), 0).astype(x_md.dtype)


def _kernels():
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    return ragged_dot_mgpu, transposed_ragged_dot_mgpu


# Each kernel call is its own jitted function, so that a program lowers a kernel once
# per operand shape however often it calls it (the sampler's layers and decode steps):
# lowering a Mosaic GPU kernel takes about half a second of Python.
# `tiles`: the kernel's settings (None: `for_widths` with `rows_per_group`), for
# benchmarks that compare them.
@functools.partial(jax.jit, static_argnames=("transpose_rhs", "tiles", "rows_per_group"))
def _forward(x_md, w_gkn, group_sizes, transpose_rhs=False, tiles: Tiles | None = None,
             rows_per_group: int = 0):
    ragged, _ = _kernels()
    _, k, n = w_gkn.shape
    t = tiles or for_widths(k, k if transpose_rhs else n, rows_per_group)
    return ragged.ragged_dot(x_md, w_gkn, group_sizes=group_sizes, block_m=t.block_m,
                             block_n=t.block_n, block_k=t.block_k,
                             max_concurrent_steps=t.max_concurrent_steps,
                             grid_block_n=t.grid_block_n, transpose_rhs=transpose_rhs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _mosaic(x_md, w_gkn, group_sizes, rows_per_group: int):
    return _forward(x_md, w_gkn, group_sizes, rows_per_group=rows_per_group)


def _mosaic_fwd(x_md, w_gkn, group_sizes, rows_per_group):
    return _mosaic(x_md, w_gkn, group_sizes, rows_per_group), (x_md, w_gkn, group_sizes)


@functools.partial(jax.jit, static_argnames="tiles")
def _weight_gradient(x_md, d_out, group_sizes, tiles: Tiles | None = None):
    """`[G, K, N]`: x_g^T dy_g over each group g's rows."""
    _, transposed = _kernels()
    t = tiles or for_widths(x_md.shape[1], d_out.shape[1])
    return transposed.transposed_ragged_dot(
        x_md, d_out, group_sizes=group_sizes, block_m=t.block_m, block_n=t.block_n,
        block_k=t.block_k, max_concurrent_steps=t.max_concurrent_steps,
        grid_block_n=t.grid_block_n)


def _mosaic_bwd(rows_per_group, residuals, d_out):
    x_md, w_gkn, group_sizes = residuals
    d_out = d_out.astype(x_md.dtype)
    # dx = dy w_g^T (the weights read transposed); dw_g = x_g^T dy_g over group g's rows.
    d_x = _forward(d_out, w_gkn, group_sizes, transpose_rhs=True,
                   rows_per_group=rows_per_group)
    d_w = _weight_gradient(x_md, d_out, group_sizes)
    # Rows past the groups carry no gradient (the kernel leaves theirs unwritten).
    rows = jnp.arange(x_md.shape[0]) < jnp.sum(group_sizes)
    d_x = jnp.where(rows[:, None], d_x, 0)
    return d_x.astype(x_md.dtype), d_w.astype(w_gkn.dtype), None


_mosaic.defvjp(_mosaic_fwd, _mosaic_bwd)
