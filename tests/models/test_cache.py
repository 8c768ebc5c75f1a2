"""KV cache: prefill + one-token decode steps reproduce the full forward and HF greedy decoding."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jrl.models import (
    PRESETS,
    attention_mask,
    forward_logits,
    init_cache,
    load_pretrained,
    positions_from_mask,
)
from jrl.models.cache import KVCache, PagedCache, layer_slots, ring_slots
from jrl.rollout import sampler

CASE = "qwen3_untied"  # q/k norm, GQA, head_dim != hidden / heads
NUM_NEW = 6


@pytest.fixture(scope="module")
def model(hf_checkpoint):
    path, torch_model = hf_checkpoint(CASE)
    config, params = load_pretrained(path)
    return config, params, torch_model


@functools.partial(jax.jit, static_argnames="config")
def _full_logits(params, tokens_bt, mask_bt, *, config):
    logits, _ = forward_logits(
        params, tokens_bt, positions_from_mask(mask_bt), mask_bt, config=config
    )
    return logits


@functools.partial(jax.jit, static_argnames="config")
def _cached_step(params, tokens_bt, positions_bt, key_mask_bs, cache, write_index, *, config):
    return forward_logits(
        params, tokens_bt, positions_bt, key_mask_bs, cache, write_index, config=config
    )


def _prefill(params, config, batch, max_len):
    """Prefill the left-padded prompts into a fresh cache of max_len slots."""
    prompt_len = batch["tokens"].shape[1]
    key_mask = jnp.zeros((batch["tokens"].shape[0], max_len), jnp.int32)
    key_mask = key_mask.at[:, :prompt_len].set(jnp.asarray(batch["mask"]))
    cache = init_cache(config, batch["tokens"].shape[0], max_len)
    logits, cache = _cached_step(
        params, jnp.asarray(batch["tokens"]), jnp.asarray(batch["positions"]), key_mask,
        cache, jnp.int32(0), config=config,
    )
    return logits, cache, key_mask


def _decode(params, config, token_b, step, prompt_lengths, cache, key_mask, prompt_len):
    """Feed one token per row at slot prompt_len + step."""
    slot = prompt_len + step
    key_mask = key_mask.at[:, slot].set(1)
    positions = jnp.asarray(prompt_lengths + step, jnp.int32)[:, None]
    logits, cache = _cached_step(
        params, jnp.asarray(token_b, jnp.int32)[:, None], positions, key_mask, cache,
        jnp.int32(slot), config=config,
    )
    return logits[:, 0], cache, key_mask


def test_attention_mask_training_and_decode():
    # Row 0: one pad token then two real ones; row 1: three real tokens.
    key_mask = jnp.array([[0, 1, 1], [1, 1, 1]])
    expected_row0 = [[1, 0, 0],  # the padding query sees only its own slot
                     [0, 1, 0],
                     [0, 1, 1]]
    expected_row1 = [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    np.testing.assert_array_equal(attention_mask(key_mask, 3, None)[:, 0],
                                  [expected_row0, expected_row1])
    # Decode at slot 3 of 5: slot 4 is unwritten, slot 0 is padding.
    cache_mask = jnp.array([[0, 1, 1, 1, 0]])
    np.testing.assert_array_equal(attention_mask(cache_mask, 1, 3)[0, 0], [[0, 1, 1, 1, 0]])


def test_init_cache_shape(model):
    config, _, _ = model
    cache = init_cache(config, batch_size=3, max_len=20)
    shape = (3, config.num_kv_heads, 20, config.head_dim)
    assert len(cache.k) == len(cache.v) == config.num_layers
    assert all(b.shape == shape and b.dtype == jnp.float32 for b in cache.k + cache.v)
    assert cache.max_len == 20


def test_ring_buffer_holds_each_slot_at_its_index_mod_the_window():
    """A sliding-window layer's ring of W = 3 slots, written by hand: a prefill of 5 tokens
    keeps the last 3 (slot s at index s mod 3), each decode step overwrites the oldest, and
    `ring_slots` names the slot each index holds (-1: none yet)."""
    config = dataclasses.replace(PRESETS["tiny-gemma"], num_layers=2, sliding_window=3,
                                 num_kv_heads=1, head_dim=2)
    cache = init_cache(config, batch_size=1, max_len=12, ring=True)
    assert [b.shape[2] for b in cache.k] == [3, 12]  # layer 0 sliding, layer 1 global
    assert cache.max_len == 12
    token = lambda *slots: jnp.repeat(
        jnp.asarray(slots, jnp.float32).reshape(1, -1, 1, 1) + 100, 2, axis=3)
    cache = cache.write_ring(0, 0, token(0, 1, 2, 3, 4), -token(0, 1, 2, 3, 4))
    np.testing.assert_array_equal(cache.k[0][0, 0, :, 0], [103, 104, 102])
    np.testing.assert_array_equal(cache.v[0][0, 0, :, 0], [-103, -104, -102])
    np.testing.assert_array_equal(ring_slots(4, 3), [3, 4, 2])
    for slot in (5, 6):
        cache = cache.write_ring(0, jnp.int32(slot), token(slot), token(slot))
    np.testing.assert_array_equal(cache.k[0][0, 0, :, 0], [106, 104, 105])
    np.testing.assert_array_equal(ring_slots(6, 3), [6, 4, 5])
    np.testing.assert_array_equal(ring_slots(1, 3), [0, 1, -1])
    # A global layer never takes a ring; nor does a window longer than the cache.
    assert layer_slots(config, 12, ring=True) == (3, 12)
    assert layer_slots(config, 2, ring=True) == (2, 2)
    assert layer_slots(config, 12) == (12, 12)
    # A model of sliding layers only keeps full buffers: the cache's length is its
    # longest buffer's.
    only_sliding = dataclasses.replace(config, layer_types=("sliding_attention",) * 2)
    assert layer_slots(only_sliding, 12, ring=True) == (12, 12)


def test_gemma3_ring_cache_is_a_fifth_of_a_full_one_at_long_responses():
    """Gemma 3 1B (22 of 26 layers sliding, window 512) at P512 + R8192: the rollout cache
    is 20.4% of full buffers', as 4 full layers plus 22 windows give by hand."""
    config = PRESETS["gemma-3-1b"]
    slots = 512 + 8192
    assert config.layer_types.count("sliding_attention") == 22
    ring = sum(layer_slots(config, slots, ring=True))
    assert ring == 4 * slots + 22 * 512
    assert ring / sum(layer_slots(config, slots)) == pytest.approx(46080 / 226304)


