"""The fused unembedding + log-softmax kernel (`jrl.kernels.logprob_head`, on Pallas'
Mosaic GPU backend) against float64 numpy and against the XLA path of `jrl.rl.logprobs`:
in Pallas' GPU interpret mode with float32 operands (on every backend: compiled, a GPU
would run float32 operands as tf32), and compiled with bfloat16 operands on a Hopper GPU.

The numpy reference forms the full `[T, V]` logits, `log Z` by a max-shifted sum and
the entropy as `-sum p log p`; nothing here calls the code under test to build an
expected value.
"""

import json
import textwrap
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import sharding
from jrl.errors import ConfigError
from jrl.kernels import logprob_head as hk
from jrl.kernels import mosaic_backend
from jrl.models import ModelConfig
from jrl.rl import logprobs
from tests.eight_devices import run_script
from tests.markers import INTERPRETS, NEEDS_MOSAIC

pytestmark = NEEDS_MOSAIC
# The float32 tests' `token_log_probs` (no interpret flag there) runs the kernel compiled
# on a GPU, where its float32 operands would be tf32: those run off a GPU only.
OFF_GPU = pytest.mark.skipif(jax.default_backend() == "gpu",
                             reason="float32 operands run as tf32 on the GPU")
ON_HOPPER = pytest.mark.skipif(not mosaic_backend.on_hopper(), reason="needs a Hopper GPU")

# Small tiles so a handful of tokens and entries spans several programs of the grid
# (wgmma's 64 rows, 16 float32 hidden units per pipeline step).
SMALL = hk.MosaicBlocks(t=64, v=32, k=16, stages=2)
T, D, V = 37, 48, 101  # neither T nor V a multiple of the tiles
TEMPERATURE = 0.7


def _inputs(seed=0, dtype=jnp.float32):
    """`h [1, T, D]`, `w [V, D]`, `y [1, T]`."""
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(1, T, D))
    w = rng.normal(size=(V, D)) * 0.4  # far from uniform: errors show
    y = rng.integers(0, V, (1, T))
    return (jnp.asarray(h, dtype), jnp.asarray(w, dtype), jnp.asarray(y, jnp.int32))


def _reference(h, w, y, temperature):
    """float64, over the `T` tokens of row 0: logits, log Z, log-probs of y,
    probabilities, entropy."""
    h, y = h[0], y[0]
    z = np.asarray(h, np.float64) @ np.asarray(w, np.float64).T / temperature
    top = z.max(1, keepdims=True)
    log_z = np.log(np.exp(z - top).sum(1)) + top[:, 0]
    log_p = z - log_z[:, None]
    p = np.exp(log_p)
    return z, log_z, log_p[np.arange(len(y)), np.asarray(y)], p, -(p * log_p).sum(1)


