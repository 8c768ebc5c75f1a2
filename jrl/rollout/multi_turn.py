"""Multi-turn rollouts with tools: the cache and the token ids are kept across turns.

A row's response is a sequence of assistant turns, written by the model, and the
tool results between them, written by the host: `[turn 1][tool block][turn 2]...`.
Each tool block is the chat template's text between the model's end-of-turn token
and the next assistant opening (the tool messages and their markup), tokenised on
its own and appended to the row. Nothing is re-tokenised and nothing is
re-prefilled: the KV cache of the earlier turns stays on the device.

The device side is two programs over a `TurnState`, jitted by `generate` with the
sampler's compiler options (`rollout.jit_sampler`):

- `start` (prefill of the prompts, then one *segment* of decoding) and
- `resume` (append each row's block of new tokens, then one segment).

A segment decodes every active row until it emits a turn-ending token (an
end-of-turn or tool-call-closing id), runs out of response budget, or the cache has
no free slot. Then the host reads the segment, parses tool calls of the rows whose
turn ended, runs the tools (in parallel, each with a timeout), and builds each
row's next block: the token that ended its turn (sampled but not yet fed) followed
by the tool block's tokens, or only the pending token for a row cut by the slot
limit mid-turn, or nothing for a finished row.

Cache layout. The single-turn sampler's contract (`jrl.models.cache`) holds at the
start of every segment: each row's real tokens fill contiguous slots ending at the
shared write slot. During a segment a row that has ended its turn stops writing
(its slots stay masked), and a block is written right-padded at the write slot (its
real tokens right after the row's); so before and after each block the cache is
*compacted*: every row's real slots are moved, in order, to end at
`W = max(real tokens of a row)`. RoPE positions count a row's real tokens, so the
model sees exactly the tokens of the compact sequence that training uses, and the
decode-attention kernel keeps reading contiguous slots.

The response budget `R` (`rollout.response_length`) counts every response token,
the model's and the tools'; the cache has `P + R + T + 1` slots (T = the most tokens
of one tool block), enough for any row after compaction.

The paged cache (`rollout.kv_cache=paged`, `jrl.rollout.paged`) keeps the same
logical slots, so the same attention. A row's real tokens fill its physical slots
from 0 in order (a row stops writing when it stops decoding, and a block's real
tokens follow the row's), so compaction moves nothing: it sets each row's shift
(logical slot of its physical slot 0) to `W` less its tokens. Rows take pages as
their tokens need them and give them back when they end, so the pool's use follows
the live tokens (`rollout/page_usage`). On XLA:CPU its rollouts are the contiguous
cache's bit for bit. Every row is decoded at once (no decode slots to wait for). A
pool sized by `rollout.num_pages` (at least one row at full length) admits at the
start the rows that fit while a page stays free for each other row; a row that lacks
a page preempts the row admitted last (vLLM's recompute preemption), whose pages go
back and which waits. A waiting row's tokens so far (its prompt and response) are
prefilled again in blocks, as many as there are pages for, before it decodes on:
the same tokens and log-probs up to float rounding, and its tools do not run again
(`rollout/preemptions`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jrl import tools as tools_lib
from jrl.models.cache import (
    CACHE_LOGICAL_AXES,
    TRASH_PAGE,
    KVCache,
    positions_from_mask,
)
from jrl.models.config import ModelConfig
from jrl.models.heads import unembed
from jrl.models.transformer import forward
from jrl.rollout import paged
from jrl.rollout.sampler import (
    SamplingConfig,
    _from_logits,
    _prefill,
    cache_slots,
    decoding_mask,
    jit_sampler,
    next_tokens,
    per_layer,
    row_keys,
)
from jrl.sharding import constrain

Params = Mapping[str, Any]


@flax.struct.dataclass
class TurnState:
    """What stays on the device between segments (N rows, S cache slots, R budget).

    `seg_*` hold the tokens sampled in the current segment (the host reads them after
    each call); everything else carries over.
    """

    slot: jax.Array  # int32 []: the next write slot, shared by all rows
    last_tokens: jax.Array  # int32 [N]: sampled, not yet fed
    positions: jax.Array  # int32 [N]: RoPE position of the next fed token (real tokens so far)
    used: jax.Array  # int32 [N]: response tokens so far (the model's and the tools')
    active: jax.Array  # bool [N]: decoding in this segment
    turn_ended: jax.Array  # bool [N]: the segment ended with a turn-ending token
    seg_tokens: jax.Array  # int32 [N, R]
    seg_log_probs: jax.Array  # float32 [N, R]
    seg_len: jax.Array  # int32 [N]
    cache: KVCache  # or a `PagedCache` (`rollout.kv_cache` "paged", with `pages`)
    key_mask: jax.Array  # int32 [N, S]
    pages: Pages | None = None


@flax.struct.dataclass
class Pages:
    """The page pool's bookkeeping, with a `PagedCache` (`jrl.rollout.paged`)."""

    free: jax.Array  # int32 [pages]: a stack of free pages, its first num_free entries
    num_free: jax.Array  # int32 []
    peak: jax.Array  # int32 []: the most pages held at once (the trash page aside)
    # Rows whose cache lacks tokens they have: not admitted yet, preempted, or between the
    # blocks that prefill them again.
    waiting: jax.Array  # bool [N]
    admitted: jax.Array  # int32 [N]: admission order (the last admitted is preempted first)
    admissions: jax.Array  # int32 []
    preemptions: jax.Array  # int32 [N]: each row's times preempted
    # A pool sized by `rollout.num_pages` (else every row at full length: nothing waits).
    sized: bool = flax.struct.field(pytree_node=False, default=False)


