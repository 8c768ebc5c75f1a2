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

from jrl import sharding
from jrl.models import ModelConfig, init_params, load_pretrained, transformer
from jrl.models.heads import init_critic_params
from jrl.optim import make_optimizer
from jrl.rl import buckets, logprobs, update
from tests.rl.test_update import _MODEL, _actor_settings


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
    """Critic values, and log-probs over micro-batches of 8 rows (2 groups) with
    response buckets: sorting moves whole groups and the outputs come back in order."""
    params = transformer.init_params(_MODEL, jax.random.key(0))
    critic = init_critic_params(params, jax.random.key(1), stddev=0.5)
    batch = _grouped_batch(3, groups=4)
    vfn = functools.partial(logprobs.response_values, config=_MODEL)
    np.testing.assert_allclose(jax.jit(functools.partial(vfn, group=4))(critic, *batch),
                               jax.jit(vfn)(critic, *batch), atol=2e-5, rtol=0)
    fn = functools.partial(logprobs.response_log_probs, config=_MODEL, chunk_size=4)
    want = jax.jit(fn)(params, *batch)[0]
    sizes = buckets.sizes(batch[2].shape[1], 2)
    got = jax.jit(logprobs.in_micro_batches(fn, 8, sizes, group=4))(params, *batch)[0]
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


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
        loss_fn = functools.partial(update.actor_loss, model_config=_MODEL, actor=actor,
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


def test_trainer_stops_when_rows_do_not_share_their_prompt(tmp_path, monkeypatch, capsys):
    from jrl.train import run
    from tests.tiny import tiny_config

    calls = []

    def mismatch(ids, mask, group):
        calls.append(group)
        return jnp.float32(3)

    monkeypatch.setattr(logprobs, "prompt_mismatch", mismatch)
    with pytest.raises(ValueError, match=r"step 0: 3 rows of the batch do not hold the "
                                         r"prompt.*group of 2 rows.*actor.share_prompts=False"):
        run(tiny_config(), str(tmp_path / "shared"))
    assert calls == [2]  # checked once, before any pass ran
    # The start-up report: n = 2 and micro-batches of 2 rows in every pass (GRPO: no critic).
    assert ("shared prompts, rows per prompt forward: log-prob/value passes 2, actor "
            "update 2\n") in capsys.readouterr().out
    # With sharing off the check (and the layout) does not apply.
    summary = run(tiny_config(**{"actor.share_prompts": False}), str(tmp_path / "plain"))
    assert summary["step"] == 2
    assert "shared prompts: off (actor.share_prompts=False)" in capsys.readouterr().out
    # Sharing on, but one row per micro-batch in every pass: nothing to share, and why.
    one_row = {"actor.ppo_micro_batch_size": 1, "rollout.log_prob_micro_batch_size": 1,
               "trainer.total_training_steps": 1}
    run(tiny_config(**one_row), str(tmp_path / "one_row"))
    assert ("log-prob/value passes 1, actor update 1 (none: in every pass the rows a "
            "micro-batch puts on each of the 1 batch shards have no factor above 1 in "
            "common with rollout.n=2)") in capsys.readouterr().out


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("p, r", [(5, 7), (4, 7), (5, 6), (4, 0)])
def test_attention_sees_even_lengths_and_outputs_keep_their_shape(monkeypatch, group, p, r):
    """cuDNN's attention needs even query and key lengths: `response_hidden` adds a masked
    column where P or R is odd, and the real tokens' hidden states do not change (the
    plain layout with the odd lengths, attention in XLA, is the reference)."""
    config = ModelConfig.preset("tiny", num_layers=2, attention_impl="xla")
    params = init_params(config, jax.random.key(0))
    rng = np.random.default_rng(p * 10 + r)
    prompt = np.repeat(rng.integers(3, 100, (2, p)), 2, axis=0)  # rows 2i, 2i+1 share one
    prompt_mask = np.ones_like(prompt)
    prompt_mask[:2, :1] = 0  # a left-padded prompt
    responses = rng.integers(3, 100, (4, r))
    response_mask = np.ones_like(responses)
    if r:
        response_mask[1, r - 2:] = 0

    want = None
    if r:
        tokens, mask, positions = logprobs.sequence_inputs(prompt, prompt_mask, responses,
                                                           response_mask)
        want = transformer.forward(params, tokens, positions, mask, config=config)[0][
            :, p - 1 : p + r - 1]
    lengths = []
    choose = transformer._attention_impl
    monkeypatch.setattr(transformer, "_attention_impl",
                        lambda c, dtype, q, k: lengths.append((q, k)) or choose(c, dtype, q, k))
    got = logprobs.response_hidden(params, prompt, prompt_mask, responses, response_mask,
                                   config=config, group=group)
    chex.assert_shape(got, (4, r, config.hidden_size))
    assert lengths and all(q % 2 == 0 and k % 2 == 0 for q, k in lengths), lengths
    log_probs, _ = logprobs.response_log_probs(params, prompt, prompt_mask, responses,
                                               response_mask, config=config, group=group)
    chex.assert_shape(log_probs, (4, r))
    if r:
        real = np.asarray(response_mask, bool)
        np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=1e-5,
                                   atol=1e-5)
