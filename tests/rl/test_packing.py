"""Packed token-budget passes (jrl.rl.packing) against the padded layout.

The references are the padded passes (`logprobs.response_log_probs`, `response_values`,
and for the attention a dense mask built here from the segment layout), which see one
sequence per row. A leak across packed sequences, a wrong RoPE restart or a wrong
gather back to the response grid moves the numbers far past the tolerances: the tiny
model's initializer range is large, so every token's distribution is sharp.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels import packed_attention
from jrl.models import transformer
from jrl.models.config import ModelConfig
from jrl.models.heads import init_critic_params
from jrl.rl import logprobs, packing

P, R = 6, 10
PROMPT_LENS = np.array([6, 3, 1, 2, 5, 4, 6, 2])
RESPONSE_LENS = np.array([10, 4, 0, 9, 1, 7, 3, 10])
RTOL, ATOL = 2e-5, 2e-6


def tiny_config(**overrides):
    kwargs = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, initializer_range=0.3, attention_impl="xla")
    return ModelConfig.preset("tiny", **{**kwargs, **overrides})


CONFIG = tiny_config()


@functools.cache
def params():
    return jax.jit(transformer.init_params, static_argnums=0)(CONFIG, jax.random.key(0))


def make_batch(seed=0):
    rng = np.random.default_rng(seed)
    prompt_mask = (np.arange(P)[None] >= P - PROMPT_LENS[:, None]).astype(np.int32)
    response_mask = (np.arange(R)[None] < RESPONSE_LENS[:, None]).astype(np.int32)
    ids = lambda mask: np.where(mask == 1, rng.integers(3, CONFIG.vocab_size, mask.shape),
                                0).astype(np.int32)
    prompt_ids, responses = ids(prompt_mask), ids(response_mask)
    return prompt_ids, prompt_mask, responses, response_mask


def test_plan_places_every_token_once_within_a_row():
    prompt_ids, prompt_mask, responses, response_mask = make_batch()
    length = P + R  # a packed row holds the longest possible sequence
    plan = jax.jit(packing.for_sequences, static_argnums=4)(
        prompt_ids, prompt_mask, responses, response_mask, 2 * length + 5)
    mask = np.concatenate([prompt_mask, response_mask], 1).astype(bool)
    tokens = np.concatenate([prompt_ids, responses], 1)
    slots = np.asarray(plan.slots_bt)
    real = slots[mask]
    assert len(set(real.tolist())) == mask.sum()  # no two tokens share a slot
    for i in range(len(mask)):
        row = slots[i][mask[i]]
        # A sequence's tokens are consecutive slots of one packed row, in order.
        np.testing.assert_array_equal(row, row[0] + np.arange(len(row)))
        assert row[0] // length == row[-1] // length
        np.testing.assert_array_equal(np.asarray(plan.tokens_f)[row], tokens[i][mask[i]])
        np.testing.assert_array_equal(np.asarray(plan.positions_f)[row], np.arange(len(row)))
        assert np.all(np.asarray(plan.segment_ids_f)[row] == i + 1)
    # Sequence lengths 16, 7, 1, 11, 6, 11, 9, 12 in rows of 16, first fit, longest
    # first: [16], [12, 1], [11], [11], [9, 7], [6]: 6 rows; a budget of 37 tokens holds
    # 2 rows per micro-batch (one device), so 3 micro-batches.
    np.testing.assert_array_equal(np.asarray(plan.micro_b), [0, 2, 0, 1, 2, 1, 2, 0])
    assert int(plan.num_micros) == 3
    assert np.all(np.asarray(plan.segment_ids_f)[np.setdiff1d(np.arange(8 * length), real)] == 0)


def test_segment_offsets():
    seg = jnp.array([[1, 1, 1, 4, 4, 0, 0], [2, 2, 2, 2, 2, 2, 2], [0] * 7], jnp.int32)
    offsets, lengths = packed_attention.segment_offsets(seg, 3)
    np.testing.assert_array_equal(offsets, [[0, 3, -1, -1], [0, -1, -1, -1], [-1] * 4])
    np.testing.assert_array_equal(lengths, [[3, 2, -1], [7, -1, -1], [-1] * 3])


@pytest.mark.parametrize("max_segments", [1, 3])
def test_cudnn_is_handed_the_segment_offsets(monkeypatch, max_segments):
    """JAX passes cuDNN the offsets only with two or more segments a row
    (`get_max_seg_per_batch`); without them cuDNN starts every row's tokens at slot 0,
    so a left-padded row (one segment, under `mesh.context`) must still carry them."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    seen = {}

    def fake(q, k, v, *, q_offsets, kv_offsets, q_seqlen, kv_seqlen, **kwargs):
        seen.update(q_offsets=q_offsets, kv_offsets=kv_offsets, q_seqlen=q_seqlen)
        return jnp.zeros_like(q)

    monkeypatch.setattr(cudnn, "dot_product_attention", fake)
    ids = jnp.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], jnp.int32)  # left padding
    q = jnp.ones((2, 6, 2, 8), jnp.bfloat16)
    packed_attention._cudnn(q, q[:, :, :1], q[:, :, :1],
                            packed_attention.segments(ids, max_segments))
    for key in ("q_offsets", "kv_offsets"):
        assert cudnn.get_max_seg_per_batch(seen[key]) > 1, seen[key].shape
        np.testing.assert_array_equal(np.asarray(seen[key])[:, 0], [2, 0])
    np.testing.assert_array_equal(np.asarray(seen["q_seqlen"])[:, 0], [4, 6])


