"""The decode step's head (`sampler.next_tokens`): the kernel's draw from the masses of
ranges of the vocabulary (`logprob_head.block_masses`, `sampler._draw_from_masses`)
against the draw from the whole float32 logits (`sampler.sample_tokens`), against
float64 numpy, and its choice of path (`sampler.head_impl`).

The kernel runs in Pallas' GPU interpret mode with float32 operands. The references
(numpy's masses and log-softmax, the chi-square against the softmax) are computed here
from the logits alone.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.errors import ConfigError
from jrl.kernels import logprob_head as hk
from jrl.models import ModelConfig, init_params
from jrl.rollout import paged, sampler
from jrl.rollout.sampler import SamplingConfig
from tests.markers import INTERPRETS, NEEDS_MOSAIC

# Blocks of 32 entries in ranges of 16, 16 hidden units a pipeline step: a vocabulary of
# 101 spans four blocks, the last one padded.
SMALL_BLOCKS = hk.MosaicBlocks(t=64, v=32, k=16, stages=2)
N, D, V = 37, 48, 101
TEMPERATURE = 0.7
CHI2_CRITICAL_0001 = {9: 27.877, 10: 29.588, 11: 31.264}


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(N, D)).astype(np.float32)
    w = (rng.normal(size=(V, D)) * 0.4).astype(np.float32)  # far from uniform
    return h, w


def _numpy_masses(z, block, parts):
    """float64 `(block_max [Vp / block, N], masses [parts, Vp / block, N])` of logits
    `z [N, V]`, padding at -inf."""
    n, v = z.shape
    padded = np.full((n, -(-v // block) * block), -np.inf)
    padded[:, :v] = z
    blocks = padded.reshape(n, -1, parts, block // parts)
    top = blocks.max(axis=(2, 3))
    masses = np.exp(blocks - top[:, :, None, None]).sum(-1)
    return top.T, masses.transpose(2, 1, 0)


@NEEDS_MOSAIC
@INTERPRETS
@pytest.mark.parametrize("vocab_first", [True, False])
def test_block_masses_match_float64(vocab_first):
    h, w = _inputs()

    @jax.jit
    def masses_of(h, w):
        weight = hk.pad_vocab(w if vocab_first else w.T, vocab_first, SMALL_BLOCKS)
        return hk.block_masses(h, weight, vocab=V, vocab_first=vocab_first,
                               temperature=TEMPERATURE, parts=2, blocks=SMALL_BLOCKS,
                               interpret=True)

    block_max, masses = masses_of(h, w)
    z = h.astype(np.float64) @ w.T.astype(np.float64) / TEMPERATURE
    expected_max, expected_masses = _numpy_masses(z, 32, 2)
    assert block_max.shape == (4, N) and masses.shape == (2, 4, N)
    np.testing.assert_allclose(block_max, expected_max, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(masses, expected_masses, rtol=1e-4, atol=1e-6)
    # The last block holds entries 96-100 in its first range and padding alone in its
    # second: no mass.
    np.testing.assert_array_equal(masses[1, 3], 0.0)


@NEEDS_MOSAIC
def test_block_masses_refuses_ranges_off_the_tiles():
    h, w = _inputs()
    weight = hk.pad_vocab(jnp.asarray(w), True, SMALL_BLOCKS)
    with pytest.raises(ValueError, match="into 3 ranges"):
        hk.block_masses(jnp.asarray(h), weight, vocab=V, vocab_first=True, parts=3,
                        blocks=SMALL_BLOCKS, interpret=True)
    with pytest.raises(ValueError, match="pad it with pad_vocab"):
        hk.block_masses(jnp.asarray(h), jnp.asarray(w), vocab=V, vocab_first=True,
                        blocks=SMALL_BLOCKS, interpret=True)


@functools.partial(jax.jit, static_argnums=0)
def _keys(n, seed=1):
    return jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed), jnp.arange(n))


@functools.partial(jax.jit, static_argnums=(2, 6, 7))
def _draw(h, weight, vocab_first, block_max, masses, keys, vocab, temperature):
    return sampler._draw_from_masses(h, weight, vocab_first, block_max, masses, keys, vocab,
                                     temperature)


@pytest.mark.parametrize("vocab_first", [True, False])
def test_draw_from_masses_matches_the_draw_from_the_logits(vocab_first):
    """Given the float64 masses, the draw takes the token the whole-row inverse CDF
    takes for the same uniform number, with the log-softmax at it."""
    h, w = _inputs(seed=2)
    z = h.astype(np.float64) @ w.T.astype(np.float64) / TEMPERATURE
    block_max, masses = _numpy_masses(z, 32, 2)
    weight = np.zeros((128, D), np.float32)
    weight[:V] = w
    keys = _keys(N)
    tokens, log_probs = _draw(h, weight if vocab_first else weight.T, vocab_first,
                              block_max.astype(np.float32), masses.astype(np.float32), keys, V,
                              TEMPERATURE)
    expected, _ = jax.jit(sampler.sample_tokens, static_argnums=2)(
        h @ w.T, keys, SamplingConfig(temperature=TEMPERATURE))
    np.testing.assert_array_equal(tokens, expected)
    log_softmax = z - z.max(1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(1, keepdims=True))
    np.testing.assert_allclose(log_probs, log_softmax[np.arange(N), np.asarray(tokens)],
                               atol=2e-5)
    assert np.all(np.asarray(tokens) < V)


def test_draw_from_masses_follows_the_softmax():
    """20,000 draws of one row: chi-square against the float64 softmax at p = 0.001, and
    no token of the padding or of zero weight."""
    rng = np.random.default_rng(3)
    vocab, block, parts, d = 12, 8, 2, 4
    h = rng.normal(size=(1, d)).astype(np.float32)
    w = rng.normal(size=(vocab, d)).astype(np.float32) * 0.5
    z = (h.astype(np.float64) @ w.T.astype(np.float64))[0]
    block_max, masses = _numpy_masses(z[None], block, parts)
    draws = 20_000
    weight = np.zeros((16, d), np.float32)
    weight[:vocab] = w
    tokens, log_probs = _draw(np.repeat(h, draws, 0), weight, True,
                              np.repeat(block_max, draws, 1).astype(np.float32),
                              np.repeat(masses, draws, 2).astype(np.float32),
                              _keys(draws, seed=4), vocab, 1.0)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    counts = np.bincount(np.asarray(tokens), minlength=16)
    assert counts[vocab:].sum() == 0
    expected = draws * probs
    statistic = ((counts[:vocab] - expected) ** 2 / expected).sum()
    assert statistic < CHI2_CRITICAL_0001[vocab - 1], (statistic, counts, probs)
    np.testing.assert_allclose(log_probs, np.log(probs[np.asarray(tokens)]), atol=1e-5)


# Hidden size 32 (whole pipeline steps of 16), vocabulary 101: the rollout's kernel pads
# the unembedding once (`sampler.PADDED_HEAD`).
TINY = ModelConfig(
    family="qwen2", vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True, initializer_range=0.3,
)


@pytest.fixture
def small_sample_blocks(monkeypatch):
    """Tiles of 32 entries: up to 16 rows one warpgroup of 64 rows a program, above it
    two of 64 each (the rollouts' 6 rows take the first, `N` rows the second)."""
    monkeypatch.setattr(hk, "SAMPLE_BLOCKS_FEW", SMALL_BLOCKS)
    monkeypatch.setattr(hk, "SAMPLE_BLOCKS", dataclasses.replace(SMALL_BLOCKS, t=128,
                                                                 consumers=2, group=16))
    monkeypatch.setattr(hk, "SAMPLE_FEW_ROWS", 16)


def test_sample_blocks_by_rows():
    assert hk.sample_blocks(1) is hk.sample_blocks(hk.SAMPLE_FEW_ROWS) is hk.SAMPLE_BLOCKS_FEW
    assert hk.sample_blocks(hk.SAMPLE_FEW_ROWS + 1) is hk.SAMPLE_BLOCKS
    assert hk.SAMPLE_BLOCKS.v == hk.SAMPLE_BLOCKS_FEW.v  # one padding of the unembedding


@NEEDS_MOSAIC
@INTERPRETS
@pytest.mark.parametrize("tied", [True, False])
def test_next_tokens_kernel_equals_the_xla_head(small_sample_blocks, tied):
    config = dataclasses.replace(TINY, tie_word_embeddings=tied)
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    hidden = np.random.default_rng(1).normal(size=(N, config.hidden_size)).astype(np.float32) * 2
    keys = _keys(N, seed=5)
    sampling = SamplingConfig(temperature=TEMPERATURE)

    def draw(impl):
        cfg = dataclasses.replace(config, decode_head_impl=impl)
        return jax.jit(lambda p, h, k: sampler.next_tokens(sampler.per_layer(p, cfg), h, k,
                                                           sampling, cfg))(params, hidden, keys)

    tokens, log_probs = draw("mosaic")
    expected_tokens, expected_log_probs = draw("xla")
    np.testing.assert_array_equal(tokens, expected_tokens)
    np.testing.assert_allclose(log_probs, expected_log_probs, atol=2e-5)


@NEEDS_MOSAIC
@INTERPRETS
@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_rollout_with_the_kernel_head_equals_the_xla_head(small_sample_blocks, kv_cache):
    """A float32 rollout (8 tokens, 6 rows, stop ids) draws the same tokens with either
    head, and log-probs within 2e-5."""
    params = jax.jit(init_params, static_argnums=0)(TINY, jax.random.key(2))
    rng = np.random.default_rng(0)
    ids = rng.integers(1, V, (3, 5)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0, :2] = 0
    sampling = SamplingConfig(n=2, max_new_tokens=8, temperature=1.1, stop_token_ids=(7, 9),
                              kv_cache=kv_cache)
    generate = paged.generate if kv_cache == "paged" else sampler.generate
    outs = [generate(params, ids, mask, jax.random.key(3), sampling,
                     config=dataclasses.replace(TINY, decode_head_impl=impl))
            for impl in ("mosaic", "xla")]
    np.testing.assert_array_equal(outs[0].responses, outs[1].responses)
    np.testing.assert_allclose(outs[0].rollout_log_probs, outs[1].rollout_log_probs, atol=2e-5)
    assert len(np.unique(np.asarray(outs[0].responses))) > 4  # the draws are not one token


def test_head_impl_choices(monkeypatch):
    sample = SamplingConfig(temperature=0.8)
    assert sampler.head_impl(TINY, sample) == "xla"  # auto, off a Hopper GPU
    assert sampler.head_impl(dataclasses.replace(TINY, decode_head_impl="xla"), sample) == "xla"
    forced = dataclasses.replace(TINY, decode_head_impl="mosaic")
    assert sampler.head_impl(forced, sample) == "mosaic"
    # The draws the kernel does not make take XLA's head, forced or not (greedy validation).
    for sampling in (SamplingConfig(top_k=5), SamplingConfig(top_p=0.9),
                     SamplingConfig(do_sample=False)):
        assert sampler.head_impl(forced, sampling) == "xla"
    assert sampler.head_impl(forced, SamplingConfig(top_k=V)) == "mosaic"  # top-k off
    chosen = []  # a sweep's run draws with a traced temperature: XLA's head
    jax.make_jaxpr(lambda t: chosen.append(sampler.head_impl(
        forced, dataclasses.replace(sample, temperature=t))))(0.5)
    assert chosen == ["xla"]
    # On a Hopper GPU "auto" takes the kernel for a temperature draw alone.
    monkeypatch.setattr(hk.mosaic_backend, "on_hopper", lambda: True)
    bf16 = dataclasses.replace(TINY, dtype="bfloat16", hidden_size=64)  # whole steps of 64
    assert sampler.head_impl(bf16, sample) == "mosaic"
    assert sampler.head_impl(bf16, SamplingConfig(top_k=5)) == "xla"
    assert sampler.head_impl(dataclasses.replace(bf16, hidden_size=4096, head_dim=1024),
                             sample) == "xla"  # past logprob_head.MAX_HIDDEN
    assert sampler.head_impl(TINY, sample) == "xla"  # float32 compute


@pytest.mark.parametrize("key, value, named", [("top_k", 5, "top-k"), ("top_p", 0.9, "top-p"),
                                              ("do_sample", False, "greedy")])
def test_a_forced_kernel_head_refuses_training_draws_it_does_not_make(key, value, named):
    """Stopped by the config check, before anything compiles."""
    from jrl.config import settings
    from tests.tiny import tiny_config

    config = tiny_config(**{"model.decode_head_impl": "mosaic"})
    config.rollout[key] = value
    with pytest.raises(ConfigError, match=f"model.decode_head_impl: 'mosaic'.*{named}"):
        settings.from_config(config)


def test_padded_head_only_where_the_kernel_may_draw():
    def heads(config, tied):
        """The padded head's shape (None: none), and whether it is the unembedding with
        zero rows (or columns) after it."""
        config = dataclasses.replace(config, tie_word_embeddings=tied)

        def padded(key):
            params = init_params(config, key)
            head = sampler.per_layer(params, config).get(sampler.PADDED_HEAD)
            if head is None:
                return None
            weight = params["embed"]["embedding"] if tied else params["lm_head"]["kernel"].T
            rows = head if tied else head.T
            return head.shape, (jnp.all(rows[:config.vocab_size] == weight)
                                & jnp.all(rows[config.vocab_size:] == 0))

        return jax.jit(padded)(jax.random.key(0))

    forced = dataclasses.replace(TINY, decode_head_impl="mosaic")
    assert heads(TINY, True) is None  # auto, off a Hopper GPU
    for tied in (True, False):  # 101 entries to whole blocks of 128, the weight's layout
        shape, same = heads(forced, tied)
        assert shape == ((128, 32) if tied else (32, 128)) and bool(same)
    assert heads(dataclasses.replace(forced, vocab_size=128), True) is None


@NEEDS_MOSAIC
def test_block_masses_lowers_for_the_gpu(monkeypatch):
    """The compiled path (not the interpreter's) lowers for CUDA without a GPU: one
    Mosaic GPU call, at the default tiles and at a batch that is not whole tiles."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    sds = jax.ShapeDtypeStruct
    fn = functools.partial(hk.block_masses, vocab=1000, vocab_first=True, temperature=0.9)
    text = jax.jit(fn).trace(sds((200, 896), jnp.bfloat16), sds((1024, 896), jnp.bfloat16)
                             ).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1