def test_cache_scatters_are_declared_unique():
    """The paged cache's write and the ring buffer's prefill write reach XLA as scatters
    with `unique_indices` (a GPU scatter without it writes each 16-bit element by a
    compare-and-swap loop, which rows writing the trash page at one offset contend for).
    Read off the lowered programs: nothing is compiled."""
    pool = jnp.zeros((2, 9, 4, 8), jnp.bfloat16)
    paged_cache = PagedCache(k=(pool,), v=(pool,), num_slots=16,
                             block_table=jnp.zeros((3, 4), jnp.int32),
                             shift=jnp.zeros((3,), jnp.int32))
    new = jnp.ones((3, 2, 2, 8), jnp.bfloat16)  # [B, T, K, H]
    ring = KVCache(k=(jnp.zeros((3, 2, 4, 8), jnp.bfloat16),),
                   v=(jnp.zeros((3, 2, 4, 8), jnp.bfloat16),))
    texts = {
        "paged": jax.jit(lambda c, i, n: c.write(0, i, n, n)).lower(
            paged_cache, jnp.zeros((3,), jnp.int32), new).as_text(),
        "ring": jax.jit(lambda c, i, n: c.write_ring(0, i, n, n)).lower(
            ring, jnp.int32(5), new).as_text(),
    }
    for name, text in texts.items():
        scatters = [line for line in text.splitlines() if "stablehlo.scatter" in line]
        assert len(scatters) == 2, (name, scatters)
        assert all("unique_indices = true" in line for line in scatters), (name, scatters)


