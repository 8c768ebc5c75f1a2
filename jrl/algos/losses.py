"""Policy losses, the value loss, entropy and KL estimators (verl's math).

Every policy loss has the signature

    loss_fn(old_log_probs, log_probs, advantages, response_mask, config,
            normalizer=None, rng=None) -> (loss, metrics)

with `[B, T]` arrays, a static `PolicyLossConfig`, the mini-batch's global
`masks.LossNormalizer` (so micro-batch losses add up to the mini-batch loss),
and a PRNG key for the losses that sample (`clip_cov`). `metrics` uses verl's
names (`actor/pg_clipfrac`, `actor/ppo_kl`, `actor/pg_clipfrac_lower`) and
holds means over the tokens of this (micro-)batch.

| loss_mode  | objective                                               | paper       |
|------------|---------------------------------------------------------|-------------|
| vanilla    | PPO clip, clip-higher, dual-clip (`clip_ratio_c`)       | 1707.06347, 1912.09729 |
| gspo       | sequence-level ratio, clipped                           | 2507.18071  |
| gpg        | `-A * log pi`                                           | 2504.02546  |
| cispo      | `-sg(clip(r)) * A * log pi`                             | 2506.13585  |
| sapo       | soft sigmoid gate of the ratio                          | 2511.20347  |
| clip_cov   | PPO clip + detach a random few high-covariance tokens   | 2505.22617  |
| kl_cov     | no clip; `|log r|` penalty on the top-covariance tokens | 2505.22617  |
| geo_mean   | geometric-mean ratio per sequence (GMPO)                | 2507.20673  |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jrl.algos import masks
from jrl.algos.masks import LossNormalizer, agg_loss, masked_mean
from jrl.errors import ConfigError

Array = jax.Array
sg = jax.lax.stop_gradient

# verl clamps log-ratios before exp for stability.
_LOG_RATIO_CLAMP = 20.0


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Static settings of the policy losses (verl's `actor` keys).

    Attributes:
      loss_mode: `actor.policy_loss.loss_mode`.
      loss_agg_mode: `actor.loss_agg_mode`.
      clip_ratio: symmetric PPO clip epsilon.
      clip_ratio_low: lower epsilon (defaults to `clip_ratio`).
      clip_ratio_high: upper epsilon (defaults to `clip_ratio`; DAPO's clip-higher).
      clip_ratio_c: dual-clip bound for negative advantages, > 1.
      loss_scale_factor: divisor of `seq-mean-token-sum-norm` (defaults to T).
      clip_cov_ratio, clip_cov_lb, clip_cov_ub: Clip-Cov selection.
      kl_cov_ratio, ppo_kl_coef: KL-Cov selection and penalty weight.
      tau_pos, tau_neg: SAPO gate temperatures.
    """

    loss_mode: str = "vanilla"
    loss_agg_mode: str = "token-mean"
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    loss_scale_factor: float | None = None
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    tau_pos: float = 1.0
    tau_neg: float = 1.05

    @property
    def low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    def validate(self, prefix: str = "actor") -> None:
        """Raises a `ConfigError` (a ValueError) naming the first invalid key."""
        if self.loss_mode not in POLICY_LOSSES:
            raise ConfigError(
                f"{prefix}.policy_loss.loss_mode={self.loss_mode!r} is not known; "
                f"valid: {sorted(POLICY_LOSSES)}"
            )
        if self.loss_agg_mode not in masks.LOSS_AGG_MODES:
            raise ConfigError(
                f"{prefix}.loss_agg_mode={self.loss_agg_mode!r} is not known; "
                f"valid: {list(masks.LOSS_AGG_MODES)}"
            )
        for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ConfigError(f"{prefix}.{key} must be > 0, got {value}")
        if not self.clip_ratio_c > 1.0:
            raise ConfigError(
                f"{prefix}.clip_ratio_c must be > 1 (dual-clip), got {self.clip_ratio_c}"
            )
        for key in ("clip_cov_ratio", "kl_cov_ratio", "tau_pos", "tau_neg"):
            value = getattr(self, key)
            if not value > 0:
                raise ConfigError(f"{prefix}.policy_loss.{key} must be > 0, got {value}")


