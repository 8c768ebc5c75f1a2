"""jrl.rl.logprobs against a naive reference computed from the full `[B, T, V]` logits.

The reference runs `transformer.forward_logits` once over prompt + response, takes
`log_softmax(logits / temperature)` over the whole vocabulary with the usual shift
(the logit at position t predicts token t + 1), gathers the response tokens and
computes the entropy as `-(p * log p).sum(-1)`. Nothing here calls the functions under
test to build a reference.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.models import transformer
from jrl.models.config import ModelConfig
from jrl.models.heads import init_critic_params
from jrl.rl import logprobs

P, R = 5, 7  # prompt and response widths
# Row 0 unpadded, row 1 padded on both sides, row 2 a one-token prompt and an empty
# response, row 3 a short prompt and one padded response slot.
PROMPT_LENS = np.array([5, 3, 1, 2])
RESPONSE_LENS = np.array([7, 4, 0, 6])
RTOL, ATOL = 1e-5, 1e-6


def tiny_config(**overrides):
    # initializer_range 0.3 makes the predictive distributions far from uniform, so a
    # wrong shift, temperature or gather moves the numbers well beyond the tolerance.
    kwargs = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, initializer_range=0.3, attention_impl="xla")
    return ModelConfig.preset("tiny", **{**kwargs, **overrides})


CONFIGS = {"tied": tiny_config(), "untied": tiny_config(tie_word_embeddings=False)}


@functools.cache
def params_for(name):
    init = jax.jit(transformer.init_params, static_argnums=0)
    return init(CONFIGS[name], jax.random.key(0))


def make_batch(seed=0, prompt_pad=0, response_pad=0):
    """Left-padded prompts and right-padded responses (int32 numpy arrays)."""
    rng = np.random.default_rng(seed)
    prompt_mask = (np.arange(P)[None] >= P - PROMPT_LENS[:, None]).astype(np.int32)
    response_mask = (np.arange(R)[None] < RESPONSE_LENS[:, None]).astype(np.int32)
    vocab = CONFIGS["tied"].vocab_size
    prompt_ids = rng.integers(3, vocab, prompt_mask.shape)
    responses = rng.integers(3, vocab, response_mask.shape)
    prompt_ids = np.where(prompt_mask == 1, prompt_ids, prompt_pad).astype(np.int32)
    responses = np.where(response_mask == 1, responses, response_pad).astype(np.int32)
    return prompt_ids, prompt_mask, responses, response_mask


@functools.partial(jax.jit, static_argnames="config")
def naive_full(params, config, prompt_ids, prompt_mask, responses, response_mask):
    """Full-sequence tokens, and the forward's hidden states and logits over all of them."""
    tokens = jnp.concatenate([prompt_ids, responses], axis=1).astype(jnp.int32)
    mask = jnp.concatenate([prompt_mask, response_mask], axis=1).astype(jnp.int32)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    hidden, _ = transformer.forward(params, tokens, positions, mask, config=config)
    logits, _ = transformer.forward_logits(params, tokens, positions, mask, config=config)
    return tokens, hidden, logits


@functools.partial(jax.jit, static_argnames=("config", "temperature"))
def naive_log_probs(params, config, batch, temperature):
    """`(log_probs [B, R], entropy [B, R])` from the full logits, at every response slot."""
    prompt_width = batch[0].shape[1]
    tokens, _, logits = naive_full(params, config, *batch)
    logp_btv = jax.nn.log_softmax(logits[:, :-1] / temperature, axis=-1)  # t predicts t + 1
    lp_bt = jnp.take_along_axis(logp_btv, tokens[:, 1:, None], axis=-1)[..., 0]
    ent_bt = -(jnp.exp(logp_btv) * logp_btv).sum(-1)
    # Response token j sits at P + j and is predicted by position P + j - 1.
    return lp_bt[:, prompt_width - 1:], ent_bt[:, prompt_width - 1:]


def jitted_log_probs(config, **kwargs):
    return jax.jit(functools.partial(logprobs.response_log_probs, config=config, **kwargs))


