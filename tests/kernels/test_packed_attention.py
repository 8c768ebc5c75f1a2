"""Packed attention with Gemma's options (`packed_attention.attend`'s window, soft-cap and
query scale): the XLA reference against a numpy formula, splash (Pallas' TPU interpret
mode) against the reference, forward and gradients, and which kernel 'auto' takes."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels import packed_attention


def _segment_ids(length, lengths):
    """int32 `[rows, length]`: 1, 2, ... for each row's segments of `lengths[row]`, 0 after."""
    ids = np.zeros((len(lengths), length), np.int32)
    for row, row_lengths in enumerate(lengths):
        starts = np.cumsum([0, *row_lengths])
        for index, (start, end) in enumerate(zip(starts[:-1], starts[1:], strict=True)):
            ids[row, start:end] = index + 1
    return ids


def _numpy_attention(q, k, v, ids, *, window, softcap, scale):
    """Each segment attended alone: key j visible to query i when `j <= i` and
    `i - j < window`; scores scaled, soft-capped, soft-maxed (float64). Unused slots 0."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    out = np.zeros_like(q)
    group = q.shape[2] // k.shape[2]
    for row in range(q.shape[0]):
        for segment in set(ids[row][ids[row] > 0].tolist()):
            slots = np.flatnonzero(ids[row] == segment)
            i, j = np.meshgrid(np.arange(len(slots)), np.arange(len(slots)), indexing="ij")
            visible = (j <= i) & (i - j < (window or len(slots)))
            for head in range(q.shape[2]):
                scores = q[row, slots, head] @ k[row, slots, head // group].T * scale
                if softcap is not None:
                    scores = softcap * np.tanh(scores / softcap)
                scores = np.where(visible, scores, -np.inf)
                weights = np.exp(scores - scores.max(-1, keepdims=True))
                weights /= weights.sum(-1, keepdims=True)
                out[row, slots, head] = weights @ v[row, slots, head // group]
    return out


def _qkv(rows, length, n, k, h, seed):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(rows, length, n, h)), jnp.float32)
    key, value = (jnp.asarray(rng.normal(size=(rows, length, k, h)), jnp.float32)
                  for _ in range(2))
    return q, key, value


def test_reference_applies_window_softcap_and_scale():
    """Segments of 2 to 9 slots with a window of 3, a cap that bends the scores (s up to
    about 4 against a cap of 1.5) and a scale other than `H ** -0.5`."""
    ids = _segment_ids(16, [[7, 2, 5], [9, 3]])
    q, k, v = _qkv(2, 16, 4, 2, 8, seed=0)
    options = dict(window=3, softcap=1.5, scale=0.6)
    got = jax.jit(functools.partial(packed_attention.attend, impl="xla", **options))(
        q, k, v, packed_attention.segments(jnp.asarray(ids), 3))
    want = _numpy_attention(q, k, v, ids, **options)
    used = (ids > 0)[:, :, None, None]
    np.testing.assert_allclose(np.where(used, got, 0), want, atol=2e-6, rtol=2e-5)
    # Each option changes the outputs: none is silently dropped.
    for name, off in (("window", None), ("softcap", None), ("scale", 8 ** -0.5)):
        other = _numpy_attention(q, k, v, ids, **{**options, name: off})
        assert np.max(np.abs(other - want)) > 0.05, name


# Rows of 256 slots (blocks of 128): segments shorter (50, 20) and longer (100, 130, 186)
# than the window of 64, which reaches into the previous key block.
SPLASH_IDS = _segment_ids(256, [[100, 130], [50, 186, 20]])
SPLASH_CASES = {
    "window": dict(window=64),
    "softcap and scale": dict(softcap=2.0, scale=0.2),
    "window, softcap and scale": dict(window=64, softcap=2.0, scale=0.2),
}


@pytest.mark.parametrize("case", sorted(SPLASH_CASES))
def test_splash_with_gemma_options_matches_reference(case):
    """Splash's local mask, soft-cap and query scale against the XLA reference: the
    outputs at used slots and the gradients of a weighted sum of them."""
    options = SPLASH_CASES[case]
    seg = jnp.asarray(SPLASH_IDS)
    q, k, v = _qkv(2, 256, 4, 2, 128, seed=1)
    used = (seg > 0)[:, :, None, None]
    weights = jnp.asarray(np.random.default_rng(2).normal(size=q.shape), jnp.float32)
    segments = packed_attention.segments(seg, 4)
    splash = functools.partial(packed_attention.splash, segment_ids_bt=seg, interpret=True,
                               block=128, **options)
    reference = functools.partial(packed_attention.attend, segments=segments, impl="xla",
                                  **options)

    @jax.jit
    def outputs_and_grads(q, k, v):
        def loss(fn, *qkv):
            return jnp.sum(jnp.where(used, fn(*qkv) * weights, 0))

        return [(jnp.where(used, fn(q, k, v), 0),
                 jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2))(q, k, v))
                for fn in (splash, reference)]

    (got, got_grads), (want, want_grads) = outputs_and_grads(q, k, v)
    chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)
    chex.assert_trees_all_close(got_grads, want_grads, atol=2e-4, rtol=2e-4)


def test_auto_never_takes_cudnn_with_a_softcap(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(packed_attention, "_hopper", lambda: True)
    choose = functools.partial(packed_attention.choose_impl, "auto", jnp.bfloat16, 64, 256)
    assert choose() == "cudnn"
    assert choose(softcap=True) == "xla"
    with pytest.raises(ValueError, match="no soft-cap"):
        q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
        packed_attention.attend(q, q, q, packed_attention.segments(jnp.ones((1, 8), int), 1),
                                "cudnn", softcap=30.0)
