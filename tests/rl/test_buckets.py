"""Response-length buckets (`jrl.rl.buckets`): the passes on trimmed columns give the
full-length passes' results; bucket lengths and used lengths by hand."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.algos import masks
from jrl.models import transformer
from jrl.models.heads import init_critic_params
from jrl.optim import make_optimizer
from jrl.rl import buckets, logprobs, update
from tests.rl.test_update import _MODEL, _actor_settings


def test_sizes_by_hand():
    assert buckets.sizes(256, 4) == (64, 128, 192, 256)
    assert buckets.sizes(256, 1) == (256,)
    # 100 / 3 = 33.3 -> 48, 66.7 -> 80, then R itself.
    assert buckets.sizes(100, 3) == (48, 80, 100)
    # Short responses: rounding to 16 merges buckets; the last is always R.
    assert buckets.sizes(20, 4) == (16, 20)
    assert buckets.sizes(7, 4) == (7,)
    with pytest.raises(ValueError, match="num_buckets must be >= 1"):
        buckets.sizes(8, 0)


def test_used_lengths_and_order_by_hand():
    mask = jnp.asarray([[1, 1, 0, 0, 0],
                        [0, 0, 0, 0, 0],
                        [1, 0, 1, 1, 0],   # a hole (a tool output in a multi-turn row)
                        [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(buckets.used_lengths(mask), [2, 0, 4, 5])
    np.testing.assert_array_equal(buckets.sort_order(jnp.asarray([3, 1, 3, 0])), [3, 1, 0, 2])


def test_switch_picks_the_smallest_bucket_that_holds_the_length():
    picked = lambda n: int(buckets.switch(jnp.int32(n), (4, 8, 12), lambda r: lambda: r))
    assert [picked(n) for n in (0, 1, 4, 5, 8, 9, 12)] == [4, 4, 4, 8, 8, 12, 12]


def _batch(seed, b=8, p=4, r=40):
    """Left-padded prompts, right-padded responses of varied lengths (some short)."""
    rng = np.random.default_rng(seed)
    lengths = np.array([1, 3, 40, 17, 0, 9, 33, 5])[:b]
    response_mask = (np.arange(r)[None] < lengths[:, None]).astype(np.int32)
    prompt_mask = (np.arange(p)[None] >= rng.integers(0, 3, b)[:, None]).astype(np.int32)
    prompt_ids = (rng.integers(3, 40, (b, p)) * prompt_mask).astype(np.int32)
    responses = (rng.integers(3, 40, (b, r)) * response_mask).astype(np.int32)
    return prompt_ids, prompt_mask, responses, response_mask


@functools.cache
def _params():
    return transformer.init_params(_MODEL, jax.random.key(0))


def test_log_probs_and_values_in_buckets_equal_the_full_pass():
    """Sorted, trimmed micro-batches give the full pass's log-probs, entropy and values on
    every used column, and zeros after each micro-batch's last one."""
    batch = _batch(0)
    params = _params()
    fn = functools.partial(logprobs.response_log_probs, config=_MODEL, chunk_size=8,
                           with_entropy=True)
    full = jax.jit(logprobs.in_micro_batches(fn, 2))(params, *batch)
    sizes = buckets.sizes(40, 4)
    assert sizes == (16, 32, 40)
    got = jax.jit(logprobs.in_micro_batches(fn, 2, sizes))(params, *batch)
    mask = batch[3].astype(bool)
    for g, f in zip(got, full, strict=True):
        np.testing.assert_allclose(np.where(mask, g, 0), np.where(mask, f, 0),
                                   rtol=1e-5, atol=1e-6)
    # Sorted lengths 0,1 | 3,5 | 9,17 | 33,40: the rows of length 1, 3, 5 run 16
    # columns (zeros after), 9 and 17 run 32, 33 and 40 all 40.
    lp = np.asarray(got[0])
    for row, run in ((0, 16), (1, 16), (7, 16), (5, 32), (3, 32)):
        assert np.all(lp[row, run:] == 0) and np.all(lp[row, :batch[3][row].sum()] != 0)
    assert np.all(lp[3, 17:32] != 0)  # computed up to its bucket (padding tokens)
    # One pass over all rows (no micro-batches) in one bucket: the longest row's.
    one = jax.jit(logprobs.in_micro_batches(fn, None, sizes))(params, *batch)
    np.testing.assert_allclose(np.where(mask, one[0], 0), np.where(mask, full[0], 0),
                               rtol=1e-5, atol=1e-6)

    critic = init_critic_params(params, jax.random.key(1), stddev=0.5)
    vfn = functools.partial(logprobs.response_values, config=_MODEL)
    v_full = jax.jit(logprobs.in_micro_batches(vfn, 4))(critic, *batch)
    v_got = jax.jit(logprobs.in_micro_batches(vfn, 4, sizes))(critic, *batch)
    np.testing.assert_allclose(np.where(mask, v_got, 0), np.where(mask, v_full, 0),
                               rtol=1e-5, atol=1e-6)