@pytest.mark.parametrize(
    "name, chunk_size, temperature, with_entropy",
    [
        ("tied", 1, 0.7, True),
        ("tied", 3, 0.7, True),  # 3 does not divide R = 7: the last chunk is padded
        ("tied", 7, 0.7, True),  # one chunk of exactly R
        ("tied", 128, 0.7, True),  # larger than R (the default): clipped to one chunk
        ("tied", None, 0.7, True),  # None: one chunk
        ("tied", 3, 0.7, False),
        ("untied", 3, 1.0, True),  # separate lm_head kernel, no temperature
    ],
)
def test_chunked_log_probs_and_entropy_match_full_logits(name, chunk_size, temperature,
                                                         with_entropy):
    config, params = CONFIGS[name], params_for(name)
    batch = make_batch()
    fn = jitted_log_probs(config, chunk_size=chunk_size, temperature=temperature,
                          with_entropy=with_entropy)
    lp, ent = fn(params, *batch)
    ref_lp, ref_ent = naive_log_probs(params, config, batch, temperature)

    assert lp.shape == ent.shape == (len(PROMPT_LENS), R)
    assert lp.dtype == ent.dtype == jnp.float32
    # The distributions are far from uniform (the test would not see a shift otherwise).
    assert float(jnp.std(ref_lp)) > 0.5
    if not with_entropy:
        chex.assert_trees_all_close(lp, ref_lp, rtol=RTOL, atol=ATOL)
        np.testing.assert_array_equal(ent, np.zeros((len(PROMPT_LENS), R), np.float32))
        return
    # Every response slot, padded ones included: the function applies no response mask,
    # so at padding it returns the log-prob (and entropy) of the pad token there, computed
    # from the same masked forward as the reference.
    chex.assert_trees_all_close((lp, ent), (ref_lp, ref_ent), rtol=RTOL, atol=ATOL)
    padded = batch[3] == 0
    assert padded.any()
    assert np.isfinite(np.asarray(lp)).all() and np.isfinite(np.asarray(ent)).all()
    assert (np.asarray(lp)[padded] < 0).all() and (np.asarray(ent)[padded] > 0).all()


def naive_token_log_probs(kernel_dv, hidden_brd, targets_br, temperature):
    logp = jax.nn.log_softmax(hidden_brd @ kernel_dv / temperature, axis=-1)
    lp = jnp.take_along_axis(logp, targets_br[..., None], axis=-1)[..., 0]
    return lp, -(jnp.exp(logp) * logp).sum(-1)


@pytest.mark.parametrize("name", ["untied", "tied"])
@pytest.mark.parametrize("entropy_weight", [0.0, 0.1])
def test_token_log_probs_values_and_gradients_per_chunk_size(name, entropy_weight):
    """`token_log_probs` on given hidden states: values, and gradients through its own
    backward rule (hidden states and the LM head or the tied embedding), against
    autodiff of one log-softmax over the whole `[B, R, V]` logits."""
    config, params = CONFIGS[name], params_for(name)
    batch = make_batch(seed=1)
    tokens, hidden, _ = naive_full(params, config, *batch)
    hidden_brd, targets = hidden[:, P - 1:P + R - 1], tokens[:, P:]
    weights = jnp.asarray(batch[3], jnp.float32)
    loss = lambda lp_ent: jnp.sum(weights * (lp_ent[0] + entropy_weight * lp_ent[1]))
    path = ("lm_head", "kernel") if name == "untied" else ("embed", "embedding")
    weight = params[path[0]][path[1]]

    def naive(w, h):
        kernel_dv = w if name == "untied" else w.T
        return naive_token_log_probs(kernel_dv, h, targets, 0.9)

    ref_grads = jax.grad(lambda w, h: loss(naive(w, h)), argnums=(0, 1))(weight, hidden_brd)
    ref_out = naive(weight, hidden_brd)
    assert float(jnp.abs(ref_grads[0]).max()) > 1e-3  # the check below can fail
    for chunk_size in (2, 4, 6, None):
        def chunked(w, h, chunk_size=chunk_size):
            p = {**params, path[0]: {**params[path[0]], path[1]: w}}
            return logprobs.token_log_probs(p, h, targets, temperature=0.9,
                                            chunk_size=chunk_size, with_entropy=True)

        out = jax.jit(chunked)(weight, hidden_brd)
        chex.assert_trees_all_close(out, ref_out, rtol=RTOL, atol=ATOL)
        grads = jax.jit(jax.grad(lambda w, h, f=chunked: loss(f(w, h)), argnums=(0, 1)))(
            weight, hidden_brd)
        chex.assert_trees_all_close(grads, ref_grads, rtol=1e-4, atol=1e-5)


