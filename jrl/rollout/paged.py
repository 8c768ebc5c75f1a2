"""Sampling over a paged KV cache with in-flight refill (`rollout.kv_cache=paged`).

The contiguous sampler (`jrl.rollout.sampler.generate`) gives each of the step's `N = B·n`
rows a cache of `S = P + R` slots for the whole program, and a row that stops keeps its
slot until the batch ends. Here, as in vLLM's and SGLang's engines:

- **Pages.** The cache is a pool of `rollout.num_pages` pages of `rollout.page_size` slots
  per layer (`cache.PagedCache`). A row holds a block table of the pages of its tokens,
  kept compactly from its first real token (its left padding in no page): pages for its
  prompt when it is admitted, one more each time its tokens cross into a new page, all
  of them returned when it stops. The pool is sized to the live tokens, not to `N` full
  rows.
- **Decode slots.** The decode loop runs over `M = rollout.max_num_seqs` slots. The step's
  rows wait in order; when slots free up (rows that stopped), the next waiting rows are
  prefilled into them inside the same `lax.while_loop` (`refill_rows` at a time, fewer
  at the end), so the batch stays full until no row waits.
- **Preemption.** When a step's rows need more pages than are free, the row admitted last
  gives its pages back and waits again, to start over (vLLM's recompute preemption). Its
  tokens come out the same: a row's token i is drawn with `fold_in(key_row, i)` from the
  same weights, whenever and wherever it runs. In a pool sized by `num_pages`, a new row
  is admitted only while a page stays free for each other running row, so preemption is
  rare; the default pool holds every decode slot's row at full length and never
  preempts.

Every row's slots keep the contiguous cache's layout (left-padded prompt, then the
response). Where a decode kernel applies (`transformer.paged_kernel`: on a Hopper GPU
`decode_attention.paged_attention`, on a TPU `decode_attention.tpu_paged_attention`), a
decode step reads each row's pages in place through its block table; elsewhere, and in
the prefills, attention reads the pages gathered into that layout. Either way a
row's tokens and log-probs are those of `sampler.generate` with the same key: the same
per-row keys, prompts, positions, masks and operations. On XLA:CPU they are the same bits
where the attention's softmax runs at a size on the same side of XLA's small/large
reduction split as the contiguous program's (`decode_attention.grouped_attention`).

Single-turn rollouts on one program; not with `cache_segments` > 1 or routing records.
Partial rollouts' rounds (`continue_program`) admit each continued row's prompt and
tokens so far as one prompt and draw on with the key and token index
`sampler.continue_rows` uses; no cache is kept between calls. Multi-turn rollouts keep
their pages between their programs (`jrl.rollout.multi_turn`, with `take_pages` and
`give_back`).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from jrl.models import transformer
from jrl.models.cache import TRASH_PAGE, PagedCache, init_pool, positions_from_mask
from jrl.models.config import ModelConfig
from jrl.models.heads import unembed
from jrl.rollout import sampler
from jrl.sharding import constrain


def shape(sampling, num_rows: int, prompt_len: int, steps: int | None = None,
          max_tokens: int | None = None) -> dict[str, int]:
    """The paged program's sizes for `num_rows` rows of prompts `P = prompt_len` drawing
    `steps` tokens each (None: R): slots per row (`P + steps`), pages per row, decode
    slots, pool pages (the trash page included) and rows per refill. `max_tokens`: the
    most real tokens a row holds (None or 0: its slots), which sizes the default pool: pages
    hold real tokens only, so a continued row, whose prompt width pads its tokens so far
    to the round's prefix width, never holds more than its prompt and R tokens."""
    slots = prompt_len + (sampling.max_new_tokens if steps is None else steps)
    per_row = -(-slots // sampling.page_size)
    held = -(-min(slots, max_tokens or slots) // sampling.page_size)
    seqs = min(sampling.max_num_seqs or num_rows, num_rows)
    pages = sampling.num_pages or seqs * held + 1
    # At least two rows a refill: each refill is a prefill program of its own, and on
    # XLA:CPU a one-row matmul rounds otherwise than the same row among others.
    refill = min(sampling.refill_rows or max(2, seqs // 8), seqs)
    return dict(slots=slots, pages_per_row=per_row, seqs=seqs, pages=pages, refill=refill)


def check_pages(sampling, prompt_len: int, prefix: str = "rollout") -> None:
    """A pool too small for one row at full length would leave a row no way to finish:
    stops with the keys that size it."""
    if sampling.kv_cache != "paged" or not sampling.num_pages:
        return
    sizes = shape(sampling, 1, prompt_len)
    if sampling.num_pages - 1 < sizes["pages_per_row"]:
        raise ValueError(
            f"{prefix}.num_pages={sampling.num_pages} is too few for one sequence: a row of "
            f"{prompt_len} prompt + {sampling.max_new_tokens} response slots "
            f"(rollout.response_length) needs {sizes['pages_per_row']} pages of "
            f"{prefix}.page_size={sampling.page_size}, plus the trash page: set "
            f"{prefix}.num_pages >= {sizes['pages_per_row'] + 1} (or 0: every decode slot "
            "at full length)")


def generate(params, prompt_ids, prompt_mask, rng, sampling, *, config: ModelConfig
             ) -> sampler.RolloutOutput:
    """`sampler.generate` over a paged cache (`sampling.kv_cache` "paged"): the same
    arguments, checks (and the pool's, `check_pages`) and outputs, in one program."""
    check_inputs(prompt_ids, prompt_mask, sampling, config)
    return sampler.call_program(generate_program, (params, prompt_ids, prompt_mask, rng),
                                sampling=sampling, config=config)


def check_inputs(prompt_ids, prompt_mask, sampling, config: ModelConfig) -> None:
    """`sampler.check_inputs`, and the pool against the prompts (`check_pages`)."""
    sampler.check_inputs(prompt_ids, prompt_mask, sampling, config)
    if sampling.kv_cache != "paged":
        raise ValueError(f"rollout.kv_cache={sampling.kv_cache!r}: the paged program needs "
                         "'paged'")
    check_pages(sampling, prompt_ids.shape[1])


@flax.struct.dataclass
class _State:
    """The loop's carry: M decode slots over N rows, a pool of pages."""

    rows: jax.Array  # int32 [M]: the row in each slot; N where none
    lengths: jax.Array  # int32 [M]: the slot's row's tokens so far (index of the next)
    last_tokens: jax.Array  # int32 [M]: the token fed next
    prompt_lengths: jax.Array  # int32 [M]
    key_mask: jax.Array  # int32 [M, S]
    admitted: jax.Array  # int32 [M]: admission order (the last admitted is preempted first)
    cache: PagedCache  # pools and the slots' block tables [M, pages_per_row]
    free: jax.Array  # int32 [pages]: a stack of free pages, its first num_free entries
    num_free: jax.Array  # int32 []
    admissions: jax.Array  # int32 []
    pending: jax.Array  # bool [N]: rows waiting for a slot
    responses: jax.Array  # int32 [N, R]
    log_probs: jax.Array  # float32 [N, R]
    out_lengths: jax.Array  # int32 [N]
    finished: jax.Array  # bool [N]: stopped by a stop token or at R tokens
    peak_pages: jax.Array  # int32 []: the most pages held at once (the trash page aside)
    preemptions: jax.Array  # int32 [N]: each row's times sent back to wait


@flax.struct.dataclass
class Rows:
    """The rows a paged program samples (N of them), each a prompt (`ids` LEFT-padded,
    `mask` 1 on its real tokens: for continued rows, the prompt and the response so far)
    whose response is drawn from index `offsets` on with `keys` (token i with
    `fold_in(key, i)`), at most `steps` tokens a call (static)."""

    ids: jax.Array  # int32 [N, P]
    mask: jax.Array  # int32 [N, P]
    keys: jax.Array  # [N] typed PRNG keys
    offsets: jax.Array  # int32 [N]: response tokens before this call
    pending: jax.Array  # bool [N]: rows to sample (the others keep their outputs)
    responses: jax.Array  # int32 [N, R]: the outputs before this call
    log_probs: jax.Array  # float32 [N, R]
    out_lengths: jax.Array  # int32 [N]: each row's length, unless it stops earlier
    finished: jax.Array  # bool [N]
    steps: int = flax.struct.field(pytree_node=False)
    # The most real tokens a row holds (0: its P + steps slots); sizes the default pool.
    max_tokens: int = flax.struct.field(pytree_node=False, default=0)


def generate_program(params, prompt_ids, prompt_mask, rng, *, sampling, config: ModelConfig
                     ) -> sampler.RolloutOutput:
    """`sampler.generate_program` over a paged cache (arguments checked by the caller):
    the same rows, keys and outputs."""
    row_ids, row_mask, state = run(params, prompt_ids, prompt_mask, rng, sampling=sampling,
                                   config=config)
    return _output(row_ids, row_mask, state)


def _output(prompt_ids, prompt_mask, state: _State) -> sampler.RolloutOutput:
    usage = state.peak_pages / (state.free.shape[0] - 1)  # the trash page aside
    return sampler.rollout_output(prompt_ids, prompt_mask, state.responses, state.log_probs,
                                  state.out_lengths).replace(
        preemptions=state.preemptions,
        page_usage=jnp.full(state.preemptions.shape, usage, jnp.float32))


def continue_program(params, prompt_ids, prompt_mask, prefix: sampler.Prefix,
                     carried=None, *, sampling, config: ModelConfig, max_steps: int,
                     keep_cache: bool = False) -> sampler.RolloutOutput:
    """`sampler.continue_program` over a paged cache: each row's prompt and response so far
    admitted as one prompt (prefilled whole when a decode slot takes it), then at most
    `max_steps` more tokens, each drawn with the key and index `sampler.continue_rows`
    draws it with. No cache is carried between calls (`carried` None, `keep_cache`
    False): a continued row's pages are its prompt's and its tokens'."""
    if carried is not None or keep_cache:
        raise ValueError("rollout.partial_keep_cache=True hands a contiguous cache between "
                         "rounds; with rollout.kv_cache='paged' set it to False")
    prefix = sampler._with_typed_keys(prefix)
    steps = min(max_steps, sampling.max_new_tokens)
    ids, mask, lengths, begun, done = sampler.joined_prefix(prompt_ids, prompt_mask, prefix,
                                                            sampling)
    responses, log_probs, out_lengths = sampler.begun_outputs(
        prefix.responses, prefix.log_probs, lengths, begun, done, steps, sampling)
    rows = Rows(ids=ids, mask=mask, keys=prefix.keys, offsets=lengths, pending=~done,
                responses=responses, log_probs=log_probs, out_lengths=out_lengths,
                finished=done, steps=steps,
                max_tokens=prompt_ids.shape[1] + sampling.max_new_tokens)
    state = run_rows(params, rows, sampling=sampling, config=config)
    return _output(prompt_ids.astype(jnp.int32), prompt_mask.astype(jnp.int32),
                   state).replace(finished=state.finished)


def run(params, prompt_ids, prompt_mask, rng, *, sampling, config: ModelConfig):
    """The paged program: `(row prompt ids [N, P], row prompt mask, final state)`; the
    state's outputs, its page stack (every page returned), the most pages held at once
    (`peak_pages`) and each row's preemptions."""
    num_rows, num_new = prompt_ids.shape[0] * sampling.n, sampling.max_new_tokens
    repeat = lambda x: constrain(jnp.repeat(x.astype(jnp.int32), sampling.n, axis=0),
                                 ("batch", None))
    row_ids, row_mask = repeat(prompt_ids), repeat(prompt_mask)
    rows = Rows(ids=row_ids, mask=row_mask, keys=sampler.row_keys(rng, num_rows),
                offsets=jnp.zeros((num_rows,), jnp.int32),
                pending=jnp.ones((num_rows,), bool),
                responses=jnp.full((num_rows, num_new), sampling.pad_token_id, jnp.int32),
                log_probs=jnp.zeros((num_rows, num_new), jnp.float32),
                out_lengths=jnp.full((num_rows,), num_new, jnp.int32),
                finished=jnp.zeros((num_rows,), bool), steps=num_new)
    return row_ids, row_mask, run_rows(params, rows, sampling=sampling, config=config)


def run_rows(params, rows: Rows, *, sampling, config: ModelConfig) -> _State:
    """Samples `rows` over the paged cache: the final state (see `run`)."""
    num_rows, prompt_len = rows.ids.shape
    sizes = shape(sampling, num_rows, prompt_len, rows.steps, rows.max_tokens)
    params = sampler.per_layer(params, config)
    seqs, slots = sizes["seqs"], sizes["slots"]
    cache, free, num_free = empty_pool(config, sizes["pages"], sampling.page_size, seqs, slots)
    state = _State(
        rows=jnp.full((seqs,), num_rows, jnp.int32),
        lengths=jnp.zeros((seqs,), jnp.int32),
        last_tokens=jnp.zeros((seqs,), jnp.int32),
        prompt_lengths=jnp.ones((seqs,), jnp.int32),
        key_mask=jnp.zeros((seqs, slots), jnp.int32),
        admitted=jnp.zeros((seqs,), jnp.int32),
        cache=cache,
        free=free,
        num_free=num_free,
        admissions=jnp.int32(0),
        pending=rows.pending,
        responses=rows.responses,
        log_probs=rows.log_probs,
        out_lengths=rows.out_lengths,
        finished=rows.finished,
        peak_pages=jnp.int32(0),
        preemptions=jnp.zeros((num_rows,), jnp.int32),
    )
    ctx = _Context(params, rows, sampling, config)
    state = _admit(ctx, state, seqs)
    refill = sizes["refill"]
    # With the whole pool (num_pages 0) the first admission takes every row (that waits).
    all_at_once = seqs >= num_rows and not sampling.num_pages

    def body(state: _State) -> _State:  # (run where rows may wait: not `all_at_once`)
        state = _decode(ctx, state)
        fill = min(refill, state.rows.shape[0])
        ready = _admissible(ctx, state, fill)
        running = jnp.sum(state.rows < num_rows)
        waiting = jnp.sum(state.pending)
        # Refill a whole batch of rows at once (a prefill each), fewer at the end or when
        # the batch would otherwise run empty.
        go = (ready > 0) & ((ready >= jnp.minimum(fill, waiting)) | (running == 0))
        return lax.cond(go, lambda s: _admit(ctx, s, fill), lambda s: s, state)

    # Once no row waits, the running rows drain at the decode loop's smaller batch sizes
    # (`rollout.decode_buckets`), as the contiguous sampler's do: slots compacted, the
    # pool as it is. A pool sized by `num_pages` may still preempt a row there, which
    # then waits again: those loops admit rows too, so none is left waiting.
    preempts = bool(sampling.num_pages)
    batch_sizes = sampler.decode_sizes(seqs, sampler._row_groups(seqs), sampling)
    for smaller in (*batch_sizes[1:], 0):
        admits = not all_at_once and (state.rows.shape[0] == seqs or preempts)

        def going(state: _State, smaller=smaller, admits=admits) -> jax.Array:
            running = jnp.sum(state.rows < num_rows)
            if not admits:  # every row admitted, and none sent back
                return running > smaller
            # Rows wait: go on while some run (they free pages) or one can be admitted.
            fill = min(refill, state.rows.shape[0])
            waiting = jnp.any(state.pending) & (
                (running > 0) | (_admissible(ctx, state, fill) > 0))
            return (running > smaller) | waiting

        step = body if admits else functools.partial(_decode, ctx)
        state = lax.while_loop(going, step, state)
        if smaller:
            state = _compact(state, smaller, num_rows)
    return state


def _compact(state: _State, size: int, num_rows: int) -> _State:
    """The state over `size` decode slots: the running ones first, in order (the others
    are empty: no pages, no row)."""
    order = jnp.argsort(state.rows >= num_rows, stable=True)[:size]
    take = lambda x: x[order]
    return state.replace(
        rows=take(state.rows), lengths=take(state.lengths),
        last_tokens=take(state.last_tokens), prompt_lengths=take(state.prompt_lengths),
        key_mask=take(state.key_mask), admitted=take(state.admitted),
        cache=state.cache.replace(block_table=take(state.cache.block_table),
                                  shift=take(state.cache.shift)))


class _Context:
    """What every part of the program reads and none changes."""

    def __init__(self, params, rows: Rows, sampling, config):
        self.params, self.row_ids, self.row_mask, self.keys = params, rows.ids, rows.mask, rows.keys
        self.offsets, self.steps = rows.offsets, rows.steps
        self.sampling, self.config = sampling, config
        self.num_rows, self.prompt_len = rows.ids.shape
        self.page = sampling.page_size

    def draw_keys(self, rows, index):
        """The keys of rows `rows` `[M]` (N: none) for their `index`-th new tokens."""
        rows = jnp.minimum(rows, self.num_rows - 1)
        return jax.vmap(jax.random.fold_in)(self.keys[rows], self.offsets[rows] + index)


def _candidates(ctx: _Context, state: _State, width: int):
    """The next `width` admissions: `(slots, rows, pages needed, admitted?)`, each
    `[width]`: empty slots and waiting rows in order, as many as the free pages allow
    while, in a pool sized by `num_pages`, one page stays free for each other running
    row. The default pool holds every decode slot's row at full length, so it admits
    every row a slot takes (the program's first admission takes all of them when the
    slots are as many as the rows)."""
    empty = state.rows >= ctx.num_rows
    slots = jnp.argsort(~empty, stable=True)[:width]
    rows = jnp.argsort(~state.pending, stable=True)[:width]
    k = jnp.arange(width)
    fill = (k < jnp.sum(empty)) & (k < jnp.sum(state.pending))
    need = jnp.where(fill, _prompt_pages(ctx, jnp.sum(ctx.row_mask[rows], axis=1)), 0)
    # Running rows besides this one, once it is admitted: each keeps a page to grow into.
    others = jnp.sum(~empty) + k if ctx.sampling.num_pages else 0
    ok = fill & (jnp.cumsum(need) + others <= state.num_free)
    return slots, rows, jnp.where(ok, need, 0), ok


def _admissible(ctx: _Context, state: _State, width: int) -> jax.Array:
    return jnp.sum(_candidates(ctx, state, width)[3])


def _prompt_pages(ctx: _Context, prompt_lengths):
    """The pages of a row of `prompt_lengths` tokens (held from physical slot 0)."""
    return -(-prompt_lengths // ctx.page)


def _admit(ctx: _Context, state: _State, width: int) -> _State:
    """Prefills up to `width` waiting rows into empty slots (pages for their prompts) and
    draws their first tokens."""
    slots, rows, need, ok = _candidates(ctx, state, width)
    ids, mask = ctx.row_ids[rows], ctx.row_mask[rows]
    # Row k takes free[start_k : start_k + need_k], popped from the stack's top, for its
    # physical pages 0 .. need_k - 1.
    start = state.num_free - jnp.cumsum(need)
    j = jnp.arange(state.cache.block_table.shape[1])[None, :]
    table = jnp.where(j < need[:, None], state.free[jnp.clip(start[:, None] + j, 0)],
                      TRASH_PAGE)
    lengths = jnp.sum(mask, axis=1)
    shift = ctx.prompt_len - lengths  # the left padding
    slots_total = state.key_mask.shape[1]
    key_mask = jnp.pad(mask, ((0, 0), (0, slots_total - ctx.prompt_len)))
    cache = state.cache.replace(block_table=table, shift=shift)
    hidden, cache = transformer.forward(ctx.params, ids, positions_from_mask(mask), key_mask,
                                        cache, jnp.zeros((width,), jnp.int32),
                                        config=ctx.config)
    logits = unembed(ctx.params, hidden[:, -1], softcap=ctx.config.final_logit_softcapping)
    keys = ctx.draw_keys(rows, jnp.zeros_like(rows))
    tokens, log_probs = sampler.sample_tokens(logits, keys, ctx.sampling)
    put = lambda old, new: old.at[slots].set(
        jnp.where(ok.reshape(-1, *(1,) * (new.ndim - 1)), new, old[slots]))
    state = state.replace(
        rows=put(state.rows, rows),
        lengths=put(state.lengths, jnp.zeros_like(rows)),
        prompt_lengths=put(state.prompt_lengths, lengths),
        key_mask=put(state.key_mask, key_mask),
        admitted=put(state.admitted, state.admissions + jnp.arange(width, dtype=jnp.int32)),
        cache=cache.replace(block_table=put(state.cache.block_table, table),
                            shift=put(state.cache.shift, shift)),
        num_free=state.num_free - jnp.sum(need),
        admissions=state.admissions + width,
        pending=state.pending.at[rows].set(state.pending[rows] & ~ok),
    )
    seqs = state.rows.shape[0]
    spread = lambda x: jnp.zeros((seqs,), x.dtype).at[slots].set(x)
    return _take(ctx, _held(state), spread(tokens), spread(log_probs), spread(ok))


def _decode(ctx: _Context, state: _State) -> _State:
    """One token for every running slot: a page for rows whose token starts one (after
    preempting if there are too few), the forward, the draw."""
    state = lax.while_loop(lambda s: _short_of_pages(ctx, s), lambda s: _preempt(ctx, s),
                           state)
    running = state.rows < ctx.num_rows
    slot = _write_slots(ctx, state)
    need = _needs_page(ctx, state)
    # Row m's new page: the stack's top entries, one per needing row in slot order.
    top = state.num_free - jnp.cumsum(need)
    page_index = _write_page_index(ctx, state)
    table = state.cache.block_table
    new_page = jnp.where(need, state.free[jnp.clip(top, 0)], TRASH_PAGE)
    table = jnp.where(need[:, None] & (jnp.arange(table.shape[1]) == page_index[:, None]),
                      new_page[:, None], table)
    at_slot = jnp.arange(state.key_mask.shape[1])[None, :] == slot[:, None]
    key_mask = jnp.where(at_slot & running[:, None], 1, state.key_mask)
    attended = sampler.decoding_mask(key_mask, slot, running)
    positions = state.prompt_lengths + state.lengths - 1
    cache = state.cache.replace(block_table=table)
    hidden, cache = transformer.forward(ctx.params, state.last_tokens[:, None],
                                        positions[:, None], attended, cache, slot,
                                        config=ctx.config)
    keys = ctx.draw_keys(state.rows, state.lengths)
    tokens, log_probs = sampler.next_tokens(ctx.params, hidden[:, 0], keys, ctx.sampling,
                                            ctx.config)
    state = _held(state.replace(cache=cache, key_mask=key_mask,
                                num_free=state.num_free - jnp.sum(need)))
    return _take(ctx, state, tokens, log_probs, running)


def _held(state: _State) -> _State:
    """The state with its peak page count updated after an allocation."""
    held = state.free.shape[0] - 1 - state.num_free
    return state.replace(peak_pages=jnp.maximum(state.peak_pages, held))


def _write_slots(ctx: _Context, state: _State) -> jax.Array:
    """int32 `[M]`: the slot each running row feeds its last token into (`P` for empty
    slots, whose block table is all trash)."""
    running = state.rows < ctx.num_rows
    return jnp.where(running, ctx.prompt_len + state.lengths - 1, ctx.prompt_len)


def _write_page_index(ctx: _Context, state: _State) -> jax.Array:
    """int32 `[M]`: the block-table entry of each slot's write slot (its physical slot's
    page; the row's pages start at its first real token)."""
    return (_write_slots(ctx, state) - state.cache.shift) // ctx.page


def _needs_page(ctx: _Context, state: _State) -> jax.Array:
    """bool `[M]`: the running rows whose next slot lies in a page they do not hold."""
    running = state.rows < ctx.num_rows
    held = jnp.take_along_axis(state.cache.block_table,
                               _write_page_index(ctx, state)[:, None], axis=1)[:, 0]
    return running & (held == TRASH_PAGE)


def _short_of_pages(ctx: _Context, state: _State) -> jax.Array:
    return (jnp.sum(_needs_page(ctx, state)) > state.num_free) & (
        jnp.sum(state.rows < ctx.num_rows) > 1)


def _preempt(ctx: _Context, state: _State) -> _State:
    """The running row admitted last gives its pages back and waits again (this call's
    outputs cleared: it starts over, drawing the same tokens)."""
    running = state.rows < ctx.num_rows
    victim = jnp.argmax(jnp.where(running, state.admitted, -1))
    row = state.rows[victim]
    drawn = jnp.arange(state.responses.shape[1]) >= ctx.offsets[row]
    state = state.replace(
        preemptions=state.preemptions.at[row].add(1),
        pending=state.pending.at[row].set(True),
        responses=state.responses.at[row].set(
            jnp.where(drawn, ctx.sampling.pad_token_id, state.responses[row])),
        log_probs=state.log_probs.at[row].set(jnp.where(drawn, 0.0, state.log_probs[row])))
    return _release(state, jnp.arange(running.shape[0]) == victim, ctx.num_rows)


def _release(state: _State, leaving: jax.Array, empty_row: int) -> _State:
    """The slots `leaving` (bool `[M]`) emptied, their pages pushed back on the stack."""
    cache, free, num_free = give_back(state.cache, state.free, state.num_free, leaving)
    return state.replace(rows=jnp.where(leaving, empty_row, state.rows),
                         key_mask=jnp.where(leaving[:, None], 0, state.key_mask),
                         cache=cache, free=free, num_free=num_free)


def empty_pool(config: ModelConfig, num_pages: int, page_size: int, num_rows: int,
               slots: int) -> tuple[PagedCache, jax.Array, jax.Array]:
    """A pool of `num_pages` zero pages (the trash page among them) for `num_rows` rows of
    `slots` slots that hold none yet, and its free stack: `(cache, free, num_free)`."""
    pool_k, pool_v = init_pool(config, num_pages, page_size)
    cache = PagedCache(k=pool_k, v=pool_v, num_slots=slots,
                       block_table=jnp.full((num_rows, -(-slots // page_size)), TRASH_PAGE,
                                            jnp.int32),
                       shift=jnp.zeros((num_rows,), jnp.int32))
    # Popped from the end: pages 1, 2, ... go out first (the trash page, 0, never).
    free = jnp.arange(num_pages - 1, -1, -1, dtype=jnp.int32)
    return cache, free, jnp.int32(num_pages - 1)


def give_back(cache: PagedCache, free: jax.Array, num_free: jax.Array, leaving: jax.Array):
    """The pages of the rows `leaving` (bool `[B]`) pushed back on the free stack (`free`,
    its first `num_free` entries), their block tables emptied: `(cache, free, num_free)`."""
    table = cache.block_table
    returned = (leaving[:, None] & (table != TRASH_PAGE)).reshape(-1)
    at = num_free + jnp.cumsum(returned) - 1
    free = free.at[jnp.where(returned, at, free.shape[0])].set(table.reshape(-1), mode="drop")
    cache = cache.replace(block_table=jnp.where(leaving[:, None], TRASH_PAGE, table),
                          shift=jnp.where(leaving, 0, cache.shift))
    return cache, free, num_free + jnp.sum(returned)


def take_pages(cache: PagedCache, free: jax.Array, num_free: jax.Array, first: jax.Array,
               count: jax.Array):
    """Pages for each row's physical slots `[first_b, first_b + count_b)` (`[B]` each), for
    rows that hold the pages of their slots below `first_b` and none after: those it
    lacks, popped from the free stack's top in row order. The caller makes sure there
    are enough. Returns `(cache, num_free)`."""
    page = cache.page_size
    held = -(-first // page)
    need = jnp.where(count > 0, -(-(first + count) // page) - held, 0)
    start = num_free - jnp.cumsum(need)
    table = cache.block_table
    j = jnp.arange(table.shape[1])[None, :] - held[:, None]  # the row's new pages from 0
    new = (j >= 0) & (j < need[:, None])
    table = jnp.where(new, free[jnp.clip(start[:, None] + j, 0, free.shape[0] - 1)], table)
    return cache.replace(block_table=table), num_free - jnp.sum(need)


def _take(ctx: _Context, state: _State, tokens, log_probs, active) -> _State:
    """Records the `active` slots' drawn tokens (`[M]` each) at their rows' next index;
    rows that stop (a stop token, R tokens, or the call's `steps`) leave their slots."""
    num_rows = ctx.num_rows
    num_new = state.responses.shape[1]
    row = jnp.where(active, state.rows, num_rows)
    index = state.lengths  # this call's
    column = ctx.offsets[jnp.minimum(row, num_rows - 1)] + index  # the response's
    responses = state.responses.at[row, column].set(tokens, mode="drop")
    log_probs_out = state.log_probs.at[row, column].set(log_probs, mode="drop")
    finished = active & (_stops(ctx, state, tokens) | (column + 1 >= num_new))
    stopped = finished | (active & (index + 1 >= ctx.steps))
    leaving = jnp.where(stopped, row, num_rows)
    state = state.replace(
        lengths=jnp.where(active, index + 1, state.lengths),
        last_tokens=jnp.where(active, tokens, state.last_tokens),
        responses=responses, log_probs=log_probs_out,
        out_lengths=state.out_lengths.at[leaving].set(column + 1, mode="drop"),
        finished=state.finished.at[jnp.where(finished, row, num_rows)].set(True, mode="drop"))
    return _release(state, stopped, num_rows)


def _stops(ctx: _Context, state: _State, tokens) -> jax.Array:
    """bool `[M]`: the slots' tokens, drawn at index `state.lengths`, end their rows (stop
    tokens). The benchmarks replace it to stop rows at lengths of their own."""
    del state
    return sampler._is_stop_token(tokens, ctx.sampling)


def pool_bytes(sampling, config: ModelConfig, num_rows: int, prompt_len: int) -> int:
    """Bytes of the page pool (keys and values of every layer)."""
    pages = shape(sampling, num_rows, prompt_len)["pages"]
    per_page = config.num_kv_heads * sampling.page_size * config.head_dim
    return 2 * config.num_layers * pages * per_page * jnp.dtype(config.dtype).itemsize