def test_dense_mask_blocks_other_segments_and_the_future():
    mask = np.asarray(packed_attention.dense_mask(jnp.array([[1, 1, 2, 2, 0]])))[0, 0]
    expected = np.array([[1, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0],
                         [0, 0, 1, 0, 0],
                         [0, 0, 1, 1, 0],
                         [0, 0, 0, 0, 1]], bool)
    np.testing.assert_array_equal(mask, expected)


@pytest.mark.parametrize("budget", [16, 40, 160])
def test_packed_log_probs_equal_padded(budget):
    """Rows of 16 slots, 1, 2 or 8 of them per micro-batch."""
    batch = make_batch()
    config = CONFIG
    padded = jax.jit(functools.partial(logprobs.response_log_probs, config=config,
                                       with_entropy=True, temperature=0.7))(params(), *batch)
    packed = jax.jit(lambda p: logprobs.packed_pass(
        functools.partial(logprobs.packed_log_probs, config=config, with_entropy=True,
                          temperature=0.7), p, packing.for_sequences(*batch, budget),
        batch[3]))(params())
    mask = batch[3]
    for got, want in zip(packed, padded, strict=True):
        np.testing.assert_allclose(np.where(mask, got, 0), np.where(mask, want, 0),
                                   rtol=RTOL, atol=ATOL)
        np.testing.assert_array_equal(np.asarray(got)[mask == 0], 0)


def test_packed_values_equal_padded():
    batch = make_batch(1)
    critic = init_critic_params(params(), jax.random.key(1))
    padded = jax.jit(functools.partial(logprobs.response_values, config=CONFIG))(critic, *batch)
    packed = jax.jit(lambda p: logprobs.packed_pass(
        functools.partial(logprobs.packed_values, config=CONFIG), p,
        packing.for_sequences(*batch, 32), batch[3]))(critic)
    np.testing.assert_allclose(np.where(batch[3], packed, 0), np.where(batch[3], padded, 0),
                               rtol=RTOL, atol=ATOL)


