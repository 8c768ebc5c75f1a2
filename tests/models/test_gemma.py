"""Gemma 2 and Gemma 3 (text) against transformers: logits, export, cached decoding, the
soft-capped log-prob head and the config errors (float32, tiny random checkpoints)."""

import dataclasses
import functools
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jrl.errors import ConfigError
from jrl.kernels import packed_attention
from jrl.models import (
    PRESETS,
    ModelConfig,
    forward_logits,
    gemma,
    init_cache,
    init_params,
    load_pretrained,
    save_pretrained,
    transformer,
)
from jrl.rl import logprobs, packing
from jrl.rl.logprobs import token_log_probs
from jrl.rollout import sampler
from jrl.rollout.sampler import SamplingConfig
from tests.models.conftest import saved_checkpoints
from tests.rl.test_packing import make_batch
from tests.rl.test_shared_prompts import _grouped_batch
from tests.rollout.test_sampler import ragged_prompts

_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
_COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    # head_dim != hidden / heads and a query scale != head_dim, as in the real checkpoints
    # (whose scale is head_dim ** -0.5 only by coincidence of the two numbers).
    head_dim=32, query_pre_attn_scalar=24,
    # A window shorter than the batch's 9 tokens, on layers 0 and 2.
    sliding_window=4, layer_types=_LAYER_TYPES,
    initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
# Caps small enough to bend the scores and logits of these weights (each changes the
# logits by over 20% relative L2).
CASES = {
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(attn_logit_softcapping=3.0, final_logit_softcapping=5.0)),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               dict(final_logit_softcapping=5.0, rope_parameters={
                   "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}
forward_logits_jit = jax.jit(forward_logits, static_argnames="config")


def _build(case: str, **changes) -> torch.nn.Module:
    config_cls, model_cls, kwargs = CASES[case]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**_COMMON, **kwargs, **changes})).eval()
    with torch.no_grad():  # HF starts the norms at 0 (a scale of 1): random, to see layouts
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def gemma_checkpoint(tmp_path_factory):
    return saved_checkpoints(tmp_path_factory, _build)


def _jrl_logits(params, config, batch):
    logits, _ = forward_logits_jit(params, jnp.asarray(batch["tokens"]),
                                   jnp.asarray(batch["positions"]), jnp.asarray(batch["mask"]),
                                   config=config)
    return np.asarray(logits)


def _relative_error(actual, expected):
    return np.linalg.norm(actual - expected) / np.linalg.norm(expected)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, gemma_checkpoint, ragged_batch, torch_forward):
    path, model = gemma_checkpoint(case)
    config, params = load_pretrained(path)
    assert config.family == case and config.tie_word_embeddings and "lm_head" not in params
    assert config.layer_types == tuple(_LAYER_TYPES) and config.sliding_window == 4
    valid = ragged_batch["mask"].astype(bool)
    expected = torch_forward(model, ragged_batch)[valid]
    assert _relative_error(_jrl_logits(params, config, ragged_batch)[valid], expected) < 1e-4
    # The window matters on this batch: transformers' own logits (the same weights) move
    # by over 10% without it.
    wide = torch_forward(_build(case, sliding_window=64), ragged_batch)[valid]
    assert _relative_error(wide, expected) > 0.1


@pytest.mark.parametrize("case", sorted(CASES))
def test_save_pretrained_loads_in_transformers(case, gemma_checkpoint, ragged_batch,
                                               torch_forward, tmp_path):
    source, _ = gemma_checkpoint(case)
    config = ModelConfig.from_hf(json.loads((source / "config.json").read_text()))
    # Random N(0, 0.2) leaves (norms included, to see their layout) made on the host, so
    # that neither they nor save_pretrained's per-layer slices build XLA programs.
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda x: rng.normal(0, 0.2, x.shape).astype(np.float32), shapes)
    save_pretrained(tmp_path, config, params)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == [CASES[case][1].__name__]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(model) is CASES[case][1]

    valid = ragged_batch["mask"].astype(bool)
    expected = torch_forward(model, ragged_batch)[valid]
    actual = _jrl_logits(params, config, ragged_batch)[valid]
    assert _relative_error(actual, expected) < 1e-4

    reloaded_config, reloaded = load_pretrained(tmp_path)
    assert reloaded_config == config
    jax.tree.map(np.testing.assert_array_equal, reloaded, params)


