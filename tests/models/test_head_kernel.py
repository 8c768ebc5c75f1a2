"""The fused unembedding + log-softmax kernels (`jrl.models.head_kernel`), compiled on a
GPU and in Pallas' interpret mode elsewhere, against float64 numpy and against the XLA
path of `jrl.logprobs`: the Triton one (`impl="pallas"`) and the Mosaic GPU one
(`impl="mosaic"`, always in Pallas' GPU interpret mode here; its compiled form is
checked on a Hopper GPU by experiments/check_mosaic_head.py).

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

from jrl import logprobs, sharding
from jrl.errors import ConfigError
from jrl.models import ModelConfig
from jrl.models import head_kernel as hk
from tests.eight_devices import run_script
from tests.markers import NEEDS_MOSAIC, NEEDS_TRITON

# On a GPU the Triton kernel runs compiled, elsewhere in Pallas' interpret mode.
INTERPRET = jax.default_backend() != "gpu"

# Small tiles so a handful of tokens and entries spans several programs of the grid
# (the Mosaic kernel's: wgmma's 64 rows, 16 float32 hidden units per pipeline step).
SMALL = hk.Blocks(t=16, v=32, k=16)
SMALL_MOSAIC = hk.MosaicBlocks(t=64, v=32, k=16, stages=2)
# Each kernel with its small tiles and interpret flag (the Mosaic one always interpreted:
# on a GPU its float32 operands would run as tf32).
KERNELS = [pytest.param("pallas", SMALL, INTERPRET, marks=NEEDS_TRITON, id="pallas"),
           pytest.param("mosaic", SMALL_MOSAIC, True, marks=NEEDS_MOSAIC, id="mosaic")]
# Through `token_log_probs` (no interpret flag there): the Mosaic kernel off a GPU only.
IMPLS = [pytest.param("pallas", marks=NEEDS_TRITON),
         pytest.param("mosaic", marks=[NEEDS_MOSAIC, pytest.mark.skipif(
             not INTERPRET, reason="float32 operands run as tf32 on the GPU")])]
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


@pytest.mark.parametrize(("impl", "blocks", "interpret"), KERNELS)
@pytest.mark.parametrize("vocab_first", [True, False])
@pytest.mark.parametrize("tokens_per_call", [32768, 20])  # one launch; two, the last padded
def test_stats_match_float64(impl, blocks, interpret, vocab_first, tokens_per_call):
    h, w, y = _inputs()
    weight = hk.pad_vocab(w if vocab_first else w.T, vocab_first, blocks)
    assert weight.shape == ((128, D) if vocab_first else (D, 128))
    log_z, target, ent = hk.log_softmax_stats(h, weight, y, vocab=V, vocab_first=vocab_first,
                                              temperature=TEMPERATURE, with_entropy=True,
                                              impl=impl, blocks=blocks,
                                              tokens_per_call=tokens_per_call,
                                              interpret=interpret)
    z, ref_log_z, ref_lp, _, ref_ent = _reference(h, w, y, TEMPERATURE)
    chex.assert_shape((log_z, target, ent), (1, T))
    np.testing.assert_allclose(log_z[0], ref_log_z, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(target[0], z[np.arange(T), np.asarray(y[0])], rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose((target - log_z)[0], ref_lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent[0], ref_ent, rtol=1e-5, atol=1e-5)
    assert ref_ent.std() > 0.1  # varied distributions, not a degenerate case


@pytest.mark.parametrize(("impl", "blocks", "interpret"), KERNELS)
def test_stats_without_entropy_and_targets_in_the_last_block(impl, blocks, interpret):
    h, w, y = _inputs(seed=1)
    y = y.at[0, :5].set(V - 1)  # the last real entry, in the block with padding
    weight = hk.pad_vocab(w, True, blocks)
    log_z, target, ent = hk.log_softmax_stats(h, weight, y, vocab=V, vocab_first=True,
                                              impl=impl, blocks=blocks, interpret=interpret)
    z, ref_log_z, _, _, _ = _reference(h, w, y, 1.0)
    np.testing.assert_allclose(log_z[0], ref_log_z, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(target[0], z[np.arange(T), np.asarray(y[0])], rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_array_equal(ent, 0.0)


@NEEDS_TRITON
def test_unpadded_or_overpadded_unembedding_is_refused():
    h, w, y = _inputs()
    for weight in (w, jnp.pad(w, ((0, 128 + 32 - V), (0, 0)))):  # 101 rows; a whole extra block
        with pytest.raises(ValueError, match="pad it with pad_vocab"):
            hk.log_softmax_stats(h, weight, y, vocab=V, vocab_first=True, blocks=SMALL,
                                 interpret=INTERPRET)


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(hk, "FORWARD", SMALL)
    monkeypatch.setattr(hk, "MOSAIC_FORWARD", SMALL_MOSAIC)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk_size", [4, None])
def test_token_log_probs_kernel_matches_xla(small_blocks, impl, tied, chunk_size):
    """Values and gradients (hidden states, unembedding) of the log-probs and the
    entropy through `token_log_probs`, the kernel's forward (and the residuals it
    hands the backward pass) against the chunked XLA path."""
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

    for entropy_grad in (True, False):
        grad = jax.grad(loss, argnums=(0, 1), has_aux=True)
        (g_params, g_hidden), (lp, ent) = grad(params, hidden, impl, entropy_grad)
        (w_params, w_hidden), (w_lp, w_ent) = grad(params, hidden, "xla", entropy_grad)
        chex.assert_trees_all_close((lp, ent), (w_lp, w_ent), rtol=1e-5, atol=1e-5)
        chex.assert_trees_all_close(g_hidden, w_hidden, rtol=1e-4, atol=1e-5)
        chex.assert_trees_all_close(g_params, w_params, rtol=1e-4, atol=1e-5)
        assert float(jnp.abs(g_hidden).max()) > 1e-2


@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16_hidden_states(small_blocks, impl):
    """bf16 hidden states and unembedding (the compute dtype on GPU): the kernel and the
    XLA path multiply the same bf16 operands with float32 accumulation."""
    rng = np.random.default_rng(5)
    hidden = jnp.asarray(rng.normal(size=(2, 9, D)), jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, V, (2, 9)), jnp.int32)
    params = {"embed": {"embedding": jnp.asarray(rng.normal(size=(V, D)) * 0.4, jnp.float32)}}
    out = {name: logprobs.token_log_probs(params, hidden, targets, chunk_size=4,
                                          with_entropy=True, impl=name)
           for name in (impl, "xla")}
    chex.assert_trees_all_close(out[impl], out["xla"], rtol=1e-4, atol=1e-4)


@NEEDS_TRITON
def test_trainer_runs_the_kernel_in_its_log_prob_passes(small_blocks, tmp_path, monkeypatch):
    """`model.logprob_impl` reaches the reference pass (no entropy) and the update (with
    it), and a run through the kernel ends where the XLA path's does."""
    from jrl.train import run
    from tests.trainer.tiny import tiny_config

    calls = []
    stats = hk.log_softmax_stats

    def recording(*args, **kwargs):
        calls.append(kwargs["with_entropy"])
        return stats(*args, **kwargs)

    monkeypatch.setattr(hk, "log_softmax_stats", recording)
    config = lambda impl: tiny_config(**{"model.logprob_impl": impl, "model.hidden_size": 32,
                                         "actor.use_kl_loss": True})
    last = {}
    for impl in ("pallas", "xla"):
        run(config(impl), str(tmp_path / impl))
        with open(tmp_path / impl / "metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
        last[impl] = {k: v for k, v in rows[-1].items()
                      if k.startswith(("actor/pg_loss", "actor/kl_loss", "actor/grad_norm",
                                       "actor/entropy", "critic/score"))}
    assert set(calls) == {True, False}, calls
    assert {"actor/pg_loss", "actor/kl_loss", "actor/entropy"} <= set(last["xla"])
    chex.assert_trees_all_close(last["pallas"], last["xla"], rtol=1e-3, atol=1e-5)


@NEEDS_TRITON
def test_choice_and_errors(monkeypatch):
    assert hk.choose_impl("auto", 896) == ("pallas" if jax.default_backend() == "gpu"
                                           else "xla")
    assert hk.choose_impl("pallas", 30) == "pallas"
    assert hk.choose_impl("xla", 896) == "xla"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert hk.choose_impl("auto", 896) == "pallas"
    assert hk.choose_impl("auto", 896, with_entropy=False) == "xla"  # no faster in the step
    assert hk.choose_impl("auto", 30) == "xla"  # not whole k blocks
    assert hk.choose_impl("auto", 3584) == "xla"  # above MAX_HIDDEN: XLA is faster
    assert hk.choose_impl("pallas", 3584) == "pallas"
    for tensor, want in ((1, "pallas"), (2, "xla")):  # the active mesh's tensor axis
        sharder = types.SimpleNamespace(mesh=types.SimpleNamespace(
            shape={"data": 2, "fsdp": 1, "tensor": tensor}))
        with monkeypatch.context() as patch:
            patch.setattr(sharding, "active_sharder", lambda s=sharder: s)
            assert hk.choose_impl("auto", 896) == want
    monkeypatch.undo()
    with pytest.raises(ValueError, match="'auto', 'xla', 'pallas', 'mosaic'"):
        hk.choose_impl("triton", 896)
    h, w, y = _inputs()
    with pytest.raises(ValueError, match="multiple of 64"):
        hk.log_softmax_stats(h, hk.pad_vocab(w, True), y, vocab=V, vocab_first=True,
                             interpret=INTERPRET)
    with pytest.raises(ConfigError, match="logprob_impl"):
        ModelConfig.preset("tiny", logprob_impl="cuda")


@NEEDS_MOSAIC
def test_mosaic_is_taken_only_when_forced(monkeypatch):
    assert hk.choose_impl("mosaic", 896) == "mosaic"
    assert ModelConfig.preset("tiny", logprob_impl="mosaic").logprob_impl == "mosaic"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert hk.choose_impl("auto", 896) in ("pallas", "xla")
    assert hk.default_blocks("mosaic") is hk.MOSAIC_FORWARD
    assert hk.pad_vocab(jnp.zeros((101, 8)), True, SMALL_MOSAIC).shape == (128, 8)
    with pytest.raises(ValueError, match="t a multiple of 64 per consumer"):
        hk.MosaicBlocks(t=32)
    with pytest.raises(ValueError, match="t a multiple of 64 per consumer"):
        hk.MosaicBlocks(t=64, consumers=2)
    with pytest.raises(ValueError, match="stages >= 2"):
        hk.MosaicBlocks(stages=1)


@NEEDS_MOSAIC
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


@NEEDS_MOSAIC
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
    from jrl import logprobs, sharding
    from jrl.models import head_kernel as hk

    assert jax.device_count() == 8, jax.devices()
    hk.FORWARD = hk.Blocks(t=16, v=32, k=16)
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
                return grad(params, hidden, "pallas")
        got = jax.jit(fn)(params, hidden)
        diffs = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), got, want)
        out[name] = max(jax.tree.leaves(diffs))
    # Per shard: under the data mesh nothing is gathered (each device its rows).
    data = sharding.Sharder(sharding.make_mesh(sharding.MeshSettings(data=8, fsdp=1, tensor=1)))
    def forward(params, hidden):
        with data.active():
            return values(params, hidden, "pallas")
    shardings = (data.replicated, data.batch(3))
    hlo = jax.jit(forward, in_shardings=shardings).lower(params, hidden).compile().as_text()
    out["gathers"] = hlo.count("all-gather")
    print(json.dumps(out))
""")


@NEEDS_TRITON
def test_kernel_under_a_mesh_runs_per_shard_and_matches():
    """Under a `Sharder` the kernel runs in a shard_map over the batch axes."""
    result = run_script(_SHARDED_SCRIPT)
    assert set(result) == {"data", "fsdp_tensor", "gathers"}
    assert result.pop("gathers") == 0, result
    assert all(diff < 1e-4 for diff in result.values()), result
