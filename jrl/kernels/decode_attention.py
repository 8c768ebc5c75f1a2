"""A decode step's attention: rotate one new token's query and key (RoPE), append its
key and value to each row's cache and attend its queries over the row's filled slots.

A decode step's queries `[B, N, H]` (N = K * G query heads over K key/value heads)
attend to the cache's keys and values `[B, K, S, H]` (the cache's heads-before-slots
layout), where row b's real tokens fill the contiguous slots `start[b] <= s <= slot`:
left padding before them, the new token at `slot` (shared by all rows), slots not
yet written after. Two implementations of `append_and_attend`:

- `"mosaic"` (Hopper GPUs, a bfloat16 or float16 cache): Pallas kernels on its Mosaic
  GPU backend. Per (row, key/value head), one warpgroup streams the cache blocks that
  hold `[start, slot]` into shared memory with TMA copies (`MosaicTiles.stages`
  buffers deep, one barrier per buffer), scores them with a wgmma of the query group
  (padded to wgmma's 64 rows) against the block's keys, and runs the online softmax on
  the WGMMA layout before a second wgmma adds the weighted values: no blocks of
  padding or unwritten slots are read.
  `MosaicTiles(fused=True)` (the sampler's `MOSAIC_TILES`): the kernel reads the
  qkv projection's output itself, adds the bias and RoPE in registers, stores the new
  key and value at `slot` (the cache buffers are JAX refs, aliased in and out of the
  kernel) and attends over `[start, slot]` from the cache: no XLA op between the
  projection and the kernel, no `dynamic_update_slice` around it
  (`_mosaic_fused_kernel`). Unfused, RoPE (and the fused operand's bias) and the cache
  write run in XLA before the kernel, as on the XLA path: the write is a
  `dynamic_update_slice` of one slot per row and head, which XLA does in place on the
  cache buffer (no pass over the cache), so the kernel only reads the cache. There,
  `MosaicTiles.splits` (0: `slot_splits`' choice) splits each pair's blocks over
  programs, for long caches of too few (row, key/value head) pairs to keep the GPU's
  memory busy, each storing its normalised output and base-2 log-sum-exp, weighed
  together in XLA (`_merge_parts`); and `MosaicTiles.row_group` runs several batch rows
  of a key/value head in one program, through one pipeline of copies
  (`_mosaic_rows_kernel`), for short caches, where a program of one row waits on each
  copy with nothing else to do. The fused kernel keeps each pair in one program, so
  with `MosaicTiles.fused_max_splits` a step whose pairs the unfused kernel would
  split into more parts than that (few rows over a long cache: the decode loop
  compacts to few rows as they stop) runs unfused and split.
- `"xla"`: RoPE (`jrl.models.rope`), the cache write as `dynamic_update_slice`, then
  `decode_attention` (`grouped_attention` over all S slots with the equivalent
  mask); it runs on every backend and is the reference the kernel is tested against
  (on CPU in Pallas' GPU interpret mode).

`choose_impl("auto", ...)` takes the kernel where it applies and the XLA path elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from jrl import sharding
from jrl.kernels import mosaic_backend
from jrl.models import rope
from jrl.models.cache import TRASH_PAGE, write_slots

mgpu = mosaic_backend.plgpu  # None where jax has no Mosaic GPU backend (`_mosaic` says so)

# Cache slots per kernel block at the least: the cache holds whole blocks of it when the
# kernel decodes (`cache_slots`), and a `MosaicTiles.block` that does not divide the
# cache's slots falls back to it.
_BLOCK = 64

# A program streams its pair's cache blocks one after another, each block's reads
# waiting on the last one's softmax, so a long cache reads at HBM's rate only when many
# programs run at once: with fewer (row, key/value head) pairs than
# `PROGRAMS_PER_MULTIPROCESSOR` per multiprocessor, `slot_splits` splits each pair's
# blocks over programs of at least `MIN_SPLIT_SLOTS` slots of a full cache
# (`MosaicTiles.splits` 0). Measured on an H200 with the kernel's earlier version on
# Pallas' Triton backend, which split its blocks the same way (µs a layer-step,
# Qwen2.5-0.5B's 2 key/value heads, 8,704 slots half / nearly filled;
# `experiments/bench_decode_kernel.py --splits`): 32 rows 61.3 / 110.8 in one program
# against 26.7 / 43.4 in 4 parts; 96 rows 76.4 / 137.2 against 58.7 / 103.3 in 2;
# 128 rows 83.3 / 149.2 against 76.1 / 135.9 in 2.
_MULTIPROCESSORS = 132  # an H100's or H200's, where the device does not say
MIN_SPLIT_SLOTS = 1024
PROGRAMS_PER_MULTIPROCESSOR = 2


def slot_splits(programs: int, num_slots: int, multiprocessors: int | None = None) -> int:
    """Programs per (row, key/value head) for `programs` pairs over caches of `num_slots`
    slots: enough for `PROGRAMS_PER_MULTIPROCESSOR` programs on every multiprocessor,
    each over at least `MIN_SPLIT_SLOTS` slots; 1 when the pairs alone are as many."""
    if multiprocessors is None:
        multiprocessors = getattr(jax.devices()[0], "core_count", None) or _MULTIPROCESSORS
    target = PROGRAMS_PER_MULTIPROCESSOR * multiprocessors
    if programs >= target:
        return 1
    return max(1, min(-(-target // programs), num_slots // MIN_SPLIT_SLOTS))


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """The Mosaic GPU kernel's settings: `block` cache slots per step of its loop (a
    multiple of `_BLOCK`; one that does not divide the cache's slots falls back to
    `_BLOCK`), `stages` shared-memory buffers per key and value, and `compact`: the query
    group travels (in and out) as its rows rounded up to 8, one tile row of shared memory,
    instead of wgmma's 64 (a TMA copy of a slice of a swizzled buffer; the rows of the
    buffer it leaves unset score garbage that is never read back). `fused`: the kernel
    reads the qkv projection's output itself (bias and RoPE in registers) and writes the
    key and value into the cache itself (`_mosaic_fused_kernel`), so no XLA op runs
    between the projection and it, nor a cache write around it. `block` 0: by the
    cache's slots (`split_like`'s when given), 64 below `LONG_CACHE` slots, 128 from it
    (64 at a head_dim above 128, whose 128-slot buffers would not fit shared memory)
    (the faster of the two on either side, docs/performance.md). `splits` (not with
    `fused`): programs per (row, key/value head), each over its share of the filled
    blocks (0: `slot_splits`' choice; 1: one program over all of them); each part
    stores its normalised output and base-2 log-sum-exp, `_merge_parts` weighs them.
    `row_group` (not with `fused` or `splits`): batch rows per program, their blocks
    streamed through one pipeline (`_mosaic_rows_kernel`), so a short cache's copies of
    the next row overlap this row's math; a row group that does not divide a shard's rows
    falls back to one row a program. `split_like`: with `block` 0 or `splits` 0, choose
    as for a shard's cache of these `(rows, slots)` instead of this one's (a cache of
    fewer rows and slots standing in for the single sampling program's,
    `cache.RowCache`: both then run the same blocks and parts, bit for bit).
    `fused_max_splits` (read with `fused`; None: at any rows): where the unfused
    kernel would split a pair's blocks into more parts than this (`slot_splits`, as for
    `split_like` when given), the step takes it, split, instead (`_fused_or_split`):
    one program a pair leaves most multiprocessors idle at few rows over a long cache."""

    block: int = 128
    stages: int = 2
    compact: bool = False
    fused: bool = False
    splits: int = 1
    row_group: int = 1
    split_like: tuple[int, int] | None = None
    fused_max_splits: int | None = None

    def __post_init__(self):
        if not isinstance(self.splits, int) or self.splits < 0 or (self.fused
                                                                  and self.splits != 1):
            raise ValueError(f"MosaicTiles.splits must be an integer >= 0 (0: slot_splits' "
                             f"choice), and 1 with fused=True; got {self.splits} "
                             f"(fused={self.fused})")
        if not isinstance(self.row_group, int) or self.row_group < 1 or (
                self.row_group > 1 and (self.fused or self.splits != 1)):
            raise ValueError(f"MosaicTiles.row_group must be an integer >= 1, and 1 with "
                             f"fused=True or splits other than 1; got {self.row_group}")
        if self.fused_max_splits is not None and (not isinstance(self.fused_max_splits, int)
                                                  or self.fused_max_splits < 1):
            raise ValueError(f"MosaicTiles.fused_max_splits must be None or an integer >= 1; "
                             f"got {self.fused_max_splits}")

    def takes_fused(self, rows: int, num_kv: int, num_slots: int) -> bool:
        """Whether a step over a cache of `rows` rows (a shard's), `num_kv` key/value
        heads and `num_slots` slots runs the fused kernel: `fused`, and the unfused
        kernel would split a pair's blocks into at most `fused_max_splits` parts."""
        if not self.fused or self.fused_max_splits is None:
            return self.fused
        rows, num_slots = self.split_like or (rows, num_slots)
        return slot_splits(rows * num_kv, num_slots) <= self.fused_max_splits

    @classmethod
    def from_spec(cls, spec: str) -> MosaicTiles:
        """From "BLOCK,STAGES[,compact][,fused][,splitsN][,rowsN][,maxsplitsN]" (the
        benches' flag), e.g. "128,2,fused", "128,2,compact,splits0",
        "128,2,compact,rows4" or "0,2,compact,fused,maxsplits2"."""
        parts = [p.strip() for p in spec.split(",")]
        flags = set(parts[2:])
        numbered = {name: [f for f in flags if f.startswith(name) and f[len(name):].isdigit()]
                    for name in ("splits", "rows", "maxsplits")}
        if (len(parts) < 2 or not all(p.isdigit() for p in parts[:2])
                or any(len(found) > 1 for found in numbered.values())
                or flags - {"compact", "fused", *sum(numbered.values(), [])}):
            raise ValueError(f"Mosaic GPU decode tiles {spec!r}: expected "
                             "BLOCK,STAGES[,compact][,fused][,splitsN][,rowsN][,maxsplitsN], "
                             "e.g. 128,2,compact,fused")
        value = lambda name, default: (int(numbered[name][0][len(name):]) if numbered[name]
                                       else default)
        return cls(int(parts[0]), int(parts[1]), "compact" in flags, "fused" in flags,
                   value("splits", 1), value("rows", 1), fused_max_splits=value("maxsplits", None))


# The Mosaic GPU kernel's settings when a caller gives none (the sampler's; benches set it),
# read when a program is traced: set it before the first trace. The fused kernel, its
# block by the cache's length: on an H200 (`experiments/bench_decode_kernel.py --mosaic
# 64,2,compact,fused 128,2,compact,fused`), GPU time a layer-step at 64 against 128-slot
# blocks was 39.06 against 40.70 µs at batch 256 of 1,024 slots, then 41.31 against
# 37.72 at batch 128 of 2,048, 74.45 against 67.00 of 4,096 and 151.96 against 133.98
# of 8,704.
# Few rows over a long cache leave the fused kernel (`fused_max_splits` 2): where the
# unfused kernel would split a pair's slots into more than two parts, the step runs it
# split, with the bias, RoPE and the cache write in XLA. One program a pair reads a long
# cache at a fraction of HBM's rate when the pairs fill few multiprocessors (the comment
# on `slot_splits`), which is the natural-length step's tail. Measured on one H100 in one
# call (`experiments/bench_long.sh natural natural+mosaic0,2,compact,fused`,
# P512 / R8192, 16 x 8, lengths uniform in [512, 8192]): generation 18.04 s for 4,386
# tokens a row on average against 19.38 s for 4,265 with the fused kernel at any rows
# (4.11 against 4.54 ms a token of the mean row). At two parts the fused kernel stays:
# an H200 measured it as fast as the unfused one split in two (128 rows of 8,704 slots:
# 133.98 against 135.58 µs).
LONG_CACHE = 2048
MOSAIC_TILES = MosaicTiles(0, 2, compact=True, fused=True, fused_max_splits=2)

IMPLS = ("auto", "xla", "mosaic")


def choose_impl(impl: str, head_dim: int, num_slots: int | None = None,
                dtype=None) -> str:
    """`"mosaic"` where the kernel applies (a Hopper GPU, Pallas' Mosaic GPU backend, a
    power-of-two head_dim from 32 to 256 (the heads its swizzled tiles and RoPE halves
    are laid out and tested for), a 16-bit cache `dtype` (wgmma's operands) and, when
    given, a cache of whole blocks), else `"xla"`. A forced `impl` is returned as
    is, but a forced `"mosaic"` stops with a ConfigError without Pallas' Mosaic GPU
    backend and with a ValueError on a GPU other than Hopper (off a GPU the kernel runs
    in interpret mode); a value not in `IMPLS` stops with a ValueError naming them."""
    if impl not in IMPLS:
        raise ValueError(_not_an_impl(impl))
    on_gpu = jax.default_backend() == "gpu"
    if impl == "mosaic":
        mosaic_backend.require("model.decode_attention_impl")
        if on_gpu and not mosaic_backend.on_hopper():
            raise ValueError("model.decode_attention_impl='mosaic' needs a Hopper GPU "
                             "(compute capability 9.0: its wgmma and TMA); use 'auto' or "
                             "'xla'")
    if impl != "auto":
        return impl
    head_ok = 32 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0
    applies = (on_gpu and head_ok and (num_slots is None or num_slots % _BLOCK == 0)
               and mosaic_backend.available() and mosaic_backend.on_hopper()
               and dtype is not None and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16))
    return "mosaic" if applies else "xla"