def _abs(x: Array) -> Array:
    """`|x|` with torch's gradient `sign(x)`, which is 0 at x = 0 (jnp.abs's is 1).

    Log-probs equal their reference (or old) values exactly on the first update,
    where an `|log r|` term must then add no gradient, as in verl.
    """
    return jnp.sign(x) * x


def _log_ratio(log_probs: Array, old_log_probs: Array, clamp: bool = True) -> Array:
    log_ratio = log_probs - old_log_probs
    return jnp.clip(log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP) if clamp else log_ratio


def _metrics(clipfrac, ppo_kl, clipfrac_lower=0.0) -> dict[str, Array]:
    return {
        "actor/pg_clipfrac": jnp.asarray(clipfrac, jnp.float32),
        "actor/ppo_kl": jnp.asarray(ppo_kl, jnp.float32),
        "actor/pg_clipfrac_lower": jnp.asarray(clipfrac_lower, jnp.float32),
    }


def _agg(loss_bt, mask, cfg: PolicyLossConfig, normalizer, mode: str | None = None,
         weights=None):
    """Aggregates per-token losses, each first multiplied by its rollout-correction
    weight (`weights`, detached; None: 1)."""
    if weights is not None:
        loss_bt = loss_bt * weights
    return agg_loss(loss_bt, mask, mode or cfg.loss_agg_mode, normalizer, cfg.loss_scale_factor)


# ----------------------------------------------------------------------------- policy losses


def vanilla(old_log_probs, log_probs, advantages, response_mask, cfg, normalizer=None, rng=None,
            weights=None):
    """PPO clipped surrogate with asymmetric clipping and dual-clip.

    r = exp(clamp(logp - logp_old, ±20));
    L1 = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high));
    L = min(L1, -A c) where A < 0 (dual-clip, c = clip_ratio_c), else L1.
    """
    del rng
    log_ratio = _log_ratio(log_probs, old_log_probs)
    ratio = jnp.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * jnp.clip(ratio, 1 - cfg.low, 1 + cfg.high)
    clipped = jnp.maximum(loss1, loss2)
    loss3 = -advantages * cfg.clip_ratio_c
    negative = advantages < 0
    pg_losses = jnp.where(negative, jnp.minimum(loss3, clipped), clipped)
    metrics = _metrics(
        masked_mean((loss2 > loss1).astype(jnp.float32), response_mask),
        masked_mean(-log_ratio, response_mask),
        masked_mean(((clipped > loss3) & negative).astype(jnp.float32), response_mask),
    )
    return _agg(pg_losses, response_mask, cfg, normalizer, weights=weights), metrics


def gspo(old_log_probs, log_probs, advantages, response_mask, cfg, normalizer=None, rng=None,
         weights=None):
    """GSPO: per-token ratio `sg(s_i) * pi / sg(pi)` with `s_i` the length-normalised
    sequence ratio; clipped like PPO; the per-token losses are aggregated by the configured
    `loss_agg_mode`, as verl 0.9's `compute_policy_loss_gspo` does (the GSPO paper's
    sequence mean is `seq-mean-token-mean`)."""
    del rng
    log_ratio = log_probs - old_log_probs
    mask = jnp.asarray(response_mask, log_probs.dtype)
    lengths = jnp.maximum(jnp.sum(mask, axis=-1), 1)
    seq_log_ratio = jnp.sum(log_ratio * mask, axis=-1) / lengths
    token_log_ratio = log_probs - sg(log_probs) + sg(seq_log_ratio)[:, None]
    ratio = jnp.exp(jnp.minimum(token_log_ratio, 10.0))
    loss1 = -advantages * ratio
    loss2 = -advantages * jnp.clip(ratio, 1 - cfg.low, 1 + cfg.high)
    pg_losses = jnp.maximum(loss1, loss2)
    metrics = _metrics(
        masked_mean((loss2 > loss1).astype(jnp.float32), response_mask),
        masked_mean(-log_ratio, response_mask),
    )
    return _agg(pg_losses, response_mask, cfg, normalizer, weights=weights), metrics