def _emit(state: TurnState, sample, row_keys, sampling: SamplingConfig, budget: int,
          turn_stop_ids: tuple[int, ...]) -> TurnState:
    """Samples the next token of every active row and records it in the segment;
    `sample(keys [N]) -> (tokens, log_probs)` draws (`next_tokens`, or `sample_tokens`
    over given logits).

    A row's token `u` of the response draws with `fold_in(row_key, u)`, so a row's
    samples do not depend on the other rows or on where segments break."""
    keys = jax.vmap(jax.random.fold_in)(row_keys, state.used)
    tokens, log_probs = sample(keys)
    active = state.active
    tokens = jnp.where(active, tokens, sampling.pad_token_id)
    rows = jnp.arange(tokens.shape[0])
    column = jnp.minimum(state.seg_len, state.seg_tokens.shape[1] - 1)
    seg_tokens = state.seg_tokens.at[rows, column].set(
        jnp.where(active, tokens, state.seg_tokens[rows, column]))
    seg_log_probs = state.seg_log_probs.at[rows, column].set(
        jnp.where(active, log_probs, state.seg_log_probs[rows, column]))
    used = state.used + active
    stops = jnp.asarray(turn_stop_ids or (-1,), jnp.int32)
    ended = active & jnp.any(tokens[:, None] == stops[None, :], axis=1)
    out_of_budget = active & (used >= budget)
    return state.replace(
        last_tokens=jnp.where(active, tokens, state.last_tokens),
        used=used,
        seg_tokens=seg_tokens,
        seg_log_probs=seg_log_probs,
        seg_len=state.seg_len + active,
        active=active & ~ended & ~out_of_budget,
        turn_ended=state.turn_ended | ended,
    )


def _decode_segment(params, state: TurnState, row_keys, sampling, budget, turn_stop_ids,
                    config: ModelConfig, end_fraction: float) -> TurnState:
    """Decodes until no row is active, the cache is full, or `end_fraction` of the rows
    that started the segment have ended their turn (their tools can run meanwhile; the
    rows still decoding go on in the next segment)."""
    num_slots_ = state.key_mask.shape[1]
    started = jnp.sum(state.active | state.turn_ended)
    enough = jnp.ceil(end_fraction * started).astype(jnp.int32)

    def going(state):
        return (jnp.any(state.active) & (state.slot < num_slots_)
                & (jnp.sum(state.turn_ended) < jnp.maximum(enough, 1)))

    def step(state):
        state, count = _make_room(state, state.active.astype(jnp.int32))
        feed = count > 0
        key_mask = lax.dynamic_update_slice_in_dim(
            state.key_mask, feed[:, None].astype(state.key_mask.dtype), state.slot, axis=1)
        # A row not decoding (its turn ended, or it waits for the next segment) has its
        # outputs discarded.
        attended = decoding_mask(key_mask, state.slot, feed)
        state, write_index = _grow(state, feed.astype(jnp.int32))
        hidden, cache = forward(params, state.last_tokens[:, None], state.positions[:, None],
                                attended, state.cache, write_index, config=config)
        state = state.replace(cache=cache, key_mask=key_mask, slot=state.slot + 1,
                              positions=state.positions + feed)
        sample = lambda keys: next_tokens(params, hidden[:, 0], keys, sampling, config)
        return _emit(state, sample, row_keys, sampling, budget, turn_stop_ids)

    return lax.while_loop(going, step, state)


def _grow(state: TurnState, count: jax.Array) -> tuple[TurnState, jax.Array]:
    """Before writing `count [N]` tokens of each row at the write slot: with a paged cache,
    the pages they start (`_make_room` and `_admit` left enough), and the write slot for
    each row; else the state and the shared write slot."""
    if state.pages is None:
        return state, state.slot
    pages, cache = state.pages, state.cache
    # A row's real tokens fill its physical slots from 0 (module docstring): the write
    # slot's physical slot is its first new one.
    cache, num_free = paged.take_pages(cache, pages.free, pages.num_free,
                                       state.slot - cache.shift, count)
    held = pages.free.shape[0] - 1 - num_free
    pages = pages.replace(num_free=num_free, peak=jnp.maximum(pages.peak, held))
    write_index = jnp.full(count.shape, state.slot, jnp.int32)
    return state.replace(cache=cache, pages=pages), write_index


def _holds(state: TurnState) -> jax.Array:
    """bool `[N]`: the rows holding pages (a row's first page is its first to go)."""
    return state.cache.block_table[:, 0] != TRASH_PAGE