def test_packing_leak_is_detected():
    """The check above would fail if attention crossed segments: with the segments
    merged (one id for the whole row), the log-probs move well past the tolerance."""
    batch = make_batch()
    plan = packing.for_sequences(*batch, 160)
    merged = plan.replace(segment_ids_f=jnp.where(plan.segment_ids_f > 0, 1, 0))
    fn = functools.partial(logprobs.packed_log_probs, params(), config=CONFIG)
    shapes = jax.eval_shape(fn, packing.Micro(plan, jnp.int32(0)))
    good = packing.map_responses(fn, plan, batch[3], shapes)[0]
    leaked = packing.map_responses(fn, merged, batch[3], shapes)[0]
    assert np.max(np.abs(np.asarray(good) - np.asarray(leaked))) > 1e-2


def test_splash_attention_matches_reference_in_interpret_mode():
    length = 256
    seg = np.zeros((2, length), np.int32)
    seg[0, :100], seg[0, 100:230] = 1, 2
    seg[1, :50], seg[1, 50:] = 1, 2
    seg = jnp.asarray(seg)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, length, 4, 128)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, length, 2, 128)), jnp.float32) for _ in range(2))
    used = (seg > 0)[:, :, None, None]
    segments = packed_attention.segments(seg, 4)
    splash = lambda q, k, v: packed_attention.splash(q, k, v, seg, interpret=True, block=128)
    reference = lambda q, k, v: packed_attention.attend(q, k, v, segments, "xla")
    chex.assert_trees_all_close(jnp.where(used, splash(q, k, v), 0),
                                jnp.where(used, reference(q, k, v), 0), atol=1e-5)
    grads = lambda fn: jax.grad(lambda *a: jnp.sum(jnp.where(used, fn(*a), 0) ** 2),
                                argnums=(0, 1, 2))(q, k, v)
    chex.assert_trees_all_close(grads(splash), grads(reference), atol=1e-4, rtol=1e-4)


def test_splash_attention_in_the_model_matches_xla():
    """`attention_impl='splash'` (Pallas' TPU splash attention, interpreted here): padded
    rows of 128 tokens (one segment each) and packed rows give the XLA path's hidden
    states and parameter gradients."""
    rng = np.random.default_rng(2)
    lengths = np.array([128, 70, 5])
    mask = (np.arange(128)[None] >= 128 - lengths[:, None]).astype(np.int32)
    tokens = jnp.asarray(np.where(mask, rng.integers(3, CONFIG.vocab_size, mask.shape), 0),
                         jnp.int32)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    seg = np.zeros((1, 128), np.int32)
    seg[0, :60], seg[0, 60:100] = 1, 2
    packed_positions = jnp.asarray(np.concatenate([np.arange(60), np.arange(40),
                                                   np.zeros(28, int)])[None], jnp.int32)
    packed = packed_attention.segments(jnp.asarray(seg), 2)
    cases = [(tokens, positions, jnp.asarray(mask), mask > 0),
             (tokens[:1], packed_positions, packed, seg > 0)]
    for toks, pos, how, used in cases:
        (_, want), want_grads = _hidden_and_grads(toks, pos, how, used, "xla")
        (_, got), got_grads = _hidden_and_grads(toks, pos, how, used, "splash")
        np.testing.assert_allclose(np.asarray(got)[used], np.asarray(want)[used], atol=2e-5,
                                   rtol=2e-5)
        chex.assert_trees_all_close(got_grads, want_grads, atol=2e-4, rtol=2e-4)


def _hidden_and_grads(tokens, positions, mask, used, impl):
    """((loss, hidden states), parameter gradients) of a forward with `impl` attention."""
    config = tiny_config(attention_impl=impl)

    def loss(p):
        hidden, _ = transformer.forward(p, tokens, positions, mask, config=config)
        return jnp.sum(jnp.where(used[..., None], hidden, 0) ** 2), hidden

    return jax.value_and_grad(loss, has_aux=True)(params())


def test_a_large_budget_runs_no_more_rows_than_sequences():
    """A budget of 100 rows over 8 sequences runs 8 rows (one micro-batch), not 100."""
    plan = packing.for_sequences(*make_batch(), 100 * (P + R))
    assert (plan.rows, int(plan.num_micros)) == (8, 1)