def gpg(old_log_probs, log_probs, advantages, response_mask, cfg, normalizer=None, rng=None,
        weights=None):
    """GPG: plain policy gradient `-A * log pi` (no ratio, no clip)."""
    del rng
    metrics = _metrics(0.0, masked_mean(old_log_probs - log_probs, response_mask))
    return _agg(-log_probs * advantages, response_mask, cfg, normalizer, weights=weights), metrics


def cispo(old_log_probs, log_probs, advantages, response_mask, cfg, normalizer=None, rng=None,
          weights=None):
    """CISPO: `-sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi`."""
    del rng
    log_ratio = _log_ratio(log_probs, old_log_probs)
    ratio = jnp.exp(log_ratio)
    clipped_ratio = jnp.clip(ratio, 1 - cfg.low, 1 + cfg.high)
    pg_losses = -sg(clipped_ratio) * advantages * log_probs
    metrics = _metrics(
        masked_mean((ratio != clipped_ratio).astype(jnp.float32), response_mask),
        masked_mean(-log_ratio, response_mask),
    )
    return _agg(pg_losses, response_mask, cfg, normalizer, weights=weights), metrics


def sapo(old_log_probs, log_probs, advantages, response_mask, cfg, normalizer=None, rng=None,
         weights=None):
    """SAPO: `-(4 / tau) * sigmoid(tau * (r - 1)) * A`, tau = tau_pos if A > 0 else
    tau_neg; always aggregated `seq-mean-token-mean`."""
    del rng
    log_ratio = _log_ratio(log_probs, old_log_probs)
    ratio = jnp.exp(log_ratio)
    tau = jnp.where(advantages > 0, cfg.tau_pos, cfg.tau_neg)
    gates = jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    metrics = _metrics(0.0, masked_mean(-log_ratio, response_mask))
    pg_losses = -gates * advantages
    return _agg(pg_losses, response_mask, cfg, normalizer, "seq-mean-token-mean",
                weights), metrics


def _ranked_first(score_n: Array, eligible_n: Array, k: Array) -> Array:
    """Marks the `k` eligible entries with the highest score (ties by position)."""
    order = jnp.argsort(jnp.where(eligible_n, -score_n, jnp.inf), stable=True)
    rank = jnp.empty_like(order).at[order].set(jnp.arange(order.shape[0]))
    return eligible_n & (rank < k)


def clip_cov(old_log_probs, log_probs, advantages, response_mask, cfg, normalizer=None, rng=None,
             weights=None):
    """Clip-Cov: PPO clip, and a random `clip_cov_ratio` share (at least one) of
    the unclipped tokens whose centred covariance `(A - mean A)(logp - mean logp)`
    lies in `(clip_cov_lb, clip_cov_ub)` is dropped from the loss."""
    if rng is None:
        raise ValueError("policy loss 'clip_cov' samples tokens and needs an `rng` key")
    valid = jnp.asarray(response_mask) > 0
    ratio = jnp.exp(log_probs - old_log_probs)
    loss1 = -advantages * ratio
    loss2 = -advantages * jnp.clip(ratio, 1 - cfg.low, 1 + cfg.high)
    cov = (advantages - masked_mean(advantages, response_mask)) * (
        sg(log_probs) - masked_mean(sg(log_probs), response_mask)
    )
    eligible = valid & ~(loss2 > loss1) & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    clip_num = jnp.maximum(jnp.floor(cfg.clip_cov_ratio * jnp.sum(valid)), 1)
    # A uniformly random subset of the eligible tokens: rank by random keys.
    keys = jax.random.uniform(rng, valid.shape).reshape(-1)
    detached = _ranked_first(keys, eligible.reshape(-1), clip_num).reshape(valid.shape)
    pg_losses = jnp.where(detached, 0.0, 1.0) * jnp.maximum(loss1, loss2)
    metrics = _metrics(
        masked_mean(detached.astype(jnp.float32), response_mask),
        masked_mean(old_log_probs - log_probs, response_mask),
    )
    return _agg(pg_losses, response_mask, cfg, normalizer, weights=weights), metrics


