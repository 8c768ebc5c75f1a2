"""The rollout/training mismatch: its metrics and its correction (verl's rollout correction).

The sampler draws each token from the rollout policy and records its log-probability
(`rollout_log_probs`); the trainer's log-probs of the same tokens (`old_log_probs`)
differ from them through kernels, dtypes and batch shapes, and by a whole update when
the rollout is a step stale (one-step asynchronous training). With the log-ratio
`log rho = old - rollout` per token (clamped to +-20 before `exp`, as verl does):

    IS weights (`rollout_is`)     rho token by token (`token`) or one product over the
                                  row (`sequence`), detached, multiplying each token's
                                  policy loss. `rollout_is_threshold` a number u: TIS,
                                  w = min(rho, u); a string "l_u": IcePop, w = rho
                                  inside [l, u] and 0 outside
    rejection (`rollout_rs`)      one or more comma-separated options `<level>_<k>`:
                                  k1 = -log rho = log(pi_rollout / pi_train),
                                  k2 = (log rho)^2 / 2, k3 = rho - 1 - log rho, per token
                                  (`token`) or per row (`seq_sum`, `seq_mean`, `seq_max`);
                                  a token or row whose value is outside the option's
                                  bounds leaves the loss mask (k1: log l <= k1 <= log u,
                                  bounds on pi_rollout / pi_train; k2, k3: value <= u)
    veto (jrl's)                  a row with any token's rho below
                                  `rollout_token_veto_threshold` leaves the loss mask

`metrics` reports the mismatch with verl's names: `training/rollout_probs_diff_*`
(|p_old - p_rollout| per token) and `rollout_corr/*` (KL, perplexities, chi-square, the
statistics of the IS weights as applied, of each rejection option's value, and the
fractions rejected). `PRESETS` holds verl's named settings
(`algorithm.rollout_correction.preset`).

The semantics are those of verl 0.9's `rollout_corr_helper` and
`RolloutCorrectionConfig` (`docs/from_verl.md` maps the keys).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jrl.algos.masks import masked_mean
from jrl.errors import ConfigError

Array = jax.Array

SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
LOSS_TYPES = ("ppo_clip", "reinforce")
# jrl's earlier rejection levels: the ratio pi_train / pi_rollout in [l, u], which is
# the k1 option below with the bounds on the inverse ratio, "1/u_1/l".
_OLD_RS_LEVELS = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}

# Thresholds are strings, as the config keys are.
_GEO, _K3, _ICEPOP = "0.999_1.001", "0.01", "0.5_5.0"
_CLIP = {"bypass_mode": True, "loss_type": "ppo_clip"}
_PG = {"bypass_mode": True, "loss_type": "reinforce"}
_SEQ_TIS = {"rollout_is": "sequence", "rollout_is_threshold": "2.0"}
_TOKEN_TIS = {"rollout_is": "token", "rollout_is_threshold": "2.0"}
_GEO_RS = {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": _GEO}
_K3_RS = {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": _K3}
# verl's `RolloutCorrectionConfig` factory methods, by name, with their default arguments.
PRESETS: dict[str, dict] = {
    "disabled": {},
    "decoupled_token_is": _TOKEN_TIS,
    "decoupled_seq_is": _SEQ_TIS,
    "decoupled_token_icepop": {"rollout_is": "token", "rollout_is_threshold": _ICEPOP},
    "decoupled_seq_is_rs": {**_SEQ_TIS, "rollout_rs": "seq_sum_k1",
                            "rollout_rs_threshold": "0.5_2.0"},
    "decoupled_geo_rs": _GEO_RS,
    "decoupled_geo_rs_seq_tis": {**_SEQ_TIS, **_GEO_RS},
    "decoupled_geo_rs_token_tis": {**_TOKEN_TIS, **_GEO_RS},
    "decoupled_k3_rs": _K3_RS,
    "decoupled_k3_rs_seq_tis": {**_SEQ_TIS, **_K3_RS},
    "decoupled_k3_rs_token_tis": {**_TOKEN_TIS, **_K3_RS},
    "bypass_ppo_clip": _CLIP,
    "bypass_ppo_clip_geo_rs": {**_GEO_RS, **_CLIP},
    "bypass_ppo_clip_k3_rs": {**_K3_RS, **_CLIP},
    "bypass_pg_is": {**_SEQ_TIS, **_PG},
    "bypass_pg_token_icepop": {"rollout_is": "token", "rollout_is_threshold": _ICEPOP, **_PG},
    "bypass_pg_geo_rs": {**_GEO_RS, **_PG},
    "bypass_pg_geo_rs_seq_tis": {**_SEQ_TIS, **_GEO_RS, **_PG},
    "bypass_pg_geo_rs_token_tis": {**_TOKEN_TIS, **_GEO_RS, **_PG},
}


class RsOption(NamedTuple):
    """One rejection option: its name, its upper bound and (k1 only) its lower bound."""
    name: str
    upper: float
    lower: float | None = None


def _number(text, fail) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        fail(f"{text!r} is not a positive number")
    return value


def _bounds(spec, fail, pair_ok: bool = True) -> tuple[float, float | None]:
    """(upper, lower or None) of a threshold: a number u, or a string "u" or "l_u"."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        fail(f"must be a number or a string such as '2.0' or '0.5_2.0', got {spec!r}")
    if isinstance(spec, str) and "_" in spec:
        if not pair_ok:
            fail(f"{spec!r}: a k2 or k3 option takes one upper bound, without '_'")
        lower, upper = (_number(part.strip(), fail) for part in spec.strip().split("_", 1))
        if lower > upper:
            fail(f"{spec!r}: the lower bound is above the upper bound")
        return upper, lower
    return _number(spec.strip() if isinstance(spec, str) else spec, fail), None


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionConfig:
    """`algorithm.rollout_correction.*` (all off by default).

    Attributes:
      rollout_is: None, "token" or "sequence": importance-sampling weights.
      rollout_is_threshold: u (TIS: weights truncated at u) or "l_u" (IcePop: weights
        outside [l, u] set to 0); a string in the config (a number here too).
      rollout_is_batch_normalize: divide the weights by their batch mean.
      rollout_rs: None, or comma-separated rejection options (`RS_OPTIONS`); all must pass.
      rollout_rs_threshold: one threshold for every option or one per option, comma
        separated: "l_u" or u for a k1 option (bounds on pi_rollout / pi_train; u alone
        means l = 1 / u), u for k2 and k3; a string in the config (a number here too).
      rollout_token_veto_threshold: reject a row with any token ratio below it (None: off).
      bypass_mode: the rollout's log-probs are the old ones (no old-log-prob pass); the
        weights and rejections then come from the update's own log-probs.
      loss_type: with bypass_mode, "ppo_clip" (the configured policy loss; its ratio is
        the IS correction, no weights on top) or "reinforce" (`-w A log pi`).
    """

    rollout_is: str | None = None
    rollout_is_threshold: float | str = "2.0"
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None
    rollout_token_veto_threshold: float | None = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"

    @classmethod
    def from_preset(cls, preset: str | None, prefix: str = "algorithm.rollout_correction",
                    **values) -> RolloutCorrectionConfig:
        """The config of verl's named `preset` (None: none), where each of `values` that
        differs from its default replaces the preset's."""
        if preset is None:
            return cls(**values)
        if preset not in PRESETS:
            raise ConfigError(f"{prefix}.preset: {preset!r} is not a preset; choose one of "
                              f"{[None, *PRESETS]}")
        default = cls()
        chosen = {k: v for k, v in values.items() if v != getattr(default, k)}
        return cls(**{**PRESETS[preset], **chosen})

    @property
    def rejects(self) -> bool:
        """Whether some rows or tokens may leave the loss mask."""
        return self.rollout_rs is not None or self.rollout_token_veto_threshold is not None

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rejects or self.bypass_mode

    def is_bounds(self, prefix: str = "algorithm.rollout_correction"
                  ) -> tuple[float, float | None]:
        """(upper, lower: None for TIS, the IcePop lower bound) of the IS weights."""
        def fail(message):
            raise ConfigError(f"{prefix}.rollout_is_threshold: {message}")
        return _bounds(self.rollout_is_threshold, fail)

    def rs_options(self, prefix: str = "algorithm.rollout_correction") -> tuple[RsOption, ...]:
        """The rejection options in order (repeats dropped), each with its bounds."""
        if self.rollout_rs is None:
            return ()
        names = list(dict.fromkeys(o.strip() for o in str(self.rollout_rs).split(",")
                                   if o.strip()))
        for name in names or [""]:
            if name in _OLD_RS_LEVELS:
                raise ConfigError(
                    f"{prefix}.rollout_rs: {name!r} is now {_OLD_RS_LEVELS[name]!r}, bounded "
                    "on pi_rollout / pi_train: a ratio pi_train / pi_rollout in [l, u] is "
                    "rollout_rs_threshold='<1/u>_<1/l>'")
            if name not in RS_OPTIONS:
                raise ConfigError(f"{prefix}.rollout_rs: {name!r} is not valid; give one or "
                                  f"more of {list(RS_OPTIONS)}, comma separated")
        return tuple(self._rs_option(n, s, prefix) for n, s in zip(
            names, self._rs_specs(len(names), prefix), strict=True))

    def _rs_specs(self, count: int, prefix: str) -> list:
        spec = self.rollout_rs_threshold
        if spec is None:
            raise ConfigError(f"{prefix}.rollout_rs_threshold: is needed with rollout_rs="
                              f"{self.rollout_rs!r} (e.g. '0.5_2.0' for a k1 option, 0.01 "
                              "for k2 or k3)")
        specs = [p.strip() for p in spec.split(",") if p.strip()] if isinstance(
            spec, str) else [spec]
        if len(specs) not in (1, count):
            raise ConfigError(f"{prefix}.rollout_rs_threshold: {spec!r} gives {len(specs)} "
                              f"thresholds for {count} rollout_rs options; give 1 or {count}")
        return specs * count if len(specs) == 1 else specs

    @staticmethod
    def _rs_option(name: str, spec, prefix: str) -> RsOption:
        def fail(message):
            raise ConfigError(f"{prefix}.rollout_rs_threshold: {name}: {message}")
        upper, lower = _bounds(spec, fail, pair_ok=name.endswith("k1"))
        if name.endswith("k1") and lower is None:
            lower = 1.0 / upper
            if lower > upper:
                fail(f"{spec!r} alone means [1/{spec}, {spec}], which is empty; give 'l_u'")
        return RsOption(name, upper, lower)

    def validate(self, prefix: str = "algorithm.rollout_correction") -> RolloutCorrectionConfig:
        """Raises a `ConfigError` naming the first invalid key; returns self."""
        def fail(key, message):
            raise ConfigError(f"{prefix}.{key}: {message}")

        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            fail("rollout_is", f"{self.rollout_is!r} is not valid; choose one of "
                 f"{[None, *IS_LEVELS]}")
        if self.rollout_is is not None:
            self.is_bounds(prefix)
        self.rs_options(prefix)
        veto = self.rollout_token_veto_threshold
        if veto is not None and (isinstance(veto, bool) or not isinstance(veto, (int, float))
                                 or not veto > 0):
            fail("rollout_token_veto_threshold", f"must be a positive number, got {veto!r}")
        if self.loss_type not in LOSS_TYPES:
            fail("loss_type", f"{self.loss_type!r} is not valid; choose one of {list(LOSS_TYPES)}")
        if self.loss_type != "ppo_clip" and not self.bypass_mode:
            fail("loss_type", f"{self.loss_type!r} applies only with bypass_mode=True")
        return self


