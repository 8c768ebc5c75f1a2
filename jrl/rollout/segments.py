"""Sampling in cache segments: KV-cache memory that follows the tokens generated.

`sampler.generate_program` is one static program, so it reserves the cache for its
worst case, every row running to `R = max_new_tokens`: `N x (P + R)` slots for the
whole rollout, however early the rows stop. With `SamplingConfig.cache_segments = m`
the response is decoded in m segments instead, each its own jitted program: segment
k decodes response steps up to `e_k = ceil(R (k+1) / m)` into a cache of the fewest
slots `S_k >= P + e_k` that differ from the single program's `S = P + R` (rounded as
`sampler.cache_slots`) by whole blocks (`slot_block`: 64 slots, 128 where a
decode-attention kernel runs), holding only the rows still running.
Between segments the host reads how many rows still run (one small device-to-host
transfer), picks the smallest number of cache rows that holds them (`segment_sizes`:
a whole number of rows per batch shard), and moves the running rows' cache into the
new, smaller-but-longer buffers, one layer buffer at a time, deleting each old buffer
as soon as it is copied. Peak cache memory is then

    max_k max(C_{k-1} + C_k / 2L, C_k + C_{k-1} / 2L),  C_k = rows_k * S_k * (slot bytes),

(both buffers of the one layer being moved are live), against `N (P + R)` slots for
the single program: for 32 rows of P8 + R504 whose lengths averaged 163, 45% of it
(`tests/rollout/test_segments.py`).

Only the cache shrinks; the decode step's batch is the single program's. Its rows (the
last tokens, keys, masks, positions) follow the single program's schedule: all N rows,
or with `decode_buckets` > 1 the same batch sizes from the same steps in the same
order (`sampler._compact`, run by the stage at the step the single program runs it).
The cache is a `models.cache.RowCache`: each batch row's cache row (none once it has
stopped and left the cache). Every matmul (projections, MLP, unembedding) runs on the
batch as in the single program; the attention gathers the running rows' queries, keys
and values into the cache's rows, appends and attends there (the decode-attention
kernels, per-row programs, take them unchanged), and gathers its output back to the
batch (zeros for stopped rows, whose outputs are discarded). On the XLA path the
softmax runs at the single program's shape (its batch rows and `P + R` slots, the
extra slots masked), since XLA:CPU reduces a softmax of under about 4096 elements
another way than a larger one. So the tokens, masks, lengths and log-probs are the
single program's, bit for bit, on XLA:CPU (tested at decode_buckets 1 and 4, top-k
and top-p, on one device and on a 4-device mesh); and the segments compute what the
single program computes at the same `decode_buckets`: to stop spending decode steps
on stopped rows, set `decode_buckets` as there.

Exactness rests on XLA's fusion decisions: the two programs fuse the same
computations alike (the first program also emits the first token's log-probs as the
single program does when it compacts, `_first_stage`). The Mosaic GPU decode kernel
runs per (row, head) on the same inputs and, with the caches differing by whole kernel
blocks, the same blocks (in GPU interpret mode it gives the single program's bits,
tested); on a GPU the other ops run at the single program's shapes, but bit-equality
there is not tested here.

The host loop cannot run inside another jit: `generate` here is called outside one
(`sampler.generate`, the single program, refuses `cache_segments > 1` and names this
function), and the trainer calls it instead of its single jitted sampler when
`rollout.cache_segments > 1`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from jrl.kernels import decode_attention
from jrl.models.cache import (
    CACHE_LOGICAL_AXES,
    RowCache,
    inverse_rows,
    layer_slots,
    take_rows,
)
from jrl.models.config import ModelConfig
from jrl.rollout import sampler
from jrl.rollout.sampler import RolloutOutput, SamplingConfig
from jrl.sharding import constrain

# Segments' caches differ from the single program's by whole blocks of at least this
# many slots (`slot_block`): the decode-attention kernels' smallest block
# (`decode_attention.cache_slots` rounds to it); XLA:CPU also rounds its reductions over
# the slots by the slot count modulo 64 (and otherwise below 64 slots), so attention
# over a segment's cache gives the single program's bits.
SLOT_BLOCK = 64
# Cache rows a segment may hold (besides the decode loop's batch sizes): evenly
# spaced down to 1/8 of the rows.
SEGMENT_ROW_BUCKETS = 8


def segment_ends(sampling: SamplingConfig) -> tuple[int, ...]:
    """The response step at which each segment ends: `ceil(R (k+1) / m)`, the last R."""
    num_new, segments = sampling.max_new_tokens, sampling.cache_segments
    return tuple(-(-num_new * (k + 1) // segments) for k in range(segments))


def segment_slots(config: ModelConfig, prompt_len: int, sampling: SamplingConfig
                  ) -> tuple[int, ...]:
    """Cache slots of each segment: the fewest, at least one block (or S), that hold
    `P + end` and differ from the single program's `S = cache_slots(P + R)` by whole
    blocks (`slot_block`; the last: S)."""
    full = sampler.cache_slots(config, prompt_len + sampling.max_new_tokens)
    block = slot_block(config, full)
    fewest = lambda end: max(prompt_len + end, block)
    return tuple(full - max(full - fewest(end), 0) // block * block
                 for end in segment_ends(sampling))


def slot_block(config: ModelConfig, full_slots: int) -> int:
    """The slots by which a segment's cache may differ from the single program's
    `full_slots`: `SLOT_BLOCK`, or where a decode-attention kernel decodes, a multiple
    of its tiles' block too: the kernel runs its loop in blocks of `MosaicTiles.block`
    slots where they divide the cache's slots, else of 64, so each segment's cache must
    divide alike for the kernel to sum a row's blocks as the single program's does."""
    impl = decode_attention.choose_impl(config.decode_attention_impl, config.head_dim,
                                        full_slots, config.dtype)
    if impl != "mosaic":
        return SLOT_BLOCK
    # (A block of 0 is 64 or 128 by the cache's length: 128 divides alike.)
    return math.lcm(SLOT_BLOCK, decode_attention.MOSAIC_TILES.block or 128)


def segment_sizes(num_rows: int, groups: int, sampling: SamplingConfig) -> tuple[int, ...]:
    """The cache rows a segment may hold, largest first: `SEGMENT_ROW_BUCKETS` evenly
    spaced sizes and the decode loop's batch sizes (`sampler.decode_sizes`);
    `(num_rows,)` when rows never stop early."""
    finer = dataclasses.replace(sampling, decode_buckets=SEGMENT_ROW_BUCKETS)
    sizes = {*sampler.decode_sizes(num_rows, groups, sampling),
             *sampler.decode_sizes(num_rows, groups, finer)}
    return tuple(sorted(sizes, reverse=True))


def cache_bytes(config: ModelConfig, rows: int, slots: int, ring: bool = False) -> int:
    """Bytes of a KV cache of `rows x slots`: keys and values of every layer; with `ring`
    the single program's, whose sliding-window layers keep rings (`layer_slots`)."""
    per_slot = 2 * config.num_kv_heads * config.head_dim
    return rows * sum(layer_slots(config, slots, ring)) * per_slot * \
        jnp.dtype(config.dtype).itemsize


