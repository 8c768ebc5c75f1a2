"""The kernels at the models' real sizes, compiled on a GPU, against XLA: the decode step's
Mosaic GPU kernel at the presets' head shapes and caches (and the new token at the cache's
edges), the log-prob head's Mosaic GPU kernel forward and backward at Qwen2.5-0.5B's head
(D 896, V 151,936, tied, bf16), Gemma-3-1B's (D 1,152, V 262,144) and Qwen3-30B-A3B's
(D 2,048, V 151,936), the sampler's head on the same kernel (`block_masses`) at all
three, and cuDNN's attention (packed, windowed and masked) at Qwen2.5-0.5B's and
Gemma-3-1B's heads (head_dim 256 on Hopper). Skipped off a GPU:
tests/kernels/test_decode_attention.py and test_logprob_head.py run the same kernels in
interpret mode at toy sizes; the timings of these shapes are experiments/bench_*.py's.

    JAX_PLATFORMS=cuda pytest -q tests/kernels/test_gpu_checks.py

Each reference is XLA on the same bf16 values, in float32 where the kernel accumulates in
float32, so the bounds are a few bf16 roundings of the values compared.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels import decode_attention as da
from jrl.kernels import logprob_head as hk
from jrl.kernels import mosaic_backend, packed_attention
from jrl.rl import logprobs
from tests.markers import NEEDS_MOSAIC

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="the kernels compiled at real sizes: a GPU only")
ON_HOPPER = pytest.mark.skipif(jax.default_backend() == "gpu" and not mosaic_backend.on_hopper(),
                               reason="the Mosaic GPU kernels compile for Hopper GPUs only")


def _max_diff(got, want) -> float:
    return float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))


# ------------------------------------------------------------------ decode attention

DECODE_SHAPES = {  # name: (rows B, query heads N, key/value heads K, head_dim H, slots S)
    "qwen2.5-0.5b b256": (256, 14, 2, 64, 384),
    "qwen2.5-0.5b b512": (512, 14, 2, 64, 384),
    "qwen2.5-0.5b b128 long": (128, 14, 2, 64, 8704),
    "qwen2.5-0.5b b32 long": (32, 14, 2, 64, 8704),
    "qwen2.5-7b b64": (64, 28, 4, 128, 384),
    "qwen3-0.6b b64": (64, 16, 8, 128, 256),
    "llama-3-8b b8": (8, 32, 8, 128, 1024),
}
# The default (fused, block by the cache's length, few rows of a long cache left to the
# unfused kernel split over slots), the fused kernel at any rows, and the unfused compact
# kernel.
DEFAULT_TILES = {"default": da.MOSAIC_TILES,
                 "fused_any_rows": dataclasses.replace(da.MOSAIC_TILES, fused_max_splits=None),
                 "128,2,compact": da.MosaicTiles(128, 2, True)}
# Every setting the kernel takes, at one shape: block, stages, compact, fused, split over
# slots (0: `slot_splits`' choice), rows a program.
TILE_SPECS = ["128,2,compact", "128,3,compact", "64,3,compact", "128,2,compact,splits0",
              "128,2,compact,rows4", "128,3,compact,rows8", "128,2", "128,2,compact,fused",
              "128,2,fused"]
EDGE_SPECS = ["128,2,compact", "128,2,compact,fused", "128,2", "128,2,fused"]


def _decode_inputs(b, n, k, h, s, slot, seed=0):
    """bf16 queries `[B, N, H]`, new keys/values `[B, K, H]`, caches `[B, K, S, H]`, RoPE
    angles, rows starting at random slots below 128 (and at most `slot`)."""
    keys = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(keys[0], (b, n, h), jnp.bfloat16)
    k_new, v_new = (jax.random.normal(key, (b, k, h), jnp.bfloat16) for key in keys[1:3])
    k_cache, v_cache = (jax.random.normal(key, (b, k, s, h), jnp.bfloat16) for key in keys[3:5])
    angles = jax.random.uniform(keys[5], (b, h // 2), maxval=1000.0)
    start = np.random.default_rng(seed).integers(0, min(128, slot + 1), b).astype(np.int32)
    return (q, k_new, v_new, jnp.sin(angles), jnp.cos(angles), k_cache, v_cache,
            jnp.asarray(start), jnp.int32(slot))


@functools.partial(jax.jit, static_argnames=("impl", "tiles"))
def _append_and_attend(args, impl, tiles):
    return da.append_and_attend(*args, impl=impl, tiles=tiles)


def decode_errors(shape, tiles, slot=None, seed=0) -> dict:
    """The kernel at `tiles` against XLA: `err` / `xla_err`, the largest differences of
    its / XLA's bf16 attention output from XLA's float32 one; `cache_diff`, of its
    updated caches from XLA's; `nonfinite` outputs; `scale`, the largest float32 output."""
    b, n, k, h, s = shape
    args = _decode_inputs(b, n, k, h, s, s - 37 if slot is None else slot, seed)
    got = _append_and_attend(args, "mosaic", tiles)
    want = _append_and_attend(args, "xla", None)
    f32 = tuple(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in args)
    exact = _append_and_attend(f32, "xla", None)[0]
    return dict(err=_max_diff(got[0], exact), xla_err=_max_diff(want[0], exact),
                cache_diff=max(_max_diff(a, c) for a, c in zip(got[1:], want[1:], strict=True)),
                nonfinite=int(jnp.sum(~jnp.isfinite(got[0].astype(jnp.float32)))),
                scale=float(jnp.max(jnp.abs(exact))))