# ----------------------------------------------------------------------------- the correction


def _row_sum(x: Array, mask: Array) -> Array:
    return jnp.sum(x * mask, axis=-1, keepdims=True)


def _is_log_ratios(log_ratio: Array, mask: Array, level: str) -> Array:
    """The unclamped log-ratios the IS level weighs: per token `[B, T]`, per row `[B, 1]`."""
    return log_ratio if level == "token" else _row_sum(log_ratio, mask)


def _is_weights(log_ratio: Array, mask: Array, cfg: RolloutCorrectionConfig
                ) -> tuple[Array, Array]:
    """(raw ratios `[B, T]` (clamped in log space, 0 off the mask), the weights as
    applied: truncated at the upper bound (TIS), or 0 outside the bounds (IcePop))."""
    upper, lower = cfg.is_bounds()
    raw_log = jnp.clip(_is_log_ratios(log_ratio, mask, cfg.rollout_is),
                       -SAFETY_BOUND, SAFETY_BOUND)
    raw = jnp.broadcast_to(jnp.exp(raw_log), log_ratio.shape) * mask
    if lower is None:
        return raw, jnp.minimum(raw, upper)
    return raw, jnp.where((raw >= lower) & (raw <= upper), raw, 0.0)


def is_weights(log_ratio: Array, mask: Array, cfg: RolloutCorrectionConfig) -> Array:
    """The IS weights `[B, T]` as applied (0 off the mask), detached; divided by their
    batch mean (over tokens, or over rows for `sequence`) with `rollout_is_batch_normalize`."""
    w = jax.lax.stop_gradient(_is_weights(log_ratio, mask, cfg)[1])
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


