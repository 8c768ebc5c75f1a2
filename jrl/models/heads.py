"""Output heads over the final hidden states `[B, T, D]` (post final norm).

Heads are plain functions of the parameter dict, so the trainer can apply them to
chunks of hidden states (e.g. compute log-probs over a few hundred tokens at a time
without materialising `[B, T, V]` in float32).

Parameter layout (top-level keys next to the backbone's `embed`, `layers`,
`final_norm`):

| head   | key          | leaves                                   | HF name              |
| ------ | ------------ | ---------------------------------------- | -------------------- |
| LM     | `lm_head`    | `kernel [D, V]` (absent when tied)       | `lm_head.weight`     |
| value  | `value_head` | `kernel [D, 1]`, `bias [1]`              | (PPO critic, no HF)  |
| score  | `score`      | `kernel [D, 1]`                          | `score.weight`       |
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jrl.models import gemma

Params = Mapping[str, Any]
BACKBONE_KEYS = ("embed", "layers", "final_norm")
HEADS = ("lm", "value", "score", "none")


class Head(nn.Module):
    """Creates a head's parameters: `kernel [D, features]` and optionally `bias`.

    Used only at init time (via `jrl.models.init_params`); the heads are applied by
    the functions below so that they work on plain parameter dicts.
    """

    features: int
    use_bias: bool
    feature_axis: str | None
    stddev: float
    param_dtype: str

    @nn.compact
    def __call__(self, hidden_btd: jax.Array) -> None:
        kernel_init = nn.initializers.normal(self.stddev)
        self.param(
            "kernel",
            nn.with_logical_partitioning(kernel_init, ("embed", self.feature_axis)),
            (hidden_btd.shape[-1], self.features),
            self.param_dtype,
        )
        if self.use_bias:
            self.param(
                "bias",
                nn.with_logical_partitioning(nn.initializers.zeros, (self.feature_axis,)),
                (self.features,),
                self.param_dtype,
            )


def unembed(params: Params, hidden_btd: jax.Array, *, dtype: str | None = None,
            softcap: float | None = None) -> jax.Array:
    """LM logits `hidden @ W` with `W` the LM head, or the embedding's transpose when tied.

    Args:
      params: model parameters; tied when they have no `lm_head`.
      hidden_btd: `[..., D]` final hidden states (any leading shape, e.g. a chunk).
      dtype: dtype of the matmul operands; defaults to `hidden_btd.dtype`. The
        product is accumulated and returned in float32 either way.
      softcap: the model's `final_logit_softcapping` (Gemma): logits `z` become
        `cap * tanh(z / cap)`, in float32; None: as they are.

    Returns:
      float32 logits `[..., V]`.
    """
    dtype = dtype or hidden_btd.dtype
    hidden = hidden_btd.astype(dtype)
    if "lm_head" in params:
        weight_dv = params["lm_head"]["kernel"].astype(dtype)
        logits = jnp.einsum("...d,dv->...v", hidden, weight_dv,
                            preferred_element_type=jnp.float32)
    else:
        embedding_vd = params["embed"]["embedding"].astype(dtype)
        logits = jnp.einsum("...d,vd->...v", hidden, embedding_vd,
                            preferred_element_type=jnp.float32)
    return gemma.softcap(logits, softcap)


def values(params: Params, hidden_btd: jax.Array) -> jax.Array:
    """PPO critic values, one per token: `hidden @ w + b`, in float32.

    Args:
      params: critic parameters with `value_head`.
      hidden_btd: `[B, T, D]` final hidden states.

    Returns:
      float32 `[B, T]`.
    """
    head = params["value_head"]
    kernel_d1 = head["kernel"].astype(jnp.float32)
    out_bt1 = hidden_btd.astype(jnp.float32) @ kernel_d1 + head["bias"].astype(jnp.float32)
    return out_bt1[..., 0]


def sequence_scores(params: Params, hidden_btd: jax.Array, mask_bt: jax.Array) -> jax.Array:
    """Reward-model scores read at each row's last valid token (HF `*ForSequenceClassification`).

    Args:
      params: reward-model parameters with `score`.
      hidden_btd: `[B, T, D]` final hidden states.
      mask_bt: `[B, T]`, 1 for real tokens (left or right padding both work).

    Returns:
      float32 `[B]`.
    """
    num_tokens = mask_bt.shape[1]
    # Index of the rightmost 1 in each row.
    last_b = num_tokens - 1 - jnp.argmax(mask_bt[:, ::-1].astype(bool), axis=1)
    hidden_bd = jnp.take_along_axis(hidden_btd, last_b[:, None, None], axis=1)[:, 0]
    kernel_d1 = params["score"]["kernel"].astype(jnp.float32)
    return (hidden_bd.astype(jnp.float32) @ kernel_d1)[:, 0]


def init_value_head(rng: jax.Array, hidden_size: int, dtype, stddev: float = 0.02) -> dict:
    """Fresh value head: `kernel [D, 1] ~ N(0, stddev)`, `bias [1] = 0`."""
    kernel = stddev * jax.random.normal(rng, (hidden_size, 1), jnp.float32)
    return {"kernel": kernel.astype(dtype), "bias": jnp.zeros((1,), dtype)}


def init_critic_params(actor_params: Params, rng: jax.Array, *, stddev: float = 0.02) -> dict:
    """A PPO critic initialised from an actor: the actor's backbone and a fresh value head.

    The backbone leaves are copied into new buffers, so donating the actor's
    parameters in a jitted update cannot invalidate the critic's.

    Args:
      actor_params: causal-LM parameters (`embed`, `layers`, `final_norm`, ...).
      rng: key for the value head.
      stddev: init scale of the value head's kernel.

    Returns:
      `{embed, layers, final_norm, value_head}`; the same tree as
      `init_params(config, rng, head="value")`.
    """
    backbone = {key: jax.tree.map(jnp.copy, actor_params[key]) for key in BACKBONE_KEYS}
    embedding = actor_params["embed"]["embedding"]
    value_head = init_value_head(rng, embedding.shape[1], embedding.dtype, stddev)
    return {**backbone, "value_head": value_head}