def _update(batch, sizes, agg, micro=2):
    actor = _actor_settings(micro, agg)  # mini-batches of 4 sequences
    params = _params()
    optimizer = make_optimizer(actor.optim)
    loss_fn = functools.partial(update.actor_loss, model_config=_MODEL, actor=actor,
                                temperature=1.0, chunk_size=8)
    state = update.ModelState(params, optimizer.init(params))
    fn = jax.jit(functools.partial(update.run_updates, loss_fn=loss_fn, optimizer=optimizer,
                                   update=actor.update, bucket_sizes=sizes))
    return fn(state, batch, jax.random.key(1), actor.optim.lr)


def test_update_in_buckets_equals_the_full_update(agg="seq-mean-token-sum-norm"):
    """Same parameters, loss terms and per-token outputs as the update on all 40 columns;
    `seq-mean-token-sum-norm` still divides by the full 40 (not a bucket's length)."""
    ids, pmask, resp, rmask = _batch(1)
    rng = np.random.default_rng(5)
    b, r = rmask.shape
    batch = {"prompt_ids": jnp.asarray(ids), "prompt_mask": jnp.asarray(pmask),
             "responses": jnp.asarray(resp), "response_mask": jnp.asarray(rmask),
             "old_log_probs": jnp.asarray(-rng.random((b, r)) * 3, jnp.float32),
             "ref_log_probs": jnp.asarray(-rng.random((b, r)) * 3, jnp.float32),
             "rollout_log_probs": jnp.asarray(-rng.random((b, r)) * 3, jnp.float32),
             "advantages": jnp.asarray(np.repeat(rng.normal(size=(b, 1)), r, 1), jnp.float32)}
    full, full_m, _ = _update(batch, (), agg)
    got, got_m, _ = _update(batch, buckets.sizes(r, 4), agg)
    chex.assert_trees_all_close(got.params, full.params, atol=2e-6, rtol=0)
    for key in ("pg_loss", "kl_loss", "entropy_loss", "grad_norm"):
        np.testing.assert_allclose(got_m[key], full_m[key], rtol=2e-5, err_msg=key)
    assert float(full_m["grad_norm"]) > 0


def test_token_sum_norm_divides_by_the_normalizers_columns():
    loss = jnp.ones((2, 3))
    mask = jnp.asarray([[1, 1, 0], [1, 0, 0]])
    norm = masks.loss_normalizer(jnp.pad(mask, ((0, 0), (0, 5))))  # 8 columns in all
    assert norm.num_columns == 8
    # (2 + 1) / 2 sequences / 8 columns.
    got = masks.agg_loss(loss, mask, "seq-mean-token-sum-norm", norm)
    np.testing.assert_allclose(got, 3 / 2 / 8)
    np.testing.assert_allclose(masks.agg_loss(loss, mask, "seq-mean-token-sum-norm"), 3 / 2 / 3)