def _rs_values(name: str, log_ratio: Array, mask: Array) -> tuple[Array, Array]:
    """(the option's value on each token `[B, T]`: its own, or its row's for the sequence
    levels; the value per row `[B]`: the row's, or the mean of its tokens' for `token`)."""
    safe = jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    level, k = name.rsplit("_", 1)
    token = {"k1": -safe, "k2": 0.5 * safe ** 2, "k3": jnp.exp(safe) - 1.0 - safe}[k]
    if level == "token":
        return token, masked_mean(token, mask, axis=-1)
    if level == "seq_sum":
        row = jnp.sum(token * mask, axis=-1)
    elif level == "seq_mean":
        row = masked_mean(token, mask, axis=-1)
    else:  # seq_max; 0 for a row without tokens
        row = jnp.where(mask.sum(-1) > 0, jnp.where(mask > 0, token, -jnp.inf).max(-1), 0.0)
    return jnp.broadcast_to(row[:, None], log_ratio.shape), row


def _rs_bounds(option: RsOption) -> tuple[float, float | None]:
    """(upper, lower or None) on the option's value: logs of the ratio bounds for k1."""
    if option.lower is None:
        return option.upper, None
    return math.log(option.upper), math.log(option.lower)


def _rs_keep(option: RsOption, value: Array) -> Array:
    upper, lower = _rs_bounds(option)
    keep = value <= upper
    return keep if lower is None else keep & (value >= lower)


