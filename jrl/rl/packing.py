"""Token-budget micro-batches: sequences packed end to end, with no padding.

A pass over `n` sequences (left-padded prompts, right-padded responses) pays, in the
padded layout, for `n * (P + R)` tokens whatever the sequences' real lengths. Packed,
each sequence's real tokens (prompt, then response) are laid end to end into rows of
`L = P + R` slots (the longest possible sequence), each sequence a segment with its
own RoPE positions from 0, attention never crossing a segment
(`jrl.kernels.packed_attention`). A micro-batch is `G` such rows, as many per batch
shard (device) as the token budget holds (verl's `ppo_max_token_len_per_gpu`), so a
device runs at most the budget's tokens per micro-batch however its sequences'
lengths are spread, and the number of micro-batches follows the real token count (a
`lax.while_loop`).

The plan is made on the device from the masks (`plan`): sequences are placed by first
fit, longest first, into rows of `L` slots, at most `MAX_SEGMENTS` a row (that the
budget holds a row, `budget >= P + R`, is checked with the config). Outputs are
computed per slot and gathered back to the padded `[n, R]` grid of the response
tokens, so losses, advantages and metrics see the arrays the padded passes give: equal
up to floating-point summation order.

This is jrl's form of verl's `use_dynamic_bsz` with `use_remove_padding`.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from jrl.kernels import packed_attention
from jrl.models import cache as cache_lib
from jrl.models import context_attention
from jrl.sharding import constrain

Array = jax.Array
_ROWS = ("batch", None)


@flax.struct.dataclass
class Plan:
    """Where each sequence's tokens sit in the packed rows.

    Attributes:
      slots_bt: int32 `[n, P + R]`, the flat slot of each real token (row `k` of the
        packed rows holds slots `k L .. (k + 1) L - 1`); `num_slots` for padding.
      micro_b: int32 `[n]`, the micro-batch that holds each sequence.
      tokens_f: int32 `[num_slots + 1]`, the packed token ids (one slot more, so the
        slot after each holds the token it predicts).
      positions_f, segment_ids_f: int32 `[num_slots]`, RoPE positions (from 0 in each
        sequence) and segment ids (the sequence's index + 1; 0 for unused slots).
      num_micros: int32 scalar, the micro-batches holding any sequence.
      length: L, slots per row (static).
      rows: G, rows per micro-batch (static).
      max_segments: a bound on the sequences of one row (static).
    """

    slots_bt: Array
    micro_b: Array
    tokens_f: Array
    positions_f: Array
    segment_ids_f: Array
    num_micros: Array
    length: int = flax.struct.field(pytree_node=False)
    rows: int = flax.struct.field(pytree_node=False)
    max_segments: int = flax.struct.field(pytree_node=False)


# The most sequences one packed row holds. cuDNN's packed attention runs some of its
# passes over rows x MAX_SEGMENTS x L slots, so a loose bound costs time (a bound of
# 384 at P128 / R256 cost the update 3x its padded time on an H200); rows of P + R
# slots rarely hold more.
MAX_SEGMENTS = 8


def _first_fit(lengths_b: Array, length: int, num_bins: int,
               max_segments: int) -> tuple[Array, Array]:
    """(bin, offset) of each sequence: first fit, longest first, into bins of `length`
    slots holding at most `max_segments` sequences each."""
    order = jnp.argsort(-lengths_b, stable=True)

    def place(carry, i):
        fills, counts = carry
        size = lengths_b[i]
        # An empty bin always fits (every sequence fits one row).
        index = jnp.argmax((fills + size <= length) & (counts < max_segments))
        return (fills.at[index].add(size), counts.at[index].add(1)), (index, fills[index])

    zeros = jnp.zeros(num_bins, jnp.int32)
    _, (bins, offsets) = lax.scan(place, (zeros, zeros), order)
    unsort = lambda x: jnp.zeros_like(x).at[order].set(x)
    return unsort(bins), unsort(offsets)


def plan(tokens_bt: Array, mask_bt: Array, *, length: int, rows: int) -> Plan:
    """Packs `n` sequences (`tokens_bt [n, T]`, real where `mask_bt`) into micro-batches
    of `rows` rows of `length` slots; every sequence must fit one row."""
    n, _ = tokens_bt.shape
    mask = mask_bt.astype(bool)
    lengths_b = jnp.sum(mask, axis=1, dtype=jnp.int32)
    num_bins = -(-n // rows) * rows  # at most one row per sequence
    max_segments = min(n, MAX_SEGMENTS)
    bin_b, offset_b = _first_fit(lengths_b, length, num_bins, max_segments)
    positions_bt = cache_lib.positions_from_mask(mask)  # each sequence's, from 0
    num_slots = num_bins * length
    slots_bt = jnp.where(mask, (bin_b * length + offset_b)[:, None] + positions_bt, num_slots)
    scatter = lambda size, values: jnp.zeros(size, jnp.int32).at[slots_bt.reshape(-1)].set(
        values.reshape(-1).astype(jnp.int32), mode="drop")
    segment_bt = jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.int32)[:, None], mask.shape)
    used_bins = jnp.max(jnp.where(lengths_b > 0, bin_b, -1)) + 1
    return Plan(slots_bt=slots_bt, micro_b=bin_b // rows,
                tokens_f=scatter(num_slots + 1, tokens_bt),
                positions_f=scatter(num_slots, positions_bt),
                segment_ids_f=scatter(num_slots, segment_bt),
                num_micros=(used_bins + rows - 1) // rows,
                length=length, rows=rows, max_segments=max_segments)


class Micro(flax.struct.PyTreeNode):
    """Micro-batch `index` of a plan: what a packed forward pass runs on."""

    plan: Plan
    index: Array

    @property
    def first_slot(self) -> Array:
        return self.index * self.plan.rows * self.plan.length

    def inputs(self):
        """`(tokens, positions, segments, targets)`: the micro-batch's rows `[G, L]` (the
        segments as `packed_attention.Segments`), and each slot's next token."""
        p = self.plan
        size = p.rows * p.length
        take = lambda x, n=size: lax.dynamic_slice_in_dim(x, self.first_slot, n)
        rows = lambda x: constrain(x.reshape(p.rows, p.length), _ROWS)
        tokens = take(p.tokens_f, size + 1)
        segment_ids = rows(take(p.segment_ids_f))
        return (rows(tokens[:-1]), rows(take(p.positions_f)),
                packed_attention.segments(segment_ids, p.max_segments), rows(tokens[1:]))

    def responses(self, slot_values_gl: Array, response_mask_br: Array) -> Array:
        """Per-slot values `[G, L, ...]` of this micro-batch as the `[n, R, ...]` grid of
        response tokens: each token's value from the slot before it (the state that
        predicts it), zero for padding and for the sequences of other micro-batches."""
        p = self.plan
        flat = slot_values_gl.reshape(p.rows * p.length, *slot_values_gl.shape[2:])
        r = response_mask_br.shape[1]
        live_br = (response_mask_br > 0) & (p.micro_b == self.index)[:, None]
        # Tokens not in this micro-batch read past the end: zeros, and no gradient piles
        # onto one slot in the backward pass (a clipped index would send them all there).
        index_br = jnp.where(live_br, p.slots_bt[:, -r:] - 1 - self.first_slot, flat.shape[0])
        values = jnp.take(flat, index_br, axis=0, mode="fill", fill_value=0)
        return constrain(values, _ROWS)

    def member(self) -> Array:
        """bool `[n]`: the sequences this micro-batch holds."""
        return self.plan.micro_b == self.index