def kl_cov(old_log_probs, log_probs, advantages, response_mask, cfg, normalizer=None, rng=None,
           weights=None):
    """KL-Cov: unclipped `-A r`, plus `ppo_kl_coef * |log r|` on the `kl_cov_ratio`
    share of valid tokens with the largest centred covariance of A and logp.

    `actor/ppo_kl` reports the masked mean of `|log r|` here, as verl does.
    """
    del rng
    valid = jnp.asarray(response_mask) > 0
    log_ratio = log_probs - old_log_probs
    ratio = jnp.exp(log_ratio)
    abs_kl = _abs(log_ratio)
    cov = (advantages - masked_mean(advantages, valid)) * (
        sg(log_probs) - masked_mean(sg(log_probs), valid)
    )
    k = jnp.maximum(jnp.floor(jnp.sum(valid) * cfg.kl_cov_ratio), 1)
    top = _ranked_first(cov.reshape(-1), valid.reshape(-1), k).reshape(valid.shape)
    pg_losses = -advantages * ratio + jnp.where(top, cfg.ppo_kl_coef * abs_kl, 0.0)
    metrics = _metrics(0.0, masked_mean(abs_kl, response_mask))
    return _agg(pg_losses, response_mask, cfg, normalizer, weights=weights), metrics


def geo_mean(old_log_probs, log_probs, advantages, response_mask, cfg, normalizer=None, rng=None,
             weights=None):
    """GMPO: per sequence, `-A_seq * exp(mean_t clip_sgn(log r_t))`, with the
    token log-ratio clipped to `[-eps_low, eps_high]` on the side the advantage's
    sign makes pessimistic; mean over sequences (`loss_agg_mode` is not used)."""
    del rng
    mask = jnp.asarray(response_mask, log_probs.dtype)
    log_ratio = log_probs - old_log_probs
    sign = jnp.sign(advantages)
    clamped = jnp.clip(log_ratio, -cfg.low, cfg.high)
    pessimistic = sign * jnp.minimum(sign * log_ratio, sign * clamped)
    lengths = jnp.sum(mask, axis=-1) + 1e-8
    seq_ratio = jnp.exp(jnp.sum(pessimistic * mask, axis=-1) / lengths)
    seq_adv = jnp.sum(advantages * mask, axis=-1) / lengths
    num_seqs = mask.shape[0] if normalizer is None else normalizer.num_seqs
    loss = jnp.sum(-seq_adv * seq_ratio) / num_seqs
    was_clipped = (log_ratio != clamped).astype(jnp.float32)
    metrics = _metrics(
        masked_mean(was_clipped * (advantages > 0), response_mask),
        masked_mean(-log_ratio, response_mask),
        masked_mean(was_clipped * (advantages < 0), response_mask),
    )
    return loss, metrics


PolicyLossFn = Callable[..., tuple[Array, dict[str, Array]]]

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "vanilla": vanilla,
    "gspo": gspo,
    "gpg": gpg,
    "cispo": cispo,
    "sapo": sapo,
    "clip_cov": clip_cov,
    "kl_cov": kl_cov,
    "geo_mean": geo_mean,
}


def get_policy_loss(name: str) -> PolicyLossFn:
    if name not in POLICY_LOSSES:
        raise ConfigError(
            f"actor.policy_loss.loss_mode={name!r} is not known; valid: {sorted(POLICY_LOSSES)}"
        )
    return POLICY_LOSSES[name]


