"""The rollout/training mismatch: its metrics and its correction (verl's rollout correction).

The sampler draws each token from the rollout policy and records its log-probability
(`rollout_log_probs`); the trainer's log-probs of the same tokens (`old_log_probs`)
differ from them through kernels, dtypes and batch shapes, and by a whole update when
the rollout is a step stale (one-step asynchronous training). With the log-ratio
`log rho = old - rollout` per token:

    truncated IS (`rollout_is`)      w = min(rho, threshold), token by token (`token`) or
                                     one product over the row's tokens (`sequence`);
                                     detached, multiplying each token's policy loss
    rejection (`rollout_rs`)         tokens (`token`) or whole rows (`sequence`: the
                                     product of rho, `geometric`: its geometric mean)
                                     outside [lower, upper] leave the loss mask
    veto (`rollout_token_veto_...`)  a row with any token's rho below the threshold
                                     leaves the loss mask

`metrics` reports the mismatch with verl's names: `training/rollout_probs_diff_*`
(|p_old - p_rollout| per token) and `rollout_corr/*` (KL, perplexities, chi-square and
the statistics of the weights and rejections). Log-ratios are clamped to +-20 before
`exp`, as verl does.

The settings follow verl's `algorithm.rollout_correction` of the generation with
`rollout_rs` in token|sequence|geometric and `rollout_token_veto_threshold`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jrl.errors import ConfigError
from jrl.masks import masked_mean

Array = jax.Array

SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")
LOSS_TYPES = ("ppo_clip", "reinforce")


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionConfig:
    """`algorithm.rollout_correction.*` (all off by default, as verl's).

    Attributes:
      rollout_is: None, "token" or "sequence": truncated importance sampling.
      rollout_is_threshold: the truncation (upper bound) of the IS weights.
      rollout_is_batch_normalize: divide the weights by their batch mean.
      rollout_rs: None, "token", "sequence" or "geometric": rejection sampling.
      rollout_rs_threshold: upper bound of the accepted ratios (needed with rollout_rs).
      rollout_rs_threshold_lower: lower bound (None: 1 / upper).
      rollout_token_veto_threshold: reject a row with any token ratio below it (None: off).
      bypass_mode: the rollout's log-probs are the old ones (no old-log-prob pass); the
        weights and rejections then come from the update's own log-probs.
      loss_type: with bypass_mode, "ppo_clip" (the configured policy loss; its ratio is
        the IS correction, no weights on top) or "reinforce" (`-w A log pi`).
    """

    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | None = None
    rollout_rs_threshold_lower: float | None = None
    rollout_token_veto_threshold: float | None = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"

    @property
    def rejects(self) -> bool:
        """Whether some rows or tokens may leave the loss mask."""
        return self.rollout_rs is not None or self.rollout_token_veto_threshold is not None

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rejects or self.bypass_mode

    @property
    def rs_lower(self) -> float:
        lower = self.rollout_rs_threshold_lower
        return 1.0 / self.rollout_rs_threshold if lower is None else lower

    def validate(self, prefix: str = "algorithm.rollout_correction") -> RolloutCorrectionConfig:
        """Raises a `ConfigError` naming the first invalid key; returns self."""
        def fail(key, message):
            raise ConfigError(f"{prefix}.{key}: {message}")

        def positive(key):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, (int, float))
                                          and not isinstance(value, bool) and value > 0):
                fail(key, f"must be a positive number, got {value!r}")

        for key, levels in (("rollout_is", IS_LEVELS), ("rollout_rs", RS_LEVELS)):
            value = getattr(self, key)
            if value is not None and value not in levels:
                fail(key, f"{value!r} is not valid; choose one of {[None, *levels]}")
        for key in ("rollout_is_threshold", "rollout_rs_threshold",
                    "rollout_rs_threshold_lower", "rollout_token_veto_threshold"):
            positive(key)
        if self.rollout_is is not None and self.rollout_is_threshold is None:
            fail("rollout_is_threshold", "is needed with rollout_is (e.g. 2.0)")
        if self.rollout_rs is not None and self.rollout_rs_threshold is None:
            fail("rollout_rs_threshold", f"is needed with rollout_rs={self.rollout_rs!r} "
                 "(the largest accepted ratio, e.g. 2.0)")
        if self.rollout_rs is not None and self.rs_lower > self.rollout_rs_threshold:
            fail("rollout_rs_threshold_lower", f"{self.rs_lower} is above rollout_rs_threshold="
                 f"{self.rollout_rs_threshold}: nothing would be accepted")
        if self.loss_type not in LOSS_TYPES:
            fail("loss_type", f"{self.loss_type!r} is not valid; choose one of {list(LOSS_TYPES)}")
        if self.loss_type != "ppo_clip" and not self.bypass_mode:
            fail("loss_type", f"{self.loss_type!r} applies only with bypass_mode=True")
        return self


# ----------------------------------------------------------------------------- the correction


def _row_sum(x: Array, mask: Array) -> Array:
    return jnp.sum(x * mask, axis=-1, keepdims=True)


def _log_weights(log_ratio: Array, mask: Array, level: str) -> tuple[Array, Array]:
    """(log-weights broadcast to `[B, T]`, clamped to +-20; the unclamped log-ratios the
    level looks at: per token `[B, T]`, or per row `[B, 1]`)."""
    if level == "token":
        raw = log_ratio
    elif level == "sequence":
        raw = _row_sum(log_ratio, mask)
    else:  # geometric
        raw = masked_mean(log_ratio, mask, axis=-1)[:, None]
    clamped = jnp.clip(raw, -SAFETY_BOUND, SAFETY_BOUND)
    return jnp.broadcast_to(clamped, log_ratio.shape), raw


def is_weights(log_ratio: Array, mask: Array, cfg: RolloutCorrectionConfig) -> Array:
    """Truncated IS weights `[B, T]` (0 off the mask), detached; divided by their batch
    mean (over tokens, or over rows for `sequence`) with `rollout_is_batch_normalize`."""
    log_w, _ = _log_weights(log_ratio, mask, cfg.rollout_is)
    w = jnp.minimum(jnp.exp(log_w) * mask, cfg.rollout_is_threshold)
    w = jax.lax.stop_gradient(w)
    if cfg.rollout_is_batch_normalize:
        mean = _batch_mean(w, mask, cfg.rollout_is)
        w = jnp.where(mean > 1e-8, w / mean, w)
    return w


def _batch_mean(w: Array, mask: Array, level: str) -> Array:
    if level == "token":
        return masked_mean(w, mask)
    has_tokens = (mask.sum(-1) > 0).astype(w.dtype)
    return jnp.sum(masked_mean(w, mask, axis=-1) * has_tokens) / jnp.maximum(
        has_tokens.sum(), 1e-8)


def keep_mask(log_ratio: Array, mask: Array, cfg: RolloutCorrectionConfig) -> Array:
    """`[B, T]` 1 where a token stays in the loss: rejection sampling, then the veto."""
    keep = jnp.ones_like(log_ratio)
    if cfg.rollout_rs is not None:
        log_w, _ = _log_weights(log_ratio, mask, cfg.rollout_rs)
        w = jnp.exp(log_w)
        keep = ((w >= cfg.rs_lower) & (w <= cfg.rollout_rs_threshold)).astype(log_ratio.dtype)
    if cfg.rollout_token_veto_threshold is not None:
        keep = keep * (~_vetoed(log_ratio, mask, cfg)).astype(log_ratio.dtype)[:, None]
    return keep


def _catastrophic(log_ratio, mask, cfg) -> Array:
    return (log_ratio < jnp.log(cfg.rollout_token_veto_threshold)) & (mask > 0)


def _vetoed(log_ratio, mask, cfg) -> Array:
    """`[B]` rows with a token whose ratio is below the veto threshold."""
    return _catastrophic(log_ratio, mask, cfg).any(-1)


def correct(old_log_probs: Array, rollout_log_probs: Array, response_mask: Array,
            cfg: RolloutCorrectionConfig) -> tuple[Array | None, Array]:
    """(IS weights `[B, T]` or None, the loss mask after rejections) of a batch.

    `old_log_probs` are the training policy's (the actor before the update, or in
    bypass mode the update's current ones), `rollout_log_probs` the sampler's.
    """
    mask = response_mask.astype(jnp.float32)
    log_ratio = (old_log_probs - rollout_log_probs).astype(jnp.float32)
    weights = None if cfg.rollout_is is None else is_weights(log_ratio, mask, cfg)
    if cfg.rejects:
        mask = mask * keep_mask(log_ratio, mask, cfg)
    return weights, mask.astype(response_mask.dtype)


# ----------------------------------------------------------------------------- metrics


def _masked_max(x, mask):
    return jnp.where(mask > 0, x, -jnp.inf).max()


def _masked_min(x, mask):
    return jnp.where(mask > 0, x, jnp.inf).min()


def _std(x: Array) -> Array:
    """Unbiased standard deviation of a vector (torch's `std`); 0 for one element."""
    if x.size < 2:
        return jnp.float32(0.0)
    return jnp.std(x, ddof=1)


def _weight_metrics(name: str, w: Array, raw: Array, mask: Array, level: str,
                    upper: float, lower: float) -> dict:
    """verl's statistics of a set of ratios `w` `[B, T]` (clamped to +-20 in log space);
    `raw` are the unclamped log-ratios of the level (`[B, T]` or `[B, 1]`)."""
    p = f"rollout_corr/{name}"
    out = {f"{p}_mean": masked_mean(w, mask)}
    if level == "token":
        out.update({
            f"{p}_max": _masked_max(w, mask), f"{p}_min": _masked_min(w, mask),
            f"{p}_ratio_fraction_high": masked_mean((w > upper).astype(jnp.float32), mask),
            f"{p}_ratio_fraction_low": masked_mean((w < lower).astype(jnp.float32), mask)})
    else:  # one ratio per row, judged in log space
        out.update({
            f"{p}_max": jnp.exp(jnp.minimum(raw.max(), SAFETY_BOUND)),
            f"{p}_min": jnp.exp(raw.min()),
            f"{p}_ratio_fraction_high": jnp.mean((raw > jnp.log(upper)).astype(jnp.float32)),
            f"{p}_ratio_fraction_low": jnp.mean((raw < jnp.log(lower)).astype(jnp.float32))})
    clamped = jnp.clip(w, lower, upper)
    mean_c = masked_mean(clamped, mask)
    var = masked_mean(clamped ** 2, mask) - mean_c ** 2
    out[f"{p}_std"] = jnp.where(mask.sum() > 1, jnp.sqrt(jnp.maximum(var, 0.0)), 0.0)
    out[f"{p}_eff_sample_size"] = 1.0 / masked_mean((clamped / (mean_c + 1e-8)) ** 2, mask)
    seq = masked_mean(w, mask, axis=-1)
    out.update({
        f"{p}_seq_mean": seq.mean(), f"{p}_seq_std": _std(seq), f"{p}_seq_max": seq.max(),
        f"{p}_seq_min": seq.min(), f"{p}_seq_max_deviation": jnp.abs(seq - 1.0).max(),
        f"{p}_seq_fraction_high": jnp.mean((seq > upper).astype(jnp.float32)),
        f"{p}_seq_fraction_low": jnp.mean((seq < lower).astype(jnp.float32))})
    return out


def offpolicy_metrics(old_log_probs: Array, rollout_log_probs: Array, mask: Array) -> dict:
    """KL(rollout || training) by k1 and k3, both perplexities and their ratio, and the
    token and sequence chi-square divergences (`rollout_corr/*`)."""
    p = "rollout_corr"
    # Padding's log-ratios are never exponentiated (an inf there would turn a mean NaN).
    log_ratio = jnp.where(mask > 0, old_log_probs - rollout_log_probs, 0.0)
    mean_old = masked_mean(old_log_probs, mask, axis=-1)
    mean_rollout = masked_mean(rollout_log_probs, mask, axis=-1)
    log_ppl_diff = mean_rollout - mean_old
    safe = jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    seq_safe = jnp.clip(_row_sum(log_ratio, mask)[:, 0], -SAFETY_BOUND, SAFETY_BOUND)
    return {
        f"{p}/training_ppl": jnp.exp(-mean_old).mean(),
        f"{p}/training_log_ppl": (-mean_old).mean(),
        f"{p}/kl": masked_mean(rollout_log_probs - old_log_probs, mask),
        f"{p}/k3_kl": masked_mean(jnp.exp(log_ratio) - log_ratio - 1.0, mask),
        f"{p}/rollout_ppl": jnp.exp(-mean_rollout).mean(),
        f"{p}/rollout_log_ppl": (-mean_rollout).mean(),
        f"{p}/log_ppl_diff": log_ppl_diff.mean(),
        f"{p}/log_ppl_abs_diff": jnp.abs(log_ppl_diff).mean(),
        f"{p}/log_ppl_diff_max": log_ppl_diff.max(),
        f"{p}/log_ppl_diff_min": log_ppl_diff.min(),
        f"{p}/ppl_ratio": jnp.exp(log_ppl_diff).mean(),
        f"{p}/chi2_token": masked_mean(jnp.exp(safe) ** 2, mask) - 1.0,
        f"{p}/chi2_seq": jnp.mean(jnp.exp(2.0 * seq_safe)) - 1.0,
    }


def probs_diff_metrics(old_log_probs: Array, rollout_log_probs: Array, mask: Array) -> dict:
    """verl's `training/rollout_probs_diff_*`: |p_old - p_rollout| over the response
    tokens (max, mean, unbiased std) and the Pearson correlation of the two."""
    m = mask > 0
    count = jnp.maximum(m.sum(), 1)
    old, rollout = jnp.exp(old_log_probs), jnp.exp(rollout_log_probs)
    diff = jnp.abs(old - rollout)
    mean = jnp.where(m, diff, 0).sum() / count
    var = jnp.where(m, (diff - mean) ** 2, 0).sum() / jnp.maximum(count - 1, 1)

    def centred(x):
        return jnp.where(m, x - jnp.where(m, x, 0).sum() / count, 0)

    x, y = centred(old), centred(rollout)
    corr = (x * y).sum() / jnp.sqrt((x * x).sum() * (y * y).sum())
    return {"training/rollout_probs_diff_valid": jnp.float32(1.0),
            "training/rollout_probs_diff_max": jnp.where(m, diff, -jnp.inf).max(),
            "training/rollout_probs_diff_mean": mean,
            "training/rollout_probs_diff_std": jnp.sqrt(var),
            "training/rollout_actor_probs_pearson_corr": corr}


def metrics(old_log_probs: Array, rollout_log_probs: Array, response_mask: Array,
            cfg: RolloutCorrectionConfig) -> dict:
    """The step's mismatch metrics (verl's names) over `response_mask` (before rejections):
    always the probability differences and the off-policy figures, and the statistics of
    the IS weights, the rejections and the veto where those are configured."""
    mask = response_mask.astype(jnp.float32)
    old_log_probs = old_log_probs.astype(jnp.float32)
    rollout_log_probs = rollout_log_probs.astype(jnp.float32)
    log_ratio = old_log_probs - rollout_log_probs
    out = {**probs_diff_metrics(old_log_probs, rollout_log_probs, mask),
           **offpolicy_metrics(old_log_probs, rollout_log_probs, mask)}
    if cfg.rollout_is is not None:
        log_w, raw = _log_weights(log_ratio, mask, cfg.rollout_is)
        upper = cfg.rollout_is_threshold
        out.update(_weight_metrics("rollout_is", jnp.exp(log_w) * mask, raw, mask,
                                   cfg.rollout_is, upper, 1.0 / upper))
        if cfg.rollout_is_batch_normalize:
            w = jnp.minimum(jnp.exp(log_w) * mask, upper)
            mean = _batch_mean(w, mask, cfg.rollout_is)
            out["rollout_corr/rollout_is_batch_norm_factor"] = jnp.where(mean > 1e-8, mean, 1.0)
    if cfg.rollout_rs is not None:
        log_w, raw = _log_weights(log_ratio, mask, cfg.rollout_rs)
        w = jnp.exp(log_w)
        upper, lower = cfg.rollout_rs_threshold, cfg.rs_lower
        out.update(_weight_metrics("rollout_rs", w, raw, mask, cfg.rollout_rs, upper, lower))
        keep = ((w >= lower) & (w <= upper)).astype(jnp.float32)
        out["rollout_corr/rollout_rs_masked_fraction"] = masked_mean(1.0 - keep, mask)
        if cfg.rollout_rs == "token":
            rejected_rows = ((1.0 - keep) * mask).sum(-1) > 0
        else:
            rejected_rows = keep[:, 0] == 0
        out["rollout_corr/rollout_rs_seq_masked_fraction"] = rejected_rows.astype(
            jnp.float32).mean()
    veto, catastrophic = jnp.float32(0.0), jnp.float32(0.0)
    if cfg.rollout_token_veto_threshold is not None:
        veto = _vetoed(log_ratio, mask, cfg).astype(jnp.float32).mean()
        catastrophic = masked_mean(_catastrophic(log_ratio, mask, cfg).astype(jnp.float32),
                                   mask)
    out["rollout_corr/rollout_is_veto_fraction"] = veto
    out["rollout_corr/rollout_is_catastrophic_token_fraction"] = catastrophic
    return out