def _assert_decode_matches(errors):
    assert errors["nonfinite"] == 0, errors
    # The kernel's output rounds to bf16 once, as XLA's; its float32 sums run in
    # another order.
    assert errors["err"] <= 2 * errors["xla_err"] + 2 ** -8 * errors["scale"], errors
    # The new key is rotated in float32 and rounded to bf16 once, as in XLA, though by
    # other operations: at most one bf16 step of a rotated key (|k| < 8 here).
    assert errors["cache_diff"] <= 2 ** -5, errors


@NEEDS_MOSAIC
@ON_HOPPER
@pytest.mark.parametrize("tiles", DEFAULT_TILES.values(), ids=list(DEFAULT_TILES))
@pytest.mark.parametrize("shape", DECODE_SHAPES.values(), ids=list(DECODE_SHAPES))
def test_decode_kernel_matches_xla_at_the_presets_shapes(shape, tiles):
    _assert_decode_matches(decode_errors(shape, tiles))


@NEEDS_MOSAIC
@ON_HOPPER
@pytest.mark.parametrize("spec", TILE_SPECS)
def test_decode_kernel_settings_match_xla(spec):
    _assert_decode_matches(decode_errors(DECODE_SHAPES["qwen2.5-0.5b b256"],
                                         da.MosaicTiles.from_spec(spec)))


@NEEDS_MOSAIC
@ON_HOPPER
@pytest.mark.parametrize("slot", [0, 63, 64, 65, 127, 383])
@pytest.mark.parametrize("spec", EDGE_SPECS)
def test_decode_kernel_at_the_caches_edges(spec, slot):
    """The new token in a block's first or last slot, or the cache's last."""
    _assert_decode_matches(decode_errors((64, 14, 2, 64, 384), da.MosaicTiles.from_spec(spec),
                                         slot=slot, seed=slot))


@functools.partial(jax.jit, static_argnames=("num_heads", "paged"))
def _attend_qkv(qkv, sin, cos, k, v, start, slot, table, *, num_heads, paged):
    """The fused projection's operand attended over contiguous caches by XLA, or over
    pools by the paged fused kernel (`table` the rows' pages, every row at `slot`)."""
    if not paged:
        return da.append_and_attend_qkv(qkv, None, sin, cos, k, v, start, slot,
                                        num_heads=num_heads, impl="xla")
    return da.append_and_attend_qkv_paged(qkv, None, sin, cos, k, v, table, start,
                                          jnp.full(start.shape, slot), num_heads=num_heads)


@NEEDS_MOSAIC
@ON_HOPPER
@pytest.mark.parametrize("name", ["qwen2.5-0.5b b256", "qwen2.5-0.5b b32 long",
                                  "qwen2.5-7b b64"])