def keep_mask(log_ratio: Array, mask: Array, cfg: RolloutCorrectionConfig) -> Array:
    """`[B, T]` 1 where a token stays in the loss: every rejection option, then the veto."""
    keep = jnp.ones_like(log_ratio)
    for option in cfg.rs_options():
        value, _ = _rs_values(option.name, log_ratio, mask)
        keep = keep * _rs_keep(option, value).astype(log_ratio.dtype)
    if cfg.rollout_token_veto_threshold is not None:
        keep = keep * (~_vetoed(log_ratio, mask, cfg)).astype(log_ratio.dtype)[:, None]
    return keep


def _catastrophic(log_ratio, mask, cfg) -> Array:
    return (log_ratio < jnp.log(cfg.rollout_token_veto_threshold)) & (mask > 0)


def _vetoed(log_ratio, mask, cfg) -> Array:
    """`[B]` rows with a token whose ratio is below the veto threshold."""
    return _catastrophic(log_ratio, mask, cfg).any(-1)


def _log_ratio(old_log_probs: Array, rollout_log_probs: Array, mask: Array) -> Array:
    """`old - rollout` in float32, 0 off the mask (padding never reaches an `exp`)."""
    return jnp.where(mask > 0, old_log_probs.astype(jnp.float32)
                     - rollout_log_probs.astype(jnp.float32), 0.0)


def correct(old_log_probs: Array, rollout_log_probs: Array, response_mask: Array,
            cfg: RolloutCorrectionConfig) -> tuple[Array | None, Array]:
    """(IS weights `[B, T]` or None, the loss mask after rejections) of a batch.

    `old_log_probs` are the training policy's (the actor before the update, or in
    bypass mode the update's current ones), `rollout_log_probs` the sampler's.
    """
    mask = response_mask.astype(jnp.float32)
    log_ratio = _log_ratio(old_log_probs, rollout_log_probs, mask)
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


def _clamped_std(x: Array, mask: Array, lower: float, upper: float) -> Array:
    """verl's spread of `x` clamped to [lower, upper] over the mask (0 for one token)."""
    c = jnp.clip(x, lower, upper)
    var = masked_mean(c ** 2, mask) - masked_mean(c, mask) ** 2
    return jnp.where(mask.sum() > 1, jnp.sqrt(jnp.maximum(var, 0.0)), 0.0)