def test_prefill_then_decode_matches_full_forward(model, ragged_batch):
    config, params, _ = model
    batch, prompt_len = ragged_batch, ragged_batch["tokens"].shape[1]
    rng = np.random.default_rng(1)
    response = rng.integers(3, config.vocab_size, (batch["tokens"].shape[0], NUM_NEW))
    full_tokens = np.concatenate([batch["tokens"], response], axis=1).astype(np.int32)
    full_mask = np.concatenate([batch["mask"], np.ones_like(response)], axis=1).astype(np.int32)
    expected = np.asarray(_full_logits(params, full_tokens, full_mask, config=config))

    # Two spare slots stay unwritten: they must be masked out.
    logits, cache, key_mask = _prefill(params, config, batch, prompt_len + NUM_NEW + 2)
    valid = batch["mask"].astype(bool)
    np.testing.assert_allclose(np.asarray(logits)[valid], expected[:, :prompt_len][valid],
                               atol=1e-5, rtol=0)
    prompt_lengths = batch["mask"].sum(axis=1)
    for step in range(NUM_NEW):
        step_logits, cache, key_mask = _decode(
            params, config, response[:, step], step, prompt_lengths, cache, key_mask, prompt_len
        )
        np.testing.assert_allclose(np.asarray(step_logits), expected[:, prompt_len + step],
                                   atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def greedy_cached(model, ragged_batch):
    """Greedy continuation of the ragged batch through the cache."""
    config, params, _ = model
    prompt_len = ragged_batch["tokens"].shape[1]
    logits, cache, key_mask = _prefill(params, config, ragged_batch, prompt_len + NUM_NEW)
    prompt_lengths = ragged_batch["mask"].sum(axis=1)
    token = np.asarray(jnp.argmax(logits[:, -1], axis=-1))
    generated = [token]
    for step in range(NUM_NEW - 1):
        step_logits, cache, key_mask = _decode(
            params, config, token, step, prompt_lengths, cache, key_mask, prompt_len
        )
        token = np.asarray(jnp.argmax(step_logits, axis=-1))
        generated.append(token)
    return np.stack(generated, axis=1)


def test_cached_greedy_matches_recomputed_greedy(model, ragged_batch, greedy_cached):
    config, params, _ = model
    batch, prompt_len = ragged_batch, ragged_batch["tokens"].shape[1]
    num_rows = batch["tokens"].shape[0]
    # A fixed-size buffer, filled left to right, keeps this at one compilation.
    tokens = np.zeros((num_rows, prompt_len + NUM_NEW), np.int32)
    mask = np.zeros_like(tokens)
    tokens[:, :prompt_len], mask[:, :prompt_len] = batch["tokens"], batch["mask"]
    for step in range(NUM_NEW):
        logits = _full_logits(params, tokens, mask, config=config)
        last = prompt_len + step - 1
        tokens[:, last + 1] = np.asarray(jnp.argmax(logits[:, last], axis=-1))
        mask[:, last + 1] = 1
    np.testing.assert_array_equal(greedy_cached, tokens[:, prompt_len:])


def test_cached_greedy_matches_transformers_generate(model, ragged_batch, greedy_cached):
    _, _, torch_model = model
    torch_model.generation_config.eos_token_id = None  # generate exactly NUM_NEW tokens
    with torch.no_grad():
        out = torch_model.generate(
            input_ids=torch.as_tensor(ragged_batch["tokens"], dtype=torch.long),
            attention_mask=torch.as_tensor(ragged_batch["mask"], dtype=torch.long),
            max_new_tokens=NUM_NEW,
            min_new_tokens=NUM_NEW,
            do_sample=False,
            pad_token_id=0,
        )
    prompt_len = ragged_batch["tokens"].shape[1]
    np.testing.assert_array_equal(greedy_cached, out[:, prompt_len:].numpy())


def test_write_past_the_cache_is_rejected(model, ragged_batch):
    config, params, _ = model
    cache = init_cache(config, 3, 4)
    with pytest.raises(ValueError, match="exceeds the cache's 4 slots"):
        forward_logits(
            params, jnp.asarray(ragged_batch["tokens"]), jnp.asarray(ragged_batch["positions"]),
            jnp.ones((3, 4), jnp.int32), cache, 0, config=config,
        )


@pytest.mark.parametrize("case", ["llama_untied", "qwen2_untied", "qwen3_untied"])
def test_fused_projections_match_the_training_forward(hf_checkpoint, ragged_batch, case):
    """The sampler's layout (q/k/v and gate/up fused, `sampler.per_layer`): prefill and
    decode steps through it give the training forward's logits (qkv bias, q/k norm)."""
    config, params = load_pretrained(hf_checkpoint(case)[0])
    fused = sampler.per_layer(params, config)
    attn, mlp = fused["layers"][0]["attn"], fused["layers"][0]["mlp"]
    assert "qkv_proj" in attn and "q_proj" not in attn and "gate_up_proj" in mlp
    assert attn["qkv_proj"]["kernel"].shape == (
        config.hidden_size, config.num_heads + 2 * config.num_kv_heads, config.head_dim)
    assert ("bias" in attn["qkv_proj"]) == config.qkv_bias
    batch, prompt_len = ragged_batch, ragged_batch["tokens"].shape[1]
    response = np.random.default_rng(2).integers(3, config.vocab_size,
                                                 (batch["tokens"].shape[0], 2))
    full_tokens = np.concatenate([batch["tokens"], response], axis=1).astype(np.int32)
    full_mask = np.concatenate([batch["mask"], np.ones_like(response)], axis=1).astype(np.int32)
    expected = np.asarray(_full_logits(params, full_tokens, full_mask, config=config))
    logits, cache, key_mask = _prefill(fused, config, batch, prompt_len + 2)
    valid = batch["mask"].astype(bool)
    np.testing.assert_allclose(np.asarray(logits)[valid], expected[:, :prompt_len][valid],
                               atol=1e-5, rtol=0)
    prompt_lengths = batch["mask"].sum(axis=1)
    for step in range(2):
        step_logits, cache, key_mask = _decode(fused, config, response[:, step], step,
                                               prompt_lengths, cache, key_mask, prompt_len)
        np.testing.assert_allclose(np.asarray(step_logits), expected[:, prompt_len + step],
                                   atol=1e-5, rtol=0)
    # Switched off, the layers keep their separate projections.
    plain = sampler.per_layer(params, dataclasses.replace(config,
                                                          fuse_decode_projections=False))
    assert "q_proj" in plain["layers"][0]["attn"] and "up_proj" in plain["layers"][0]["mlp"]