def test_paged_fused_kernel_matches_xla_at_the_presets_shapes(name):
    """The fused kernel over a paged cache (`decode_attention.PAGED_FUSED`: pages of 16
    slots shuffled through the pools) against XLA on the same rows' contiguous caches:
    the output within the decode kernel's bound, the pools read back through the rows'
    tables within one bf16 step of XLA's caches (the new key rotated in the kernel)."""
    b, n, k, h, s = DECODE_SHAPES[name]
    page = 16
    q, k_new, v_new, sin, cos, k_cache, v_cache, start, slot = _decode_inputs(
        b, n, k, h, s, s - 37)
    qkv = jnp.concatenate([q, k_new, v_new], axis=1)
    table = jnp.asarray(np.random.default_rng(1).permutation(b * s // page).reshape(b, -1) + 1,
                        jnp.int32)
    pool = lambda x: jnp.zeros((k, 1 + b * s // page, page, h), x.dtype).at[
        :, table.reshape(-1)].set(x.reshape(b, k, s // page, page, h).transpose(
            1, 0, 2, 3, 4).reshape(k, -1, page, h))
    got = _attend_qkv(qkv, sin, cos, pool(k_cache), pool(v_cache), start, slot, table,
                      num_heads=n, paged=True)
    want = _attend_qkv(qkv, sin, cos, k_cache, v_cache, start, slot, None, num_heads=n,
                       paged=False)
    exact = _attend_qkv(qkv.astype(jnp.float32), sin, cos, k_cache.astype(jnp.float32),
                        v_cache.astype(jnp.float32), start, slot, None, num_heads=n,
                        paged=False)[0]
    back = lambda x: x[:, table].transpose(1, 0, 2, 3, 4).reshape(b, k, s, h)
    _assert_decode_matches(dict(
        err=_max_diff(got[0], exact), xla_err=_max_diff(want[0], exact),
        cache_diff=max(_max_diff(back(g), w) for g, w in zip(got[1:], want[1:], strict=True)),
        nonfinite=int(jnp.sum(~jnp.isfinite(got[0].astype(jnp.float32)))),
        scale=float(jnp.max(jnp.abs(exact)))))


# ------------------------------------------------------------------ the log-prob head

HEAD_HIDDEN, HEAD_VOCAB = 896, 151936  # Qwen2.5-0.5B, tied embedding
# Hidden size, vocabulary of the tied heads `auto` takes the kernel for (`hk.MAX_HIDDEN`).
# The heads "auto" takes the kernels at: the smallest and largest hidden sizes up to
# `logprob_head.MAX_HIDDEN` (Qwen3-30B-A3B's D 2,048, the MoE sampler's and update's) and
# Gemma's vocabulary.
HEAD_SHAPES = {"qwen2.5-0.5b": (HEAD_HIDDEN, HEAD_VOCAB), "gemma-3-1b": (1152, 262144),
               "qwen3-30b-a3b": (2048, 151936)}


def _head_inputs(tokens, seed=0, shape=(HEAD_HIDDEN, HEAD_VOCAB)):
    """bf16 hidden states `[T, D]`, unembedding `[V, D]` and int targets `[T]` (D, V
    `shape`)."""
    hidden, vocab = shape
    keys = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(keys[0], (tokens, hidden), jnp.bfloat16)
    w = (0.05 * jax.random.normal(keys[1], (vocab, hidden))).astype(jnp.bfloat16)
    y = jax.random.randint(keys[2], (tokens,), 0, vocab)
    return h, w, y


@functools.partial(jax.jit, static_argnames=("with_entropy", "chunk"))
def _xla_stats(h_td, w_vd, y_t, with_entropy, chunk=1024):
    """`(log_z, target_logit, entropy)` `[T]` each from float32 logits of the bf16 operands,
    `chunk` tokens at a time (entropy zero unless `with_entropy`)."""
    t, d = h_td.shape
    chunk = min(chunk, t)

    def one(xs):
        h, y = xs
        z = jnp.einsum("td,vd->tv", h, w_vd, preferred_element_type=jnp.float32)
        log_z = jax.nn.logsumexp(z, axis=-1)
        target = jnp.take_along_axis(z, y[:, None], axis=-1)[:, 0]
        if not with_entropy:
            return log_z, target, jnp.zeros_like(log_z)
        p = jnp.exp(z - log_z[:, None])
        return log_z, target, log_z - jnp.sum(p * z, axis=-1)

    out = jax.lax.map(one, (h_td.reshape(-1, chunk, d), y_t.reshape(-1, chunk)))
    return tuple(x.reshape(t) for x in out)


def head_forward_errors(tokens, with_entropy, blocks=None, shape=(HEAD_HIDDEN, HEAD_VOCAB)
                        ) -> dict:
    """The largest differences of the kernel's `log Z`, target logit, log-prob and entropy
    from `_xla_stats`'."""
    h, w, y = _head_inputs(tokens, shape=shape)
    stats = jax.jit(lambda h, w, y: tuple(x[0] for x in hk.log_softmax_stats(
        h[None], w, y[None], vocab=shape[1], vocab_first=True, with_entropy=with_entropy,
        impl="mosaic", blocks=blocks)))
    log_z, target, entropy = stats(h, hk.pad_vocab(w, True, blocks), y)
    want = _xla_stats(h, w, y, with_entropy)
    return dict(log_z=_max_diff(log_z, want[0]), target=_max_diff(target, want[1]),
                log_prob=_max_diff(target - log_z, want[1] - want[0]),
                entropy=_max_diff(entropy, want[2]))


@NEEDS_MOSAIC
@ON_HOPPER
@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("blocks", [None, "64,256,64,4,1", "128,128,64,4,1,16,2"],
                         ids=["default", "64 tokens", "two consumers"])
def test_head_forward_matches_xla(blocks, with_entropy):
    """16,384 tokens: the kernel and XLA both sum the bf16 products in float32."""
    if blocks:  # t, v, k, stages, overlap[, group[, consumers]]
        t, v, k, stages, overlap, *rest = map(int, blocks.split(","))
        blocks = hk.MosaicBlocks(t, v, k, stages, bool(overlap),
                                 **dict(zip(["group", "consumers"], rest, strict=False)))
    errors = head_forward_errors(16384, with_entropy, blocks)
    assert max(errors.values()) < 0.02, errors


@NEEDS_MOSAIC
@ON_HOPPER
def test_head_forward_matches_xla_at_gemmas_head():
    """Gemma-3-1B's head (D 1,152, V 262,144), which `auto` takes the kernel for."""
    assert hk.choose_impl("auto", 1152) == "mosaic"
    errors = head_forward_errors(16384, True, shape=HEAD_SHAPES["gemma-3-1b"])
    assert max(errors.values()) < 0.02, errors


@NEEDS_MOSAIC
@ON_HOPPER
@pytest.mark.parametrize("rows, vocab_first", [(256, True), (37, True), (256, False)])
@pytest.mark.parametrize("shape", HEAD_SHAPES)
def test_decode_head_kernel_matches_xla(shape, rows, vocab_first):
    """The sampler's head (`block_masses` and the draw from it, `sampler._draw_from_masses`;
    256 rows take `SAMPLE_BLOCKS`, 37 `SAMPLE_BLOCKS_FEW`) against XLA's float32 logits of
    the same bf16 operands: the masses of the 64-entry ranges; each token where its row's
    uniform number falls in the float64 CDF of those logits, within 1e-5 of the total (the
    paths' float32 sums differ by about 1e-7 of it, which over a near-flat distribution of
    152k entries, 7e-6 each, moves the token drawn on one row of a hundred to a
    neighbour: a range of 64 entries off would be 4e-4 off); the log-probs against
    float64's log-softmax at the tokens."""
    from jrl.rollout import sampler

    vocab = HEAD_SHAPES[shape][1]
    h, w, _ = _head_inputs(rows, shape=HEAD_SHAPES[shape])
    temperature = 0.9
    weight = w if vocab_first else w.T  # tied `[V, D]`, or an `lm_head`'s `[D, V]`
    block_max, masses = jax.jit(functools.partial(
        hk.block_masses, vocab=vocab, vocab_first=vocab_first, temperature=temperature))(
        h, weight)
    z = jnp.einsum("td,vd->tv", h, w, preferred_element_type=jnp.float32) / temperature
    ranges = z.reshape(rows, -1, 2, 64)
    want_max = jnp.max(ranges, axis=(2, 3))
    want_masses = jnp.sum(jnp.exp(ranges - want_max[:, :, None, None]), axis=3)
    assert _max_diff(block_max, want_max.T) < 1e-3
    assert _max_diff(masses, jnp.transpose(want_masses, (2, 1, 0))) < 1e-3 * 64
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(1), jnp.arange(rows))
    tokens, log_probs = jax.jit(lambda h, w, keys: sampler._draw_from_masses(
        h, w, vocab_first, block_max, masses, keys, vocab, temperature))(h, weight, keys)
    tokens = np.asarray(tokens)
    u = np.asarray(jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys), np.float64)
    z64 = np.asarray(z, np.float64)
    p = np.exp(z64 - z64.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    cdf = np.cumsum(p, axis=1)
    rows_ = np.arange(rows)
    below, up_to = cdf[rows_, tokens] - p[rows_, tokens], cdf[rows_, tokens]
    outside = (below - 1e-5 > u) | (u > up_to + 1e-5)
    assert not outside.any(), (np.flatnonzero(outside), below[outside], u[outside])
    np.testing.assert_allclose(log_probs, np.log(p[rows_, tokens]), atol=2e-3)


def _xla_grad_logits(h_td, w_vd, y_t, log_z_t, g_lp_t, g_ent_t, ent_t, entropy_grad):
    """`d loss / d z` `[T, V]` bf16 by `jrl.rl.logprobs._fused_bwd`'s formula in XLA."""
    log_p = jnp.einsum("td,vd->tv", h_td, w_vd,
                       preferred_element_type=jnp.float32) - log_z_t[:, None]
    p = jnp.exp(log_p)
    onehot = jnp.arange(w_vd.shape[0])[None] == y_t[:, None]
    grad = g_lp_t[:, None] * (onehot.astype(jnp.float32) - p)
    if entropy_grad:
        grad -= g_ent_t[:, None] * p * (log_p + ent_t[:, None])
    return grad.astype(h_td.dtype)


@NEEDS_MOSAIC
@ON_HOPPER
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_head_grad_logits_matches_xla(entropy_grad):
    """`grad_logits` (the logits recomputed on chip, `d loss / d z` written once in bf16)
    for one 8,192-token chunk of the update's backward, against the same formula in XLA:
    the two differ by bf16 roundings of the same values."""
    tokens = 8192
    h, w, y = _head_inputs(tokens)
    g_lp, g_ent = (jax.random.normal(key, (tokens,)) for key in jax.random.split(
        jax.random.key(3)))
    weight = hk.pad_vocab(w, True, hk.MOSAIC_BACKWARD)
    log_z, _, ent = jax.jit(lambda h, w, y: tuple(x[0] for x in hk.log_softmax_stats(
        h[None], w, y[None], vocab=HEAD_VOCAB, vocab_first=True, with_entropy=True)))(
            h, weight, y)
    got = jax.jit(lambda *a: hk.grad_logits(
        a[0][None], weight, *(x[None] for x in a[1:]), vocab=HEAD_VOCAB, vocab_first=True,
        entropy_grad=entropy_grad)[0, :, :HEAD_VOCAB])(h, y, log_z, g_lp, g_ent, ent)
    want = jax.jit(functools.partial(_xla_grad_logits, entropy_grad=entropy_grad))(
        h, w, y, log_z, g_lp, g_ent, ent)
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    assert _max_diff(got, want) <= 2 ** -6 * scale


@NEEDS_MOSAIC
@ON_HOPPER
@pytest.mark.parametrize("shape", HEAD_SHAPES)
def test_token_log_probs_on_the_kernel_match_xla(shape):
    """`token_log_probs` as the update runs it (64-token chunks, the entropy a metric):
    log-probs, entropies and the gradients of the log-probs' weighted sum, the kernel's
    forward and backward (`impl="mosaic"`) against the XLA path."""
    h, w, y = _head_inputs(16384, shape=HEAD_SHAPES[shape])
    hidden, targets = h.reshape(64, 256, h.shape[-1]), y.reshape(64, 256)
    params = {"embed": {"embedding": w.astype(jnp.float32)}}
    g_lp = jax.random.normal(jax.random.key(7), targets.shape, jnp.float32)

    def run(impl):
        def loss(params, hidden):
            lp, ent = logprobs.token_log_probs(params, hidden, targets, chunk_size=64,
                                               with_entropy=True, entropy_grad=False, impl=impl)
            return jnp.sum(lp * g_lp), (lp, ent)
        (grad_w, grad_h), (lp, ent) = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(
            params, hidden)
        return lp, ent, grad_w["embed"]["embedding"], grad_h

    got, want = run("mosaic"), run("xla")
    assert _max_diff(got[0], want[0]) < 0.02 and _max_diff(got[1], want[1]) < 0.02
    for grad, ref in zip(got[2:], want[2:], strict=True):
        assert _max_diff(grad, ref) <= 2 ** -6 * float(jnp.max(jnp.abs(ref)))


@NEEDS_MOSAIC
@ON_HOPPER
def test_token_log_probs_on_the_kernel_vmapped_over_runs_match_xla():
    """The kernel under `jax.vmap`, as the many-runs programs (`jrl.rl.runs`, whose
    `vmapped_model` keeps `logprob_impl` "auto") run the update: three runs, each its own
    unembedding and hidden states, log-probs and gradients against the XLA path vmapped
    the same way, and each run against the kernel run alone on its own inputs."""
    shape, runs = HEAD_SHAPES["qwen2.5-0.5b"], 3
    inputs = [_head_inputs(4096, seed=seed, shape=shape) for seed in range(runs)]
    hidden = jnp.stack([h.reshape(16, 256, h.shape[-1]) for h, _, _ in inputs])
    weights = jnp.stack([w.astype(jnp.float32) for _, w, _ in inputs])
    targets = jnp.stack([y.reshape(16, 256) for _, _, y in inputs])
    g_lp = jax.random.normal(jax.random.key(7), targets.shape, jnp.float32)

    def one(impl, w, hidden, targets, g_lp):
        def loss(w, hidden):
            lp, _ = logprobs.token_log_probs({"embed": {"embedding": w}}, hidden, targets,
                                             chunk_size=64, impl=impl)
            return jnp.sum(lp * g_lp), lp
        return jax.grad(loss, argnums=(0, 1), has_aux=True)(w, hidden)

    def vmapped(impl):
        (grad_w, grad_h), lp = jax.jit(jax.vmap(functools.partial(one, impl)))(
            weights, hidden, targets, g_lp)
        return lp, grad_w, grad_h

    got, want = vmapped("mosaic"), vmapped("xla")
    assert _max_diff(got[0], want[0]) < 0.02
    for grad, ref in zip(got[1:], want[1:], strict=True):
        assert _max_diff(grad, ref) <= 2 ** -6 * float(jnp.max(jnp.abs(ref)))
    alone = jax.jit(functools.partial(one, "mosaic"))
    for r in range(runs):
        (grad_w, grad_h), lp = alone(weights[r], hidden[r], targets[r], g_lp[r])
        assert _max_diff(lp, got[0][r]) < 1e-3
        # One bfloat16 rounding of the largest element (bf16's spacing is at most 2^-7 of
        # a value): the batched program may add the hidden gradient's float32 terms in
        # another order, which can round it to the neighbouring value.
        assert _max_diff(grad_h, got[2][r]) <= 2 ** -7 * float(jnp.max(jnp.abs(grad_h)))


# ------------------------------------------------------------------ packed attention


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _segment_ids(rows, length, lengths):
    """int `[rows, length]`: 1, 2, ... for each row's segments of `lengths[row]`, 0 after."""
    ids = np.zeros((rows, length), np.int32)
    for row in range(rows):
        at = 0
        for index, n in enumerate(lengths[row]):
            ids[row, at:at + n] = index + 1
            at += n
    return jnp.asarray(ids)


# Query heads, key/value heads, head_dim: Qwen2.5-0.5B's; Gemma-3-1B's (head_dim 256,
# which cuDNN takes on Hopper only, `packed_attention.cudnn_head_dim`).
HEADS = {"qwen2.5-0.5b": (14, 2, 64), "gemma-3-1b": (4, 1, 256)}


def _skip_unless_cudnn_takes(head_dim):
    if not packed_attention.cudnn_head_dim(head_dim):
        pytest.skip(f"cuDNN takes head_dim {head_dim} on Hopper only")


def _cudnn_errors(attend, q, k, v, used, cotangent) -> list[float]:
    """Relative errors of `attend(impl, q, k, v)` with impl "cudnn" (the bf16 operands,
    jitted) against "xla" in float32: the outputs at the `used` slots, then the gradients
    by q, k and v of their sum weighted by `cotangent`."""
    def loss(impl, q, k, v):
        out = attend(impl, q, k, v).astype(jnp.float32)
        return jnp.sum(jnp.where(used, out * cotangent, 0))

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    got = jax.jit(functools.partial(attend, "cudnn"))(q, k, v)
    want = attend("xla", *f32)
    grads = jax.jit(jax.grad(functools.partial(loss, "cudnn"), argnums=(0, 1, 2)))(q, k, v)
    grads_want = jax.grad(functools.partial(loss, "xla"), argnums=(0, 1, 2))(*f32)
    errors = [_rel(jnp.where(used, got, 0), jnp.where(used, want, 0))]
    return errors + [_rel(a, b) for a, b in zip(grads, grads_want, strict=True)]


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("rows,length,lengths", [
    (1, 256, [[100, 130]]),
    (2, 512, [[200, 1, 311], [512]]),
    (3, 1024, [[1000], [17, 300, 600, 7], [5]]),
])
def test_cudnn_packed_attention_matches_xla(rows, length, lengths, heads):
    """cuDNN's packed layout (bf16, the models' heads) against the float32 XLA reference:
    the outputs at used slots and the gradients of a weighted sum of them."""
    n, kv, h = HEADS[heads]
    _skip_unless_cudnn_takes(h)
    seg = _segment_ids(rows, length, lengths)
    segments = packed_attention.segments(seg, 8)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(rows, length, n, h)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(rows, length, kv, h)), jnp.bfloat16) for _ in range(2))
    used = (seg > 0)[:, :, None, None]
    cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    attend = lambda impl, *qkv: packed_attention.attend(*qkv, segments, impl)
    errors = _cudnn_errors(attend, q, k, v, used, cotangent)
    assert max(errors) < 2e-2, errors


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("window", [16, 128])
def test_cudnn_sliding_window_keeps_q_minus_k_below_it(window, head_dim):
    """cuDNN's `sliding_window_length` W with a query scale (Gemma's sliding layers, bf16)
    against the float32 XLA reference at windows W - 1, W and W + 1: it agrees with
    `q - k < W` only (segments shorter and longer than W; gradients too at W)."""
    _skip_unless_cudnn_takes(head_dim)
    seg = _segment_ids(2, 512, [[200, 1, 311], [12, 500]])
    segments = packed_attention.segments(seg, 8)
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(2, 512, 8, head_dim)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(2, 512, 4, head_dim)), jnp.bfloat16)
            for _ in range(2))
    used = (seg > 0)[:, :, None, None]
    cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]

    def loss(impl, w, q, k, v):
        out = packed_attention.attend(q, k, v, segments, impl, window=w, scale=0.1)
        return jnp.sum(jnp.where(used, out.astype(jnp.float32) * cotangent, 0))

    got = jax.jit(lambda *a: packed_attention.attend(*a, segments, "cudnn", window=window,
                                                     scale=0.1))(q, k, v)
    errors = {w: _rel(jnp.where(used, got, 0), jnp.where(used, packed_attention.attend(
        *f32, segments, "xla", window=w, scale=0.1), 0)) for w in (window - 1, window,
                                                                   window + 1)}
    assert errors[window] < 2e-2 < min(errors[window - 1], errors[window + 1]), errors
    grads = jax.jit(jax.grad(functools.partial(loss, "cudnn", window), argnums=(0, 1, 2)))(
        q, k, v)
    grads_want = jax.grad(functools.partial(loss, "xla", window), argnums=(0, 1, 2))(*f32)
    errors = [_rel(a, b) for a, b in zip(grads, grads_want, strict=True)]
    assert max(errors) < 2e-2, errors


