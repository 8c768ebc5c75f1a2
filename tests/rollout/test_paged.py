"""The paged sampler (`rollout.kv_cache=paged`): the contiguous sampler's rollouts bit for
bit on XLA:CPU with refill and preemption, its page bookkeeping by hand, and its
settings checked before compiling."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.models.cache import TRASH_PAGE
from jrl.rollout import paged, sampler
from jrl.rollout.sampler import SamplingConfig
from tests.models.test_lora import _randomise_b
from tests.rollout.test_sampler import SMALL, ragged_prompts, random_params

# Three prompts of 7 columns, two samples each: six rows. At these shapes every
# program's attention softmax is below XLA:CPU's small/large reduction split, on both
# samplers (`decode_attention.grouped_attention`), so the two must agree bit for bit.
PROMPT_LEN, NUM_NEW = 7, 12
BASE = SamplingConfig(n=2, max_new_tokens=NUM_NEW, stop_token_ids=(3, 5), pad_token_id=0)
LORA = dataclasses.replace(SMALL, lora_rank=4, lora_alpha=8.0)


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts([5, 2, 7], prompt_len=PROMPT_LEN, vocab_size=SMALL.vocab_size, seed=3)


@pytest.fixture(scope="module")
def params():
    return {"small": random_params(SMALL, 0), "lora": _randomise_b(random_params(LORA, 1), 2)}


def _run(params, prompts, sampling, config):
    program = jax.jit(paged.run, static_argnames=("sampling", "config"))
    return program(params, *prompts, jax.random.key(7), sampling=sampling, config=config)[2]


# (name, sampling, model): the stop lengths of the natural rows are 1-12 tokens.
CASES = [
    # Every row at once, the whole pool: pages as rows need them; the rows left drain at
    # 4 and then 2 slots (decode buckets).
    ("natural", dict(page_size=4, decode_buckets=3), "small"),
    # Four slots for six rows: the last two refill freed slots, two at a time; then the
    # rows drain at 2 slots.
    ("refill", dict(max_num_seqs=4, refill_rows=2, page_size=4, decode_buckets=2), "small"),
    # A pool for little more than one full row: rows wait for pages and are preempted,
    # also once the slots are compacted (2 decode buckets), and are admitted again there.
    ("preempt", dict(max_num_seqs=4, page_size=2, num_pages=12, decode_buckets=2), "small"),
    # Every row to R tokens (benchmarks' forced lengths), pages of 3 slots, greedy.
    ("forced_greedy", dict(max_num_seqs=2, page_size=3, ignore_stop=True, do_sample=False),
     "small"),
    # Adapters applied at every decode step (LoRA, `model.lora_rollout=unmerged`).
    ("lora", dict(max_num_seqs=4, page_size=4), "lora"),
    # Pages of 32 slots: a row's prompt and response in one page, as its prompt alone.
    # The default pool (a page a decode slot) admits every row at once all the same.
    ("one_page_a_row", dict(page_size=32), "small"),
]


@pytest.mark.parametrize("name,settings,model", CASES, ids=[c[0] for c in CASES])
def test_paged_rollouts_equal_the_contiguous_samplers(params, prompts, name, settings, model):
    config = LORA if model == "lora" else SMALL
    contiguous = dataclasses.replace(BASE, **{k: v for k, v in settings.items()
                                              if k in ("ignore_stop", "do_sample")})
    pages = dataclasses.replace(contiguous, kv_cache="paged", **settings)
    want = sampler.generate(params[model], *prompts, jax.random.key(7), contiguous, config=config)
    if name == "natural":  # through the public `generate`
        got = paged.generate(params[model], *prompts, jax.random.key(7), pages, config=config)
        for field in ("prompt_ids", "prompt_mask", "responses", "response_mask",
                      "rollout_log_probs", "response_lengths"):
            np.testing.assert_array_equal(np.asarray(getattr(got, field)),
                                          np.asarray(getattr(want, field)), err_msg=field)
        lengths = np.asarray(want.response_lengths)  # several stop lengths, some at R
        assert len(set(lengths.tolist())) >= 3 and lengths.max() == NUM_NEW
        np.testing.assert_array_equal(np.asarray(got.preemptions), np.zeros(6))
        usage = np.asarray(got.page_usage)  # `rollout/page_usage`, checked below
    # The program itself, for its final state (one compile per case).
    state = _run(params[model], prompts, pages, config)
    for got, field in ((state.responses, "responses"), (state.log_probs, "rollout_log_probs"),
                       (state.out_lengths, "response_lengths")):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(getattr(want, field)),
                                      err_msg=field)
    lengths = np.asarray(want.response_lengths)
    # Every page is back on the stack, each once; no row waits or holds a slot.
    num_pages = int(state.free.shape[0])
    np.testing.assert_array_equal(np.sort(np.asarray(state.free[:int(state.num_free)])),
                                  np.arange(1, num_pages))
    assert not np.asarray(state.pending).any()
    assert (np.asarray(state.rows) == 6).all()
    assert (np.asarray(state.cache.block_table) == TRASH_PAGE).all()
    # The most pages held at once: at least the biggest row's, at most the pool.
    # The tokens a row writes, from its first page: its prompt and the tokens fed back.
    written = np.asarray(prompts[1]).sum(1).repeat(2) + lengths - 1
    row_pages = -(-written // pages.page_size)
    assert row_pages.max() <= int(state.peak_pages) <= num_pages - 1
    if name == "natural":  # the peak as a fraction of the pool, the trash page aside
        np.testing.assert_array_equal(usage, np.full(6, int(state.peak_pages) / (num_pages - 1),
                                                     np.float32))
    preemptions = np.asarray(state.preemptions)
    if name == "preempt":
        assert preemptions.sum() >= 1
    else:
        assert not preemptions.any()


# (name, paged settings): eight rows continued four tokens a call, three calls.
CONTINUED = [
    ("whole_pool", dict(page_size=4, decode_buckets=2)),
    # Each call's prefix padded to R, as the trainer's prefix widths pad a row's tokens
    # so far: its P + R + 4 slots are more than a row's P + R real tokens, which size
    # the pool (`paged.shape`'s max_tokens).
    ("whole_pool_padded", dict(page_size=4, decode_buckets=2)),
    # Four decode slots refilled two rows at a time from the rows that wait.
    ("refill", dict(max_num_seqs=4, refill_rows=2, page_size=4)),
    # A pool of little more than one row at full length (7 + 12 slots in pages of 2, and
    # the trash page): rows are preempted and start their call's tokens over.
    ("preempt", dict(max_num_seqs=4, page_size=2, num_pages=13, decode_buckets=2)),
]


@pytest.mark.parametrize("name,settings", CONTINUED, ids=[c[0] for c in CONTINUED])
def test_rows_continued_over_paged_calls_draw_the_tokens_of_one_call(params, name, settings):
    """Partial rollouts over the paged cache: rows drawn four tokens a call, each call
    admitting a row's prompt and tokens so far as one prompt (the prefix as wide as the
    longest row's tokens), end as one contiguous `generate` call's rows (same keys and
    parameters): the same tokens and lengths, log-probs to float32 rounding. Between
    calls a row's length is its tokens so far and it is `finished` only once it has
    stopped; a finished row keeps its tokens, and two rows finished from the start with
    none (the trainer's free decode rows) draw none. Every page comes back each call."""
    ids, mask = ragged_prompts([5, 2, 7, 1, 4, 6], 7, SMALL.vocab_size, seed=4)
    contiguous = SamplingConfig(n=1, max_new_tokens=NUM_NEW, temperature=1.2,
                                stop_token_ids=(2, 3, 4))
    sampling = dataclasses.replace(contiguous, kv_cache="paged", **settings)
    rng = jax.random.key(1)
    whole = sampler.generate(params["small"], ids, mask, rng, contiguous, config=SMALL)
    final = np.asarray(whole.response_lengths)
    # Rows stop in each of the three calls, and some run to R.
    assert sorted(set(np.minimum(-(-final // 4), 3))) == [1, 2, 3] and final.max() == NUM_NEW
    ids, mask = np.concatenate([ids, ids[:2]]), np.concatenate([mask, mask[:2]])
    final = np.concatenate([final, [0, 0]])
    prefix = sampler.new_rows(rng, 8).replace(finished=np.arange(8) >= 6)
    program = jax.jit(paged.continue_program,
                      static_argnames=("sampling", "config", "max_steps"))
    preempted = 0
    for call in range(1, 4):
        out = program(params["small"], ids, mask, prefix, sampling=sampling, config=SMALL,
                      max_steps=4)
        lengths, finished = np.asarray(out.response_lengths), np.asarray(out.finished)
        np.testing.assert_array_equal(lengths, np.minimum(final, 4 * call))
        np.testing.assert_array_equal(finished, final <= 4 * call)
        was_finished = np.asarray(prefix.finished)
        width = prefix.responses.shape[1]
        np.testing.assert_array_equal(np.asarray(out.responses)[was_finished, :width],
                                      np.asarray(prefix.responses)[was_finished])
        preempted += int(np.asarray(out.preemptions).sum())
        assert 0 < float(np.asarray(out.page_usage)[0]) <= 1
        width = NUM_NEW if name.endswith("padded") else int(lengths[~was_finished].max())
        prefix = sampler.Prefix(out.responses[:, :width], out.rollout_log_probs[:, :width],
                                out.response_lengths, out.finished, prefix.keys)
    assert finished.all()
    assert (preempted > 0) == (name == "preempt")
    if name == "whole_pool_padded":  # 8 rows of 7 + 12 tokens in pages of 4, not 7 + 12 + 4
        assert paged.shape(sampling, 8, 7 + NUM_NEW, 4, 7 + NUM_NEW)["pages"] == 8 * 5 + 1
        assert paged.shape(sampling, 8, 7 + NUM_NEW, 4)["pages"] == 8 * 6 + 1
    for field in ("prompt_ids", "prompt_mask", "responses", "response_mask",
                  "response_lengths"):
        np.testing.assert_array_equal(np.asarray(getattr(out, field))[:6],
                                      np.asarray(getattr(whole, field)), err_msg=field)
    np.testing.assert_allclose(out.rollout_log_probs[:6], whole.rollout_log_probs, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.responses)[6:], sampling.pad_token_id)


def test_paged_partial_rollouts_hand_no_cache_on(params):
    """`partial_keep_cache` keeps a contiguous cache, which the paged program has none of:
    it stops before tracing."""
    ids, mask = ragged_prompts([5, 2], 7, SMALL.vocab_size, seed=4)
    sampling = dataclasses.replace(BASE, n=1, kv_cache="paged")
    with pytest.raises(ValueError, match=r"rollout.partial_keep_cache=True hands a "
                                         r"contiguous cache.*set it to False"):
        paged.continue_program(params["small"], ids, mask,
                               sampler.new_rows(jax.random.key(0), 2), sampling=sampling,
                               config=SMALL, max_steps=4, keep_cache=True)


def test_rows_admitted_in_order_while_a_page_stays_free_for_each_running_row():
    """`_candidates` on a state set by hand: P = 7, pages of 4 slots (two per prompt), a
    pool of 8 pages (`num_pages`), four slots, slot 1 running row 3, rows 1 and 2
    waiting, four pages free."""
    num_rows = 4
    row_mask = ragged_prompts([5, 2, 7, 1], prompt_len=7, vocab_size=8, seed=0)[1]
    rows = paged.Rows(ids=jnp.zeros((num_rows, 7), jnp.int32), mask=jnp.asarray(row_mask),
                      keys=None, offsets=None, pending=None, responses=None, log_probs=None,
                      out_lengths=None, finished=None, steps=NUM_NEW)
    ctx = paged._Context(params=None, rows=rows,
                         sampling=dataclasses.replace(BASE, page_size=4, num_pages=8),
                         config=SMALL)
    state = paged._State(
        rows=jnp.array([num_rows, 3, num_rows, num_rows]), lengths=None, last_tokens=None,
        prompt_lengths=None, key_mask=None, admitted=None, cache=None, free=None,
        num_free=jnp.int32(4), admissions=None,
        pending=jnp.array([False, True, True, False]), responses=None, log_probs=None,
        out_lengths=None, finished=None, peak_pages=None, preemptions=None)
    slots, rows, need, ok = (np.asarray(x) for x in paged._candidates(ctx, state, 3))
    # Empty slots in order; waiting rows in order (then others, never admitted).
    np.testing.assert_array_equal(slots, [0, 2, 3])
    np.testing.assert_array_equal(rows[:2], [1, 2])
    # Row 1 (2 tokens: one page) needs one page and leaves 3 free, one for row 3:
    # admitted. Row 2 (7 tokens: two pages) needs two more, which would leave 1 free for
    # two other running rows: not admitted. The third candidate has no waiting row.
    np.testing.assert_array_equal(ok, [True, False, False])
    np.testing.assert_array_equal(need, [1, 0, 0])
    # The default pool (`num_pages` 0) holds every slot's row at full length: no page is
    # kept back, and both waiting rows are admitted.
    ctx.sampling = dataclasses.replace(ctx.sampling, num_pages=0)
    slots, rows, need, ok = (np.asarray(x) for x in paged._candidates(ctx, state, 3))
    np.testing.assert_array_equal(ok, [True, True, False])
    np.testing.assert_array_equal(need, [1, 2, 0])


def test_paged_settings_are_checked_before_compiling(params, prompts, monkeypatch):
    def no_compile(*args, **kwargs):
        raise AssertionError("compiled before checking")

    monkeypatch.setattr(sampler, "jit_sampler", no_compile)
    # Seven prompt + twelve response slots in pages of 4: five pages and the trash page.
    few = dataclasses.replace(BASE, kv_cache="paged", page_size=4, num_pages=5)
    with pytest.raises(ValueError, match=r"rollout.num_pages=5 is too few for one sequence.*"
                                         r"needs 5 pages of rollout.page_size=4.*>= 6"):
        paged.generate(params["small"], *prompts, jax.random.key(0), few, config=SMALL)
    with pytest.raises(ValueError, match="rollout.kv_cache='paged': call "
                                         "jrl.rollout.paged.generate"):
        sampler.generate(params["small"], *prompts, jax.random.key(0), few, config=SMALL)
    bad = {"kv_cache": ("ring", "rollout.kv_cache must be one of 'contiguous', 'paged'"),
           "page_size": (0, "rollout.page_size must be an integer >= 1"),
           "max_num_seqs": (-1, r"rollout.max_num_seqs must be an integer >= 0 \(0: every"),
           "num_pages": (2.5, "rollout.num_pages must be an integer >= 0")}
    for key, (value, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(BASE, **{key: value}).validate()
    with pytest.raises(ValueError, match="rollout.kv_cache must be 'contiguous' with "
                                         "rollout.cache_segments > 1"):
        dataclasses.replace(BASE, kv_cache="paged", cache_segments=2).validate()


def test_pool_bytes_count_the_pages():
    """A pool of 9 pages of 4 slots: 2 (k, v) x 2 layers x 9 x 2 heads x 4 x 8 x 4 bytes."""
    config = dataclasses.replace(SMALL, dtype="float32")
    sampling = dataclasses.replace(BASE, kv_cache="paged", page_size=4, num_pages=9)
    assert paged.pool_bytes(sampling, config, num_rows=6, prompt_len=7) == 2 * 2 * 9 * 2 * 4 * 8 * 4
    # The default pool: every decode slot at full length (5 pages a row) and the trash page.
    full = dataclasses.replace(sampling, num_pages=0, max_num_seqs=4)
    assert paged.shape(full, 6, 7)["pages"] == 4 * 5 + 1