@pytest.mark.parametrize("ring", [False, True], ids=["full", "ring"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cached_decoding_equals_the_full_forward(case, ring, gemma_checkpoint, ragged_batch):
    """Prefill 5 slots, then decode the other 4 one by one: each step's logits are the full
    forward's at that token, with the window (4) reaching back past the prompt; also with
    the sliding layers' caches as rings of 4 slots, which the prefill overfills."""
    path, _ = gemma_checkpoint(case)
    config, params = load_pretrained(path)
    # Host arrays, sliced on the host: only the two jitted programs are built.
    tokens, mask, positions = (ragged_batch[k] for k in ("tokens", "mask", "positions"))
    expected = _jrl_logits(params, config, ragged_batch)
    batch, num_tokens = tokens.shape
    prompt = 5
    cache = init_cache(config, batch, num_tokens, ring=ring)
    assert [b.shape[2] for b in cache.k] == [4 if ring else num_tokens, num_tokens,
                                             4 if ring else num_tokens]
    key_mask = np.where(np.arange(num_tokens) < prompt, mask, 0)
    logits, cache = forward_logits_jit(params, tokens[:, :prompt], positions[:, :prompt],
                                       key_mask, cache, np.int32(0), config=config)
    steps = [np.asarray(logits)]
    for slot in range(prompt, num_tokens):
        key_mask = np.where(np.arange(num_tokens) <= slot, mask, 0)
        logits, cache = forward_logits_jit(params, tokens[:, slot:slot + 1],
                                           positions[:, slot:slot + 1], key_mask, cache,
                                           np.int32(slot), config=config)
        steps.append(np.asarray(logits))
    valid = ragged_batch["mask"].astype(bool)
    actual = np.concatenate(steps, axis=1)
    np.testing.assert_allclose(actual[valid], expected[valid], rtol=1e-5, atol=1e-5)


def _reference_log_probs(embedding_vd, hidden_brd, targets_br, cap, temperature):
    """The head written out: soft-capped logits over the temperature, log-softmax, gather."""
    logits = cap * jnp.tanh(hidden_brd @ embedding_vd.T / cap) / temperature
    log_p = jax.nn.log_softmax(logits, axis=-1)
    entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
    return jnp.take_along_axis(log_p, targets_br[..., None], axis=-1)[..., 0], entropy


def test_log_probs_with_final_softcap_match_reference():
    rng = np.random.default_rng(0)  # host arrays: no conversion programs
    embedding = rng.normal(0, 1.0, (128, 16)).astype(np.float32)
    hidden = rng.normal(0, 1.0, (2, 7, 16)).astype(np.float32)
    targets = rng.integers(0, 128, (2, 7)).astype(np.int32)
    weights = rng.normal(0, 1.0, (2, 7)).astype(np.float32)
    cap, temperature = 3.0, 0.7
    params = {"embed": {"embedding": embedding}}

    def loss(fn, embedding, hidden):
        log_p, entropy = fn(embedding, hidden)
        return jnp.sum(weights * log_p) + 0.3 * jnp.sum(entropy), (log_p, entropy)

    def jrl(embedding, hidden):  # chunks of 3 over 7 tokens: a padded last chunk
        return token_log_probs({"embed": {"embedding": embedding}}, hidden, targets,
                               temperature=temperature, chunk_size=3, with_entropy=True,
                               softcap=cap)

    def reference(embedding, hidden):
        return _reference_log_probs(embedding, hidden, targets, cap, temperature)

    grad = lambda fn: jax.jit(jax.grad(lambda e, h: loss(fn, e, h), argnums=(0, 1),
                                       has_aux=True))
    (grads, (log_p, entropy)) = grad(jrl)(embedding, hidden)
    (ref_grads, (ref_log_p, ref_entropy)) = grad(reference)(embedding, hidden)
    chex.assert_trees_all_close((log_p, entropy), (ref_log_p, ref_entropy), rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-4, atol=1e-5)
    # The cap is active: the uncapped head (in numpy) gives other log-probs.
    logits = hidden @ embedding.T / temperature
    uncapped = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    uncapped = np.take_along_axis(uncapped, targets[..., None], -1)[..., 0]
    assert np.max(np.abs(uncapped - np.asarray(log_p))) > 0.5
    with pytest.raises(ValueError, match="no soft-cap"):
        token_log_probs(params, hidden, targets, softcap=cap, impl="mosaic")


@pytest.mark.parametrize("name", ["tiny-gemma", "gemma-2-2b", "gemma-2-9b", "gemma-3-1b",
                                  "gemma-3-4b", "gemma-3-12b"])
def test_presets_export_configs_transformers_reads(name, tmp_path):
    config = PRESETS[name]
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf()))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert list(hf.layer_types) == list(config.layer_types)
    assert hf.sliding_window == config.sliding_window
    assert hf.query_pre_attn_scalar == config.query_pre_attn_scalar
    assert hf.final_logit_softcapping == config.final_logit_softcapping
    assert ModelConfig.from_hf(hf.to_dict()) == config
    if config.family == "gemma3":
        assert hf.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
        factor = hf.rope_parameters["full_attention"].get("factor")
        assert factor == (None if config.rope_scaling is None else 8.0)