@pytest.mark.parametrize("heads", HEADS)
def test_cudnn_masked_attention_matches_xla(heads):
    """The masked path (`transformer._attend`: the shared-prompt layout's and the
    unpacked passes') on cuDNN, bf16, a causal mask over left-padded rows, against XLA in
    float32: outputs at the rows' real queries and the gradients of a weighted sum of
    them."""
    from jrl.models import transformer
    from jrl.models.config import ModelConfig

    n, kv, h = HEADS[heads]
    _skip_unless_cudnn_takes(h)
    config = dataclasses.replace(ModelConfig.preset("tiny"), num_heads=n, num_kv_heads=kv,
                                 head_dim=h)
    length, starts = 256, np.array([0, 37, 200])
    real = jnp.asarray(np.arange(length)[None] >= starts[:, None])
    mask = transformer.attention_mask(real.astype(jnp.int32), length, None)
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(3, length, n, h)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(3, length, kv, h)), jnp.bfloat16) for _ in range(2))
    used = real[:, :, None, None]
    cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    attend = lambda impl, *qkv: transformer._attend(
        dataclasses.replace(config, attention_impl=impl), *qkv, mask)
    errors = _cudnn_errors(attend, q, k, v, used, cotangent)
    assert max(errors) < 2e-2, errors