def _is_metrics(log_ratio: Array, mask: Array, cfg: RolloutCorrectionConfig) -> dict:
    """verl's `rollout_is_*`: statistics of the weights as applied (before the batch
    normalisation); the fractions above and below the bounds, of tokens or of rows, and
    at the sequence level the max and min, from the raw ratios (safety-bounded only:
    under TIS no mean of truncated weights passes the upper bound)."""
    p = "rollout_corr/rollout_is"
    upper, icepop_lower = cfg.is_bounds()
    lower = 1.0 / upper if icepop_lower is None else icepop_lower
    raw, w = _is_weights(log_ratio, mask, cfg)
    out = {f"{p}_mean": masked_mean(w, mask)}
    if cfg.rollout_is == "token":
        out.update({
            f"{p}_max": _masked_max(w, mask), f"{p}_min": _masked_min(w, mask),
            f"{p}_ratio_fraction_high": masked_mean((raw > upper).astype(jnp.float32), mask),
            f"{p}_ratio_fraction_low": masked_mean((raw < lower).astype(jnp.float32), mask)})
    else:  # one ratio per row (empty rows too), judged in log space
        row = _is_log_ratios(log_ratio, mask, "sequence")
        out.update({
            f"{p}_max": jnp.exp(jnp.minimum(row.max(), SAFETY_BOUND)),
            f"{p}_min": jnp.exp(row.min()),
            f"{p}_ratio_fraction_high": jnp.mean((row > math.log(upper)).astype(jnp.float32)),
            f"{p}_ratio_fraction_low": jnp.mean((row < math.log(lower)).astype(jnp.float32))})
    clamped = jnp.clip(w, 0.0, upper)
    out[f"{p}_std"] = _clamped_std(w, mask, 0.0, upper)
    out[f"{p}_eff_sample_size"] = 1.0 / masked_mean(
        (clamped / (masked_mean(clamped, mask) + 1e-8)) ** 2, mask)
    seq, raw_seq = masked_mean(w, mask, axis=-1), masked_mean(raw, mask, axis=-1)
    out.update({
        f"{p}_seq_mean": seq.mean(), f"{p}_seq_std": _std(seq), f"{p}_seq_max": seq.max(),
        f"{p}_seq_min": seq.min(), f"{p}_seq_max_deviation": jnp.abs(seq - 1.0).max(),
        f"{p}_seq_fraction_high": jnp.mean((raw_seq > upper).astype(jnp.float32)),
        f"{p}_seq_fraction_low": jnp.mean((raw_seq < lower).astype(jnp.float32))})
    if icepop_lower is not None:
        out[f"{p}_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).astype(
            jnp.float32), mask)
    if cfg.rollout_is_batch_normalize:
        mean = _batch_mean(w, mask, cfg.rollout_is)
        out[f"{p}_batch_norm_factor"] = jnp.where(mean > 1e-8, mean, 1.0)
    return out


def _over_rows(x: Array, valid: Array) -> dict:
    """mean, unbiased std, max, min of `x` `[B]` over the `valid` rows (0 without any)."""
    n = valid.sum()
    mean = jnp.where(valid, x, 0.0).sum() / jnp.maximum(n, 1)
    var = jnp.where(valid, (x - mean) ** 2, 0.0).sum() / jnp.maximum(n - 1, 1)
    return {"mean": mean, "std": jnp.where(n > 1, jnp.sqrt(var), 0.0),
            "max": jnp.where(n > 0, jnp.where(valid, x, -jnp.inf).max(), 0.0),
            "min": jnp.where(n > 0, jnp.where(valid, x, jnp.inf).min(), 0.0)}


def _rs_option_metrics(option: RsOption, log_ratio: Array, mask: Array) -> tuple[dict, Array]:
    """(verl's `rollout_rs_<option>_*`: statistics of the option's value and the fractions
    it rejects, of tokens and of non-empty rows; the option's keep mask `[B, T]`)."""
    p = f"rollout_corr/rollout_rs_{option.name}"
    value, row = _rs_values(option.name, log_ratio, mask)
    upper, lower = _rs_bounds(option)
    valid = mask.sum(-1) > 0
    n_valid = jnp.maximum(valid.sum(), 1)

    def fraction(hit):  # over the non-empty rows, or the tokens for the token level
        if option.name.startswith("token"):
            return masked_mean(hit.astype(jnp.float32), mask)
        return jnp.where(valid, hit[:, 0], False).sum() / n_valid

    keep = _rs_keep(option, value)
    out = {f"{p}_mean": masked_mean(value, mask), f"{p}_max": _masked_max(value, mask),
           f"{p}_min": _masked_min(value, mask), f"{p}_fraction_high": fraction(value > upper),
           f"{p}_fraction_low": jnp.float32(0.0) if lower is None else fraction(value < lower),
           f"{p}_std": _clamped_std(value, mask, 0.0 if lower is None else lower, upper)}
    rows = _over_rows(row, valid)
    out.update({f"{p}_seq_{k}": v for k, v in rows.items()})
    out[f"{p}_seq_max_deviation"] = _over_rows(jnp.abs(row), valid)["max"]
    out[f"{p}_seq_fraction_high"] = jnp.where(valid, row > upper, False).sum() / n_valid
    if lower is not None:
        out[f"{p}_seq_fraction_low"] = jnp.where(valid, row < lower, False).sum() / n_valid
    rejected = (~keep & (mask > 0)).any(-1)
    out[f"{p}_masked_fraction"] = masked_mean(1.0 - keep.astype(jnp.float32), mask)
    out[f"{p}_seq_masked_fraction"] = jnp.where(valid, rejected, False).sum() / n_valid
    return out, keep.astype(jnp.float32)