def test_a_traced_temperature_gives_the_static_ones_values_and_gradients():
    """A temperature passed as an array under jit (one run's own in a sweep, `jrl.rl.runs`)
    takes the same forward and backward passes as the same number given as a constant,
    vmapped over two temperatures as a sweep's runs are."""
    config, params = CONFIGS["untied"], params_for("untied")
    tokens, hidden, _ = naive_full(params, config, *make_batch(seed=2))
    hidden_brd, targets = hidden[:, P - 1:P + R - 1], tokens[:, P:]
    weight = params["lm_head"]["kernel"]

    def loss(w, h, temperature):
        p = {**params, "lm_head": {"kernel": w}}
        lp, ent = logprobs.token_log_probs(p, h, targets, temperature=temperature,
                                           chunk_size=4, with_entropy=True)
        return jnp.sum(lp) + 0.1 * jnp.sum(ent), (lp, ent)

    grad = jax.grad(loss, argnums=(0, 1), has_aux=True)
    traced = jax.jit(jax.vmap(grad, in_axes=(None, None, 0)))(
        weight, hidden_brd, jnp.asarray([0.7, 1.3]))
    for index, temperature in enumerate((0.7, 1.3)):
        static = jax.jit(functools.partial(grad, temperature=temperature))(weight, hidden_brd)
        chex.assert_trees_all_close(jax.tree.map(lambda x, i=index: x[i], traced), static,
                                    rtol=1e-5, atol=1e-6)
    assert not np.allclose(traced[1][0][0], traced[1][0][1])  # the temperatures differ


def test_entropy_without_its_gradient_is_a_metric_only():
    """`entropy_grad=False`: the entropy's values are computed, but a loss that includes
    it gets the gradient of its log-prob part alone (the stop-gradient autodiff one)."""
    config, params = CONFIGS["tied"], params_for("tied")
    batch = make_batch(seed=2)
    tokens, hidden, _ = naive_full(params, config, *batch)
    hidden_brd, targets = hidden[:, P - 1:P + R - 1], tokens[:, P:]
    weight = params["embed"]["embedding"]
    weights = jnp.asarray(batch[3], jnp.float32)

    def naive(h):
        lp, ent = naive_token_log_probs(weight.T, h, targets, 1.0)
        return lp, jax.lax.stop_gradient(ent)

    def fused(h, entropy_grad):
        return logprobs.token_log_probs(params, h, targets, chunk_size=4, with_entropy=True,
                                        entropy_grad=entropy_grad)

    loss = lambda out: jnp.sum(weights * (out[0] + 0.5 * out[1]))
    want = jax.grad(lambda h: loss(naive(h)))(hidden_brd)
    got = jax.jit(jax.grad(lambda h: loss(fused(h, False))))(hidden_brd)
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_close(jax.jit(lambda h: fused(h, False))(hidden_brd), naive(hidden_brd),
                                rtol=RTOL, atol=ATOL)
    with_grad = jax.jit(jax.grad(lambda h: loss(fused(h, True))))(hidden_brd)
    assert float(jnp.abs(with_grad - want).max()) > 1e-4  # the entropy's term is real