# ------------------------------------------------------------------ grouped matmuls (MoE)

# (rows M, groups G, K, N): a Qwen3-30B-A3B layer's gate (D 2048 -> F 768) and down
# (768 -> 2048) projections for 512 tokens x 8 experts and for an update's 6,144 (groups
# of ~384 rows: the forward kernels then take two column blocks a grid step), the
# rank-64 expert LoRA's matmuls there, and a small case with empty groups.
GROUPED_SHAPES = {"qwen3-30b-a3b gate": (4096, 128, 2048, 768),
                  "qwen3-30b-a3b down": (4096, 128, 768, 2048),
                  "qwen3-30b-a3b gate, tall groups": (49152, 128, 2048, 768),
                  "qwen3-30b-a3b down, tall groups": (49152, 128, 768, 2048),
                  "rank-64 LoRA b, tall groups": (49152, 128, 64, 768),
                  "gate's and up's LoRA a, tall groups": (49152, 128, 2048, 128),
                  "8 groups, 3 empty": (1000, 8, 256, 384)}


@ON_HOPPER
@NEEDS_MOSAIC
@pytest.mark.parametrize("shape", sorted(GROUPED_SHAPES))
def test_grouped_matmul_kernel_matches_xla(shape):
    """The Mosaic GPU grouped matmul, forward and both gradients, against XLA's
    `ragged_dot` in float32 on the same bf16 values (for tall groups the padded tiles,
    themselves checked against `ragged_dot` on the CPU: XLA's would hold `[M, G, K]`)."""
    from jrl.kernels import grouped_matmul as gm

    m, g, k, n = GROUPED_SHAPES[shape]
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (g, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    cot = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
    sizes = jax.random.multinomial(keys[3], m, jnp.ones(g) / g, shape=(g,)).astype(jnp.int32)
    if g == 8:
        sizes = jnp.array([300, 0, 200, 0, 0, 250, 150, 100], jnp.int32)
    assert int(sizes.sum()) == m

    def loss(impl, x, w):
        out = gm.grouped_matmul(x, w, sizes, impl=impl)
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32)), out

    grad = lambda impl, x, w: jax.jit(jax.value_and_grad(
        functools.partial(loss, impl), argnums=(0, 1), has_aux=True))(x, w)
    (_, got), (got_dx, got_dw) = grad("mosaic", x, w)
    reference = "tiles" if m // g >= 256 else "xla"
    (_, want), (want_dx, want_dw) = grad(reference, x.astype(jnp.float32),
                                         w.astype(jnp.float32))
    assert _max_diff(got, want) < 0.05 * float(jnp.abs(want).max())
    assert _max_diff(got_dx, want_dx) < 0.05 * float(jnp.abs(want_dx).max())
    assert _max_diff(got_dw, want_dw) < 0.05 * float(jnp.abs(want_dw).max())
