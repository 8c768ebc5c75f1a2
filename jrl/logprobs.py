"""Memory-bounded log-probabilities and entropy of response tokens.

A `[B, T, V]` float32 logits tensor is never materialised at once: the
unembedding, log-softmax, gather and entropy run over chunks of the response
inside a `lax.scan`, each chunk rematerialised in the backward pass, so peak
memory is `B * chunk * V` floats instead of `B * T * V`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrl.models import cache as cache_lib
from jrl.models import heads, transformer
from jrl.models.config import ModelConfig
from jrl.sharding import constrain

Array = jax.Array


def sequence_inputs(prompt_ids, prompt_mask, responses, response_mask):
    """Concatenates left-padded prompts and right-padded responses.

    Returns:
      `(tokens [B, P+R], mask [B, P+R], positions [B, P+R])`.
    """
    tokens = jnp.concatenate([prompt_ids, responses], axis=1).astype(jnp.int32)
    mask = jnp.concatenate([prompt_mask, response_mask], axis=1).astype(jnp.int32)
    return tokens, mask, cache_lib.positions_from_mask(mask)


def _chunk_log_probs(params, hidden_bcd, targets_bc, temperature, with_entropy):
    logits_bcv = constrain(heads.unembed(params, hidden_bcd), ("batch", None, "vocab"))
    logits_bcv = logits_bcv / temperature
    log_z_bc = jax.nn.logsumexp(logits_bcv, axis=-1)
    target_logit_bc = jnp.take_along_axis(logits_bcv, targets_bc[..., None], axis=-1)[..., 0]
    log_probs_bc = target_logit_bc - log_z_bc
    if not with_entropy:
        return log_probs_bc, jnp.zeros_like(log_probs_bc)
    probs_bcv = jnp.exp(logits_bcv - log_z_bc[..., None])
    entropy_bc = log_z_bc - jnp.sum(probs_bcv * logits_bcv, axis=-1)
    return log_probs_bc, entropy_bc


def token_log_probs(
    params,
    hidden_brd: Array,
    targets_br: Array,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = 128,
    with_entropy: bool = False,
):
    """Log-probs (and entropy) of `targets` given the hidden states that predict them.

    Args:
      params: model parameters (for the unembedding).
      hidden_brd: `[B, R, D]`; `hidden[:, t]` is the state that predicts `targets[:, t]`.
      targets_br: int `[B, R]` token ids.
      temperature: logits are divided by it (as the sampler did).
      chunk_size: response tokens per chunk (None: all of them, one chunk).
      with_entropy: also compute the entropy of each predictive distribution.

    Returns:
      `(log_probs [B, R], entropy [B, R])` in float32 (entropy zeros if not asked).
    """
    b, r, d = hidden_brd.shape
    chunk = r if chunk_size is None else min(chunk_size, r)
    pad = (-r) % chunk
    hidden_brd = jnp.pad(hidden_brd, ((0, 0), (0, pad), (0, 0)))
    targets_br = jnp.pad(targets_br, ((0, 0), (0, pad)))
    n = (r + pad) // chunk
    hidden_nbcd = hidden_brd.reshape(b, n, chunk, d).swapaxes(0, 1)
    targets_nbc = targets_br.reshape(b, n, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def body(_, xs):
        return None, _chunk_log_probs(params, *xs, temperature, with_entropy)

    _, (lp_nbc, ent_nbc) = jax.lax.scan(body, None, (hidden_nbcd, targets_nbc))
    unchunk = lambda x: x.swapaxes(0, 1).reshape(b, n * chunk)[:, :r]
    return unchunk(lp_nbc), unchunk(ent_nbc)


def response_hidden(params, prompt_ids, prompt_mask, responses, response_mask, *,
                    config: ModelConfig) -> Array:
    """Hidden states `[B, R, D]` that predict each response token (one full forward)."""
    tokens, mask, positions = sequence_inputs(prompt_ids, prompt_mask, responses, response_mask)
    hidden_btd, _ = transformer.forward(params, tokens, positions, mask, config=config)
    p = prompt_ids.shape[1]
    r = responses.shape[1]
    return hidden_btd[:, p - 1 : p + r - 1]


def response_log_probs(params, prompt_ids, prompt_mask, responses, response_mask, *,
                       config: ModelConfig, temperature: float = 1.0, chunk_size: int = 128,
                       with_entropy: bool = False):
    """Log-probs `[B, R]` of the responses under `params` (and entropy `[B, R]`)."""
    hidden = response_hidden(params, prompt_ids, prompt_mask, responses, response_mask,
                             config=config)
    return token_log_probs(params, hidden, responses, temperature=temperature,
                           chunk_size=chunk_size, with_entropy=with_entropy)


def response_values(critic_params, prompt_ids, prompt_mask, responses, response_mask, *,
                    config: ModelConfig) -> Array:
    """Critic values `[B, R]`: the value of the state before each response token."""
    hidden = response_hidden(critic_params, prompt_ids, prompt_mask, responses, response_mask,
                             config=config)
    return heads.values(critic_params, hidden)


def in_micro_batches(fn, micro_batch: int | None):
    """`fn(params, *arrays) -> outputs`, run over micro-batches of `micro_batch` rows.

    The rows `[N, ...]` are viewed as `[N / micro_batch, micro_batch, ...]` and mapped
    sequentially (`lax.map`), so activations and logits are bounded by one micro-batch;
    each micro-batch is split over the mesh's batch axes. None: one pass over all rows.
    """
    if micro_batch is None:
        return fn

    def mapped(params, *arrays):
        n = arrays[0].shape[0]
        if n % micro_batch:
            raise ValueError(f"{n} rows do not split into micro-batches of {micro_batch}")
        split = lambda x: constrain(x.reshape(n // micro_batch, micro_batch, *x.shape[1:]),
                                    (None, "batch") + (None,) * (x.ndim - 1))
        out = jax.lax.map(lambda xs: fn(params, *xs), tuple(split(x) for x in arrays))
        merge = lambda y: constrain(y.reshape(n, *y.shape[2:]), ("batch",) + (None,) * (y.ndim - 2))
        return jax.tree.map(merge, out)

    return mapped