def _hf_config(case: str, **changes) -> dict:
    config_cls, model_cls, kwargs = CASES[case]
    return {**config_cls(**_COMMON, **kwargs).to_dict(),
            "architectures": [model_cls.__name__], **changes}


@pytest.mark.parametrize("changes, match", [
    (dict(architectures=["Gemma3ForConditionalGeneration"]),
     "multimodal Gemma 3 .* not supported.*Gemma3ForCausalLM"),
    (dict(architectures=None, model_type="gemma3"), "model_type 'gemma3'.*gemma3_text"),
    (dict(hidden_activation="gelu"), "unsupported hidden_activation 'gelu'.*gelu_pytorch_tanh"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]),
     "layer_types: \\['chunked_attention'\\] not supported"),
])
def test_unsupported_gemma_configs_name_the_key(changes, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf(_hf_config("gemma3", **changes))


def test_kernels_without_softcap_or_window_are_refused(monkeypatch):
    tiny = PRESETS["tiny-gemma"]
    assert (tiny.decode_attention_impl, tiny.logprob_impl) == ("xla",) * 2
    # Training attention stays "auto": splash on a TPU (soft-cap and window as options),
    # XLA elsewhere, never cuDNN (`packed_attention.choose_impl`).
    assert tiny.attention_impl == "auto"
    assert dataclasses.replace(tiny, attention_impl="splash").attention_impl == "splash"
    with pytest.raises(ConfigError, match="attention_impl='cudnn' has no soft-capping.*"
                                          "attn_logit_softcapping"):
        dataclasses.replace(tiny, attention_impl="cudnn")
    with pytest.raises(ConfigError, match="sliding_window, layer_types: Gemma options"):
        dataclasses.replace(PRESETS["tiny"], sliding_window=8, layer_types=("full_attention",) * 2)
    # Gemma 3 has no attention soft-cap: cuDNN's attention stays its choice on a GPU.
    assert PRESETS["gemma-3-1b"].attention_impl == "auto"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    no_cap = dataclasses.replace(tiny, attn_logit_softcapping=None)
    assert transformer._attention_impl(no_cap, jnp.bfloat16, 8, 8) == "cudnn"
    assert transformer._attention_impl(tiny, jnp.bfloat16, 8, 8) == "xla"


# tiny-gemma (soft-caps, every other layer sliding) with a window of 3, shorter than the
# rows below; a large init spreads the logits.
LAYOUT = ModelConfig.preset("tiny-gemma", hidden_size=32, intermediate_size=64, head_dim=8,
                            query_pre_attn_scalar=8, sliding_window=3, initializer_range=0.3)


@pytest.fixture(scope="module")
def layout_params():
    return jax.jit(init_params, static_argnums=0)(LAYOUT, jax.random.key(0))


def test_packed_and_shared_prompt_layouts_keep_the_window(layout_params):
    """Packed rows (each sequence's positions restart) and shared prompts (responses as rows
    of their own) give the padded layout's log-probs: the window counts each sequence's
    tokens, never the slots of another."""
    plain = jax.jit(functools.partial(logprobs.response_log_probs, config=LAYOUT,
                                      with_entropy=True))
    batch = make_batch()
    packed = jax.jit(lambda p: logprobs.packed_pass(
        functools.partial(logprobs.packed_log_probs, config=LAYOUT, with_entropy=True), p,
        packing.for_sequences(*batch, 40), batch[3]))(layout_params)
    mask = batch[3]
    for got, want in zip(packed, plain(layout_params, *batch), strict=True):
        np.testing.assert_allclose(np.where(mask, got, 0), np.where(mask, want, 0),
                                   rtol=2e-5, atol=2e-6)

    grouped = _grouped_batch(0, vocab=LAYOUT.vocab_size)
    shared = jax.jit(functools.partial(logprobs.response_log_probs, config=LAYOUT,
                                       with_entropy=True, group=4))(layout_params, *grouped)
    for got, want in zip(shared, plain(layout_params, *grouped), strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_sampler_log_probs_equal_the_training_forwards(layout_params):
    """The sampler's decode (cache, window, soft-caps) draws each token with the log-prob the
    training pass gives it, over 12 new tokens from prompts of 1 to 7."""
    ids, mask = ragged_prompts([5, 2, 7, 1], prompt_len=7, vocab_size=LAYOUT.vocab_size, seed=0)
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0, stop_token_ids=(2,))
    out = sampler.generate(layout_params, ids, mask, jax.random.key(1), sampling, config=LAYOUT)
    want, _ = jax.jit(functools.partial(logprobs.response_log_probs, config=LAYOUT))(
        layout_params, out.prompt_ids, out.prompt_mask, out.responses, out.response_mask)
    valid = np.asarray(out.response_mask) > 0
    assert valid.sum(1).max() > LAYOUT.sliding_window + 1
    np.testing.assert_allclose(np.asarray(out.rollout_log_probs)[valid], np.asarray(want)[valid],
                               atol=2e-5, rtol=0)


# LAYOUT with a query scale other than head_dim ** -0.5 and a soft-cap that bends the
# scores, so a kernel that dropped either would leave the padded path.
PACKED = dataclasses.replace(LAYOUT, query_pre_attn_scalar=3, attn_logit_softcapping=1.0)
# Four sequences, shorter (2) and longer (9, 40, 70) than the window of 3: padded one a
# row (left padding), or packed into one row of 128 slots (7 unused), positions
# restarting per sequence.
_LENGTHS = (70, 2, 40, 9)


def _padded_and_packed_rows():
    rng = np.random.default_rng(4)
    width = max(_LENGTHS)
    mask = (np.arange(width)[None] >= width - np.array(_LENGTHS)[:, None]).astype(np.int32)
    tokens = np.where(mask, rng.integers(3, PACKED.vocab_size, mask.shape), 0)
    seg = np.zeros((1, 128), np.int32)
    seg[0, :sum(_LENGTHS)] = np.repeat(np.arange(1, len(_LENGTHS) + 1), _LENGTHS)
    packed_tokens = np.zeros((1, 128), np.int32)
    packed_tokens[0, :sum(_LENGTHS)] = tokens[mask > 0]
    packed_positions = np.zeros((1, 128), np.int32)
    packed_positions[0, :sum(_LENGTHS)] = np.concatenate([np.arange(n) for n in _LENGTHS])
    padded = (tokens, np.maximum(np.cumsum(mask, 1) - 1, 0), mask, mask > 0)
    packed = (packed_tokens, packed_positions,
              packed_attention.segments(jnp.asarray(seg), len(_LENGTHS)), seg > 0)
    return padded, packed


@pytest.mark.parametrize("impl", ["auto", "splash"])
def test_packed_rows_give_the_padded_forward_and_gradients(layout_params, impl):
    """Packed rows (`Segments`: the kernels take the window, soft-cap and query scale, the
    layer's window chosen by `lax.cond`) against the padded rows' dense XLA path: hidden
    states of every token and the parameter gradients of a weighted sum of them. "auto"
    is the XLA reference on the CPU; "splash" runs in Pallas' TPU interpret mode."""
    (tokens, positions, mask, used), (p_tokens, p_positions, segments, p_used) = (
        _padded_and_packed_rows())
    weights = np.random.default_rng(5).normal(size=(sum(_LENGTHS), PACKED.hidden_size))

    def hidden_and_grads(config, tokens, positions, how, used):
        def loss(params):
            hidden, _ = transformer.forward(params, tokens, positions, how, config=config)
            return jnp.sum(hidden[used] * weights), hidden[used]

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(layout_params)

    (_, want), want_grads = hidden_and_grads(PACKED, tokens, positions, mask, used)
    (_, got), got_grads = hidden_and_grads(
        dataclasses.replace(PACKED, attention_impl=impl), p_tokens, p_positions, segments,
        p_used)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    chex.assert_trees_all_close(got_grads, want_grads, atol=2e-4, rtol=2e-4)


def test_a_preset_at_another_depth_keeps_its_local_global_pattern():
    """`model.num_layers` on a Gemma preset: the preset's every-k-th-layer-global pattern
    over the new depth (Gemma 3: five local to one global; Gemma 2: alternating)."""
    local, full = gemma.SLIDING, gemma.FULL
    assert ModelConfig.preset("gemma-3-1b", num_layers=8).layer_types == (
        (local,) * 5 + (full,) + (local,) * 2)
    assert ModelConfig.preset("gemma-2-2b", num_layers=3).layer_types == (local, full, local)
    explicit = (full,) * 4
    assert ModelConfig.preset("gemma-3-1b", num_layers=4,
                              layer_types=explicit).layer_types == explicit
    assert ModelConfig.preset("gemma-3-1b").layer_types == gemma.layer_types(26, 6)