def test_token_log_probs_in_bfloat16_follow_the_float32_gradient():
    """bf16 hidden states (as the trainer runs): the backward rule's bf16 logits gradient
    gives gradients close to float32 autodiff (same direction, ~1% error)."""
    config, params = CONFIGS["untied"], params_for("untied")
    tokens, hidden, _ = naive_full(params, config, *make_batch(seed=2))
    hidden_brd, targets = hidden[:, P - 1:P + R - 1], tokens[:, P:]
    kernel = params["lm_head"]["kernel"]
    ref = jax.grad(lambda k, h: jnp.sum(naive_token_log_probs(k, h, targets, 1.0)[0]),
                   argnums=(0, 1))(kernel, hidden_brd)
    got = jax.grad(lambda k, h: jnp.sum(logprobs.token_log_probs(
        {**params, "lm_head": {"kernel": k}}, h.astype(jnp.bfloat16), targets,
        chunk_size=3)[0]), argnums=(0, 1))(kernel, hidden_brd)
    assert got[0].dtype == jnp.float32 and got[1].dtype == jnp.float32
    for g, r in zip(got, ref, strict=True):
        cos = jnp.sum(g * r) / (jnp.linalg.norm(g) * jnp.linalg.norm(r))
        assert float(cos) > 0.999
        assert float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) < 0.05


def test_padding_does_not_leak_into_real_tokens():
    """Real-token log-probs ignore pad ids, and equal each row run alone without padding."""
    config, params = CONFIGS["tied"], params_for("tied")
    fn = jitted_log_probs(config, chunk_size=3, temperature=0.7, with_entropy=True)
    lp, ent = fn(params, *make_batch(prompt_pad=0, response_pad=0))
    lp_junk, ent_junk = fn(params, *make_batch(prompt_pad=77, response_pad=2))
    real = make_batch()[3] == 1
    chex.assert_trees_all_close((lp_junk[real], ent_junk[real]), (lp[real], ent[real]),
                                rtol=RTOL, atol=ATOL)

    prompt_ids, _, responses, _ = make_batch()
    for row in (1, 3):  # padded on both sides
        pl, rl = PROMPT_LENS[row], RESPONSE_LENS[row]
        alone = (prompt_ids[row:row + 1, P - pl:], np.ones((1, pl), np.int32),
                 responses[row:row + 1, :rl], np.ones((1, rl), np.int32))
        lp_alone, ent_alone = fn(params, *alone)
        chex.assert_trees_all_close((lp_alone[0], ent_alone[0]), (lp[row, :rl], ent[row, :rl]),
                                    rtol=RTOL, atol=ATOL)


def test_in_micro_batches_equals_one_pass():
    config, params = CONFIGS["tied"], params_for("tied")
    batch = make_batch(seed=2)
    fn = functools.partial(logprobs.response_log_probs, config=config, chunk_size=3,
                           temperature=0.7, with_entropy=True)
    assert logprobs.in_micro_batches(fn, None) is fn
    full = jax.jit(fn)(params, *batch)
    for micro_batch in (1, 2):
        got = jax.jit(logprobs.in_micro_batches(fn, micro_batch))(params, *batch)
        chex.assert_trees_all_close(got, full, rtol=RTOL, atol=ATOL)
    # Micro-batches must divide the rows (4 rows, micro-batch 3): it refuses, at trace time.
    with pytest.raises(ValueError, match="4 rows do not split into micro-batches of 3"):
        jax.jit(logprobs.in_micro_batches(fn, 3))(params, *batch)


def test_response_values_match_value_head_over_full_hidden():
    config, params = CONFIGS["tied"], params_for("tied")
    critic = init_critic_params(params, jax.random.key(1), stddev=0.5)
    critic["value_head"]["bias"] = jnp.full((1,), 0.25, jnp.float32)  # a bias that shows
    batch = make_batch(seed=3)
    _, hidden, _ = naive_full(critic, config, *batch)
    head = critic["value_head"]
    values_bt = (hidden @ head["kernel"])[..., 0] + head["bias"][0]
    # The value of the state before response token j: the hidden state at P + j - 1.
    ref = values_bt[:, P - 1:P + R - 1]

    fn = functools.partial(logprobs.response_values, config=config)
    got = jax.jit(fn)(critic, *batch)
    assert got.shape == (len(PROMPT_LENS), R) and got.dtype == jnp.float32
    chex.assert_trees_all_close(got, ref, rtol=RTOL, atol=ATOL)
    assert float(jnp.std(ref)) > 0.1
    micro = jax.jit(logprobs.in_micro_batches(fn, 2))(critic, *batch)
    chex.assert_trees_all_close(micro, got, rtol=RTOL, atol=ATOL)