def batch_shards() -> int:
    """The batch shards (devices along the batch axes) of the active mesh; 1 without one."""
    from jrl import sharding

    sharder = sharding.active_sharder()
    return 1 if sharder is None else sharder.batch_size_multiple


def for_sequences(prompt_ids, prompt_mask, responses, attention_mask, budget: int) -> Plan:
    """The plan of a pass over sequences given as left-padded prompts and right-padded
    responses (`attention_mask`: the response tokens attended to), `budget` tokens per
    device per micro-batch.

    A packed row is as long as the longest possible sequence, `P + R` slots (rounded up
    to a multiple of the mesh's `context` size, which splits each row), so a sequence
    of full length fills one and shorter ones share rows; each batch shard runs
    `budget // L` rows per micro-batch (at least one, at most its share of the
    sequences), its `context` devices `budget / context` tokens each.
    """
    tokens = jnp.concatenate([prompt_ids, responses], axis=1)
    mask = jnp.concatenate([prompt_mask, attention_mask], axis=1)
    n, width = tokens.shape
    length = row_length(width, context_attention.context_size())
    shards = batch_shards()
    return plan(tokens, mask, length=length,
                rows=shards * rows_per_device(budget, length, n, shards))


def row_length(width: int, context: int = 1) -> int:
    """Slots of a packed row for sequences of at most `width` tokens (`P + R`): `width`
    rounded up to a multiple of the mesh's `context` size."""
    return -(-width // context) * context


def rows_per_device(budget: int, length: int, sequences: int, shards: int) -> int:
    """Packed rows of `length` slots a device runs per micro-batch of a pass over
    `sequences` on `shards` batch shards: as many as `budget` tokens hold, at least one,
    and never more than the device's share of the sequences (a large budget over a small
    pass would run mostly empty rows)."""
    return max(1, min(budget // length, -(-sequences // shards)))


def loop(plan_: Plan, body, init):
    """`body(Micro, carry) -> carry` over the plan's micro-batches (a `while_loop`:
    the count is the data's)."""
    def step(state):
        index, carry = state
        return index + 1, body(Micro(plan_, index), carry)

    _, out = lax.while_loop(lambda state: state[0] < plan_.num_micros, step,
                            (jnp.int32(0), init))
    return out


def map_responses(fn, plan_: Plan, response_mask_br: Array, out_shapes):
    """`fn(Micro) -> per-slot outputs [G, L, ...]` over every micro-batch, gathered to
    the `[n, R, ...]` grid of response tokens (`out_shapes`: a tree of
    `jax.ShapeDtypeStruct` of `fn`'s outputs)."""
    r = response_mask_br.shape[1]
    zeros = jax.tree.map(
        lambda s: jnp.zeros((response_mask_br.shape[0], r, *s.shape[2:]), s.dtype),
        out_shapes)

    def body(micro: Micro, acc):
        outs = fn(micro)
        return jax.tree.map(lambda a, y: a + micro.responses(y, response_mask_br), acc, outs)

    return loop(plan_, body, zeros)