@dataclasses.dataclass
class Report:
    """What one segmented rollout ran.

    Attributes:
      stages: `(rows, slots)` of each cache the rollout decoded in, in order (a new one
        at a segment's start or where the running rows fit fewer rows; segments that
        every row stopped before are not run).
      cache_bytes: bytes of each stage's cache.
      peak_cache_bytes: the most cache bytes live at once, counting the moves between
        stages (the old cache less the buffers already moved, plus the new one's).
      single_cache_bytes: the single program's cache, N x (P + R) slots (its sliding-window
        layers' rings of their window).
      programs: `(name, CompiledMemoryStats)` of every program run, in order.
    """

    stages: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    cache_bytes: list[int] = dataclasses.field(default_factory=list)
    peak_cache_bytes: int = 0
    single_cache_bytes: int = 0
    programs: list[tuple[str, Any]] = dataclasses.field(default_factory=list)


def generate(params, prompt_ids, prompt_mask, rng, sampling: SamplingConfig, *,
             config: ModelConfig, report: Report | None = None) -> RolloutOutput:
    """`sampler.generate` in `sampling.cache_segments` segments (see the module
    docstring); arguments as there. Call outside any jit.

    Args:
      report: when given, filled with the stages run and their memory (`Report`);
        compiling each program's memory analysis costs a compile per shape.
    """
    sampler.check_inputs(prompt_ids, prompt_mask, sampling, config)
    num_rows, prompt_len = prompt_ids.shape[0] * sampling.n, prompt_ids.shape[1]
    groups = sampler._row_groups(num_rows)
    ends, slots = segment_ends(sampling), segment_slots(config, prompt_len, sampling)
    static = dict(sampling=sampling, config=config, groups=groups, prompt_len=prompt_len)
    first = _program(_first_stage, sampling)
    args, kwargs = (params, prompt_ids, prompt_mask, rng), static | dict(num_slots=slots[0])
    _record(report, "prefill", first, args, kwargs)
    prompts, state, out, layer_params, _ = first(*args, **kwargs)
    if report is not None:
        report.single_cache_bytes = cache_bytes(config, num_rows, slots[-1], ring=True)
        _add_stage(report, config, (num_rows, slots[0]), None)
    cache_sizes = segment_sizes(num_rows, groups, sampling)
    batch_sizes = sampler.decode_sizes(num_rows, groups, sampling)
    stage = _program(_stage, sampling, donate_argnames=("state", "out"))
    segment, step, rows, batch, compact = 0, 1, num_rows, num_rows, ()
    while True:
        if step == ends[segment]:
            segment += 1
        cache = (state.cache.k[0].shape[0], state.cache.max_len)
        if (rows, slots[segment]) != cache:
            state = _move(state, rows, slots[segment], slots[-1], groups, sampling, report)
            if report is not None:
                _add_stage(report, config, (rows, slots[segment]), cache)
        batch = compact[-1] if compact else batch
        smaller = max([s for s in batch_sizes if s < batch], default=0)
        args = (layer_params, state, out)
        kwargs = static | dict(end=ends[segment], smaller=smaller, compact=compact)
        with warnings.catch_warnings():
            # A stage that compacts the batch first reuses the donated cache, not the
            # state's per-row buffers, whose shapes change.
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            _record(report, f"decode {batch} rows ({rows} cached) to step {ends[segment]}",
                    stage, args, kwargs)
            state, out, counts = stage(*args, **kwargs)
        step, running = (int(x) for x in jax.device_get(counts))  # the one host transfer
        if running == 0 or step == ends[-1]:
            break
        rows = min(s for s in cache_sizes if s // groups >= running)
        # The single program's compactions at this step (`sampler.decode_rows`).
        compact = tuple(s for s in batch_sizes if s < batch and running <= s // groups)
    return sampler.rollout_output(*prompts, *out)


def _first_stage(params, prompt_ids, prompt_mask, rng, *, num_slots, prompt_len, sampling,
                 config, groups):
    """Prefill and the first token, into a cache of `num_slots` slots: (prompts, state,
    out, the per-layer parameters every later stage decodes with: `sampler.per_layer`,
    joined once per rollout as in the single program, and an output to discard)."""
    del prompt_len
    row_ids, row_mask, state, layer_params = sampler.start(params, prompt_ids, prompt_mask,
                                                           rng, sampling, config, num_slots)
    out = (state.responses, state.log_probs, state.lengths)
    if len(sampler.decode_sizes(state.responses.shape[0], groups, sampling)) > 1:
        # The single program holds its output buffers apart from the state's when it
        # compacts the batch (`sampler._write_rows` reads them grouped), so XLA:CPU
        # computes the first token's log-prob in a fusion of its own; with the log-probs
        # in one consumer it fuses the log there, which rounds it otherwise. Returning
        # the grouped view too makes this program compute it as the single one does.
        return (row_ids, row_mask), state, out, layer_params, sampler._grouped(
            state.log_probs, groups)
    return (row_ids, row_mask), state, out, layer_params, None


def _stage(layer_params, state, out, *, end, smaller, compact, prompt_len, sampling, config,
           groups):
    """The single program's decoding from the state's step: its compactions of the batch
    at this step (to each size of `compact`, as `sampler.decode_rows`), then decoding
    with the per-layer parameters until step `end` or until every batch shard's
    unfinished rows fit `smaller` rows; all rows written to `out`: (state, out, int32 [2]
    the step reached and the most unfinished rows of a batch shard)."""
    for size in compact:
        out = sampler._write_rows(out, state, groups)
        state = sampler._compact(state, size, groups)
    state = sampler.decode_until(layer_params, state, end, smaller, groups, prompt_len=prompt_len,
                                 sampling=sampling, config=config)
    counts = jnp.stack([state.step, _most_unfinished(state, groups)])
    return state, sampler._write_rows(out, state, groups), counts


def _most_unfinished(state, groups: int) -> jax.Array:
    """int32 []: the most unfinished rows in any batch shard."""
    return jnp.max(jnp.sum(~sampler._grouped(state.done, groups), axis=1))


def _move(state, rows: int, num_slots: int, full_slots: int, groups: int,
          sampling: SamplingConfig, report: Report | None):
    """The state with a cache (`RowCache`) of `rows` rows, each batch shard's unfinished
    rows first (then finished ones to fill its share), and `num_slots` slots; the batch
    stays as it is. The old cache is deleted one layer buffer at a time as it is
    copied."""
    order, source, maps = _program(_order, sampling)(
        state.done, getattr(state.cache, "cache_rows", None), rows=rows, groups=groups)
    key_mask = _program(_pad_slots, sampling)(state.key_mask, num_slots=num_slots)
    move = _program(_take_buffer, sampling)
    _record(report, "move", move, (state.cache.k[0], source), dict(num_slots=num_slots))

    def moved(buffers):
        new = []
        for buffer in buffers:
            new.append(move(buffer, source, num_slots=num_slots))
            buffer.delete()
        return tuple(new)

    cache = RowCache(k=moved(state.cache.k), v=moved(state.cache.v), cache_rows=maps,
                     batch_rows=order, softmax_slots=full_slots)
    return state.replace(cache=cache, key_mask=key_mask)


def _order(done, cache_rows, *, rows, groups):
    """The moved cache's rows: int32 `[groups, rows / groups]` each group's batch rows
    to keep, the unfinished first; the cache rows they come from (the cache's number of
    rows a group where none); each batch row's new cache row (`RowCache.cache_rows`)."""
    order = jax.vmap(lambda d: jnp.argsort(d, stable=True))(sampler._grouped(done, groups))
    order = order[:, :rows // groups].astype(jnp.int32)
    source = order if cache_rows is None else jnp.take_along_axis(cache_rows, order, axis=1)
    return order, source, inverse_rows(order, done.shape[0] // groups)


def _pad_slots(key_mask, *, num_slots):
    """`key_mask` `[B, S]` padded with empty slots to `num_slots`."""
    return jnp.pad(key_mask, ((0, 0), (0, num_slots - key_mask.shape[1])))


def _take_buffer(buffer_bksh, source, *, num_slots):
    """The rows `source` (`[groups, rows / groups]`, within each group; zeros where out
    of range) of one layer's cache buffer, padded with empty slots to `num_slots`."""
    taken = take_rows(buffer_bksh, source, CACHE_LOGICAL_AXES, "fill")
    pad = ((0, 0), (0, 0), (0, num_slots - taken.shape[2]), (0, 0))
    return constrain(jnp.pad(taken, pad), CACHE_LOGICAL_AXES)


_STATIC = ("sampling", "config", "groups", "end", "num_slots", "prompt_len", "rows",
           "smaller", "compact")


@functools.cache
def _program(fun, sampling: SamplingConfig, **jit_kwargs):
    """`fun` jitted with the sampler's compiler options, its keyword arguments static;
    one jitted function per `(fun, sampling)`, so the host loop's calls reuse it."""
    static = tuple(name for name in _STATIC if name in fun.__code__.co_varnames)
    return sampler.jit_sampler(fun, sampling, static_argnames=static, **jit_kwargs)


def _record(report: Report | None, name: str, program, args, kwargs) -> None:
    """Adds the memory analysis of `program(*args, **kwargs)` to `report`."""
    if report is not None:
        stats = program.lower(*args, **kwargs).compile().memory_analysis()
        report.programs.append((name, stats))


def _add_stage(report: Report, config: ModelConfig, stage, previous) -> None:
    """Adds a stage and updates the peak: while one of the 2L layer buffers moves, the
    old cache less the moved buffers and the new one's moved buffers are live."""
    new = cache_bytes(config, *stage)
    peak = new
    if previous is not None:
        old, buffers = cache_bytes(config, *previous), 2 * config.num_layers
        peak = max(old + new // buffers, new + old // buffers)
    report.stages.append(stage)
    report.cache_bytes.append(new)
    report.peak_cache_bytes = max(report.peak_cache_bytes, peak)


def peak_bytes(stats) -> int:
    """Bytes a compiled program holds at once (`memory_analysis()`): arguments, outputs
    and temporaries, less the outputs that reuse donated arguments."""
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes
            + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