def _lacking(state: TurnState, count: jax.Array) -> jax.Array:
    """int32 `[N]`: the pages each row lacks to write `count` tokens at the write slot."""
    page, first = state.cache.page_size, state.slot - state.cache.shift
    return jnp.where(count > 0, -(-(first + count) // page) + first // -page, 0)


def _make_room(state: TurnState, count: jax.Array) -> tuple[TurnState, jax.Array]:
    """Before the rows holding pages write `count [N]` tokens each: in a pool sized by
    `rollout.num_pages`, while they lack more pages than are free, the row admitted last
    is preempted (vLLM's recompute preemption: its pages go back, and its tokens so far
    are prefilled again when it is admitted again, so its tools do not run twice); its
    count becomes 0. One row at full length fits the pool, so the first admitted always
    goes on."""
    if state.pages is None or not state.pages.sized:
        return state, count

    def short(carry):
        state, count = carry
        return ((jnp.sum(_lacking(state, count)) > state.pages.num_free)
                & (jnp.sum(_holds(state)) > 1))

    def preempt(carry):
        state, count = carry
        last = jnp.argmax(jnp.where(_holds(state), state.pages.admitted, -1))
        victim = jnp.arange(count.shape[0]) == last
        pages = state.pages
        cache, free, num_free = paged.give_back(state.cache, pages.free, pages.num_free,
                                                victim)
        state = state.replace(
            cache=cache, key_mask=jnp.where(victim[:, None], 0, state.key_mask),
            positions=jnp.where(victim, 0, state.positions), active=state.active & ~victim,
            pages=pages.replace(free=free, num_free=num_free, waiting=pages.waiting | victim,
                                preemptions=pages.preemptions + victim))
        return state, jnp.where(victim, 0, count)

    return lax.while_loop(short, preempt, (state, count))


def _admit(state: TurnState, lengths: jax.Array, lacking: jax.Array
           ) -> tuple[TurnState, jax.Array]:
    """The blocks of `lengths [N]` tokens a paged cache takes in this call: those of the
    rows holding pages (after `_make_room`), and of the rows holding none (waiting), in
    row order, while the pool has pages for all the tokens they lack (`lacking [N]`, of
    which the block is the first; checked, not reserved: a row prefilled in several
    blocks is then seldom preempted before its last) and keeps a page free for each
    other row holding pages. The others' blocks are dropped (their rows wait, and the
    host sends them again). Returns the state and each row's tokens written."""
    if state.pages is None or not state.pages.sized:
        return state, lengths
    holds = _holds(state)
    state, kept = _make_room(state, jnp.where(holds, lengths, 0))
    left = state.pages.num_free - jnp.sum(_lacking(state, kept))  # after the holders' blocks
    waiting = ~holds & (lengths > 0)
    need = jnp.where(waiting, -(-lacking // state.cache.page_size), 0)
    rank = jnp.cumsum(waiting) - 1
    ok = waiting & (jnp.cumsum(need) + jnp.sum(_holds(state)) + rank <= left)
    pages = state.pages
    pages = pages.replace(admitted=jnp.where(ok, pages.admissions + rank, pages.admitted),
                          admissions=pages.admissions + jnp.sum(ok))
    return state.replace(pages=pages), jnp.where(holds, kept, jnp.where(ok, lengths, 0))


def _release(state: TurnState, leaving: jax.Array) -> TurnState:
    """With a paged cache, the pages of the rows `leaving` (`[N]`, finished) given back.
    Their key masks stay, as a contiguous cache's finished rows keep their slots: the
    write slot after each compaction is the same either way (the rows are never read
    again: they attend to the new slot alone, and their outputs are dropped)."""
    if state.pages is None:
        return state
    pages = state.pages
    cache, free, num_free = paged.give_back(state.cache, pages.free, pages.num_free, leaving)
    return state.replace(cache=cache, pages=pages.replace(free=free, num_free=num_free))


def _compact(state: TurnState) -> TurnState:
    """Moves each row's real slots, in order, to end at `W` = the longest row; the write
    slot becomes W. A paged cache moves nothing: its rows' real tokens already fill their
    physical slots from 0, so each row's shift becomes `W` less its tokens."""
    key_mask = state.key_mask.astype(bool)
    num_slots_ = key_mask.shape[1]
    lengths = key_mask.sum(axis=1)
    width = jnp.max(lengths)
    dest = jnp.arange(num_slots_)[None, :]
    new_mask = ((dest >= width - lengths[:, None]) & (dest < width)).astype(state.key_mask.dtype)
    if state.pages is not None:
        cache = state.cache.replace(shift=(width - lengths).astype(jnp.int32))
        return state.replace(cache=cache, key_mask=new_mask, slot=width.astype(jnp.int32))
    # Stable: masked slots first, then the real ones in their order.
    order = jnp.argsort(key_mask, axis=1, stable=True)
    source = jnp.take_along_axis(order, jnp.clip(dest + (num_slots_ - width), 0,
                                                 num_slots_ - 1), axis=1)
    gather = lambda x: constrain(
        jnp.take_along_axis(x, source[:, None, :, None], axis=2), CACHE_LOGICAL_AXES)
    cache = KVCache(k=tuple(map(gather, state.cache.k)), v=tuple(map(gather, state.cache.v)))
    return state.replace(cache=cache, key_mask=new_mask, slot=width.astype(jnp.int32))


def _new_segment(state: TurnState) -> TurnState:
    return state.replace(seg_tokens=jnp.zeros_like(state.seg_tokens),
                         seg_log_probs=jnp.zeros_like(state.seg_log_probs),
                         seg_len=jnp.zeros_like(state.seg_len),
                         turn_ended=jnp.zeros_like(state.turn_ended))


# `start` and `resume` are jitted by `rollout.jit_sampler` (with the sampler's compiler
# options), with these static arguments.
_START_STATIC = ("sampling", "block_len", "turn_stop_ids", "config", "end_fraction")
_RESUME_STATIC = ("sampling", "turn_stop_ids", "config", "end_fraction")


def start(params, prompt_ids, prompt_mask, rng, *, sampling: SamplingConfig, block_len: int,
          turn_stop_ids: tuple[int, ...], config: ModelConfig,
          end_fraction: float = 1.0) -> TurnState:
    """Prefill of the `[B, P]` left-padded prompts (each repeated `sampling.n` times),
    then the first segment. `sampling.max_new_tokens` is the response budget R;
    `block_len` the width of `resume`'s blocks (pending token + the most tool tokens)."""
    budget = sampling.max_new_tokens
    repeat = lambda x, axes=("batch", None): constrain(jnp.repeat(x, sampling.n, axis=0), axes)
    prompt_ids, prompt_mask = prompt_ids.astype(jnp.int32), prompt_mask.astype(jnp.int32)
    params = per_layer(params, config)
    if sampling.kv_cache == "paged":
        logits, cache, key_mask, pages = _prefill_pages(params, prompt_ids, prompt_mask,
                                                        sampling, block_len, config)
        admitted = ~pages.waiting
    else:
        logits_bv, cache, key_mask = _prefill(params, prompt_ids, prompt_mask,
                                              budget + block_len, config)
        logits, key_mask, pages = repeat(logits_bv), repeat(key_mask), None
        cache = jax.tree.map(lambda x: repeat(x, CACHE_LOGICAL_AXES), cache)
        admitted = jnp.ones((logits.shape[0],), bool)
    num_rows, prompt_len = logits.shape[0], prompt_ids.shape[1]
    state = TurnState(
        slot=jnp.asarray(prompt_len, jnp.int32),
        last_tokens=jnp.zeros((num_rows,), jnp.int32),
        positions=jnp.where(admitted, repeat(prompt_mask).sum(axis=1), 0).astype(jnp.int32),
        used=jnp.zeros((num_rows,), jnp.int32),
        active=admitted,
        turn_ended=jnp.zeros((num_rows,), bool),
        seg_tokens=jnp.zeros((num_rows, budget), jnp.int32),
        seg_log_probs=jnp.zeros((num_rows, budget), jnp.float32),
        seg_len=jnp.zeros((num_rows,), jnp.int32),
        cache=cache,
        key_mask=key_mask,
        pages=pages,
    )
    keys = row_keys(rng, num_rows)
    state = _emit(state, _from_logits(logits, sampling), keys, sampling, budget, turn_stop_ids)
    return _decode_segment(params, state, keys, sampling, budget, turn_stop_ids, config,
                           end_fraction)


def _prefill_pages(params, prompt_ids, prompt_mask, sampling: SamplingConfig, block_len: int,
                   config: ModelConfig):
    """`start`'s prefill into a paged cache of `rollout.num_pages` pages (0: every row at
    full length, its prompt and the budget R): the rows' logits `[N, V]`, the cache (the
    contiguous cache's `S` slots and key mask `[N, S]`) and its `Pages`. As there, the B
    prompts are prefilled once each, into the pages of each prompt's first row (through
    the same `S` slots, so the same bits), and those pages copied to its other rows'. A
    sized pool admits rows in order while it keeps a page free for each other row
    admitted; the others wait (no pages, no key mask) to be prefilled by `resume`."""
    n, page = sampling.n, sampling.page_size
    budget = sampling.max_new_tokens
    repeat = lambda x, axes=("batch", None): constrain(jnp.repeat(x, n, axis=0), axes)
    (num_prompts, prompt_len), num_rows = prompt_ids.shape, prompt_ids.shape[0] * n
    slots = cache_slots(config, prompt_len + budget + block_len)
    num_pages = sampling.num_pages or num_rows * -(-(prompt_len + budget) // page) + 1
    lengths = repeat(prompt_mask).sum(axis=1)
    rank = jnp.arange(num_rows)
    admitted = jnp.cumsum(-(-lengths // page)) + (rank if sampling.num_pages else 0) \
        <= num_pages - 1
    cache, free, num_free = paged.empty_pool(config, num_pages, page, num_rows, slots)
    cache = cache.replace(shift=prompt_len - lengths)  # the left padding
    cache, num_free = paged.take_pages(cache, free, num_free, jnp.zeros_like(lengths),
                                       jnp.where(admitted, lengths, 0))
    # Admission goes in row order, so a prompt's first row is admitted if any of its rows
    # is (a prompt with none writes into the trash page).
    first = cache.replace(block_table=cache.block_table[::n], shift=cache.shift[::n])
    key_mask_b = jnp.pad(prompt_mask, ((0, 0), (0, slots - prompt_len)))
    hidden, first = forward(params, prompt_ids, positions_from_mask(prompt_mask), key_mask_b,
                            first, jnp.zeros((num_prompts,), jnp.int32), config=config)
    logits_bv = unembed(params, hidden[:, -1], softcap=config.final_logit_softcapping)
    # The other rows' pages take copies of their prompt's first row's (whole pages: the
    # slots past the prompt are written before they are read).
    table = cache.block_table
    copy = (rank % n != 0)[:, None] & (table != TRASH_PAGE)
    source = jnp.repeat(table[::n], n, axis=0).reshape(-1)
    # Out of range: dropped. The pages in range are distinct (`PagedCache.write` says why
    # that is declared).
    dest = jnp.where(copy, table, num_pages).reshape(-1)
    put = lambda pool: pool.at[:, dest].set(pool[:, source], mode="drop", unique_indices=True)
    cache = cache.replace(k=tuple(map(put, first.k)), v=tuple(map(put, first.v)))
    pages = Pages(free=free, num_free=num_free, peak=num_pages - 1 - num_free,
                  waiting=~admitted, admitted=rank, admissions=jnp.sum(admitted),
                  preemptions=jnp.zeros((num_rows,), jnp.int32),
                  sized=bool(sampling.num_pages))
    key_mask = jnp.where(admitted[:, None], repeat(key_mask_b), 0)
    return constrain(repeat(logits_bv), ("batch", None)), cache, key_mask, pages


def resume(params, state: TurnState, block_ids, block_mask, added, lacking, finished, rng,
           *, sampling: SamplingConfig, turn_stop_ids: tuple[int, ...], config: ModelConfig,
           end_fraction: float = 1.0) -> TurnState:
    """Appends each row's block (`[N, T]` int32, RIGHT-padded: `block_mask` 1 on its real
    tokens; T = `start`'s `block_len`) and decodes the next segment for the rows whose
    block holds all the tokens their cache lacks (`lacking [N]`, int32, of which the
    block is the first): the row's pending token (sampled, already counted) and, after
    a turn with tool calls, the tool block. `added [N]` is how many of a row's last
    block's tokens are new to the response (the tool block's), which count against the
    budget. A row a paged cache preempted sends its prompt and tokens so far again, in
    blocks. `finished [N]`: the rows that have ended since the last call, whose pages a
    paged cache gets back."""
    budget = sampling.max_new_tokens
    params = per_layer(params, config)
    state = _compact(_new_segment(_release(state, finished)))
    num_rows, block_len = block_ids.shape
    sent = block_mask.astype(jnp.int32).sum(axis=1)
    last = sent == lacking
    state, lengths = _admit(state, sent, lacking)
    block_mask = jnp.where(lengths[:, None] > 0, block_mask, 0).astype(jnp.int32)
    # Right-padded, a row's block follows its tokens with no gap, so its real tokens fill
    # slots in a row (as a paged cache keeps them) and its padding comes after them.
    key_mask = lax.dynamic_update_slice_in_dim(state.key_mask, block_mask, state.slot, axis=1)
    positions = state.positions[:, None] + jnp.maximum(jnp.cumsum(block_mask, axis=1) - 1, 0)
    state, write_index = _grow(state, lengths)
    hidden, cache = forward(params, block_ids.astype(jnp.int32), positions, key_mask,
                            state.cache, write_index, config=config)
    hidden = jnp.take_along_axis(hidden, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)
    logits = constrain(unembed(params, hidden[:, 0], softcap=config.final_logit_softcapping),
                       ("batch", None))
    going = (lengths > 0) & last
    state = state.replace(cache=cache, key_mask=key_mask, slot=state.slot + block_len,
                          positions=state.positions + lengths, active=going,
                          used=state.used + jnp.where(going, added, 0).astype(jnp.int32))
    if state.pages is not None:
        state = state.replace(pages=state.pages.replace(waiting=state.pages.waiting & ~going))
    state = _compact(state)
    keys = row_keys(rng, num_rows)
    state = _emit(state, _from_logits(logits, sampling), keys, sampling, budget, turn_stop_ids)
    return _decode_segment(params, state, keys, sampling, budget, turn_stop_ids, config,
                           end_fraction)


# ----------------------------------------------------------------------------- the host loop

TRUNCATE_SIDES = ("left", "right", "middle")
# Stand-in assistant content, to find what a chat template writes after it.
_MARK = "MARK7"


@dataclasses.dataclass(frozen=True)
class MultiTurnConfig:
    """`rollout.multi_turn.*` (verl's names where verl has them).

    Attributes:
      max_assistant_turns: a row ends after this many model turns.
      max_user_turns: ... or after this many tool responses.
      max_tool_response_tokens: the most tokens of one tool block (the tool messages
        with their template markup); a longer block ends the row. Fixes the cache size.
      max_tool_response_length: a tool's text is cut to this many characters ...
      tool_response_truncate_side: ... keeping its "left", "right" or "middle" (the
        start and the end).
      format: how the model writes tool calls: "hermes" (Qwen) or "llama3".
      tool_timeout_s: a call that takes longer is answered with a timeout error.
      max_parallel_calls: tool calls run at once (threads).
      turn_stop_ids: tokens that end a turn besides the end-of-turn (EOS) ids, e.g. a
        tool-call closing token.
      segment_end_fraction: a decoding segment returns to the host once this share of
        its rows have ended their turn (1.0: when all have), so their tools run while
        fewer rows sit idle; the others resume where they stopped.
    """

    max_assistant_turns: int = 4
    max_user_turns: int = 4
    max_tool_response_tokens: int = 64
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    format: str = "hermes"
    tool_timeout_s: float = 5.0
    max_parallel_calls: int = 16
    turn_stop_ids: tuple[int, ...] = ()
    segment_end_fraction: float = 0.5


@dataclasses.dataclass
class MultiTurnOutput:
    """A multi-turn rollout on the host (N = B·n rows, R = the budget).

    `responses` hold every response token, the model's and the tools', compactly;
    `attention_mask` is 1 on all of them, `response_mask` (verl's loss mask) only on
    the model's. `rollout_log_probs` are the sampler's, 0 on tool tokens."""

    prompt_ids: np.ndarray  # int32 [N, P]
    prompt_mask: np.ndarray  # int32 [N, P]
    responses: np.ndarray  # int32 [N, R]
    response_mask: np.ndarray  # int32 [N, R]
    attention_mask: np.ndarray  # int32 [N, R]
    rollout_log_probs: np.ndarray  # float32 [N, R]
    tool_rewards: np.ndarray  # float32 [N]: the sum of `reward_scores[row]`
    # Per row, {tool name: its step rewards summed plus its `calc_reward`}, every loaded
    # tool; the reward function gets it as verl's `extra_info["rollout_reward_scores"]`.
    reward_scores: list[dict[str, float]]
    tool_calls: np.ndarray  # int32 [N]: calls each row made (parsed, run or not)
    metrics: dict[str, float]
    # With `rollout.kv_cache` "paged": the most pages the rows held at once, as a fraction
    # of the pool (`rollout/page_usage`), and each row's preemptions (`rollout/preemptions`).
    page_usage: float | None = None
    preemptions: np.ndarray | None = None  # int32 [N]


class TurnTemplate:
    """The text a chat template puts between an assistant turn and the next one.

    After the model's turn (ended by its end-of-turn token), a row gets: the rest of
    the template's turn closing (e.g. the newline after Qwen's `<|im_end|>`), the tool
    messages in the template's tool role, and the next assistant opening. Rendering it
    against a fixed stand-in conversation makes it independent of what the model wrote.
    """

    def __init__(self, tokenizer, **template_kwargs):
        self.tokenizer, self.kwargs = tokenizer, template_kwargs
        self._base = [{"role": "user", "content": "U"}, {"role": "assistant", "content": _MARK}]
        self._closed = tokenizer.apply_chat_template(self._base, add_generation_prompt=False,
                                                     **template_kwargs)
        end = self._closed.rfind(_MARK)
        if end < 0:
            raise ValueError("the chat template does not render an assistant message's "
                             "content; multi-turn rollouts need one that does")
        self.close = self._closed[end + len(_MARK):]

    def block_text(self, messages: Sequence[Mapping[str, Any]], stop_text: str) -> str:
        """What follows a turn that ended with `stop_text` (the decoded turn-ending
        token), when `messages` (tool role) answer it."""
        full = self.tokenizer.apply_chat_template([*self._base, *messages],
                                                  add_generation_prompt=True, **self.kwargs)
        if not full.startswith(self._closed):
            raise ValueError("the chat template renders earlier turns differently once tool "
                             "messages follow; appending turns would change the tokens")
        rest = self.close[len(stop_text):] if stop_text and self.close.startswith(
            stop_text) else self.close
        return rest + full[len(self._closed):]


def demonstration_tokens(tokenizer, messages: Sequence[Mapping[str, Any]],
                         template: TurnTemplate | None = None) -> tuple[list[int], list[int]]:
    """A multi-turn response as the rollout lays it out: `(ids, trained)`.

    `messages` alternate assistant turns and (one or more) tool messages, starting and
    ending with an assistant turn. Each assistant turn is its content and the first
    token of the template's turn closing (the end-of-turn token the model samples),
    trained; the tool messages between turns are `TurnTemplate.block_text`, context only.
    """
    template = template or TurnTemplate(tokenizer)
    end_id = tokenizer.encode(template.close)[:1]
    if not end_id:
        raise ValueError("the chat template closes an assistant turn with nothing; a "
                         "multi-turn demonstration needs an end-of-turn token")
    stop_text = tokenizer.decode(end_id, skip_special_tokens=False)
    ids, trained, tool_messages = [], [], []
    roles = [m.get("role") for m in messages]
    if not roles or roles[0] != "assistant" or roles[-1] != "assistant" or set(roles) - {
            "assistant", "tool"}:
        raise ValueError(f"a multi-turn demonstration is assistant and tool messages, "
                         f"starting and ending with an assistant turn; got roles {roles}")
    for message in messages:
        if message["role"] == "tool":
            tool_messages.append(message)
            continue
        if tool_messages:
            block = tokenizer.encode(template.block_text(tool_messages, stop_text))
            ids, trained, tool_messages = ids + block, trained + [0] * len(block), []
        turn = tokenizer.encode(message["content"]) + end_id
        ids, trained = ids + turn, trained + [1] * len(turn)
    return ids, trained


def truncate(text: str, limit: int, side: str) -> str:
    """`text` cut to `limit` characters keeping its `side` ("middle": both ends)."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "..."
    if side == "right":
        return "..." + text[-limit:]
    half = limit // 2
    return text[:half] + "..." + text[len(text) - (limit - half):]


def generate(params, prompt_ids, prompt_mask, rng, *, sampling: SamplingConfig,
             config: ModelConfig, tokenizer, tools: Mapping[str, Any], mt: MultiTurnConfig,
             tools_kwargs: Sequence[Mapping[str, Any]] | None = None, put=None,
             template: TurnTemplate | None = None) -> MultiTurnOutput:
    """Samples `sampling.n` multi-turn responses to each prompt, running tools between
    the turns (see the module docstring).

    Args:
      params: the sampler's parameters (compute dtype; `step.sampling_params`).
      prompt_ids, prompt_mask: `[B, P]` left-padded prompts (numpy or device arrays).
      rng: PRNG key; row r's response token u draws with `fold_in(fold_in(rng, r), u)`.
      sampling: `max_new_tokens` is the budget R of a whole response; its stop ids end
        turns (with `mt.turn_stop_ids`).
      config: the sampler's architecture.
      tokenizer: decodes turns, renders and encodes tool blocks (`jrl.data.tokenizers`).
      tools: name -> `jrl.tools.Tool`.
      mt: the multi-turn settings.
      tools_kwargs: per prompt, verl's `extra_info.tools_kwargs`:
        `{tool name: {"create_kwargs": {...}}}`.
      put: places host arrays `[N, ...]` on the devices (default: `jnp.asarray`).
      template: a prebuilt `TurnTemplate` of `tokenizer`.

    Returns:
      `MultiTurnOutput`.
    """
    check_paged(sampling, np.shape(prompt_ids)[1])
    put = put or (lambda xs: jax.tree.map(jnp.asarray, xs))
    template = template or TurnTemplate(tokenizer)
    prompt_ids, prompt_mask = np.asarray(prompt_ids), np.asarray(prompt_mask)
    n = sampling.n
    block_len = mt.max_tool_response_tokens + 1
    stop_ids = () if sampling.ignore_stop else tuple(
        dict.fromkeys((*sampling.stop_token_ids, *mt.turn_stop_ids)))
    program = dict(sampling=sampling, turn_stop_ids=stop_ids, config=config,
                   end_fraction=mt.segment_end_fraction)
    ids_d, mask_d = put((prompt_ids, prompt_mask))
    start_program = jit_sampler(start, sampling, static_argnames=_START_STATIC)
    resume_program = jit_sampler(resume, sampling, static_argnames=_RESUME_STATIC,
                                 donate_argnames=("state",))
    state = start_program(params, ids_d, mask_d, rng, block_len=block_len, **program)

    prompts = [p[m > 0].tolist() for p, m in zip(prompt_ids, prompt_mask, strict=True)]
    rows = _Conversations([prompts[row // n] for row in range(len(prompts) * n)], tools,
                          tokenizer, template, mt)
    for row, row_id in enumerate(rows.row_ids):
        tools_lib.create_instances(tools, row_id, tools_kwargs[row // n] if tools_kwargs else None)
    released = np.zeros(rows.num_rows, bool)  # the rows whose pages `resume` gave back
    while True:
        going, pending_calls = rows.read_segment(state, sampling.max_new_tokens)
        going += rows.answer_calls(pending_calls, sampling.max_new_tokens, block_len)
        if not going:
            break
        ended, released = rows.finished & ~released, rows.finished.copy()
        state = resume_program(params, state, *put((*rows.blocks(going, block_len, sampling),
                                                    ended)), rng, **program)
    page_usage = preemptions = None
    if state.pages is not None:  # the most pages held at once, of the pool's (trash aside)
        page_usage = float(state.pages.peak) / (state.pages.free.shape[0] - 1)
        preemptions = np.asarray(state.pages.preemptions)
    tool_rewards = rows.release(tools)
    out = _assemble(rows.tokens, rows.trained, rows.log_probs, sampling.max_new_tokens,
                    sampling.pad_token_id)
    return MultiTurnOutput(np.repeat(prompt_ids, n, axis=0).astype(np.int32),
                           np.repeat(prompt_mask, n, axis=0).astype(np.int32), *out,
                           tool_rewards=tool_rewards, reward_scores=rows.reward_scores,
                           tool_calls=rows.calls_per_row, metrics=rows.metrics(),
                           page_usage=page_usage, preemptions=preemptions)


def check_paged(sampling: SamplingConfig, prompt_len: int | None = None) -> None:
    """Multi-turn rollouts on the paged cache decode every row at once (a row waiting for
    its tools keeps its pages), over a pool that holds one row at full length at least
    (`paged.check_pages`, given `prompt_len`)."""
    if sampling.kv_cache != "paged":
        return
    if sampling.max_num_seqs:
        raise ValueError(
            f"rollout.max_num_seqs={sampling.max_num_seqs} is not supported with "
            "rollout.multi_turn.enable=True: the paged cache decodes every multi-turn row "
            "at once (rows wait for pages, not for decode slots: size the pool with "
            "rollout.num_pages); set rollout.max_num_seqs=0")
    if prompt_len is not None:
        paged.check_pages(sampling, prompt_len)


class _Conversations:
    """The host's record of N multi-turn rows between segments: each row's response
    tokens so far (`tokens`, with `trained` 1 for the model's and 0 for the tools', and
    their `log_probs`), the model turn in progress, turn and call counts, tool rewards."""

    def __init__(self, prompts: Sequence[list[int]], tools: Mapping[str, Any], tokenizer,
                 template: TurnTemplate, mt: MultiTurnConfig):
        self.prompts = prompts  # each row's prompt tokens (its real ones)
        num_rows = len(prompts)
        self.num_rows, self.tools, self.tokenizer, self.template, self.mt = (
            num_rows, tools, tokenizer, template, mt)
        self.row_ids = [f"row{row}" for row in range(num_rows)]
        self.tokens = [[] for _ in range(num_rows)]
        self.trained = [[] for _ in range(num_rows)]
        self.log_probs = [[] for _ in range(num_rows)]
        self.turn = [[] for _ in range(num_rows)]  # the current model turn's tokens
        self.finished = np.zeros(num_rows, bool)
        self.assistant_turns = np.zeros(num_rows, np.int32)
        self.user_turns = np.zeros(num_rows, np.int32)
        self.calls_per_row = np.zeros(num_rows, np.int32)
        self.reward_scores = [dict.fromkeys(tools, 0.0) for _ in range(num_rows)]
        self.results, self.parse_errors, self.cut_blocks = [], 0, 0
        self.cache_cuts, self.segments = 0, 0
        self._last = self._used = self._cached = None

    def read_segment(self, state: TurnState, budget: int):
        """Appends the segment's tokens to each unfinished row; returns the rows that go on
        mid-turn (cut by the cache's end, or waiting for a paged cache's pages) and the
        `(row, calls, parse errors)` of the rows whose turn ended with tool calls.
        Rows out of budget, without calls or out of turns finish."""
        self.segments += 1
        waiting = None if state.pages is None else state.pages.waiting
        (seg_tokens, seg_lp, seg_len, ended, active, waiting, self._used, self._last,
         key_mask) = jax.device_get(
            (state.seg_tokens, state.seg_log_probs, state.seg_len, state.turn_ended,
             state.active, waiting, state.used, state.last_tokens, state.key_mask))
        # (On the host: an op on the device would compile a program for each shape.)
        self._cached = np.asarray(key_mask).sum(axis=1)
        if waiting is None:
            waiting = np.zeros(self.num_rows, bool)
        going, pending_calls = [], []
        for row in np.flatnonzero(~self.finished):
            new = seg_tokens[row, :seg_len[row]].tolist()
            self.tokens[row] += new
            self.trained[row] += [1] * len(new)
            self.log_probs[row] += seg_lp[row, :seg_len[row]].tolist()
            self.turn[row] += new
            if active[row]:  # cut by the cache's end mid-turn: feed the pending token
                going.append(row)
                self.cache_cuts += 1
                continue
            if not ended[row]:
                if waiting[row] and self._used[row] < budget:  # preempted, or prefilling
                    going.append(row)
                    continue
                self.finished[row] = True  # out of budget, mid-turn
                self.assistant_turns[row] += bool(self.turn[row])
                continue
            self.assistant_turns[row] += 1
            text = self.tokenizer.decode(self.turn[row], skip_special_tokens=False)
            calls, errors = tools_lib.parse_tool_calls(text, self.mt.format)
            self.turn[row] = []
            out_of_turns = (self.assistant_turns[row] >= self.mt.max_assistant_turns
                            or self.user_turns[row] >= self.mt.max_user_turns)
            if (not calls and not errors) or out_of_turns:
                self.finished[row] = True
                continue
            pending_calls.append((row, calls, errors))
        return going, pending_calls

    def answer_calls(self, pending_calls, budget: int, block_len: int) -> list[int]:
        """Runs the pending calls (in parallel, with timeouts), appends each calling row's
        rendered tool messages to its tokens and returns the rows that go on. A row whose
        tool block with its pending token would not fit `block_len`, or whose budget
        it would pass, finishes instead."""
        by_row = self._run_calls(pending_calls)
        going = []
        for row, calls, errors in pending_calls:
            # A call that does not parse counts as a call (answered with its error).
            self.calls_per_row[row] += len(calls) + len(errors)
            self.parse_errors += len(errors)
            messages = [{"role": "tool", "content": f"Error: {e}"} for e in errors]
            messages += tools_lib.tool_messages(by_row.get(row, []))
            messages = [{**m, "content": truncate(m["content"], self.mt.max_tool_response_length,
                                                  self.mt.tool_response_truncate_side)}
                        for m in messages]
            stop_text = self.tokenizer.decode([int(self._last[row])], skip_special_tokens=False)
            ids = self.tokenizer.encode(self.template.block_text(messages, stop_text))
            if len(ids) + 1 > block_len or self._used[row] + len(ids) >= budget:
                self.finished[row] = True
                self.cut_blocks += 1
                continue
            self.user_turns[row] += 1
            self.tokens[row] += ids
            self.trained[row] += [0] * len(ids)
            self.log_probs[row] += [0.0] * len(ids)
            going.append(row)
        return going

    def blocks(self, going: Sequence[int], block_len: int, sampling: SamplingConfig):
        """The next `resume`'s operands for the rows `going`: each row's tokens its cache
        lacks (its pending token and a tool block; or, preempted by a paged cache, its
        prompt and response so far), the first `block_len` of them: `[N, block_len]`
        right-padded ids and mask, `[N]` tool tokens new to the budget (in a row's last
        block) and `[N]` the tokens each row's cache lacks, the block's and those after."""
        block_ids = np.full((self.num_rows, block_len), sampling.pad_token_id, np.int32)
        block_mask = np.zeros((self.num_rows, block_len), np.int32)
        added = np.zeros(self.num_rows, np.int32)
        lacking = np.zeros(self.num_rows, np.int32)
        for row in going:
            tokens = (self.prompts[row] + self.tokens[row])[self._cached[row]:]
            block_ids[row, :min(len(tokens), block_len)] = tokens[:block_len]
            block_mask[row, :min(len(tokens), block_len)] = 1
            lacking[row] = len(tokens)
            if len(tokens) <= block_len:  # the row's last block
                # The budget counts the model's tokens as they are drawn, the tools' here.
                added[row] = len(self.tokens[row]) - self._used[row]
        return block_ids, block_mask, added, lacking

    def _run_calls(self, pending_calls) -> dict[int, list]:
        """Every pending call executed; row -> its results, in call order. A call's tool
        reward goes to its row (a call to an unknown tool is an error, rewarded 0)."""
        flat = [(row, call) for row, calls, _ in pending_calls for call in calls]
        results = tools_lib.execute_calls(
            [call for _, call in flat], self.tools,
            [self.row_ids[row] for row, _ in flat],
            timeout_s=self.mt.tool_timeout_s, max_workers=self.mt.max_parallel_calls
        ) if flat else []
        by_row: dict[int, list] = {}
        for (row, _), result in zip(flat, results, strict=True):
            by_row.setdefault(row, []).append(result)
            self.results.append(result)
            if result.name in self.tools:
                self.reward_scores[row][result.name] += result.reward
        return by_row

    def release(self, tools: Mapping[str, Any]) -> np.ndarray:
        """Releases every row's tool instances, adding their final rewards; returns each
        row's total tool reward `[N]`."""
        for row, row_id in enumerate(self.row_ids):
            for name, reward in tools_lib.release_instances(tools, row_id).items():
                self.reward_scores[row][name] += reward
        return np.asarray([sum(scores.values()) for scores in self.reward_scores], np.float32)

    def metrics(self) -> dict[str, float]:
        turns = self.assistant_turns + self.user_turns
        calls = tools_lib.call_metrics(self.results)
        return {"num_turns/mean": float(turns.mean()), "num_turns/max": float(turns.max()),
                "num_turns/min": float(turns.min()),
                "multi_turn/assistant_turns/mean": float(self.assistant_turns.mean()),
                "multi_turn/tool_calls/mean": float(self.calls_per_row.mean()),
                "multi_turn/tool_calls/total": float(self.calls_per_row.sum()),
                "multi_turn/tool_calls/malformed": float(self.parse_errors),
                "multi_turn/tool_errors": calls["tools/errors"] + self.parse_errors,
                "multi_turn/tool_blocks_cut": float(self.cut_blocks),
                "multi_turn/segments": float(self.segments),
                "multi_turn/cache_cuts": float(self.cache_cuts),
                "multi_turn/tool_latency_s/mean": calls["tools/latency_mean_s"],
                "multi_turn/tool_latency_s/max": calls["tools/latency_max_s"]}


def combine_metrics(batches: Sequence[dict[str, float]]) -> dict[str, float]:
    """The metrics of several `generate` calls (validation's batches) as one set: means
    averaged (the batches are the same size), maxima and minima kept, counts and totals
    summed."""
    out = {}
    for key in dict.fromkeys(k for batch in batches for k in batch):
        values = [batch[key] for batch in batches if key in batch]
        if key.endswith("/mean"):
            out[key] = float(np.mean(values))
        elif key.endswith("/max"):
            out[key] = float(np.max(values))
        elif key.endswith("/min"):
            out[key] = float(np.min(values))
        else:
            out[key] = float(np.sum(values))
    return out


def _assemble(tokens, trained, log_probs, budget: int, pad_id: int):
    """Rows of (tokens, trained flags, log-probs) as right-padded `[N, R]` arrays:
    (responses, response_mask, attention_mask, rollout_log_probs)."""
    num_rows = len(tokens)
    responses = np.full((num_rows, budget), pad_id, np.int32)
    loss_mask = np.zeros((num_rows, budget), np.int32)
    attention = np.zeros((num_rows, budget), np.int32)
    lps = np.zeros((num_rows, budget), np.float32)
    for row in range(num_rows):
        k = len(tokens[row])
        responses[row, :k] = tokens[row]
        loss_mask[row, :k] = trained[row]
        attention[row, :k] = 1
        lps[row, :k] = log_probs[row]
    return responses, loss_mask, attention, lps