def _rs_metrics(log_ratio: Array, mask: Array, cfg: RolloutCorrectionConfig) -> dict:
    """Every option's metrics and the fractions of tokens and rows (of all rows) that
    some option rejects."""
    out, keep = {}, jnp.ones_like(log_ratio)
    for option in cfg.rs_options():
        metrics, option_keep = _rs_option_metrics(option, log_ratio, mask)
        out.update(metrics)
        keep = keep * option_keep
    p = "rollout_corr/rollout_rs"
    out[f"{p}_masked_fraction"] = masked_mean(1.0 - keep, mask)
    out[f"{p}_seq_masked_fraction"] = ((keep < 0.5) & (mask > 0)).any(-1).astype(
        jnp.float32).mean()
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
    tokens (max, mean, unbiased std) and the Pearson correlation of the two. Without
    any response token `valid` is 0 and the rest NaN; one token has a NaN std and
    correlation (torch's `std` and `corrcoef` of one element)."""
    m = mask > 0
    n = m.sum()
    count = jnp.maximum(n, 1)
    old, rollout = jnp.exp(old_log_probs), jnp.exp(rollout_log_probs)
    diff = jnp.abs(old - rollout)
    mean = jnp.where(m, diff, 0).sum() / count
    var = jnp.where(m, (diff - mean) ** 2, 0).sum() / jnp.maximum(n - 1, 1)

    def centred(x):
        return jnp.where(m, x - jnp.where(m, x, 0).sum() / count, 0)

    x, y = centred(old), centred(rollout)
    corr = (x * y).sum() / jnp.sqrt((x * x).sum() * (y * y).sum())
    some = n > 0
    return {"training/rollout_probs_diff_valid": some.astype(jnp.float32),
            "training/rollout_probs_diff_max": jnp.where(
                some, jnp.where(m, diff, -jnp.inf).max(), jnp.nan),
            "training/rollout_probs_diff_mean": jnp.where(some, mean, jnp.nan),
            "training/rollout_probs_diff_std": jnp.where(n > 1, jnp.sqrt(var), jnp.nan),
            "training/rollout_actor_probs_pearson_corr": jnp.where(n > 1, corr, jnp.nan)}


def metrics(old_log_probs: Array, rollout_log_probs: Array, response_mask: Array,
            cfg: RolloutCorrectionConfig) -> dict:
    """The step's mismatch metrics (verl's names) over `response_mask` (before rejections):
    always the probability differences and the off-policy figures, and the statistics of
    the IS weights, the rejections and the veto where those are configured. Without any
    response token, `training/rollout_probs_diff_valid` is 0 and the rest are NaN."""
    mask = response_mask.astype(jnp.float32)
    old_log_probs = old_log_probs.astype(jnp.float32)
    rollout_log_probs = rollout_log_probs.astype(jnp.float32)
    log_ratio = _log_ratio(old_log_probs, rollout_log_probs, mask)
    out = offpolicy_metrics(old_log_probs, rollout_log_probs, mask)
    if cfg.rollout_is is not None:
        out.update(_is_metrics(log_ratio, mask, cfg))
    if cfg.rollout_rs is not None:
        out.update(_rs_metrics(log_ratio, mask, cfg))
    veto, catastrophic = jnp.float32(0.0), jnp.float32(0.0)
    if cfg.rollout_token_veto_threshold is not None:
        veto = _vetoed(log_ratio, mask, cfg).astype(jnp.float32).mean()
        catastrophic = masked_mean(_catastrophic(log_ratio, mask, cfg).astype(jnp.float32),
                                   mask)
    out["rollout_corr/rollout_is_veto_fraction"] = veto
    out["rollout_corr/rollout_is_catastrophic_token_fraction"] = catastrophic
    # verl stops on a batch without response tokens; its statistics are NaN here.
    empty = mask.sum() == 0
    out = {k: jnp.where(empty, jnp.nan, v) for k, v in out.items()}
    return {**probs_diff_metrics(old_log_probs, rollout_log_probs, mask), **out}