@INTERPRETS
@pytest.mark.parametrize("vocab_first", [True, False])
@pytest.mark.parametrize("tokens_per_call", [32768, 20])  # one launch; two, the last padded
def test_stats_match_float64(vocab_first, tokens_per_call):
    h, w, y = _inputs()
    weight = hk.pad_vocab(w if vocab_first else w.T, vocab_first, SMALL)
    assert weight.shape == ((128, D) if vocab_first else (D, 128))
    log_z, target, ent = hk.log_softmax_stats(h, weight, y, vocab=V, vocab_first=vocab_first,
                                              temperature=TEMPERATURE, with_entropy=True,
                                              blocks=SMALL, tokens_per_call=tokens_per_call,
                                              interpret=True)
    z, ref_log_z, ref_lp, _, ref_ent = _reference(h, w, y, TEMPERATURE)
    chex.assert_shape((log_z, target, ent), (1, T))
    np.testing.assert_allclose(log_z[0], ref_log_z, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(target[0], z[np.arange(T), np.asarray(y[0])], rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose((target - log_z)[0], ref_lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent[0], ref_ent, rtol=1e-5, atol=1e-5)
    assert ref_ent.std() > 0.1  # varied distributions, not a degenerate case


@INTERPRETS
def test_stats_without_entropy_and_targets_in_the_last_block():
    h, w, y = _inputs(seed=1)
    y = y.at[0, :5].set(V - 1)  # the last real entry, in the block with padding
    weight = hk.pad_vocab(w, True, SMALL)
    log_z, target, ent = hk.log_softmax_stats(h, weight, y, vocab=V, vocab_first=True,
                                              blocks=SMALL, interpret=True)
    z, ref_log_z, _, _, _ = _reference(h, w, y, 1.0)
    np.testing.assert_allclose(log_z[0], ref_log_z, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(target[0], z[np.arange(T), np.asarray(y[0])], rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_array_equal(ent, 0.0)


def test_unpadded_or_overpadded_unembedding_is_refused():
    h, w, y = _inputs()
    for weight in (w, jnp.pad(w, ((0, 128 + 32 - V), (0, 0)))):  # 101 rows; a whole extra block
        with pytest.raises(ValueError, match="pad it with pad_vocab"):
            hk.log_softmax_stats(h, weight, y, vocab=V, vocab_first=True, blocks=SMALL,
                                 interpret=True)


def _grad_reference(h, w, y, temperature, g_lp, g_ent, entropy_grad):
    """float64 `d loss / d (h W)` of `loss = sum g_lp log p[y] + sum g_ent H` (the
    logits' 1 / temperature included), with the `log Z` and entropy it needs."""
    z, log_z, _, p, ent = _reference(h, w, y, temperature)
    log_p = z - log_z[:, None]
    onehot = np.arange(p.shape[1])[None] == np.asarray(y[0])[:, None]
    grad = g_lp[:, None] * (onehot - p)
    if entropy_grad:  # dH/dz_v = -p_v (log p_v + H)
        grad -= g_ent[:, None] * p * (log_p + ent[:, None])
    return grad / temperature, log_z, ent


@INTERPRETS
@pytest.mark.parametrize(("consumers", "vocab_first", "entropy_grad"),
                         [(1, True, True), (1, False, False), (2, True, False),
                          (2, False, True)])
def test_grad_logits_match_float64(consumers, vocab_first, entropy_grad):
    """The backward kernel's `d loss / d z` against float64 numpy: T = 37 tokens (one
    block, padded), V = 101 entries (the last block masked; its padding gets 0), the
    targets of a few tokens in that last block."""
    h, w, y = _inputs(seed=8)
    y = y.at[0, :3].set(V - 1)
    rng = np.random.default_rng(9)
    g_lp, g_ent = rng.normal(size=T), rng.normal(size=T)
    want, log_z, ent = _grad_reference(h, w, y, TEMPERATURE, g_lp, g_ent, entropy_grad)
    blocks = hk.MosaicBlocks(t=64 * consumers, v=32, k=16, stages=2, consumers=consumers)
    weight = hk.pad_vocab(w if vocab_first else w.T, vocab_first, blocks)
    row = lambda x: jnp.asarray(x, jnp.float32)[None]
    got = hk.grad_logits(h, weight, y, row(log_z), row(g_lp), row(g_ent), row(ent),
                         vocab=V, vocab_first=vocab_first, temperature=TEMPERATURE,
                         entropy_grad=entropy_grad, blocks=blocks, interpret=True)
    assert got.shape == (1, T, 128) and got.dtype == h.dtype
    np.testing.assert_allclose(got[0, :, :V], want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(got[0, :, V:], 0.0)


def test_grad_logits_refuses_ids_past_float32():
    """The backward kernel carries token ids as float32: a vocabulary past 2^24 stops."""
    vocab = 2 ** 24 + 1
    h = jnp.zeros((1, 4, 16), jnp.float32)
    w = jax.ShapeDtypeStruct((vocab + 31, 16), jnp.float32)  # padded to blocks of 32
    row = jnp.zeros((1, 4), jnp.float32)
    blocks = hk.MosaicBlocks(t=64, v=32, k=16, stages=2)
    with pytest.raises(ValueError, match="exact up to 16777216; got a vocabulary of 16777217"):
        jax.eval_shape(lambda w: hk.grad_logits(h, w, row.astype(jnp.int32), row, row, row,
                                                row, vocab=vocab, vocab_first=True,
                                                blocks=blocks, interpret=True), w)


@NEEDS_MOSAIC
@pytest.mark.parametrize("blocks", [None, hk.MosaicBlocks(t=64, v=128, k=64, stages=2)],
                         ids=["default", "one-consumer"])
def test_kernels_lower_for_the_gpu(blocks, monkeypatch):
    """The forward and backward kernels' compiled path (not the interpreter's, which the
    other tests run: `emulated` off in the epilogues, the warp-specialized pipeline at
    the default tiles) lowers for CUDA without a GPU, one Mosaic GPU call each."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    sds = jax.ShapeDtypeStruct
    b, t, d, vocab = 2, 128, 128, 1000
    padded = -(-vocab // 256) * 256
    h, w = sds((b, t, d), jnp.bfloat16), sds((padded, d), jnp.bfloat16)
    y, row = sds((b, t), jnp.int32), sds((b, t), jnp.float32)
    settings = dict(vocab=vocab, vocab_first=True, blocks=blocks)
    stats = lambda h, w, y: hk.log_softmax_stats(h, w, y, with_entropy=True, **settings)
    grads = lambda h, w, y, *rows: hk.grad_logits(h, w, y, *rows, **settings)
    for fn, args in ((stats, (h, w, y)), (grads, (h, w, y, row, row, row, row))):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @mosaic_gpu") == 1


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(hk, "MOSAIC_FORWARD", SMALL)
    monkeypatch.setattr(hk, "MOSAIC_BACKWARD", SMALL)


@OFF_GPU
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk_size", [4, None])
def test_token_log_probs_kernel_matches_xla(small_blocks, monkeypatch, tied, chunk_size):
    """Values and gradients (hidden states, unembedding) of the log-probs and the
    entropy through `token_log_probs`, the kernels' forward and backward (the residuals
    the forward hands the backward, `grad_logits`' per-token inputs, the padded
    vocabulary's rows cut from the unembedding's gradient) against the chunked XLA
    path."""
    rng = np.random.default_rng(4)
    b, r = 3, 10
    hidden = jnp.asarray(rng.normal(size=(b, r, D)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, (b, r)), jnp.int32)
    w = jnp.asarray(rng.normal(size=(V, D)) * 0.4, jnp.float32)
    params = {"embed": {"embedding": w}} if tied else {"lm_head": {"kernel": w.T},
                                                       "embed": {"embedding": w * 0}}
    weights_lp, weights_ent = (jnp.asarray(rng.normal(size=(b, r)), jnp.float32)
                               for _ in range(2))

    def loss(params, hidden, impl, entropy_grad):
        lp, ent = logprobs.token_log_probs(params, hidden, targets, temperature=TEMPERATURE,
                                           chunk_size=chunk_size, with_entropy=True,
                                           entropy_grad=entropy_grad, impl=impl)
        return jnp.sum(lp * weights_lp) + jnp.sum(ent * weights_ent), (lp, ent)

    kernel_calls = []
    grads = hk._mosaic_grads
    monkeypatch.setattr(hk, "_mosaic_grads",
                        lambda *a, **k: kernel_calls.append(k["entropy_grad"]) or grads(*a, **k))
    for entropy_grad in (True, False):
        grad = jax.grad(loss, argnums=(0, 1), has_aux=True)
        (g_params, g_hidden), (lp, ent) = grad(params, hidden, "mosaic", entropy_grad)
        (w_params, w_hidden), (w_lp, w_ent) = grad(params, hidden, "xla", entropy_grad)
        chex.assert_trees_all_close((lp, ent), (w_lp, w_ent), rtol=1e-5, atol=1e-5)
        chex.assert_trees_all_close(g_hidden, w_hidden, rtol=1e-4, atol=1e-5)
        chex.assert_trees_all_close(g_params, w_params, rtol=1e-4, atol=1e-5)
        assert float(jnp.abs(g_hidden).max()) > 1e-2
    assert kernel_calls == [True, False]  # the backward kernel formed d loss / d z


@OFF_GPU
def test_bfloat16_hidden_states(small_blocks):
    """bf16 hidden states and unembedding (the compute dtype on GPU): the kernel and the
    XLA path multiply the same bf16 operands with float32 accumulation."""
    rng = np.random.default_rng(5)
    hidden = jnp.asarray(rng.normal(size=(2, 9, D)), jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, V, (2, 9)), jnp.int32)
    params = {"embed": {"embedding": jnp.asarray(rng.normal(size=(V, D)) * 0.4, jnp.float32)}}
    out = {name: logprobs.token_log_probs(params, hidden, targets, chunk_size=4,
                                          with_entropy=True, impl=name)
           for name in ("mosaic", "xla")}
    chex.assert_trees_all_close(out["mosaic"], out["xla"], rtol=1e-4, atol=1e-4)


@OFF_GPU
def test_trainer_runs_the_kernel_in_its_log_prob_passes(small_blocks, tmp_path, monkeypatch):
    """`model.logprob_impl` reaches the reference pass (no entropy) and the update (with
    it), and a run through the kernel ends where the XLA path's does."""
    from jrl.train import run
    from tests.tiny import tiny_config

    calls = []
    stats = hk.log_softmax_stats

    def recording(*args, **kwargs):
        calls.append(kwargs["with_entropy"])
        return stats(*args, **kwargs)

    monkeypatch.setattr(hk, "log_softmax_stats", recording)
    config = lambda impl: tiny_config(**{"model.logprob_impl": impl, "model.hidden_size": 32,
                                         "actor.use_kl_loss": True})
    last = {}
    for impl in ("mosaic", "xla"):
        run(config(impl), str(tmp_path / impl))
        with open(tmp_path / impl / "metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
        last[impl] = {k: v for k, v in rows[-1].items()
                      if k.startswith(("actor/pg_loss", "actor/kl_loss", "actor/grad_norm",
                                       "actor/entropy", "critic/score"))}
    assert set(calls) == {True, False}, calls
    assert {"actor/pg_loss", "actor/kl_loss", "actor/entropy"} <= set(last["xla"])
    chex.assert_trees_all_close(last["mosaic"], last["xla"], rtol=1e-3, atol=1e-5)


def test_choice_and_errors(monkeypatch):
    assert hk.choose_impl("auto", 896) == ("mosaic" if mosaic_backend.on_hopper() else "xla")
    assert hk.choose_impl("mosaic", 30) == "mosaic"
    assert hk.choose_impl("xla", 896) == "xla"
    assert ModelConfig.preset("tiny", logprob_impl="mosaic").logprob_impl == "mosaic"
    monkeypatch.setattr(mosaic_backend, "on_hopper", lambda: True)
    assert hk.choose_impl("auto", 896) == "mosaic"
    assert hk.choose_impl("auto", 896, with_entropy=False) == "mosaic"  # pays there too
    assert hk.choose_impl("auto", 30) == "xla"  # not whole k steps
    # Gemma-3-1B's and Llama-3.2-1B's hidden sizes, up to MAX_HIDDEN: measured to pay.
    assert hk.choose_impl("auto", 1152) == hk.choose_impl("auto", 2048) == "mosaic"
    assert hk.choose_impl("auto", 3584) == "xla"  # above MAX_HIDDEN: not measured
    assert hk.choose_impl("mosaic", 3584) == "mosaic"
    # float32 compute (the arithmetic configs): wgmma transposes only 16-bit operands and
    # the float32 tiles would not fit shared memory, so "auto" takes XLA and a forced
    # kernel on a GPU stops naming the key.
    assert hk.choose_impl("auto", 256, dtype=jnp.float32) == "xla"
    assert hk.choose_impl("auto", 256, dtype=jnp.float16) == "mosaic"
    if jax.default_backend() != "gpu":
        assert hk.choose_impl("mosaic", 256, dtype=jnp.float32) == "mosaic"  # interpret mode
    with monkeypatch.context() as patch:
        patch.setattr(hk.jax, "default_backend", lambda: "gpu")
        with pytest.raises(ConfigError, match="model.logprob_impl='mosaic' needs a 16-bit"):
            hk.choose_impl("mosaic", 256, dtype=jnp.float32)
    # The active mesh's tensor axis, and its context axis (the kernel's rows-only
    # shard_map would gather each sequence's tokens).
    for tensor, context, want in ((1, 1, "mosaic"), (2, 1, "xla"), (1, 2, "xla")):
        sharder = types.SimpleNamespace(mesh=types.SimpleNamespace(
            shape={"data": 2, "fsdp": 1, "context": context, "tensor": tensor}))
        with monkeypatch.context() as patch:
            patch.setattr(sharding, "active_sharder", lambda s=sharder: s)
            assert hk.choose_impl("auto", 896) == want, (tensor, context)
    monkeypatch.setattr(mosaic_backend, "on_hopper", lambda: False)  # an A100, say
    assert hk.choose_impl("auto", 896) == "xla"
    monkeypatch.undo()
    for impl in ("pallas", "triton"):  # the Triton kernel is gone
        with pytest.raises(ValueError, match="'auto', 'xla', 'mosaic'"):
            hk.choose_impl(impl, 896)
    h, w, y = _inputs()
    with pytest.raises(ValueError, match="multiple of 64"):
        hk.log_softmax_stats(h, hk.pad_vocab(w, True), y, vocab=V, vocab_first=True,
                             interpret=True)
    with pytest.raises(ConfigError, match="logprob_impl"):
        ModelConfig.preset("tiny", logprob_impl="cuda")
    assert hk.pad_vocab(jnp.zeros((101, 8)), True, SMALL).shape == (128, 8)
    with pytest.raises(ValueError, match="t a multiple of 64 per consumer"):
        hk.MosaicBlocks(t=32)
    with pytest.raises(ValueError, match="t a multiple of 64 per consumer"):
        hk.MosaicBlocks(t=64, consumers=2)
    with pytest.raises(ValueError, match="stages >= 2"):
        hk.MosaicBlocks(stages=1)


@INTERPRETS
@pytest.mark.parametrize(("tokens", "group", "vocab"), [(5, 32, 40), (200, 2, 64)])
def test_mosaic_one_pipeline_step_groups_and_no_padding(tokens, group, vocab):
    """A hidden size of one `k` step (no wgmma to overlap with the next step's copies);
    200 tokens are 4 token blocks, launched as 2 groups of 2; a vocabulary of whole
    blocks (no block masks)."""
    rng = np.random.default_rng(6)
    h = jnp.asarray(rng.normal(size=(1, tokens, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(vocab, 16)), jnp.float32)
    y = jnp.asarray(rng.integers(0, vocab, (1, tokens)), jnp.int32).at[0, :2].set(vocab - 1)
    blocks = hk.MosaicBlocks(t=64, v=32, k=16, stages=2, group=group)
    log_z, target, ent = hk.log_softmax_stats(h, hk.pad_vocab(w, True, blocks), y,
                                              vocab=vocab, vocab_first=True,
                                              with_entropy=True, impl="mosaic",
                                              blocks=blocks, interpret=True)
    z, ref_log_z, _, _, ref_ent = _reference(h, w, y, 1.0)
    np.testing.assert_allclose(log_z[0], ref_log_z, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(target[0], z[np.arange(tokens), np.asarray(y[0])], rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(ent[0], ref_ent, rtol=1e-5, atol=1e-5)


@INTERPRETS
@pytest.mark.parametrize("vocab_first", [True, False])
def test_mosaic_two_consumer_warpgroups(vocab_first):
    """`consumers=2`: 128 tokens a program, 64 per warpgroup, fed by a third one."""
    h, w, y = _inputs(seed=2)
    y = y.at[0, :3].set(V - 1)
    blocks = hk.MosaicBlocks(t=128, v=64, k=16, stages=2, consumers=2)
    weight = hk.pad_vocab(w if vocab_first else w.T, vocab_first, blocks)
    log_z, target, ent = hk.log_softmax_stats(h, weight, y, vocab=V, vocab_first=vocab_first,
                                              temperature=TEMPERATURE, with_entropy=True,
                                              impl="mosaic", blocks=blocks, interpret=True)
    z, ref_log_z, _, _, ref_ent = _reference(h, w, y, TEMPERATURE)
    np.testing.assert_allclose(log_z[0], ref_log_z, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(target[0], z[np.arange(T), np.asarray(y[0])], rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(ent[0], ref_ent, rtol=1e-5, atol=1e-5)


_SHARDED_SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jrl import sharding
    from jrl.rl import logprobs
    from jrl.kernels import logprob_head as hk

    assert jax.device_count() == 8, jax.devices()
    hk.MOSAIC_FORWARD = hk.MosaicBlocks(t=64, v=32, k=16, stages=2)

    def xla_parts(h_td, w, y_t, *, vocab, vocab_first, temperature, with_entropy, blocks,
                  interpret):
        # The kernel's statistics for one block spanning the padded vocabulary, by XLA.
        z = jnp.dot(h_td, w.T if vocab_first else w) / temperature
        valid = jnp.arange(z.shape[1]) < vocab
        z = jnp.where(valid, z, -jnp.inf)
        m = z.max(1)
        e = jnp.exp(z - m[:, None])
        parts = [m, e.sum(1), jnp.take_along_axis(z, y_t[:, None], 1)[:, 0]]
        if with_entropy:
            parts.append(jnp.where(valid, e * z, 0.0).sum(1))
        return tuple(x[None] for x in parts)

    def xla_grads(h_td, w, y_t, log2_z_t, a_t, c_t, b_t, *, vocab, vocab_first,
                  temperature, entropy_grad, blocks, interpret):
        # The backward kernel's d loss / d z by XLA: a onehot - p (c + b ln p).
        z = jnp.dot(h_td, w.T if vocab_first else w) / temperature
        log_p = z - (log2_z_t / np.log2(np.e))[:, None]
        p = jnp.exp(log_p)
        onehot = jnp.arange(z.shape[1])[None] == y_t[:, None]
        coef = c_t[:, None] + (b_t[:, None] * log_p if entropy_grad else 0.0)
        grad = a_t[:, None] * onehot - p * coef
        return jnp.where(jnp.arange(z.shape[1]) < vocab, grad, 0.0).astype(h_td.dtype)

    hk._mosaic_parts = xla_parts
    hk._mosaic_grads = xla_grads
    hk.MOSAIC_BACKWARD = hk.MOSAIC_FORWARD
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(8, 6, 32)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 70, (8, 6)), jnp.int32)
    params = {"embed": {"embedding": jnp.asarray(rng.normal(size=(70, 32)) * 0.4,
                                                 jnp.float32)}}

    def values(params, hidden, impl):
        return logprobs.token_log_probs(params, hidden, targets, chunk_size=3, impl=impl)[0]

    def loss(params, hidden, impl):
        lp, ent = logprobs.token_log_probs(params, hidden, targets, chunk_size=3,
                                           with_entropy=True, impl=impl)
        return jnp.sum(lp) + jnp.sum(ent), (lp, ent)

    grad = jax.grad(loss, argnums=(0, 1), has_aux=True)
    want = grad(params, hidden, "xla")
    out = {}
    for name, sizes in (("data", dict(data=8, fsdp=1, tensor=1)),
                        ("fsdp_tensor", dict(data=2, fsdp=2, tensor=2))):
        sharder = sharding.Sharder(sharding.make_mesh(sharding.MeshSettings(**sizes)))
        def fn(params, hidden, sharder=sharder):
            with sharder.active():
                return grad(params, hidden, "mosaic")
        got = jax.jit(fn)(params, hidden)
        diffs = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), got, want)
        out[name] = max(jax.tree.leaves(diffs))
    # Per shard: under the data mesh nothing is gathered (each device its rows).
    data = sharding.Sharder(sharding.make_mesh(sharding.MeshSettings(data=8, fsdp=1, tensor=1)))
    def forward(params, hidden):
        with data.active():
            return values(params, hidden, "mosaic")
    shardings = (data.replicated, data.batch(3))
    hlo = jax.jit(forward, in_shardings=shardings).lower(params, hidden).compile().as_text()
    out["gathers"] = hlo.count("all-gather")
    print(json.dumps(out))
""")


def test_kernel_under_a_mesh_runs_per_shard_and_matches():
    """Under a `Sharder` the kernel runs in a shard_map over the batch axes, each device
    on its rows (no gathers), and values and gradients match the XLA path. The kernel
    itself (forward and backward) is stood in for by XLA here: Pallas' GPU interpreter
    cannot run kernels of several devices at once (it races on its simulated barriers)."""
    result = run_script(_SHARDED_SCRIPT)
    assert set(result) == {"data", "fsdp_tensor", "gathers"}
    assert result.pop("gathers") == 0, result
    assert all(diff < 1e-4 for diff in result.values()), result


@ON_HOPPER
@pytest.mark.parametrize("vocab_first", [True, False])
def test_compiled_kernel_on_hopper_matches_float64(vocab_first):
    """The kernel compiled on a Hopper GPU with its default tiles and bfloat16 operands
    (the trainer's), against float64 numpy of the same bfloat16 values; then values and
    gradients through `token_log_probs` against the XLA path."""
    rng = np.random.default_rng(7)
    t, d, v = 300, 128, 1000
    h = jnp.asarray(rng.normal(size=(1, t, d)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(v, d)) * 0.2, jnp.bfloat16)
    y = jnp.asarray(rng.integers(0, v, (1, t)), jnp.int32).at[0, :3].set(v - 1)
    weight = hk.pad_vocab(w if vocab_first else w.T, vocab_first)
    log_z, target, ent = hk.log_softmax_stats(h, weight, y, vocab=v, vocab_first=vocab_first,
                                              temperature=TEMPERATURE, with_entropy=True)
    z, ref_log_z, _, _, ref_ent = _reference(h, w, y, TEMPERATURE)
    np.testing.assert_allclose(log_z[0], ref_log_z, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(target[0], z[np.arange(t), np.asarray(y[0])], atol=1e-3)
    np.testing.assert_allclose(ent[0], ref_ent, rtol=1e-3, atol=2e-3)

    params = ({"embed": {"embedding": w.astype(jnp.float32)}} if vocab_first else
              {"lm_head": {"kernel": w.T.astype(jnp.float32)},
               "embed": {"embedding": jnp.zeros((v, d))}})

    def loss(params, hidden, impl):
        lp, ent = logprobs.token_log_probs(params, hidden, y.repeat(2, 0), chunk_size=64,
                                           with_entropy=True, impl=impl)
        return jnp.sum(lp) + jnp.sum(ent), (lp, ent)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    hidden = h.repeat(2, 0)
    got, want = grad(params, hidden, "mosaic"), grad(params, hidden, "xla")
    chex.assert_trees_all_close(got[1], want[1], rtol=1e-3, atol=2e-3)  # log-probs, entropy
    chex.assert_trees_all_close(got[0], want[0], rtol=2e-2, atol=2e-2)  # bf16 gradients
