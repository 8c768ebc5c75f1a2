"""Masked statistics and loss aggregation over `[batch, time]` token arrays.

All functions are pure and jit-able. Masks are 0/1 arrays of any real dtype
(booleans are accepted and cast to the values' dtype).

The loss-aggregation modes follow verl's `agg_loss`, with the normaliser made an
explicit argument: a mini-batch that is split into micro-batches passes the token
and sequence counts of the *whole* mini-batch to every micro-batch, so that the
sum of the micro-batch losses equals the loss of the whole mini-batch, and so do
their gradients.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array

# verl's guard against an all-zero mask in a mean.
_MEAN_EPS = 1e-8

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def _as_mask(mask: Array, like: Array) -> Array:
    return jnp.asarray(mask).astype(jnp.result_type(like.dtype, jnp.float32))


def masked_sum(values: Array, mask: Array, axis: int | None = None) -> Array:
    """Sum of `values * mask` over `axis` (all axes when None)."""
    return jnp.sum(values * _as_mask(mask, values), axis=axis)


def masked_mean(values: Array, mask: Array, axis: int | None = None) -> Array:
    """`sum(values * mask) / (sum(mask) + 1e-8)`, as verl computes it."""
    mask = _as_mask(mask, values)
    return jnp.sum(values * mask, axis=axis) / (jnp.sum(mask, axis=axis) + _MEAN_EPS)


def masked_var(values: Array, mask: Array, unbiased: bool = True) -> Array:
    """Variance of the masked elements (scalar over the whole array).

    With `unbiased`, Bessel's correction `n / (n - 1)` is applied, where `n` is
    the number of unmasked elements. The variance of fewer than two elements is
    undefined: verl raises, which a traced function cannot do, so the result is
    NaN there (and the trainer's non-finite guard catches it).
    """
    mask = _as_mask(mask, values)
    mean = masked_mean(values, mask)
    variance = masked_mean(jnp.square(values - mean), mask)
    if unbiased:
        n = jnp.sum(mask)
        variance = jnp.where(n > 1, variance * n / jnp.maximum(n - 1, 1), jnp.nan)
    return variance


def masked_whiten(values: Array, mask: Array, shift_mean: bool = True) -> Array:
    """`(values - mean) / sqrt(var + 1e-8)` with masked statistics.

    With `shift_mean=False` the mean is added back, so only the scale changes.
    Masked-out positions are transformed too (callers multiply by the mask when
    they need zeros there, as verl does).
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * jax.lax.rsqrt(masked_var(values, mask) + 1e-8)
    return whitened if shift_mean else whitened + mean


class LossNormalizer(NamedTuple):
    """Global normalisers for `agg_loss`, counted over a whole mini-batch.

    Attributes:
      num_tokens: number of unmasked tokens (for `token-mean`).
      num_seqs: number of sequences with at least one unmasked token
        (for the `seq-mean-*` modes).
      num_columns: the mask's response length T, the default divisor of
        `seq-mean-token-sum-norm` (a micro-batch may run on fewer columns,
        `jrl.rl.buckets`); None: the aggregated batch's own.
    """

    num_tokens: Array
    num_seqs: Array
    num_columns: int | None = None


def loss_normalizer(mask: Array) -> LossNormalizer:
    """The normalisers of the batch whose `[B, T]` response mask is `mask`."""
    mask = jnp.asarray(mask, jnp.float32)
    return LossNormalizer(
        num_tokens=jnp.sum(mask),
        num_seqs=jnp.sum((jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)),
        num_columns=mask.shape[-1],
    )


def agg_loss(
    loss_bt: Array,
    mask_bt: Array,
    mode: str,
    normalizer: LossNormalizer | None = None,
    scale_factor: float | None = None,
) -> Array:
    """Aggregates a per-token loss `[B, T]` into a scalar.

    Modes (verl's names), with `N_tok` and `N_seq` from `normalizer`:
      - `token-mean`:              sum_bt(l * m) / N_tok
      - `token-sum`:               sum_bt(l * m) (no normaliser: the mini-batch's
        micro-batch losses add up to its token sum; verl scales its local sum by
        the data-parallel size only to undo FSDP's mean over ranks)
      - `seq-mean-token-sum`:      sum_b(sum_t l * m) / N_seq
      - `seq-mean-token-mean`:     sum_b(sum_t(l * m) / (sum_t m + 1e-8)) / N_seq
      - `seq-mean-token-sum-norm`: sum_b(sum_t l * m) / N_seq / scale_factor
        (Dr. GRPO; `scale_factor` defaults to T, the normaliser's `num_columns`,
        and should stay constant through training).

    Sequences whose mask is all zero contribute nothing and are not counted.

    Args:
      loss_bt: per-token loss `[B, T]`.
      mask_bt: response mask `[B, T]`.
      mode: one of `LOSS_AGG_MODES`.
      normalizer: global counts; defaults to this batch's own counts.
      scale_factor: divisor of `seq-mean-token-sum-norm`.

    Returns:
      The scalar loss.
    """
    mask_bt = _as_mask(mask_bt, loss_bt)
    if normalizer is None:
        normalizer = loss_normalizer(mask_bt)
    if mode == "token-mean":
        return jnp.sum(loss_bt * mask_bt) / normalizer.num_tokens
    if mode == "token-sum":
        return jnp.sum(loss_bt * mask_bt)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {mode!r}")
    token_count_b = jnp.sum(mask_bt, axis=-1)
    seq_loss_b = jnp.sum(loss_bt * mask_bt, axis=-1)
    if mode == "seq-mean-token-mean":
        seq_loss_b = seq_loss_b / (token_count_b + _MEAN_EPS)
    loss = jnp.sum(jnp.where(token_count_b > 0, seq_loss_b, 0.0)) / normalizer.num_seqs
    if mode == "seq-mean-token-sum-norm":
        if scale_factor is None:
            scale_factor = (loss_bt.shape[-1] if normalizer.num_columns is None
                            else normalizer.num_columns)
        loss = loss / scale_factor
    return loss