def _not_an_impl(impl) -> str:
    """The error for a decode attention `impl` not in `IMPLS`; for "pallas" (the
    kernel's version on Pallas' Triton backend, which Pallas deprecated), what replaced
    it."""
    message = (f"model.decode_attention_impl must be one of {', '.join(map(repr, IMPLS))}, "
               f"got {impl!r}")
    if impl == "pallas":
        message += (" (the kernel on Pallas' Triton backend was removed; 'mosaic' is its "
                    "port to Pallas' Mosaic GPU backend, for Hopper GPUs)")
    return message


def cache_slots(impl: str, head_dim: int, needed: int, dtype=None) -> int:
    """Slots to allocate for `needed` tokens: rounded up to whole kernel blocks when
    the decode steps will run the kernel (`choose_impl`; `dtype`: the cache's)."""
    if choose_impl(impl, head_dim, dtype=dtype) != "mosaic":
        return needed
    return -(-needed // _BLOCK) * _BLOCK


def append_and_attend(q_bnh, k_new_bkh, v_new_bkh, sin_bk, cos_bk, k_bksh, v_bksh, start_b,
                      slot, *, impl: str = "xla", interpret: bool = False,
                      tiles: MosaicTiles | None = None):
    """Rotates the new tokens' queries and keys (RoPE), writes each row's new key and
    value at `slot`, then attends over `[start, slot]`.

    Args:
      q_bnh: `[B, N, H]` queries of the new tokens, before RoPE.
      k_new_bkh, v_new_bkh: `[B, K, H]` their keys (before RoPE) and values.
      sin_bk, cos_bk: float32 `[B, H/2]`, the rotation of each row's new token
        (`rope.sin_cos`).
      k_bksh, v_bksh: `[B, K, S, H]` the cache's buffers of this layer.
      start_b: int `[B]`, each row's first real slot.
      slot: int scalar, the slot the new tokens are written to (shared by all rows),
        below S. A Python int is checked; past S the XLA path writes slot S - 1 (as
        `dynamic_update_slice` clamps) and the fused kernel writes nothing.
      impl: "xla" or "mosaic" (see the module docstring).
      interpret: run the kernel in Pallas' GPU interpret mode (always off a GPU, so
        CPU tests run the kernel's own code).
      tiles: the kernel's settings; None: `MOSAIC_TILES`.

    Returns:
      (`[B, N, H]` attention output in the queries' dtype, the updated key and value
      buffers in the cache's dtype).
    """
    _check_slot(slot, k_bksh)
    slot = jnp.asarray(slot, jnp.int32)
    start_b = start_b.astype(jnp.int32)
    if impl not in ("xla", "mosaic"):
        raise ValueError(f"decode attention impl must be 'xla' or 'mosaic', got {impl!r}")
    tiles = tiles or MOSAIC_TILES
    if impl == "mosaic" and tiles.fused:
        return _fused_on_parts(q_bnh, k_new_bkh, v_new_bkh, sin_bk, cos_bk, k_bksh, v_bksh,
                               start_b, slot, interpret=interpret, tiles=tiles)
    q_bnh, k_bksh, v_bksh = rotate_and_write(q_bnh, k_new_bkh, v_new_bkh, sin_bk, cos_bk,
                                             k_bksh, v_bksh, slot)
    if impl == "mosaic":
        _check_blocks(k_bksh)
        kernel = functools.partial(_mosaic, interpret=interpret, tiles=tiles)
        return _sharded_attend(kernel, q_bnh, k_bksh, v_bksh, start_b, slot), k_bksh, v_bksh
    out_bnh = decode_attention(q_bnh, k_bksh.astype(q_bnh.dtype), v_bksh.astype(q_bnh.dtype),
                               start_b, slot + 1)
    return out_bnh, k_bksh, v_bksh


def _fused_on_parts(q_bnh, k_new_bkh, v_new_bkh, sin_bk, cos_bk, k_bksh, v_bksh, start_b,
                    slot, *, interpret, tiles: MosaicTiles):
    """The fused kernel (`_mosaic_fused`) on separate queries, keys and values, joined on
    each shard into the one operand a fused qkv projection leaves; `append_and_attend`'s
    outputs."""
    _check_blocks(k_bksh)

    def fused(q_bnh, k_new_bkh, v_new_bkh, *rest):  # on one shard's rows and heads
        qkv_bjh = jnp.concatenate([q_bnh, k_new_bkh.astype(q_bnh.dtype),
                                   v_new_bkh.astype(q_bnh.dtype)], axis=1)
        return _fused_or_split(qkv_bjh, None, *rest, num_heads=q_bnh.shape[1],
                               interpret=interpret, tiles=tiles)

    return _sharded(fused, q_bnh, k_new_bkh, v_new_bkh, sin_bk, cos_bk, k_bksh, v_bksh,
                    start_b, slot)


def append_and_attend_qkv(qkv_bjh, bias_jh, sin_bk, cos_bk, k_bksh, v_bksh, start_b, slot, *,
                          num_heads: int, impl: str = "xla", interpret: bool = False,
                          tiles: MosaicTiles | None = None):
    """`append_and_attend` from a fused qkv projection's output, before its bias.

    The fused kernel (`MosaicTiles.fused`) reads the projection's output as its one
    operand and adds the bias itself (rounded to the operand's dtype, as the
    projection's own bias add rounds), so a decode step runs no kernel between the
    projection and the attention; with q, k and v as three arrays XLA joins them again
    in a fusion of its own (which also adds the bias) before the kernel.

    Args:
      qkv_bjh: `[B, N + 2K, H]` the new tokens' query heads, then key heads, then
        value heads, before the bias and RoPE.
      bias_jh: `[N + 2K, H]` the projection's bias, a `KernelBias` (the same with the
        fused kernel's operand made ahead), or None.
      num_heads: N, the query heads.
      The rest as `append_and_attend`'s.
    """
    joined = num_heads + 2 * k_bksh.shape[1]
    raw = _raw_bias(bias_jh)
    if qkv_bjh.shape[1] != joined or (raw is not None
                                      and raw.shape != (joined, qkv_bjh.shape[2])):
        raise ValueError(
            f"append_and_attend_qkv: {num_heads} query heads and {k_bksh.shape[1]} key/value "
            f"heads need qkv [B, {joined}, H] and a bias [{joined}, H], got qkv "
            f"{tuple(qkv_bjh.shape)} and bias {None if raw is None else tuple(raw.shape)}")
    tiles = tiles or MOSAIC_TILES
    if impl == "mosaic" and tiles.fused:
        _check_slot(slot, k_bksh)
        _check_blocks(k_bksh)
        kernel = functools.partial(_fused_or_split, num_heads=num_heads, interpret=interpret,
                                   tiles=tiles)
        return _sharded_qkv(kernel, qkv_bjh, bias_jh, sin_bk, cos_bk, k_bksh, v_bksh,
                            start_b.astype(jnp.int32), jnp.asarray(slot, jnp.int32))
    q_bnh, k_new_bkh, v_new_bkh = _split_qkv(qkv_bjh, raw, num_heads, k_bksh.shape[1])
    return append_and_attend(q_bnh, k_new_bkh, v_new_bkh, sin_bk, cos_bk, k_bksh, v_bksh,
                             start_b, slot, impl=impl, interpret=interpret, tiles=tiles)


def _split_qkv(qkv_bjh, bias_jh, num_heads: int, num_kv: int):
    """A fused projection's output `[B, N + 2K, H]` with its bias added (in the output's
    dtype, as the projection's own add rounds), as q `[B, N, H]`, k and v `[B, K, H]`."""
    if bias_jh is not None:
        qkv_bjh = qkv_bjh + bias_jh.astype(qkv_bjh.dtype)
    return jnp.split(qkv_bjh, [num_heads, num_heads + num_kv], axis=1)


def append_and_attend_qkv_paged(qkv_bjh, bias_jh, sin_bk, cos_bk, k_pool, v_pool, block_table,
                                start_b, slot_b, *, num_heads: int, interpret: bool = False,
                                tiles: MosaicTiles | None = None):
    """`append_and_attend_qkv` over a paged cache, in the fused Mosaic GPU kernel: each
    row's new key and value go to its own physical slot `slot_b[b]` in the page its
    block table points to, and its query heads attend to its slots `[start_b[b],
    slot_b[b]]` read in place (as `paged_attention` reads them), with no XLA op between
    the projection and the attention. One device (no mesh of several: the pools are
    written in place, which a shard of the rows could not do for the others').

    Args:
      qkv_bjh, bias_jh, sin_bk, cos_bk, num_heads: as `append_and_attend_qkv`'s.
      k_pool, v_pool: `[K, pages, page, H]` this layer's pools (16-bit).
      block_table: int32 `[B, pages_per_row]`.
      start_b, slot_b: int32 `[B]` each row's first real and new token's physical slots.
      tiles: fused tiles (`block`, `stages`); None: `PAGED_FUSED_TILES`.

    Returns:
      `(out [B, N, H], k_pool, v_pool)`, the pools with the new tokens written.
    """
    tiles = tiles or PAGED_FUSED_TILES
    num_kv, page, h = k_pool.shape[0], k_pool.shape[2], k_pool.shape[3]
    joined = num_heads + 2 * num_kv
    if qkv_bjh.shape[1] != joined or not tiles.fused or not paged_applies(page, h):
        raise ValueError(
            f"append_and_attend_qkv_paged: {num_heads} query heads and {num_kv} key/value "
            f"heads need qkv [B, {joined}, H] (got {tuple(qkv_bjh.shape)}), fused tiles "
            f"(got {tiles}) and pages of 8 to {max_page(h)} slots, a power of two (got "
            f"{page})")
    sharder = sharding.active_sharder()
    if sharder is not None and sharder.mesh.size > 1:
        raise ValueError("append_and_attend_qkv_paged runs on one device: under a mesh the "
                         "paged cache is written by XLA (`transformer.paged_fused`)")
    return _mosaic_fused(qkv_bjh, bias_jh, sin_bk, cos_bk, k_pool, v_pool,
                         start_b.astype(jnp.int32), slot_b.astype(jnp.int32),
                         num_heads=num_heads, interpret=interpret, tiles=tiles,
                         block_table=block_table.astype(jnp.int32))


# The paged decode's settings (`paged_attention` without tiles): unfused (the cache write
# is the paged cache's scatter) and split over slots where the rows are too few to keep
# the GPU busy (the decode loop compacts to fewer rows as they stop).
PAGED_TILES = MosaicTiles(0, 2, compact=True, splits=0)
# The fused kernel's over a paged cache (`append_and_attend_qkv_paged`), and when the
# paged decode takes it (`transformer.paged_fused`), read when a program is traced, as
# `MOSAIC_TILES` is: "auto" where these tiles take it (`MosaicTiles.takes_fused`: where
# the unfused kernel would not split a row's blocks), "always", or "off". Measured on an
# H100 beside the unfused path (`experiments/bench_rollout.py --paged-fused off
# always`, Qwen2.5-0.5B): 1.01x the sampler's tokens/s at 256 rows and 1.03x at 512
# (P128 / R256), 1.01x at 64 rows of P512 / R2048, where the unfused kernel splits a
# row's blocks in two. At any rows ("always") the long-response step's generation took
# 1.17x this default's (P512 / R8192, lengths uniform in [512, 8192]: its tail of few
# rows over 8,704 slots). Up to 2 parts, as `MOSAIC_TILES` (`bench_long.sh
# paged_natural+pmax2 paged_natural`), took 0.96x a token there, but beside the default
# measured on another H100, not in one call.
PAGED_FUSED_TILES = MosaicTiles(0, 2, compact=True, fused=True, fused_max_splits=1)
PAGED_FUSED_MODES = ("auto", "always", "off")
PAGED_FUSED = "auto"


def max_page(head_dim: int) -> int:
    """The largest page the paged kernel reads in place: a 128-slot block (64 at a
    head_dim above 128, `_mosaic_layout`'s)."""
    return 64 if head_dim > 128 else 128


def paged_applies(page_size: int, head_dim: int) -> bool:
    """Whether the kernel reads pages of `page_size` slots in place (`paged_attention`):
    whole shared-memory tiles (a multiple of 8 slots), a power of two that divides or
    fills a block (at most `max_page`)."""
    return 8 <= page_size <= max_page(head_dim) and page_size & (page_size - 1) == 0


def paged_attention(q_bnh, k_pool, v_pool, block_table, start_b, slot_b, *,
                    interpret: bool = False, tiles: MosaicTiles | None = None):
    """Decode attention over a paged cache, read in place: row b's query heads attend to
    its (physical) slots `[start_b[b], slot_b[b]]`, slot s held at offset `s mod page`
    of page `block_table[b, s // page]` (`cache.PagedCache`); no `[B, K, S, H]` copy of
    the cache is made. The Mosaic GPU kernel (`_mosaic_kernel` with `page`): each block of
    slots is filled by one TMA copy per page, only the blocks holding `[start, slot]`
    are read.

    Args:
      q_bnh: `[B, N, H]` the rotated queries of the new tokens.
      k_pool, v_pool: `[K, pages, page, H]` this layer's pools, the new tokens' keys and
        values already written; 16-bit.
      block_table: int32 `[B, pages_per_row]`.
      start_b, slot_b: int32 `[B]`, each row's first real slot and the slot of its new
        token.
      interpret: run in Pallas' GPU interpret mode (always off a GPU).
      tiles: the kernel's settings (`block`, `stages`, `compact`, `splits`); None:
        `PAGED_TILES`.

    Returns:
      `[B, N, H]` in the queries' dtype.
    """
    tiles = tiles or PAGED_TILES
    page, h = k_pool.shape[2], k_pool.shape[3]
    if tiles.fused or tiles.row_group != 1 or not paged_applies(page, h):
        raise ValueError(f"the paged decode attention takes unfused tiles of one row a "
                         f"program, and pages of 8 to {max_page(h)} slots (a "
                         f"power of two); got {tiles} and pages of {page}")
    kernel = functools.partial(_mosaic, interpret=interpret, tiles=tiles)

    def run(q_bnh, k_pool, v_pool, block_table, start_b, slot_b):
        return kernel(q_bnh, k_pool, v_pool, start_b.astype(jnp.int32),
                      slot_b.astype(jnp.int32), block_table=block_table)

    specs = functools.partial(_paged_specs, q_bnh=q_bnh, k_pool=k_pool, rows=2)
    return sharding.per_shard(run, specs, q_bnh, k_pool, v_pool, block_table, start_b,
                              slot_b)


def _paged_specs(sharder, *, q_bnh, k_pool, rows: int):
    """`sharding.per_shard`'s specs of the paged kernels' operands (queries, the two pools,
    the block table, then `rows` int `[B]` operands): the rows over the batch axes, each
    reading the whole pool; heads over `tensor` where query and key/value heads both
    divide (as `_specs`)."""
    batch = sharder.spec(("batch",), q_bnh.shape[:1])[0]
    heads = sharder.spec((None, "heads", None), q_bnh.shape)[1]
    kv_heads = sharder.spec(("kv_heads", None, None, None), k_pool.shape)[0]
    if heads != kv_heads:
        heads = kv_heads = None
    pool = P(kv_heads, None, None, None)
    return ((P(batch, heads, None), pool, pool, P(batch, None), *(P(batch),) * rows),
            P(batch, heads, None))


def on_tpu() -> bool:
    """Whether JAX runs on a TPU (where the paged cache's decode steps take Pallas' TPU
    paged attention)."""
    return jax.default_backend() == "tpu"


def tpu_paged_attention(q_bnh, k_pool, v_pool, block_table, lengths_b, *, scale=None,
                        softcap=None):
    """Decode attention over a paged cache on a TPU, read in place by Pallas' paged
    attention kernel (`jax.experimental.pallas.ops.tpu.paged_attention`): row b's query
    heads attend to its physical slots `[0, lengths_b[b])` (`cache.PagedCache` keeps each
    row's tokens from physical slot 0), through its block table.

    Args:
      q_bnh: `[B, N, H]` the rotated queries of the new tokens.
      k_pool, v_pool: `[K, pages, page, H]` this layer's pools, the new tokens written.
      block_table: int32 `[B, pages_per_row]`.
      lengths_b: int32 `[B]`, each row's tokens (the new one included).
      scale: the scores' scale (None: `H ** -0.5`); the kernel takes it on the queries.
      softcap: soft-capping of the scaled scores (Gemma 2), or None.

    Returns:
      `[B, N, H]` in the queries' dtype.
    """
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    page, h = k_pool.shape[2], k_pool.shape[3]
    scale = h ** -0.5 if scale is None else scale
    per_row = block_table.shape[1]
    # Pages a step of the kernel's loop: up to 512 slots' worth, dividing the row's.
    per_block = max(d for d in range(1, per_row + 1)
                    if per_row % d == 0 and d * page <= max(page, 512))

    def run(q_bnh, k_pool, v_pool, block_table, lengths_b):
        q_bnh = (q_bnh.astype(jnp.float32) * scale).astype(k_pool.dtype)
        return paged_attention(q_bnh, k_pool, v_pool, lengths_b.astype(jnp.int32),
                               block_table, pages_per_compute_block=per_block,
                               attn_logits_soft_cap=softcap)

    specs = functools.partial(_paged_specs, q_bnh=q_bnh, k_pool=k_pool, rows=1)
    out = sharding.per_shard(run, specs, q_bnh, k_pool, v_pool, block_table, lengths_b)
    return out.astype(q_bnh.dtype)


def _check_slot(slot, k_bksh):
    """A Python-int `slot` inside the cache (a traced one is not checked)."""
    if isinstance(slot, int) and not 0 <= slot < k_bksh.shape[2]:
        raise ValueError(f"decode slot {slot} outside the cache's {k_bksh.shape[2]} slots")


def _check_blocks(k_bksh):
    """A cache of whole kernel blocks."""
    if k_bksh.shape[2] % _BLOCK:
        raise ValueError(f"the Pallas decode attention needs a multiple of {_BLOCK} "
                         f"cache slots, got {k_bksh.shape[2]}")


def rotate_and_write(q_bnh, k_new_bkh, v_new_bkh, sin_bk, cos_bk, k_bksh, v_bksh, slot):
    """The XLA path's first half: RoPE on the new queries and keys, then the new key
    and value written at `slot` (`cache.write_slots`). Returns the rotated queries and
    the updated buffers."""
    rotate = lambda x: rope.apply_rope(x[:, None], sin_bk[:, None], cos_bk[:, None])[:, 0]
    q_bnh, k_new_bkh = rotate(q_bnh), rotate(k_new_bkh)
    k_bksh, v_bksh = (write_slots(buffer, new_bkh[:, :, None], slot)
                      for buffer, new_bkh in ((k_bksh, k_new_bkh), (v_bksh, v_new_bkh)))
    return q_bnh, k_bksh, v_bksh


def decode_attention(q_bnh, k_bksh, v_bksh, start_b, end):
    """Softmax attention of one query per row and head over the slots `[start, end)`,
    in XLA: `grouped_attention` over every slot with a mask.

    Args:
      q_bnh: `[B, N, H]` queries (N = K * G query heads).
      k_bksh, v_bksh: `[B, K, S, H]` cached keys and values.
      start_b: int `[B]`, each row's first real slot.
      end: int scalar, one past the last filled slot (shared by all rows).

    Returns:
      `[B, N, H]` in the queries' dtype.
    """
    slots = jnp.arange(k_bksh.shape[2])[None, :]
    mask_bs = (slots >= start_b[:, None]) & (slots < end)
    out_b1nh = grouped_attention(q_bnh[:, None], k_bksh, v_bksh, mask_bs[:, None, None])
    return out_b1nh[:, 0]


def _sharded(kernel, q_bnh, k_new_bkh, v_new_bkh, sin_bk, cos_bk, k_bksh, v_bksh, start_b,
             slot):
    """Runs `kernel` on each device's rows (and heads) under the active mesh
    (`sharding.per_shard`): over the batch axes and, when both the query and the
    key/value heads divide over `tensor` (so each device keeps whole query groups),
    over heads too."""
    specs = functools.partial(_specs, q_bnh=q_bnh, k_bksh=k_bksh, start_b=start_b)
    return sharding.per_shard(kernel, specs, q_bnh, k_new_bkh, v_new_bkh, sin_bk, cos_bk,
                              k_bksh, v_bksh, start_b, slot)


def _specs(sharder, q_bnh, k_bksh, start_b):
    """`_sharded`'s (in_specs, out_specs)."""
    batch = sharder.spec(("batch",), start_b.shape)[0]
    heads = sharder.spec((None, "heads", None), q_bnh.shape)[1]
    kv_heads = sharder.spec((None, "kv_heads", None, None), k_bksh.shape)[1]
    if heads != kv_heads:
        heads = kv_heads = None
    q_spec, new_spec = P(batch, heads, None), P(batch, kv_heads, None)
    cache_spec, rows = P(batch, kv_heads, None, None), P(batch, None)
    return ((q_spec, new_spec, new_spec, rows, rows, cache_spec, cache_spec, P(batch), P()),
            (q_spec, cache_spec, cache_spec))


def _sharded_attend(kernel, q_bnh, k_bksh, v_bksh, start_b, slot):
    """`_sharded` for the Mosaic GPU kernel's operands: the rotated queries and the
    written cache in, the attention output out."""
    def specs(sharder):
        (q_spec, _, _, _, _, cache_spec, _, rows, _), _ = _specs(sharder, q_bnh, k_bksh,
                                                                  start_b)
        return (q_spec, cache_spec, cache_spec, rows, P()), q_spec

    return sharding.per_shard(kernel, specs, q_bnh, k_bksh, v_bksh, start_b, slot)


def _sharded_qkv(kernel, qkv_bjh, bias_jh, sin_bk, cos_bk, k_bksh, v_bksh, start_b, slot):
    """`_sharded` for the fused operand: over the batch axes only (the fused projection
    is not used when a `tensor` axis splits the heads)."""
    biases, tree = jax.tree.flatten(bias_jh)  # an array or a `KernelBias`, replicated

    def specs(sharder):
        batch = sharder.spec(("batch",), start_b.shape)[0]
        qkv_spec, cache_spec, rows = P(batch, None, None), P(batch, None, None, None), P(batch)
        return ((qkv_spec, *(P(*(None,) * x.ndim) for x in biases), P(batch, None),
                 P(batch, None), cache_spec, cache_spec, rows, P()),
                (qkv_spec, cache_spec, cache_spec))

    def run(qkv_bjh, *rest):
        bias = jax.tree.unflatten(tree, rest[:len(biases)])
        return kernel(qkv_bjh, bias, *rest[len(biases):])

    return sharding.per_shard(run, specs, qkv_bjh, *biases, sin_bk, cos_bk, k_bksh, v_bksh,
                              start_b, slot)


def _mosaic_kernel(q_ref, k_ref, v_ref, start_ref, slot_ref, *refs, block, stages,
                   scale, interpreted, splits=1, page=0):
    """One (row, key/value head) of the Mosaic GPU kernel: its query group, padded to
    `rows` (a multiple of 64, wgmma's M) in `q_smem`, from and to the first rows of
    `q_ref`/`o_ref [B, K, <= rows, H]` (`MosaicTiles.compact`), against the cache
    blocks that hold `[start, slot]`, streamed by TMA through `stages` SMEM buffers of
    `block` slots (one barrier per buffer, for its key and value copies); scores and the
    weighted values are wgmmas, the online softmax runs on the WGMMA layout.
    With `splits > 1` the grid's third axis is the part: part p runs the p-th share of
    the blocks and stores its normalised output in `o_ref [B, K, splits, <= rows, H]`
    and its base-2 log-sum-exp of the scaled scores in `lse_ref [B, K, splits, <= rows]`
    (a part without blocks: zeros and about -1e30).
    `interpreted`: the interpreter has no `layout_cast` (the layouts of the carried
    values and the slot ids are then left to it) and its wgmma takes neither a
    transposed operand nor one from registers (both matmuls are then dots of the
    tiles loaded from SMEM): the differences from the GPU's code, all behind this
    flag; the TMA copies, barriers and buffer rotation run as on the GPU.
    `page` (a paged cache, `paged_attention`): `k_ref`/`v_ref` are the pools
    `[K, pages, page, H]`, a `table_ref [B, blocks * block / page]` follows `slot_ref`
    (then `[B]`, each row's own slot), and a block's buffer is filled by one copy per
    page of it, each page read where the row's table points."""
    table_ref = None
    if page:
        table_ref, *refs = refs
    if splits > 1:
        o_ref, lse_ref, q_smem, k_smem, v_smem, barriers, q_barrier, lse_smem = refs
    else:
        o_ref, q_smem, k_smem, v_smem, barriers, q_barrier = refs
    b, kv = lax.axis_index("rows"), lax.axis_index("heads")
    start, slot = start_ref[b], slot_ref[b if page else 0]
    first, end = start // block, slot // block + 1  # the blocks holding [start, slot]
    if splits > 1:  # this part's share of the blocks
        part = lax.axis_index("parts")
        share = (end - first + splits - 1) // splits
        first = jnp.minimum(first + part * share, end)
        end = jnp.minimum(first + share, end)
        o_ref, lse_ref = o_ref.at[b, kv, part], lse_ref.at[b, kv, part]
    else:
        o_ref = o_ref.at[b, kv]
    rows, h = q_smem.shape
    dtype = q_smem.dtype

    fetch = functools.partial(_fetch_block, k_ref, v_ref, k_smem, v_smem, barriers, b, kv,
                              block=block, table_ref=table_ref, page=page)
    group_rows = q_smem if q_ref.shape[2] == rows else q_smem.at[pl.ds(0, q_ref.shape[2])]
    mgpu.copy_gmem_to_smem(q_ref.at[b, kv], group_rows, q_barrier)
    for i in range(stages):
        pl.when(first + i < end)(functools.partial(fetch, first + i, i))
    mgpu.barrier_wait(q_barrier)
    top, total, acc = _online_start(rows, h, interpreted)

    def step(j, carry):
        buffer = lax.rem(j - first, stages)
        mgpu.barrier_wait(barriers.at[buffer])
        carry = _online_block(carry, q_smem, k_smem.at[buffer], v_smem.at[buffer],
                              j * block, start, slot, scale=scale, interpreted=interpreted)
        # Both wgmmas have finished reading the buffer: refill it.
        pl.when(j + stages < end)(functools.partial(fetch, j + stages, buffer))
        return carry

    top, total, acc = lax.fori_loop(first, end, step, (top, total, acc))
    if splits > 1:  # a part without blocks: total 0, acc 0
        total = jnp.maximum(total, jnp.finfo(jnp.float32).tiny)
        lse_smem[...] = top + jnp.log2(total)
    q_smem[...] = (acc / lax.broadcast_in_dim(total, acc.shape, [0])).astype(dtype)
    mgpu.commit_smem()
    mgpu.copy_smem_to_gmem(group_rows, o_ref)
    if splits > 1:
        moved = o_ref.shape[0]
        lse_rows = lse_smem if moved == rows else lse_smem.at[pl.ds(0, moved)]
        mgpu.copy_smem_to_gmem(lse_rows, lse_ref)
    mgpu.wait_smem_to_gmem(0)


def _mosaic_rows_kernel(q_ref, k_ref, v_ref, start_ref, slot_ref, o_ref, q_smem, k_smem,
                        v_smem, o_smem, barriers, q_barriers, *, block, stages, scale,
                        group_rows, interpreted):
    """`group_rows` batch rows of one key/value head in one program: as `_mosaic_kernel`,
    but every row reads the blocks `[0, slot]` (the same count for all rows: slots before
    its `start` are masked), and the (row, block) pairs run as one loop through one
    pipeline of `stages` key/value buffers, so the next row's copies are in flight while
    a row ends. Each row's query group arrives in one of two `q_smem` buffers (the next
    row's copy issued when a row starts); its output leaves through `o_smem` (a row's
    store waits for the previous row's)."""
    kv = lax.axis_index("heads")
    base = lax.axis_index("rows") * group_rows
    slot = slot_ref[0]
    blocks = slot // block + 1
    count = group_rows * blocks
    rows, h = q_smem.shape[1:]
    moved = q_ref.shape[2]
    dtype = q_smem.dtype
    q_rows = lambda i: q_smem.at[i] if moved == rows else q_smem.at[i, pl.ds(0, moved)]
    out_rows = o_smem if moved == rows else o_smem.at[pl.ds(0, moved)]

    def fetch(t, buffer):
        row, blk = base + t // blocks, pl.ds((t % blocks) * block, block)
        mgpu.copy_gmem_to_smem(k_ref.at[row, kv, blk], k_smem.at[buffer], barriers.at[buffer])
        mgpu.copy_gmem_to_smem(v_ref.at[row, kv, blk], v_smem.at[buffer], barriers.at[buffer])

    def fetch_query(r):
        mgpu.copy_gmem_to_smem(q_ref.at[base + r, kv], q_rows(r % 2), q_barriers.at[r % 2])

    fetch_query(0)
    for i in range(stages):
        pl.when(i < count)(functools.partial(fetch, i, i))

    def step(t, carry):
        top, total, acc = carry
        r, j = t // blocks, t % blocks
        start = start_ref[base + r]

        @pl.when(j == 0)
        def _():  # a new row: its query group arrived, the next row's starts
            mgpu.barrier_wait(q_barriers.at[r % 2])
            pl.when(r + 1 < group_rows)(functools.partial(fetch_query, r + 1))

        # A new row's sums start afresh: scaled by 0 (a scalar factor; `top` is always
        # finite, so this keeps a running row's state exactly).
        keep = (j != 0).astype(jnp.float32)
        top = top * keep + (1.0 - keep) * -1e30
        total, acc = total * keep, acc * keep
        buffer = lax.rem(t, stages)
        mgpu.barrier_wait(barriers.at[buffer])
        new_top, total, acc = _online_block(
            (top, total, acc), q_smem.at[r % 2], k_smem.at[buffer], v_smem.at[buffer],
            j * block, start, slot, scale=scale, interpreted=interpreted)
        pl.when(t + stages < count)(functools.partial(fetch, t + stages, buffer))

        @pl.when(j == blocks - 1)
        def _():  # the row's last block: its output leaves
            mgpu.wait_smem_to_gmem(0)  # the previous row's store has read o_smem
            o_smem[...] = (acc / lax.broadcast_in_dim(total, acc.shape, [0])).astype(dtype)
            mgpu.commit_smem()
            mgpu.copy_smem_to_gmem(out_rows, o_ref.at[base + r, kv])

        return new_top, total, acc

    lax.fori_loop(0, count, step, _online_start(rows, h, interpreted))
    mgpu.wait_smem_to_gmem(0)


def _online_start(rows, h, interpreted):
    """The online softmax's state before any block, on the WGMMA layout: a running
    maximum at a finite floor (so a row whose slots are all masked gives weights of 0,
    not NaN), no weight and no weighted value."""
    cast = (lambda x, _: x) if interpreted else mgpu.layout_cast
    row_layout = mgpu.Layout.WGMMA.reduce(1)
    return (cast(jnp.full((rows,), -1e30, jnp.float32), row_layout),
            cast(jnp.zeros((rows,), jnp.float32), row_layout),
            cast(jnp.zeros((rows, h), jnp.float32), mgpu.Layout.WGMMA))


def _online_block(carry, q_smem, k_tile, v_tile, first_slot, start, slot, *, scale,
                  interpreted):
    """One cache block of the Mosaic GPU kernels' online softmax: the query rows'
    running maximum (base 2), sum of weights and weighted values `carry` updated with
    the block's slots `first_slot + [0, block)`, those before `start` (padding) and after
    `slot` (not yet written) masked. The maximum is taken of the raw scores (the scale
    is positive, so it commutes with rounding) and the weights are `exp2(score * scale'
    - top)`, one fused multiply-add a score."""
    top, total, acc = carry
    rows, block = q_smem.shape[0], k_tile.shape[0]
    cast = (lambda x, _: x) if interpreted else mgpu.layout_cast
    with jax.named_scope("scores"):  # (regions: experiments/profile_decode_kernel.py)
        logits = _scores(q_smem, k_tile, interpreted)
    with jax.named_scope("softmax"):
        ids = first_slot + cast(lax.broadcasted_iota(jnp.int32, (rows, block), 1),
                                mgpu.Layout.WGMMA)  # `mgpu.broadcasted_iota`'s two steps
        logits = jnp.where((ids >= start) & (ids <= slot), logits, -jnp.inf)
        scale2 = scale * math.log2(math.e)
        new_top = jnp.maximum(top, logits.max(axis=1) * scale2)
        correction = jnp.exp2(top - new_top)
        weights = jnp.exp2(logits * scale2 - lax.broadcast_in_dim(new_top, logits.shape, [0]))
        total = total * correction + weights.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0])
        weights = weights.astype(q_smem.dtype)
    with jax.named_scope("values"):
        return new_top, total, _add_weighted(acc, weights, v_tile, interpreted)