def policy_loss(old_log_probs, log_probs, advantages, response_mask, cfg: PolicyLossConfig,
                normalizer: LossNormalizer | None = None, rng=None, weights=None):
    """Dispatches to the loss named by `cfg.loss_mode`; `weights` (`[B, T]`, detached)
    multiply each token's loss before aggregation (rollout correction's IS weights)."""
    fn = get_policy_loss(cfg.loss_mode)
    return fn(old_log_probs, log_probs, advantages, response_mask, cfg, normalizer, rng,
              weights=weights)


def reinforce(rollout_log_probs, log_probs, advantages, response_mask, cfg: PolicyLossConfig,
              normalizer: LossNormalizer | None = None, weights=None):
    """REINFORCE with IS weights, `-w A log pi` (rollout correction's bypass mode with
    `loss_type='reinforce'`): no ratio, no clip; `actor/ppo_kl` is the mean of
    `rollout - log pi`."""
    metrics = _metrics(0.0, masked_mean(rollout_log_probs - log_probs, response_mask))
    return _agg(-advantages * log_probs, response_mask, cfg, normalizer,
                weights=weights), metrics


# ----------------------------------------------------------------------------- value, entropy


def value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode="token-mean",
               normalizer: LossNormalizer | None = None):
    """Clipped value loss `0.5 * agg(max((v - R)^2, (clip(v, V ± c) - R)^2))`.

    Returns:
      `(vf_loss, vf_clipfrac)`: the fraction of tokens where the clipped term won.
    """
    vclipped = jnp.clip(vpreds, values - cliprange_value, values + cliprange_value)
    loss1 = jnp.square(vpreds - returns)
    loss2 = jnp.square(vclipped - returns)
    vf_loss = 0.5 * agg_loss(jnp.maximum(loss1, loss2), response_mask, loss_agg_mode, normalizer)
    return vf_loss, masked_mean((loss2 > loss1).astype(jnp.float32), response_mask)


def entropy_from_logits(logits: Array) -> Array:
    """Categorical entropy `logsumexp(z) - sum softmax(z) * z` over the last axis."""
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(probs * logits, axis=-1)


# ----------------------------------------------------------------------------- KL estimators

KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_PENALTIES = KL_ESTIMATORS + tuple(name + "+" for name in KL_ESTIMATORS)


def _kl_forward(log_probs: Array, ref_log_probs: Array, kind: str) -> Array:
    diff = log_probs - ref_log_probs
    if kind in ("kl", "k1"):
        return diff
    if kind == "abs":
        return _abs(diff)
    if kind in ("mse", "k2"):
        return 0.5 * jnp.square(diff)
    if kind in ("low_var_kl", "k3"):
        # Schulman's k3 = ratio - log ratio - 1 with ratio = pi_ref / pi, clamped as verl.
        log_r = jnp.clip(-diff, -20.0, 20.0)
        return jnp.clip(jnp.exp(log_r) - log_r - 1.0, -10.0, 10.0)
    raise ValueError(f"kl estimator must be one of {KL_PENALTIES}, got {kind!r}")


def kl_penalty(log_probs: Array, ref_log_probs: Array, kind: str) -> Array:
    """Per-token KL(pi || pi_ref) estimate `[B, T]` (see joschu.net/blog/kl-approx).

    `k1`/`kl`: log r; `abs`: |log r| (gradient 0 where log r = 0, as torch's);
    `k2`/`mse`: (log r)^2 / 2;
    `k3`/`low_var_kl`: exp(-log r) + log r - 1 (clamped to [-10, 10]), with
    log r = logp - logp_ref. A `+` suffix is the straight-through variant: the
    forward value is the named estimator's, the gradient is k2's, whose
    expectation is the gradient of the true KL.
    """
    if kind.endswith("+"):
        base = kind[:-1]
        forward = _kl_forward(log_probs, ref_log_probs, base)
        backward = 0.5 * jnp.square(log_probs - ref_log_probs)
        return backward - sg(backward) + sg(forward)
    return _kl_forward(log_probs, ref_log_probs, kind)
