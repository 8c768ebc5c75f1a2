"""Sampling in cache segments: KV-cache memory that follows the tokens generated.

`rollout.generate_program` is one static program, so it reserves the cache for its
worst case, every row running to `R = max_new_tokens`: `N x (P + R)` slots for the
whole rollout, however early the rows stop. With `SamplingConfig.cache_segments = m`
the response is decoded in m segments instead, each its own jitted program: segment
k decodes response steps up to `e_k = ceil(R (k+1) / m)` into a cache of the fewest
slots `S_k >= P + e_k` that differ from the single program's `S = P + R` (rounded as
`rollout.cache_slots`) by whole `SLOT_BLOCK`s, holding only the rows still running.
Between segments the host reads how many rows still run (one small device-to-host
transfer), picks the smallest batch size that holds them (`segment_sizes`: a whole
number of rows per batch shard), and moves the running rows' state and cache into the
new, smaller-but-longer buffers, one layer buffer at a time, deleting each old buffer
as soon as it is copied. Peak cache memory is then

    max_k max(C_{k-1} + C_k / 2L, C_k + C_{k-1} / 2L),  C_k = rows_k * S_k * (slot bytes),

(both buffers of the one layer being moved are live), against `N (P + R)` slots for
the single program: for 32 rows of P8 + R504 whose lengths averaged 163, 45% of it
(`tests/test_rollout_segments.py`).

Every row keeps its key and global row index and every token is drawn at the same
step as in the single program (`decode_buckets` still compacts the rows within a
segment). Tokens, masks and lengths are the same. The segments' caches alone change
no bit (with the batch held at every row the log-probs are the single program's, bit
for bit, on XLA:CPU); compacting the rows does change the last bits of some log-probs,
as `decode_buckets`' compaction does in the single program: the compiler rounds a
row's reductions differently at another batch size or position in the batch (by a few
units in the last place on XLA:CPU), so a near-tie between two tokens could in
principle flip a draw.

The host loop cannot run inside another jit: `generate` here is called outside one
(`rollout.generate`, the single program, refuses `cache_segments > 1` and names this
function), and the trainer calls it instead of its single jitted sampler when
`rollout.cache_segments > 1`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jrl import rollout
from jrl.models.cache import CACHE_LOGICAL_AXES
from jrl.models.config import ModelConfig
from jrl.rollout import RolloutOutput, SamplingConfig
from jrl.sharding import constrain

# Segments' caches differ from the single program's by whole blocks of this many slots:
# the decode-attention kernels' block (`decode_attention.cache_slots` rounds to it);
# XLA:CPU also rounds its reductions over the slots by the slot count modulo 64 (and
# otherwise below 64 slots), so attention over a segment's cache gives the single
# program's bits.
SLOT_BLOCK = 64
# Batch sizes a segment may start at (besides the decode loop's own): evenly spaced
# down to 1/8 of the rows.
SEGMENT_ROW_BUCKETS = 8


def segment_ends(sampling: SamplingConfig) -> tuple[int, ...]:
    """The response step at which each segment ends: `ceil(R (k+1) / m)`, the last R."""
    num_new, segments = sampling.max_new_tokens, sampling.cache_segments
    return tuple(-(-num_new * (k + 1) // segments) for k in range(segments))


def segment_slots(config: ModelConfig, prompt_len: int, sampling: SamplingConfig
                  ) -> tuple[int, ...]:
    """Cache slots of each segment: the fewest, at least `SLOT_BLOCK` (or S), that hold
    `P + end` and differ from the single program's `S = cache_slots(P + R)` by whole
    `SLOT_BLOCK`s (the last: S)."""
    full = rollout.cache_slots(config, prompt_len + sampling.max_new_tokens)
    fewest = lambda end: max(prompt_len + end, SLOT_BLOCK)
    return tuple(full - max(full - fewest(end), 0) // SLOT_BLOCK * SLOT_BLOCK
                 for end in segment_ends(sampling))


def segment_sizes(num_rows: int, groups: int, sampling: SamplingConfig) -> tuple[int, ...]:
    """The batch sizes a segment may start at, largest first: `SEGMENT_ROW_BUCKETS`
    evenly spaced sizes and the decode loop's own (`rollout.decode_sizes`); `(num_rows,)`
    when rows never stop early."""
    finer = dataclasses.replace(sampling, decode_buckets=SEGMENT_ROW_BUCKETS)
    sizes = {*rollout.decode_sizes(num_rows, groups, sampling),
             *rollout.decode_sizes(num_rows, groups, finer)}
    return tuple(sorted(sizes, reverse=True))


def cache_bytes(config: ModelConfig, rows: int, slots: int) -> int:
    """Bytes of a KV cache of `rows x slots`: keys and values of every layer."""
    per_slot = 2 * config.num_layers * config.num_kv_heads * config.head_dim
    return rows * slots * per_slot * jnp.dtype(config.dtype).itemsize


@dataclasses.dataclass
class Report:
    """What one segmented rollout ran.

    Attributes:
      stages: `(rows, slots)` of each cache the rollout decoded in, in order (a new one
        at each segment and each compaction; segments that every row stopped before
        are not run).
      cache_bytes: bytes of each stage's cache.
      peak_cache_bytes: the most cache bytes live at once, counting the moves between
        stages (the old cache less the buffers already moved, plus the new one's).
      single_cache_bytes: the single program's cache, N x (P + R) slots.
      programs: `(name, CompiledMemoryStats)` of every program run, in order.
    """

    stages: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    cache_bytes: list[int] = dataclasses.field(default_factory=list)
    peak_cache_bytes: int = 0
    single_cache_bytes: int = 0
    programs: list[tuple[str, Any]] = dataclasses.field(default_factory=list)


def generate(params, prompt_ids, prompt_mask, rng, sampling: SamplingConfig, *,
             config: ModelConfig, report: Report | None = None) -> RolloutOutput:
    """`rollout.generate` in `sampling.cache_segments` segments (see the module
    docstring); arguments as there. Call outside any jit.

    Args:
      report: when given, filled with the stages run and their memory (`Report`);
        compiling each program's memory analysis costs a compile per shape.
    """
    rollout.check_inputs(prompt_ids, prompt_mask, sampling, config)
    num_rows, prompt_len = prompt_ids.shape[0] * sampling.n, prompt_ids.shape[1]
    groups = rollout._row_groups(num_rows)
    ends, slots = segment_ends(sampling), segment_slots(config, prompt_len, sampling)
    sizes = segment_sizes(num_rows, groups, sampling)
    static = dict(sampling=sampling, config=config, groups=groups, prompt_len=prompt_len)
    first = _program(_first_stage, sampling)
    args, kwargs = (params, prompt_ids, prompt_mask, rng), static | dict(num_slots=slots[0])
    _record(report, "prefill", first, args, kwargs)
    prompts, state, out, layer_params = first(*args, **kwargs)
    if report is not None:
        report.single_cache_bytes = cache_bytes(config, num_rows, slots[-1])
        _add_stage(report, config, (num_rows, slots[0]), None)
    loop_sizes = rollout.decode_sizes(num_rows, groups, sampling)
    stage = _program(_stage, sampling, donate_argnames=("state", "out"))
    segment, step, rows = 0, 1, num_rows
    while True:
        if step == ends[segment]:
            segment += 1
        stage_slots = slots[segment]
        if (rows, stage_slots) != (state.responses.shape[0], state.cache.max_len):
            previous = (state.responses.shape[0], state.cache.max_len)
            state = _move(state, rows, stage_slots, groups, sampling, report)
            if report is not None:
                _add_stage(report, config, (rows, stage_slots), previous)
        smaller = max([s for s in loop_sizes if s < rows], default=0)
        args, kwargs = (layer_params, state, out), static | dict(end=ends[segment], smaller=smaller)
        _record(report, f"decode {rows} rows to step {ends[segment]}", stage, args, kwargs)
        state, out, counts = stage(*args, **kwargs)
        step, running = (int(x) for x in jax.device_get(counts))  # the one host transfer
        if running == 0 or step == ends[-1]:
            break
        rows = min(s for s in sizes if s // groups >= running)
    return rollout.rollout_output(*prompts, *out)


def _first_stage(params, prompt_ids, prompt_mask, rng, *, num_slots, prompt_len, sampling,
                 config, groups):
    """Prefill and the first token, into a cache of `num_slots` slots: (prompts, state,
    out, the per-layer parameters every later stage decodes with: `rollout.per_layer`,
    joined once per rollout as in the single program)."""
    del prompt_len, groups
    row_ids, row_mask, state, layer_params = rollout.start(params, prompt_ids, prompt_mask,
                                                           rng, sampling, config, num_slots)
    return ((row_ids, row_mask), state, (state.responses, state.log_probs, state.lengths),
            layer_params)


def _stage(layer_params, state, out, *, end, smaller, prompt_len, sampling, config, groups):
    """Decoding with the per-layer parameters at the state's batch size until step `end`
    or until every batch shard's unfinished rows fit `smaller` rows; all rows written to
    `out`: (state, out, int32 [2] the step reached and the most unfinished rows of a
    batch shard)."""
    state = rollout.decode_until(layer_params, state, end, smaller, groups, prompt_len=prompt_len,
                                 sampling=sampling, config=config)
    counts = jnp.stack([state.step, _most_unfinished(state, groups)])
    return state, rollout._write_rows(out, state, groups), counts


def _most_unfinished(state, groups: int) -> jax.Array:
    """int32 []: the most unfinished rows in any batch shard."""
    return jnp.max(jnp.sum(~rollout._grouped(state.done, groups), axis=1))


def _move(state, rows: int, num_slots: int, groups: int, sampling: SamplingConfig,
          report: Report | None):
    """The state with `rows` rows (each batch shard's unfinished ones first, as
    `rollout._compact`) and a cache of `num_slots` slots; the old cache is deleted one
    layer buffer at a time as it is copied."""
    order = _program(_order, sampling)(state.done, rows=rows, groups=groups)
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
              if f.name not in ("step", "cache")}
    fields = _program(_take_fields, sampling)(fields, order, num_slots=num_slots,
                                              groups=groups)
    move = _program(_take_buffer, sampling)
    _record(report, "move", move, (state.cache.k[0], order),
            dict(num_slots=num_slots, groups=groups))

    def moved(buffers):
        new = []
        for buffer in buffers:
            new.append(move(buffer, order, num_slots=num_slots, groups=groups))
            buffer.delete()
        return tuple(new)

    cache = state.cache.replace(k=moved(state.cache.k), v=moved(state.cache.v))
    return state.replace(cache=cache, **fields)


def _order(done, *, rows, groups):
    """int32 `[groups, rows / groups]`: in each group the unfinished rows first."""
    order = jax.vmap(lambda d: jnp.argsort(d, stable=True))(rollout._grouped(done, groups))
    return order[:, :rows // groups]


def _take(x, order, groups, axes=None):
    grouped = rollout._grouped(x, groups, axes)
    return rollout._ungrouped(jax.vmap(lambda x, i: x[i])(grouped, order), axes)


def _take_fields(fields, order, *, num_slots, groups):
    """The rows `order` of the state's per-row fields; `key_mask` padded to `num_slots`."""
    fields = {name: _take(x, order, groups) for name, x in fields.items()}
    key_mask = fields["key_mask"]
    fields["key_mask"] = jnp.pad(key_mask, ((0, 0), (0, num_slots - key_mask.shape[1])))
    return fields


def _take_buffer(buffer_bksh, order, *, num_slots, groups):
    """The rows `order` of one layer's cache buffer, padded with empty slots to
    `num_slots`."""
    taken = _take(buffer_bksh, order, groups, CACHE_LOGICAL_AXES)
    pad = ((0, 0), (0, 0), (0, num_slots - taken.shape[2]), (0, 0))
    return constrain(jnp.pad(taken, pad), CACHE_LOGICAL_AXES)


_STATIC = ("sampling", "config", "groups", "end", "num_slots", "prompt_len", "rows",
           "smaller")


@functools.cache
def _program(fun, sampling: SamplingConfig, **jit_kwargs):
    """`fun` jitted with the sampler's compiler options, its keyword arguments static;
    one jitted function per `(fun, sampling)`, so the host loop's calls reuse it."""
    static = tuple(name for name in _STATIC if name in fun.__code__.co_varnames)
    return rollout.jit_sampler(fun, sampling, static_argnames=static, **jit_kwargs)


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