def _scores(q_smem, k_tile, interpreted):
    """`q k^T` of the query rows and one block's keys, `[rows, block]` float32: a wgmma
    of two SMEM operands, the keys transposed (`interpreted`: a dot of the loaded
    tiles, as the interpreter's wgmma takes no transposed operand)."""
    if interpreted:
        return lax.dot_general(q_smem[...], k_tile[...], (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)

    def scores(acc_ref):
        mgpu.wgmma(acc_ref, q_smem, k_tile.transpose((1, 0)))
        return acc_ref[...]

    return pl.run_scoped(scores, mgpu.ACC((q_smem.shape[0], k_tile.shape[0]), jnp.float32))


def _add_weighted(acc, weights, v_tile, interpreted):
    """`acc + weights v` of the softmax weights (registers, the WGMMA layout) and one
    block's values, `[rows, H]` float32: the wgmma accumulates into the carried
    accumulator itself (`ACC.init`), so no second `[rows, H]` float32 tile is live
    (32 registers a thread at H = 64, which decide how many programs share a
    multiprocessor); `interpreted`: a dot added in registers, as the interpreter's wgmma
    takes no register operand and does not simulate `pl.run_state` on a carried
    accumulator."""
    if interpreted:
        return acc + jnp.dot(weights, v_tile[...], preferred_element_type=jnp.float32)

    def values(acc_ref):
        mgpu.wgmma(acc_ref, weights, v_tile)

    return pl.run_state(values)(mgpu.ACC.init(acc))


class _Layout(NamedTuple):
    """The Mosaic GPU kernels' shapes: `block` cache slots a step, `stages` buffers,
    `group` query heads per key/value head, `rows` of the query tile (wgmma's M: 64 per
    warpgroup), `moved` query rows copied in and out (`MosaicTiles.compact`, and always
    in the fused kernel), and the shared-memory `transforms` of an `[..., H]` tile
    (tiling + swizzle)."""

    block: int
    stages: int
    group: int
    rows: int
    moved: int
    transforms: tuple


def _fetch_block(k_ref, v_ref, k_smem, v_smem, barriers, b, kv, j, buffer, *, block: int,
                 table_ref=None, page: int = 0):
    """Copies cache block `j` of row `b`, key/value head `kv`, into SMEM buffer `buffer`
    (arriving on its barrier): from the cache `[B, K, S, H]`, or with a `table_ref`, from
    the pools `[K, pages, page, H]`, one copy per page of the block, each page read
    where the row's table points."""
    if page:
        for i in range(block // page):
            index = table_ref[b, j * (block // page) + i]
            into = pl.ds(i * page, page)
            for pool, tiles in ((k_ref, k_smem), (v_ref, v_smem)):
                mgpu.copy_gmem_to_smem(pool.at[kv, index], tiles.at[buffer, into],
                                       barriers.at[buffer])
        return
    blk = pl.ds(j * block, block)
    mgpu.copy_gmem_to_smem(k_ref.at[b, kv, blk], k_smem.at[buffer], barriers.at[buffer])
    mgpu.copy_gmem_to_smem(v_ref.at[b, kv, blk], v_smem.at[buffer], barriers.at[buffer])


def _whole_blocks(block_table, block: int, page: int):
    """The block table padded with the trash page to whole blocks of `block` slots: the
    kernels read a row's slots a block at a time."""
    per_block = block // page
    blocks = -(-block_table.shape[1] // per_block)
    return jnp.pad(block_table, ((0, 0), (0, blocks * per_block - block_table.shape[1])),
                   constant_values=TRASH_PAGE)


def _mosaic_layout(num_heads, k_bksh, v_bksh, tiles: MosaicTiles, page: int = 0) -> _Layout:
    """`_Layout` of a cache and `tiles`; a ValueError for a cache that is not 16-bit.
    `page`: the buffers are pools of pages of that many slots (`paged_attention`), their
    rows' slots `[B, K, S, H]`'s own; a block holds whole pages."""
    mosaic_backend.require("model.decode_attention_impl")
    kv, s, h = k_bksh.shape[1:]
    dtype = k_bksh.dtype
    if dtype not in (jnp.bfloat16, jnp.float16) or v_bksh.dtype != dtype:
        raise ValueError(f"the Mosaic GPU decode attention needs a bfloat16 or float16 cache "
                         f"(wgmma operands), got {k_bksh.dtype} and {v_bksh.dtype}")
    # (Two stages of 128-slot key and value blocks at head_dim 256 would need 256 KiB of
    # shared memory: such heads keep 64-slot blocks.)
    block = tiles.block or (128 if (tiles.split_like or (0, s))[1] >= LONG_CACHE and h <= 128
                            else 64)
    if page:  # whole pages a block
        block = -(-max(block, page) // page) * page
    else:
        block = block if s % block == 0 else _BLOCK
    group = num_heads // kv
    rows = -(-group // 64) * 64
    swizzle = min(128, h * jnp.dtype(dtype).itemsize)  # bytes
    transforms = (mgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
                  mgpu.SwizzleTransform(swizzle))
    return _Layout(block=block, stages=max(1, min(tiles.stages, s // block)), group=group,
                   rows=rows, moved=_fused_moved(group) if tiles.compact or tiles.fused else rows,
                   transforms=transforms)


def _fused_moved(group: int) -> int:
    """Query rows a compact or fused kernel copies in and out: the group, in whole
    8-row tiles."""
    return -(-group // 8) * 8


def _mosaic(q_bnh, k_bksh, v_bksh, start_b, slot, *, interpret, tiles: MosaicTiles,
            block_table=None):
    """The Mosaic GPU kernel's attention of the rotated queries `[B, N, H]` over the
    cache (the new token already written) `[start, slot]`; `[B, N, H]` in the queries'
    dtype. With a `block_table` (`paged_attention`), the buffers are pools
    `[K, pages, page, H]` and `slot` is each row's, `[B]`."""
    b, n, h = q_bnh.shape
    dtype = k_bksh.dtype
    if block_table is None:
        (kv, s), page = k_bksh.shape[1:3], 0
    else:  # pools [K, pages, page, H]; a row's slots are its table's pages
        kv, page = k_bksh.shape[0], k_bksh.shape[2]
        s = block_table.shape[1] * page
    rows_cache = jax.ShapeDtypeStruct((b, kv, s, h), dtype)
    layout = _mosaic_layout(n, rows_cache, v_bksh, tiles, page)
    block, stages, group, rows, moved, transforms = layout
    if page:  # whole blocks of pages: the table's last block padded with the trash page
        block_table = _whole_blocks(block_table, block, page)
        s = block_table.shape[1] * page
    rows_like, slots_like = tiles.split_like or (b, s)
    splits = tiles.splits or slot_splits(rows_like * kv, slots_like)
    q_bkrh = jnp.pad(q_bnh.astype(dtype).reshape(b, kv, group, h),
                     ((0, 0), (0, 0), (0, moved - group), (0, 0)))
    interpreted = mosaic_backend.interpret(interpret)
    if tiles.row_group > 1 and b % tiles.row_group == 0 and not page:
        out_bkrh = _mosaic_rows(q_bkrh, k_bksh, v_bksh, start_b, slot,
                                layout=layout,
                                group_rows=tiles.row_group, interpreted=interpreted)
        return out_bkrh[:, :, :group].reshape(b, n, h).astype(q_bnh.dtype)
    kernel = functools.partial(_mosaic_kernel, block=block, stages=stages,
                               scale=1.0 / math.sqrt(h), interpreted=bool(interpreted),
                               splits=splits, page=page)
    copies = 2 * (block // page if page else 1)  # a buffer's key and value copies
    scratch = [mgpu.SMEM((rows, h), dtype, transforms=transforms),
               mgpu.SMEM((stages, block, h), dtype, transforms=transforms),
               mgpu.SMEM((stages, block, h), dtype, transforms=transforms),
               mgpu.Barrier(num_arrivals=copies, num_barriers=stages),
               mgpu.Barrier(num_arrivals=1)]
    if splits == 1:
        out_type, grid = jax.ShapeDtypeStruct((b, kv, moved, h), dtype), (b, kv)
    else:
        out_type = (jax.ShapeDtypeStruct((b, kv, splits, moved, h), dtype),
                    jax.ShapeDtypeStruct((b, kv, splits, moved), jnp.float32))
        grid = (b, kv, splits)
        scratch.append(mgpu.SMEM((rows,), jnp.float32))
    out = mgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=grid,
        grid_names=("rows", "heads", "parts")[:len(grid)],
        compiler_params=mosaic_backend.compiler_params(regions=8 + 3 * (s // block)),
        interpret=interpreted,
    )(q_bkrh, k_bksh, v_bksh, start_b, *((slot, block_table) if page else (slot.reshape(1),)))
    out_bkrh = out if splits == 1 else _merge_parts(*out)
    return out_bkrh[:, :, :group].reshape(b, n, h).astype(q_bnh.dtype)


def _mosaic_rows(q_bkrh, k_bksh, v_bksh, start_b, slot, *, layout: _Layout, group_rows: int,
                 interpreted):
    """`_mosaic_rows_kernel` over `[B, K, moved, H]` query groups, `group_rows` rows a
    program (which divides B); `[B, K, moved, H]` outputs in the cache's dtype."""
    b, kv, moved, h = q_bkrh.shape
    dtype = k_bksh.dtype
    block, stages, rows, transforms = layout.block, layout.stages, layout.rows, \
        layout.transforms
    kernel = functools.partial(_mosaic_rows_kernel, block=block, stages=stages,
                               scale=1.0 / math.sqrt(h), group_rows=group_rows,
                               interpreted=bool(interpreted))
    return mgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((b, kv, moved, h), dtype),
        scratch_types=[mgpu.SMEM((2, rows, h), dtype, transforms=transforms),
                       mgpu.SMEM((stages, block, h), dtype, transforms=transforms),
                       mgpu.SMEM((stages, block, h), dtype, transforms=transforms),
                       mgpu.SMEM((rows, h), dtype, transforms=transforms),
                       mgpu.Barrier(num_arrivals=2, num_barriers=stages),
                       mgpu.Barrier(num_arrivals=1, num_barriers=2)],
        grid=(b // group_rows, kv),
        grid_names=("rows", "heads"),
        compiler_params=mosaic_backend.compiler_params(
            regions=8 + 3 * group_rows * (k_bksh.shape[2] // block)),
        interpret=interpreted,
    )(q_bkrh, k_bksh, v_bksh, start_b, slot.reshape(1))


def _merge_parts(out_bkprh, lse_bkpr):
    """The attention output `[B, K, rows, H]` (float32) from the parts' normalised
    outputs and base-2 log-sum-exps, each weighted by its share of the softmax's sum."""
    weight_bkpr = jnp.exp2(lse_bkpr - jnp.max(lse_bkpr, axis=2, keepdims=True))
    total_bkr = jnp.sum(weight_bkpr, axis=2)
    merged = jnp.sum(weight_bkpr[..., None] * out_bkprh.astype(jnp.float32), axis=2)
    return merged / total_bkr[..., None]


def _fused_rows(moved: int) -> int:
    """Rows of the fused kernel's query tile (wgmma's M, a multiple of 64): the query
    group (`moved` rows), then the new key's and value's rows (`moved`, `moved + 8`)."""
    return -(-(moved + 9) // 64) * 64


def rope_table(sin_bk, cos_bk, *, swap_matmul: bool):
    """The fused kernel's rotation of each row's new token, float32, one copy a program:
    `[B, 2, H/2]`, the cosines, then the sines (`rope.apply_rope`: halves `a, b` of a
    head vector rotate to `a cos - b sin, b cos + a sin`); for `swap_matmul`
    (`_swap_matmul`) `[B, 2, H]`, rows `[cos, cos]` and `[-sin, sin]`, so that `x`
    rotates to `x * row0 + swap(x) * row1`. It is the same for every layer of a step
    (the same inputs: XLA's common-subexpression elimination may keep one)."""
    if swap_matmul:
        cos, sin = cos_bk.astype(jnp.float32), sin_bk.astype(jnp.float32)
        return jnp.stack([jnp.concatenate([cos, cos], axis=-1),
                          jnp.concatenate([-sin, sin], axis=-1)], axis=1)
    return jnp.stack([cos_bk, sin_bk], axis=1).astype(jnp.float32)


def _mosaic_fused_kernel(qkv_ref, *refs, block, stages, scale, group, num_heads, moved,
                         has_bias, swap_matmul, interpreted, page=0):
    """One (row, key/value head) of the fused Mosaic GPU kernel, from a fused
    projection's output `qkv_ref [B * (N + 2K), H]` (before bias and RoPE, rows as one
    axis), its bias (when `has_bias`: `fused_bias`' rows, split into the plain tile's
    column parts, `[K, parts, R, H / parts]`), the rotation table (`rope_table`) and
    the cache's buffers `k_ref`/`v_ref`, aliased in and out.

    The program first copies its query group, new key and new value into rows
    `[0, group)`, `moved` and `moved + 8` of a plain `[R, H]` tile (R: `_fused_rows`;
    kept as two `[R, H/2]` planes where RoPE rotates in halves), and only then the
    first cache blocks, so the rows it waits on do not queue behind those. In registers
    it adds the bias, rounds to the cache's dtype (as the projection's own bias add
    rounds), rotates the queries and the key, keeps the value and zeroes every other
    row. RoPE's half swap (`_swap_matmul`): where the head fits a key buffer (head_dim
    at most the block), a wgmma with a permutation matrix, exact, built in the last
    key buffer before that buffer's first copy (`x * cos' + swap(x) * sin'`);
    otherwise (head_dim 128 at 64-slot blocks) `a cos - b sin, b cos + a sin` of the
    halves, which the WGMMA layout keeps in one thread (register slices; each half is
    stored on its own, as a column slice of the swizzled query tile and as its own
    plain plane). The result is the query tile (the scores' A) and, back in the plain
    tile, the key and value that TMA stores at `slot` of the cache row. The program
    then attends over the cache blocks holding `[start, slot]` as `_mosaic_kernel`
    does: the block holding `slot` is copied in only once those stores are done, so it
    holds the new token, and nothing else of it is kept in SMEM. A slot past the cache
    is neither written nor attended. The output's `group` rows go from the plain tile
    to `[B, N, H]`. SMEM holds the two tiles, the key and value buffers and the
    rotation table: four programs share a multiprocessor at head_dim 64 and 64-slot
    blocks. Named regions (`jax.named_scope`) time each phase under
    `experiments/profile_decode_kernel.py`. `interpreted` as `_mosaic_kernel`'s.
    `page` (a paged cache, `append_and_attend_qkv_paged`): `k_ref`/`v_ref` are the pools
    `[K, pages, page, H]`, `slot_ref` is `[B]` (each row's own physical slot), a
    `table_ref [B, blocks * block / page]` follows it, the new key and value go to the
    slot's page and the blocks are read a page at a time (`_fetch_block`)."""
    if has_bias:
        bias_ref, *refs = refs
    rot_ref, start_ref, slot_ref, *refs = refs
    table_ref = None
    if page:
        table_ref, *refs = refs
    (k_ref, v_ref, o_ref, q_smem, k_smem, v_smem, x_smem, rot_smem, barriers,
     x_barrier) = refs
    b, kv = lax.axis_index("rows"), lax.axis_index("heads")
    # (GMEM loads: their latency overlaps.)
    start, slot = start_ref[b], slot_ref[b if page else 0]
    rows, h = q_smem.shape
    dtype = q_smem.dtype
    if page:
        num_kv, num_slots = k_ref.shape[0], table_ref.shape[1] * page
    else:
        num_kv, num_slots = k_ref.shape[1], k_ref.shape[2]
    joined = num_heads + 2 * num_kv  # the operand's rows a batch row
    parts = x_smem.shape[0]  # the plain tile's column parts: 1, or RoPE's halves
    width = h // parts
    columns = [pl.ds(p * width, width) for p in range(parts)]
    cast = (lambda x, _: x) if interpreted else mgpu.layout_cast
    wgmma_layout = mgpu.Layout.WGMMA
    load = lambda ref, layout=wgmma_layout: (
        ref[...] if interpreted else mosaic_backend.load(ref, layout, optimized=False))
    # The new token's rows first: the prologue waits on them, and copies issued after
    # the cache blocks' would queue behind those.
    places = ((kv * group, 0, group), (num_heads + kv, moved, 1),
              (num_heads + num_kv + kv, moved + 8, 1))
    with jax.named_scope("copy_x"):
        for head, row, count in places:
            for part, cols in enumerate(columns):
                mgpu.copy_gmem_to_smem(qkv_ref.at[pl.ds(b * joined + head, count), cols],
                                       x_smem.at[part, pl.ds(row, count)], x_barrier)
        mgpu.copy_gmem_to_smem(rot_ref.at[b], rot_smem, x_barrier)
    if has_bias:  # from GMEM to registers while the copies run
        with jax.named_scope("load_bias"):
            bias = [load(bias_ref.at[kv, part]).astype(jnp.float32) for part in range(parts)]

    first = start // block
    last = slot // block  # the block the new token goes to
    end = jnp.maximum(first, jnp.minimum(last + 1, num_slots // block))

    fetch = functools.partial(_fetch_block, k_ref, v_ref, k_smem, v_smem, barriers, b, kv,
                              block=block, table_ref=table_ref, page=page)

    # The first copies of blocks before the new token's (with the swap matrix in the
    # last key buffer, that buffer's after the matrix has been read).
    early = stages - 1 if swap_matmul else stages
    for i in range(early):
        pl.when((first + i < end) & (first + i < last))(functools.partial(fetch, first + i, i))
    if swap_matmul and not interpreted:  # the halves' swap: swap[i, j] = (i == j ± H/2)
        with jax.named_scope("swap_matrix"):
            region = k_smem.at[stages - 1]
            swap_rows = cast(lax.broadcasted_iota(jnp.int32, (64, h), 0), wgmma_layout)
            swap_cols = cast(lax.broadcasted_iota(jnp.int32, (64, h), 1), wgmma_layout)
            for part in range(0, h, 64):  # 64-row parts (WGMMA's layout)
                ones = swap_rows + part == lax.rem(swap_cols + h // 2, h)
                region.at[pl.ds(part, 64)][...] = jnp.where(ones, 1.0, 0.0).astype(dtype)
            swap = region.at[pl.ds(0, h)]
            mgpu.commit_smem()
    with jax.named_scope("wait_x"):
        mgpu.barrier_wait(x_barrier)

    with jax.named_scope("rotate"):
        x = [load(x_smem.at[part]).astype(jnp.float32) for part in range(parts)]
        if has_bias:
            x = [x_part + bias_part for x_part, bias_part in zip(x, bias, strict=True)]
        x = [x_part.astype(dtype) for x_part in x]  # as the projection's bias add rounds
        column = lambda i: lax.broadcast_in_dim(
            load(rot_smem.at[i], wgmma_layout.reduce(0)), (rows, width), [1])
        if swap_matmul:
            (x,) = x
            if interpreted:
                swapped = jnp.concatenate([x[:, h // 2:], x[:, :h // 2]],
                                          axis=1).astype(jnp.float32)
            else:
                def swap_halves(acc_ref):
                    mgpu.wgmma(acc_ref, x, swap)
                    return acc_ref[...]

                swapped = pl.run_scoped(swap_halves, mgpu.ACC((rows, h), jnp.float32))
            x = x.astype(jnp.float32)
            rotated = [x * column(0) + swapped * column(1)]
            x = [x]
        else:  # `a cos - b sin, b cos + a sin` of the halves `a, b`
            low, high = (x_part.astype(jnp.float32) for x_part in x)
            cos, sin = column(0), column(1)
            rotated, x = [low * cos - high * sin, high * cos + low * sin], [low, high]
        row_ids = cast(lax.broadcasted_iota(jnp.int32, (rows, width), 0), wgmma_layout)
        is_rotated = (row_ids < group) | (row_ids == moved)
        is_value = row_ids == moved + 8
        new = [jnp.where(is_rotated, rotated_part, jnp.where(is_value, x_part, 0.0)).astype(dtype)
               for rotated_part, x_part in zip(rotated, x, strict=True)]
    with jax.named_scope("store_tiles"):
        for part, cols in enumerate(columns):
            q_smem.at[:, cols][...] = new[part]
        mgpu.commit_smem()  # and every thread has loaded the plain tile: overwrite it
        for part in range(parts):
            x_smem.at[part][...] = new[part]
        mgpu.commit_smem()

    @pl.when(slot < num_slots)  # a slot past the cache is not written
    def _():
        with jax.named_scope("write_kv"):
            for row, cache in ((moved, k_ref), (moved + 8, v_ref)):
                for part, cols in enumerate(columns):
                    if page:  # the slot's page, where the row's table points
                        dest = cache.at[kv, table_ref[b, slot // page],
                                        pl.ds(lax.rem(slot, page), 1), cols]
                    else:
                        dest = cache.at[b, kv, pl.ds(slot, 1), cols]
                    mgpu.copy_smem_to_gmem(x_smem.at[part, pl.ds(row, 1)], dest)

    def fetch_after_stores(j, buffer):
        pl.when(j == last)(lambda: mgpu.wait_smem_to_gmem(0))  # the new token is in GMEM
        fetch(j, buffer)

    for i in range(stages):  # the first copies not made above
        late = (first + i >= last) if i < early else True
        pl.when((first + i < end) & late)(functools.partial(fetch_after_stores, first + i, i))

    def step(j, carry):
        buffer = lax.rem(j - first, stages)
        with jax.named_scope("wait_block"):
            mgpu.barrier_wait(barriers.at[buffer])
        with jax.named_scope("block"):
            carry = _online_block(carry, q_smem, k_smem.at[buffer], v_smem.at[buffer],
                                  j * block, start, slot, scale=scale, interpreted=interpreted)
        # Both wgmmas have finished reading the buffer: refill it.
        pl.when(j + stages < end)(functools.partial(fetch_after_stores, j + stages, buffer))
        return carry

    _, total, acc = lax.fori_loop(first, end, step, _online_start(rows, h, interpreted))
    with jax.named_scope("output"):
        mgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the plain tile's stores read it
        out = (acc / lax.broadcast_in_dim(total, acc.shape, [0])).astype(dtype)
        for part in range(parts):
            x_smem.at[part][...] = out[:, part * width:(part + 1) * width]
        mgpu.commit_smem()
        for part, cols in enumerate(columns):
            mgpu.copy_smem_to_gmem(x_smem.at[part, pl.ds(0, group)],
                                   o_ref.at[b, pl.ds(kv * group, group), cols])
    mgpu.wait_smem_to_gmem(0)  # the output


def _fused_or_split(qkv_bjh, bias_jh, sin_bk, cos_bk, k_bksh, v_bksh, start_b, slot, *,
                    num_heads, interpret, tiles: MosaicTiles):
    """On one shard's rows: the fused kernel (`_mosaic_fused`), or where `tiles` leave
    these rows to the unfused kernel (`MosaicTiles.takes_fused`), the bias, RoPE and the
    cache write in XLA and the unfused kernel split over slots; `(out [B, N, H], k, v)`."""
    b, kv, s = k_bksh.shape[:3]
    if tiles.takes_fused(b, kv, s):
        return _mosaic_fused(qkv_bjh, bias_jh, sin_bk, cos_bk, k_bksh, v_bksh, start_b, slot,
                             num_heads=num_heads, interpret=interpret, tiles=tiles)
    q_bnh, k_new_bkh, v_new_bkh = _split_qkv(qkv_bjh, _raw_bias(bias_jh), num_heads, kv)
    q_bnh, k_bksh, v_bksh = rotate_and_write(q_bnh, k_new_bkh, v_new_bkh, sin_bk, cos_bk,
                                             k_bksh, v_bksh, slot)
    split = dataclasses.replace(tiles, fused=False, splits=0, fused_max_splits=None)
    out_bnh = _mosaic(q_bnh, k_bksh, v_bksh, start_b, slot, interpret=interpret, tiles=split)
    return out_bnh, k_bksh, v_bksh


def _mosaic_fused(qkv_bjh, bias_jh, sin_bk, cos_bk, k_bksh, v_bksh, start_b, slot, *,
                  num_heads, interpret, tiles: MosaicTiles, block_table=None):
    """`MosaicTiles.fused`: the kernel (`_mosaic_fused_kernel`) on the projection's
    output itself, whose cache buffers are JAX refs (`jax.new_ref`) passed to
    `pl.kernel`, which aliases them in and out; (`[B, N, H]` in the operand's dtype,
    the updated key and value buffers). With a `block_table`, the buffers are pools
    `[K, pages, page, H]` and `slot` is each row's, `[B]`."""
    b, _, h = qkv_bjh.shape
    dtype = k_bksh.dtype
    if block_table is None:
        kv, page, k_like, v_like = k_bksh.shape[1], 0, k_bksh, v_bksh
    else:  # laid out as a cache of the table's slots
        kv, page = k_bksh.shape[0], k_bksh.shape[2]
        k_like, v_like = (jax.ShapeDtypeStruct((b, kv, block_table.shape[1] * page, h),
                                               x.dtype) for x in (k_bksh, v_bksh))
    block, stages, group, _, moved, transforms = _mosaic_layout(num_heads, k_like, v_like,
                                                                tiles, page)
    swap_matmul = _swap_matmul(h, block)
    tile_columns = transforms[0].tiling[1]
    if not swap_matmul and (h // 2) % tile_columns:
        raise ValueError(f"the fused Mosaic GPU decode kernel rotates head_dim {h} in halves "
                         f"at {block}-slot blocks, which must be whole {tile_columns}-column "
                         f"tiles: use a head_dim of at most {block} or a multiple of "
                         f"{2 * tile_columns}")
    parts = _plain_parts(swap_matmul)
    call = _fused_call(b, num_heads, kv, h, jnp.dtype(dtype), block, stages, group, moved,
                       transforms, bias_jh is not None,
                       bool(mosaic_backend.interpret(interpret)), swap_matmul, page)
    operands = [qkv_bjh.astype(dtype).reshape(-1, h)]  # rows as one axis: a free reshape
    if bias_jh is not None:
        made = bias_jh.by_parts.get(parts) if isinstance(bias_jh, KernelBias) else None
        if made is None or made.dtype != dtype:  # made here, at every step
            made = _bias_operand(_raw_bias(bias_jh).astype(dtype), num_heads, kv, moved, parts)
        operands.append(made)
    operands += [rope_table(sin_bk, cos_bk, swap_matmul=swap_matmul), start_b]
    if page:
        operands += [slot, _whole_blocks(block_table, block, page)]
    else:
        operands.append(slot.reshape(1))
    out_bnh, k_bksh, v_bksh = call(*operands, k_bksh, v_bksh)
    return out_bnh.astype(qkv_bjh.dtype), k_bksh, v_bksh


class KernelBias(NamedTuple):
    """A fused qkv projection's bias with the fused kernel's operand made from it ahead
    (`kernel_bias`): a decode loop's steps would otherwise gather it again at every
    layer of every step, since XLA does not hoist a gather that makes its input larger
    (`[K, R, H]` of `[N + 2K, H]`) out of a loop.

    Attributes:
      bias_jh: `[N + 2K, H]` the bias (the unfused path adds it).
      by_parts: `{parts: [K, parts, R, H / parts]}`, the kernel's bias operand
        (`_bias_operand`) for each plain tile's column parts it may take (1, or RoPE's
        halves: 2), in the dtype it was made in (another cache's dtype makes its own).
    """

    bias_jh: jax.Array
    by_parts: dict


def kernel_bias(bias_jh, *, num_heads: int, num_kv: int, dtype) -> KernelBias:
    """`bias_jh` with the fused kernel's bias operand in `dtype` (the cache's) for either
    plain tile (`_plain_parts`: which one a step takes depends on its cache's blocks)."""
    moved = _fused_moved(num_heads // num_kv)
    return KernelBias(bias_jh, {parts: _bias_operand(bias_jh.astype(dtype), num_heads, num_kv,
                                                     moved, parts) for parts in (1, 2)})


def _raw_bias(bias):
    """The bias `[N + 2K, H]` of a `KernelBias`, or `bias` as it is (an array or None)."""
    return bias.bias_jh if isinstance(bias, KernelBias) else bias


def _bias_operand(bias_jh, num_heads: int, num_kv: int, moved: int, parts: int):
    """The fused kernel's bias operand `[K, parts, R, H / parts]` (`fused_bias` split
    into the plain tile's column parts)."""
    h = bias_jh.shape[1]
    bias_krh = fused_bias(bias_jh, num_heads=num_heads, num_kv=num_kv, moved=moved)
    return bias_krh.reshape(num_kv, -1, parts, h // parts).transpose(0, 2, 1, 3)


def fused_bias(bias_jh, *, num_heads, num_kv, moved):
    """The qkv projection's bias as the fused kernel adds it, `[K, R, H]` (R:
    `_fused_rows`): each key/value head's query group at rows `[0, group)`, its key's
    at row `moved` and its value's at `moved + 8`, zeros elsewhere (one gather of the
    parameter)."""
    group = num_heads // num_kv
    index = np.full((num_kv, _fused_rows(moved)), bias_jh.shape[0])  # the zero row
    for kv in range(num_kv):
        index[kv, :group] = kv * group + np.arange(group)
        index[kv, moved] = num_heads + kv
        index[kv, moved + 8] = num_heads + num_kv + kv
    padded = jnp.concatenate([bias_jh, jnp.zeros_like(bias_jh[:1])])
    return padded[index]


def _plain_parts(swap_matmul: bool) -> int:
    """The fused kernel's plain tile's column parts: the whole head, or RoPE's halves."""
    return 1 if swap_matmul else 2


def _swap_matmul(h, block) -> bool:
    """Whether the fused kernel rotates by a wgmma with a permutation matrix (built in
    the last key buffer, which must hold its `H` rows, written in 64-row parts) rather
    than in register halves (where it does not fit: `H` 128 at 64-slot blocks, whose
    halves are whole 64-column tiles of the swizzled query tile; at 128-slot blocks,
    caches from `LONG_CACHE` slots, the matrix, not measured against the halves there).
    On an H200 (`experiments/bench_decode_kernel.py`): at head_dim 64, batch 256 of 384 slots,
    the matrix took 16.66 µs a layer-step and a halves version that stored both halves
    through one plain tile 18.11. At head_dim 128 (Qwen2.5-7B's heads, batch 128) the
    matrix, in a tile of its own that left one program a multiprocessor, took 35.40, the
    halves 28.93."""
    return block >= -(-h // 64) * 64


@functools.cache
def _fused_call(b, num_heads, kv, h, dtype, block, stages, group, moved, transforms, has_bias,
                interpreted, swap_matmul, page=0):
    """The fused kernel's jitted call `(qkv_(b*j)h[, bias_kprh], rope_table, start_b,
    slot_1, k_bksh, v_bksh) -> (out_bnh, k_bksh, v_bksh)` (with `page`: `slot_b`, the
    block table, then the pools), one per configuration (the bias as `_mosaic_fused`
    splits it into parts, the table as `rope_table` makes it for `swap_matmul`): the
    decode step's layers call the same function, so their program lowers the kernel
    once (a private function the layers share) instead of once a layer."""
    rows = _fused_rows(moved)
    tile = lambda shape: mgpu.SMEM(shape, dtype, transforms=transforms)
    parts = _plain_parts(swap_matmul)
    scratch = [tile((rows, h)), tile((stages, block, h)), tile((stages, block, h)),
               mgpu.SMEM((parts, rows, h // parts), dtype),
               mgpu.SMEM((2, h if swap_matmul else h // 2), jnp.float32),
               # A buffer's key and value copies (a page each with a paged cache).
               mgpu.Barrier(num_arrivals=2 * (block // page if page else 1),
                            num_barriers=stages),
               mgpu.Barrier(num_arrivals=3 * parts + 1)]
    body = functools.partial(_mosaic_fused_kernel, block=block, stages=stages,
                             scale=1.0 / math.sqrt(h), group=group, num_heads=num_heads,
                             moved=moved, has_bias=has_bias, swap_matmul=swap_matmul,
                             interpreted=interpreted, page=page)
    # `plgpu.kernel` (its custom_vmap) takes no refs: `pl.kernel` on a Mosaic GPU mesh,
    # with the scratch allocated as `plgpu.kernel` does.
    run = lambda num_slots: pl.kernel(
        lambda *refs: pl.run_scoped(functools.partial(body, *refs), *scratch),
        out_type=jax.ShapeDtypeStruct((b, num_heads, h), dtype),
        mesh=mgpu.Mesh(grid=(b, kv), grid_names=("rows", "heads")),
        # (Profiled: the prologue's regions, then 5 a cache block.)
        compiler_params=mosaic_backend.compiler_params(regions=16 + 5 * (num_slots // block)),
        interpret=mosaic_backend.interpret(interpreted),
        name="append_and_attend_fused")

    @jax.jit  # refs with a memory space live inside a jit only (a no-op under the caller's)
    def call(*args):
        *operands, k_bksh, v_bksh = args
        num_slots = operands[-1].shape[1] * page if page else k_bksh.shape[2]
        k_ref, v_ref = (jax.new_ref(x, memory_space=mgpu.GMEM) for x in (k_bksh, v_bksh))
        with _no_vma_check():  # as `plgpu.kernel` calls `pl.kernel`
            out_bnh = run(num_slots)(*operands, k_ref, v_ref)
        return out_bnh, jax.freeze(k_ref), jax.freeze(v_ref)

    return call


def _no_vma_check():
    """The context `plgpu.kernel` runs `pl.kernel` in (jax 0.10 and 0.11): shard_map's
    check of varying manual axes off (a no-op where jax has no such switch)."""
    from jax._src import config as jax_config  # noqa: PLC0415 (private, as plgpu's)

    check = getattr(jax_config, "_check_vma", None)
    return contextlib.nullcontext() if check is None else check(False)


def grouped_attention(q_btnh, k_bksh, v_bksh, mask_b1ts, rows=None, *, scale=None,
                      softcap=None):
    """Softmax attention with the queries of a key/value head grouped, in float32.

    `N = K * G` query heads share K key/value heads. The queries are viewed as
    `[B, T, K, G, H]` so each cached key and value is read once for its G queries,
    never repeated to N heads, and keys/values come heads-first (the cache's
    layout), so each (row, head) is one contiguous `[S, H]` operand.

    With `rows` (a `cache.RowCache`), the queries, keys and values are the cache's C
    rows and the mask the batch's B rows: the scores are spread to the batch's rows
    for the softmax and back (zeros for batch rows with no cache row), so the softmax
    runs at the batch's shape. A row's scores and weighted values are the same bits at
    any batch size (per-row products), but XLA:CPU reduces a small softmax another
    way than a large one (its own loops below about 4096 elements, a YNNPACK fusion
    above), so a row's softmax is the single program's only at its batch's shape.

    Args:
      q_btnh: `[B, T, N, H]` queries.
      k_bksh, v_bksh: `[B, K, S, H]` keys and values.
      mask_b1ts: bool `[B, 1, T, S]`, True where a query may attend to a key.
      rows: None, or the `RowCache` whose rows q, k and v are (see above).
      scale: the scores' scale (None: `H ** -0.5`; Gemma's `query_pre_attn_scalar ** -0.5`).
      softcap: None, or the cap c of Gemma 2's soft-capping: scores `s` become
        `c * tanh(s / c)` after scaling and before the mask.

    Returns:
      `[B, T, N, H]` in the queries' dtype.
    """
    b, t, n, h = q_btnh.shape
    k = k_bksh.shape[1]
    q_bkgth = q_btnh.reshape(b, t, k, n // k, h).transpose(0, 2, 3, 1, 4)
    logits = jnp.einsum("bkgth,bksh->bkgts", q_bkgth, k_bksh,
                        preferred_element_type=jnp.float32)
    logits = logits / jnp.sqrt(jnp.float32(h)) if scale is None else logits * scale
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    axes, slots = ("batch", "kv_heads", None, None, None), k_bksh.shape[2]
    if rows is not None:  # the single program's batch rows and slots
        pad = ((0, 0),) * (logits.ndim - 1) + ((0, max(rows.softmax_slots - slots, 0)),)
        logits = jnp.pad(rows.to_batch_rows(logits, axes), pad)
        mask_b1ts = jnp.pad(mask_b1ts, pad[1:])
    logits = jnp.where(mask_b1ts[:, :, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    if rows is not None:
        probs = rows.to_cache_rows(probs[..., :slots], axes)
    probs = probs.astype(v_bksh.dtype)
    out_bkgth = jnp.einsum("bkgts,bksh->bkgth", probs, v_bksh,
                           preferred_element_type=jnp.float32)
    return out_bkgth.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q_btnh.dtype)

