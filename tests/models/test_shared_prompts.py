"""Shared prompts (`logprobs.response_hidden(..., group=k)`): running each prompt once for
its k samples gives the plain layout's log-probs, values and gradients, row for row."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jrl import buckets, logprobs, sharding, update
from jrl.models import load_pretrained, transformer
from jrl.models.heads import init_critic_params
from jrl.optim import make_optimizer
from tests.test_update import _MODEL, _actor_settings


def _grouped_batch(seed, groups=3, k=4, p=6, r=10, vocab=40):
    """`groups` prompts (left-padded by 0-3 tokens), each repeated k times, with k
    responses of varied lengths (0 to r)."""
    rng = np.random.default_rng(seed)
    prompt_mask = (np.arange(p)[None] >= rng.integers(0, 4, groups)[:, None]).astype(np.int32)
    prompt_ids = (rng.integers(3, vocab, (groups, p)) * prompt_mask).astype(np.int32)
    b = groups * k
    lengths = rng.integers(0, r + 1, b)
    lengths[0] = r
    response_mask = (np.arange(r)[None] < lengths[:, None]).astype(np.int32)
    responses = (rng.integers(3, vocab, (b, r)) * response_mask).astype(np.int32)
    repeat = lambda x: np.repeat(x, k, axis=0)
    return tuple(jnp.asarray(x) for x in (repeat(prompt_ids), repeat(prompt_mask), responses,
                                          response_mask))


@pytest.mark.parametrize("case", ["llama_untied", "qwen2_untied", "qwen3_untied"])
def test_log_probs_and_entropy_equal_the_plain_layout(hf_checkpoint, case):
    """Llama, Qwen2 (qkv bias) and Qwen3 (q/k norm): groups of 4 and of 2 give the
    log-probs and entropy of one forward per row, on every response column."""
    config, params = load_pretrained(hf_checkpoint(case)[0])
    batch = _grouped_batch(0, vocab=config.vocab_size)
    fn = lambda group: jax.jit(functools.partial(
        logprobs.response_log_probs, config=config, chunk_size=4, with_entropy=True,
        group=group))(params, *batch)
    want_lp, want_ent = fn(1)
    for group in (4, 2):
        got_lp, got_ent = fn(group)
        np.testing.assert_allclose(got_lp, want_lp, atol=2e-5, rtol=0, err_msg=f"k={group}")
        np.testing.assert_allclose(got_ent, want_ent, atol=2e-5, rtol=0, err_msg=f"k={group}")


def test_rows_that_do_not_share_their_prompt_give_other_log_probs(hf_checkpoint):
    """The check above can fail: with a different prompt in one row of a group, the
    shared layout (which reads the group's first prompt) no longer gives that row's
    plain log-probs, while the other groups' rows are unchanged."""
    config, params = load_pretrained(hf_checkpoint("llama_untied")[0])
    ids, pmask, resp, rmask = _grouped_batch(1, vocab=config.vocab_size)
    ids = ids.at[5].set(jnp.where(pmask[5] > 0, (ids[5] + 1) % config.vocab_size, 0))
    fn = lambda group: jax.jit(functools.partial(
        logprobs.response_log_probs, config=config, group=group))(params, ids, pmask, resp,
                                                                   rmask)[0]
    plain, shared = np.asarray(fn(1)), np.asarray(fn(4))
    assert np.abs(plain[5] - shared[5])[np.asarray(rmask[5]) > 0].max() > 1e-3
    np.testing.assert_allclose(shared[8:], plain[8:], atol=2e-5, rtol=0)


def test_gradients_equal_the_plain_layout():
    """d(sum of weighted log-probs)/d(params): the prompt's gradient is the sum over its
    rows either way."""
    params = transformer.init_params(_MODEL, jax.random.key(0))
    batch = _grouped_batch(2)
    weights = jax.random.normal(jax.random.key(3), batch[2].shape) * batch[3]

    def grads(group):
        loss = lambda prm: jnp.sum(weights * logprobs.response_log_probs(
            prm, *batch, config=_MODEL, chunk_size=4, group=group)[0])
        return jax.jit(jax.grad(loss))(params)

    want = grads(1)
    chex.assert_trees_all_close(grads(4), want, atol=2e-6, rtol=1e-5)
    assert float(optax.tree.norm(want)) > 0


def test_values_and_micro_batches_with_buckets_equal_the_plain_layout():
    """Critic values, and log-probs and values over micro-batches of 8 rows (2 groups)
    with 3 buckets: each group's responses packed, sorting moves whole groups, the
    outputs come back in order (zero after each row's used length)."""
    params = transformer.init_params(_MODEL, jax.random.key(0))
    critic = init_critic_params(params, jax.random.key(1), stddev=0.5)
    batch = _grouped_batch(3, groups=4, r=40)
    inside = np.arange(40)[None] < _used(batch[3])[:, None]
    vfn = functools.partial(logprobs.response_values, config=_MODEL)
    want_v = jax.jit(vfn)(critic, *batch)
    np.testing.assert_allclose(jax.jit(functools.partial(vfn, group=4))(critic, *batch),
                               want_v, atol=2e-5, rtol=0)
    fn = functools.partial(logprobs.response_log_probs, config=_MODEL, chunk_size=4)
    want = np.asarray(jax.jit(fn)(params, *batch)[0])
    sizes = buckets.sizes(40, 3)
    assert buckets.sizes(4 * 40, 3) == (64, 112, 160)  # the packed sizes of a group
    got = np.asarray(jax.jit(logprobs.in_micro_batches(fn, 8, sizes, group=4))(
        params, *batch)[0])
    np.testing.assert_allclose(got[inside], want[inside], atol=2e-5, rtol=0)
    assert not got[~inside].any()
    got_v = np.asarray(jax.jit(logprobs.in_micro_batches(vfn, 8, sizes, group=4))(
        critic, *batch))
    np.testing.assert_allclose(got_v[inside], np.asarray(want_v)[inside], atol=2e-5, rtol=0)


def test_update_with_shared_prompts_equals_the_plain_update():
    """One mini-batch of 8 rows (2 prompts x 4), micro-batches of 4, shuffled, in
    buckets: the parameters and loss terms of the plain update."""
    batch = _grouped_batch(4, groups=2, r=40)
    ids, pmask, resp, rmask = batch
    rng = np.random.default_rng(5)
    b, r = rmask.shape
    fields = {"prompt_ids": ids, "prompt_mask": pmask, "responses": resp, "response_mask": rmask,
              "old_log_probs": jnp.asarray(-rng.random((b, r)) * 3, jnp.float32),
              "ref_log_probs": jnp.asarray(-rng.random((b, r)) * 3, jnp.float32),
              "advantages": jnp.asarray(np.repeat(rng.normal(size=(b, 1)), r, 1), jnp.float32)}
    actor = _actor_settings(4)
    actor = dataclasses.replace(actor, update=dataclasses.replace(
        actor.update, mini_batch=8, micro_batch=4, shuffle=True))
    params = transformer.init_params(_MODEL, jax.random.key(0))
    optimizer = make_optimizer(actor.optim)

    def run(group):
        loss_fn = functools.partial(update.actor_loss, model=_MODEL, actor=actor,
                                    temperature=1.0, chunk_size=4, group=group)
        fn = jax.jit(functools.partial(update.run_updates, loss_fn=loss_fn, optimizer=optimizer,
                                       update=actor.update, bucket_sizes=buckets.sizes(r, 2),
                                       group=group))
        return fn(update.ModelState(params, optimizer.init(params)), fields,
                  jax.random.key(1), actor.optim.lr)

    want, want_m, _ = run(1)
    got, got_m, _ = run(4)
    chex.assert_trees_all_close(got.params, want.params, atol=2e-6, rtol=0)
    for key in ("pg_loss", "kl_loss", "entropy_loss", "grad_norm"):
        np.testing.assert_allclose(got_m[key], want_m[key], rtol=2e-5, err_msg=key)
    assert float(want_m["grad_norm"]) > 0


def test_sort_order_moves_whole_groups_by_their_longest_row():
    lengths = jnp.asarray([3, 9, 1, 1, 4, 5])  # groups of 2: longest 9, 1, 5
    np.testing.assert_array_equal(buckets.sort_order(lengths, 2), [2, 3, 4, 5, 0, 1])
    np.testing.assert_array_equal(buckets.expand_groups(jnp.asarray([1, 0]), 3),
                                  [3, 4, 5, 0, 1, 2])


def test_prompt_group_divides_the_samples_and_each_shards_rows():
    assert logprobs.prompt_group(8, 64) == 8
    assert logprobs.prompt_group(8, 12) == 4
    assert logprobs.prompt_group(5, 64) == 1
    assert logprobs.prompt_group(1, 64) == 1
    mesh = sharding.make_mesh(sharding.MeshSettings(data=-1, fsdp=1, tensor=1))
    shards = mesh.shape["data"]
    with sharding.Sharder(mesh).active():
        # each shard holds 16 / shards rows of a 16-row micro-batch
        assert logprobs.prompt_group(8, 16) == np.gcd(8, 16 // shards)
        if shards > 1:
            assert logprobs.prompt_group(8, shards + 1) == 1  # does not split evenly


def test_shared_prompt_layout_checks_its_shapes():
    params = transformer.init_params(_MODEL, jax.random.key(0))
    tokens = jnp.ones((2, 6 + 3 * 4), jnp.int32)
    shared = transformer.SharedPrompt(jnp.ones((2, 6), jnp.int32), jnp.ones((8, 10), jnp.int32))
    with pytest.raises(ValueError, match=r"tokens \[G, P \+ k R\]"):
        transformer.forward(params, tokens, tokens, shared, config=_MODEL)
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        logprobs.response_hidden(params, *_grouped_batch(0, groups=2, k=4), config=_MODEL,
                                 group=3)


def test_prompt_mismatch_counts_rows_that_are_not_their_groups():
    ids = jnp.asarray([[0, 5, 6], [0, 5, 6], [7, 8, 9], [7, 8, 9]])
    mask = jnp.asarray([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    assert float(logprobs.prompt_mismatch(ids, mask, 2)) == 0
    assert float(logprobs.prompt_mismatch(ids, mask, 4)) == 2  # rows 2, 3 differ from row 0
    assert float(logprobs.prompt_mismatch(ids.at[1, 2].set(4), mask, 2)) == 1
    assert float(logprobs.prompt_mismatch(ids, mask.at[3, 0].set(0), 2)) == 1  # mask only


def test_trainer_stops_when_rows_do_not_share_their_prompt(tmp_path, monkeypatch):
    from jrl.train import run
    from tests.trainer.tiny import tiny_config

    monkeypatch.setattr(logprobs, "prompt_mismatch", lambda *a: jnp.float32(3))
    with pytest.raises(ValueError, match=r"step 0: 3 rows of the batch do not hold the "
                                         r"prompt.*actor.share_prompts=False"):
        run(tiny_config(), str(tmp_path / "shared"))
    # With sharing off the check (and the layout) does not apply.
    summary = run(tiny_config(**{"actor.share_prompts": False}), str(tmp_path / "plain"))
    assert summary["step"] == 2


def _used(mask):
    return np.asarray(buckets.used_lengths(mask))


@pytest.mark.parametrize("case", ["llama_untied", "qwen2_untied", "qwen3_untied"])
def test_packed_log_probs_equal_the_plain_layout_on_every_used_column(hf_checkpoint, case):
    """Each group's responses end to end, cut after their used lengths (one of them
    empty), in S columns (the smallest that holds the largest total, and the most):
    the plain layout's log-probs and entropy on every used column, zeros after."""
    config, params = load_pretrained(hf_checkpoint(case)[0])
    ids, pmask, resp, rmask = _grouped_batch(5, vocab=config.vocab_size)
    rmask = rmask.at[5].set(0)
    resp = resp * rmask
    used = _used(rmask)
    inside = np.arange(resp.shape[1])[None] < used[:, None]
    want = jax.jit(functools.partial(logprobs.response_log_probs, config=config, chunk_size=4,
                                     with_entropy=True))(params, ids, pmask, resp, rmask)
    smallest = int(used.reshape(-1, 4).sum(1).max())
    for size in (smallest, 4 * resp.shape[1]):
        got = jax.jit(functools.partial(logprobs.response_log_probs, config=config, chunk_size=4,
                                        with_entropy=True, group=4, packed=size))(
            params, ids, pmask, resp, rmask)
        for g, w, what in zip(got, want, ("log-probs", "entropy"), strict=True):
            g, w = np.asarray(g), np.asarray(w)
            np.testing.assert_allclose(g[inside], w[inside], atol=2e-5, rtol=0,
                                       err_msg=f"{what}, S={size}")
            assert not g[~inside].any(), what


def test_packing_maps_by_hand():
    # Two groups of 3 rows, R = 4; used lengths 2, 0, 3 and 4, 1, 1; S = 6.
    mask = jnp.asarray([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0],
                        [1, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0]])
    rows, packed, valid, first, in_row = (np.asarray(x) for x in logprobs.packing(mask, 3, 6))
    # Group 0 packs row 0's 2 columns, then row 2's 3; group 1 all 6 columns.
    np.testing.assert_array_equal(packed[0, :5], [0, 1, 8, 9, 10])
    np.testing.assert_array_equal(packed[1], [0, 1, 2, 3, 4, 8])
    np.testing.assert_array_equal(valid, [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(first, [[1, 0, 1, 0, 0, 0], [1, 0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(rows[0, [0, 1, 8, 9, 10]], [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(rows[1, [0, 1, 2, 3, 4, 8]], [0, 1, 2, 3, 4, 5])
    np.testing.assert_array_equal(in_row.sum(1), [2, 0, 3, 4, 1, 1])


def test_packed_gradients_and_values_equal_the_plain_layout():
    params = transformer.init_params(_MODEL, jax.random.key(0))
    critic = init_critic_params(params, jax.random.key(1), stddev=0.5)
    batch = _grouped_batch(6)
    inside = np.arange(batch[2].shape[1])[None] < _used(batch[3])[:, None]
    weights = jax.random.normal(jax.random.key(3), batch[2].shape) * batch[3]
    size = int(_used(batch[3]).reshape(-1, 4).sum(1).max())

    def grads(**kw):
        loss = lambda prm: jnp.sum(weights * logprobs.response_log_probs(
            prm, *batch, config=_MODEL, chunk_size=4, **kw)[0])
        return jax.jit(jax.grad(loss))(params)

    chex.assert_trees_all_close(grads(group=4, packed=size), grads(), atol=2e-6, rtol=1e-5)
    vfn = functools.partial(logprobs.response_values, config=_MODEL)
    got = np.asarray(jax.jit(functools.partial(vfn, group=4, packed=size))(critic, *batch))
    want = np.asarray(jax.jit(vfn)(critic, *batch))
    np.testing.assert_allclose(got[inside], want[inside], atol=2e-5, rtol=0)
