"""Rollout correction (verl's): IS weights (TIS and IcePop), the k1/k2/k3 rejection options
alone and chained, the veto, the presets, the metrics and the config checks, against
hand-computed values and a plain-numpy reference written here from verl's definitions
(`rollout_corr_helper`: log rho = old - rollout clamped to +-20 before `exp`; k1 = -log rho,
k2 = (log rho)^2 / 2, k3 = rho - 1 - log rho; masked means with a 1e-8 guard)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.algos import rollout_correction as rc
from jrl.errors import ConfigError

Cfg = rc.RolloutCorrectionConfig
L = np.log
E20 = np.exp(20.0)

# Log-ratios (old - rollout); the padding (mask 0) holds garbage that must not matter.
# Row 1 goes past +20, row 2 past -20; row 3 has one token, row 4 none.
LR = np.array([[L(2.0), L(0.25), 0.0, 5.0],
               [30.0, 0.0, 7.0, -50.0],
               [L(1.5), L(0.6), L(4.0), -30.0],
               [L(3.0), 9.0, 9.0, 9.0],
               [1.0, 1.0, 1.0, 1.0]], np.float32)
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]],
                np.float32)
ROLLOUT = np.array([[-1.0, -2.0, -0.5, -3.0],
                    [-31.0, -1.5, -2.0, -1.0],
                    [-0.7, -1.2, -2.5, -30.5],
                    [-2.0, -1.0, -1.0, -1.0],
                    [-1.0, -1.0, -1.0, -1.0]], np.float32)
OLD = ROLLOUT + LR
EM20 = np.exp(-20.0)


def close(got, want, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=1e-12)


def run_correct(cfg, lr=LR, mask=MASK):
    return rc.correct(jnp.asarray(lr), jnp.zeros(lr.shape), jnp.asarray(mask), cfg.validate())


# ----------------------------------------------------------------------------- IS weights


def test_token_tis_truncates_masks_and_clamps():
    w, _ = run_correct(Cfg(rollout_is="token", rollout_is_threshold=3.0))
    close(w, [[2, 0.25, 1, 0], [3, 1, 0, 0], [1.5, 0.6, 3, EM20], [3, 0, 0, 0], [0] * 4])
    # A huge threshold shows the +20 clamp: exp(30) -> exp(20).
    w, _ = run_correct(Cfg(rollout_is="token", rollout_is_threshold=1e12))
    close(w[1], [E20, 1, 0, 0])


def test_sequence_tis_one_weight_per_row():
    # Row sums: log(0.5); 30 -> 20; log(3.6) - 30 -> -20; log(3); none.
    w, _ = run_correct(Cfg(rollout_is="sequence", rollout_is_threshold="3.0"))
    close(w, [[0.5] * 3 + [0], [3, 3, 0, 0], [EM20] * 4, [3, 0, 0, 0], [0] * 4])


def test_icepop_zeroes_weights_outside_the_bounds():
    # Token ratios 2 .25 1 | e^20 1 | 1.5 .6 4 e^-20 | 3 against [0.5, 3.2]: keep in-bound.
    w, mask = run_correct(Cfg(rollout_is="token", rollout_is_threshold="0.5_3.2"))
    close(w, [[2, 0, 1, 0], [0, 1, 0, 0], [1.5, 0.6, 0, 0], [3, 0, 0, 0], [0] * 4])
    close(mask, MASK)  # IcePop changes the weights, never the loss mask
    # Row products 0.5, e^20, e^-20, 3 against [0.6, 3.5]: only row 3 keeps its weight.
    w, _ = run_correct(Cfg(rollout_is="sequence", rollout_is_threshold=" 0.6_3.5 "))
    close(w, [[0] * 4, [0] * 4, [0] * 4, [3, 0, 0, 0], [0] * 4])


def test_batch_normalize_token_and_sequence():
    tok = np.array([[2, 0.25, 1, 0], [3, 1, 0, 0], [1.5, 0.6, 3, EM20], [3, 0, 0, 0], [0] * 4])
    w, _ = run_correct(Cfg(rollout_is="token", rollout_is_threshold=3.0,
                           rollout_is_batch_normalize=True))
    close(w, tok / (tok.sum() / 10.0))
    # The empty row does not count in the mean over rows: (0.5 + 3 + e^-20 + 3) / 4.
    w, _ = run_correct(Cfg(rollout_is="sequence", rollout_is_threshold=3.0,
                           rollout_is_batch_normalize=True))
    seq = np.array([[0.5] * 3 + [0], [3, 3, 0, 0], [EM20] * 4, [3, 0, 0, 0], [0] * 4])
    close(w, seq / ((0.5 + 3 + EM20 + 3) / 4))


def test_batch_normalize_skips_a_zero_mean():
    w, _ = run_correct(Cfg(rollout_is="token", rollout_is_batch_normalize=True),
                       np.ones((2, 3), np.float32), np.zeros((2, 3), np.float32))
    close(w, np.zeros((2, 3)))


@pytest.mark.parametrize("level,threshold", [("token", 1e3), ("sequence", 1e3),
                                             ("token", "0.1_1e3")])
@pytest.mark.parametrize("normalize", [False, True])
def test_weights_are_detached(level, threshold, normalize):
    cfg = Cfg(rollout_is=level, rollout_is_threshold=threshold,
              rollout_is_batch_normalize=normalize)

    def total(old):
        return jnp.sum(rc.correct(old, jnp.asarray(ROLLOUT), jnp.asarray(MASK), cfg)[0])

    assert float(total(jnp.asarray(OLD))) > 0
    close(jax.grad(total)(jnp.asarray(OLD)), np.zeros(OLD.shape))


# ----------------------------------------------------------------------------- rejection

# Hand values per row. k1 = -log rho (clamped): row 0: -log 2, log 4, 0; row 1: -20, 0;
# row 2: -log 1.5, -log .6, -log 4, 20; row 3: -log 3.
# seq_sum_k1: log .5 ... row 0 = -log(0.5) = 0.693; row 1 = -20; row 2 = 20 - log 3.6 = 18.72;
# row 3 = -1.0986. seq_mean_k1: 0.231, -10, 4.68, -1.0986.
@pytest.mark.parametrize("option,threshold,want", [
    # pi_rollout / pi_train in [0.45, 4.5]: ratios rho in [0.22, 2.2] stay.
    ("token_k1", "0.45_4.5", [[1, 1, 1, 0], [0, 1, 0, 0], [1, 1, 0, 0], [0] * 4, [0] * 4]),
    # One number u means [1/u, u]: rho in [1/2.5, 2.5].
    ("token_k1", 2.5, [[1, 0, 1, 0], [0, 1, 0, 0], [1, 1, 0, 0], [0] * 4, [0] * 4]),
    ("seq_sum_k1", "0.3_2.5", [[1, 1, 1, 0], [0] * 4, [0] * 4, [1, 0, 0, 0], [0] * 4]),
    ("seq_mean_k1", "0.3_1.3", [[1, 1, 1, 0], [0] * 4, [0] * 4, [1, 0, 0, 0], [0] * 4]),
    # k2 = (log rho)^2 / 2: .240, .961, 0 | 200, 0 | .082, .130, .961, 200 | .603
    ("token_k2", 0.5, [[1, 0, 1, 0], [0, 1, 0, 0], [1, 1, 0, 0], [0] * 4, [0] * 4]),
    ("seq_sum_k2", 1.3, [[1, 1, 1, 0], [0] * 4, [0] * 4, [1, 0, 0, 0], [0] * 4]),
    ("seq_mean_k2", 0.5, [[1, 1, 1, 0], [0] * 4, [0] * 4, [0] * 4, [0] * 4]),
    ("seq_max_k2", 0.7, [[0] * 4, [0] * 4, [0] * 4, [1, 0, 0, 0], [0] * 4]),
    # k3 = rho - 1 - log rho: .307, .636, 0 | e^20 - 21, 0 | .095, .111, 1.614, 19 + e^-20
    # | 0.901
    ("token_k3", 0.5, [[1, 0, 1, 0], [0, 1, 0, 0], [1, 1, 0, 0], [0] * 4, [0] * 4]),
    ("seq_sum_k3", 1.0, [[1, 1, 1, 0], [0] * 4, [0] * 4, [1, 0, 0, 0], [0] * 4]),
    ("seq_mean_k3", 0.35, [[1, 1, 1, 0], [0] * 4, [0] * 4, [0] * 4, [0] * 4]),
    ("seq_max_k3", 0.95, [[1, 1, 1, 0], [0] * 4, [0] * 4, [1, 0, 0, 0], [0] * 4]),
])
def test_each_rejection_option(option, threshold, want):
    weights, mask = run_correct(Cfg(rollout_rs=option, rollout_rs_threshold=threshold))
    assert weights is None
    close(mask, want)


def test_k1_bounds_are_on_the_rollout_over_training_ratio():
    # rho = pi_train / pi_rollout = 3 and 0.3: bounds "0.5_4" on pi_rollout / pi_train keep
    # 1/0.3 = 3.33 and reject 1/3 = 0.33 -- the reverse of bounds [0.5, 4] on rho.
    lr = np.array([[L(3.0), L(0.3)]], np.float32)
    _, mask = run_correct(Cfg(rollout_rs="token_k1", rollout_rs_threshold="0.5_4"), lr,
                          np.ones((1, 2), np.float32))
    close(mask, [[0, 1]])


def test_chained_options_all_must_pass_with_per_option_and_broadcast_thresholds():
    both = Cfg(rollout_rs="token_k1, seq_max_k3", rollout_rs_threshold="0.45_4.5,0.95")
    _, mask = run_correct(both)
    close(mask, [[1, 1, 1, 0], [0] * 4, [0] * 4, [0] * 4, [0] * 4])
    # One threshold for both: token_k2 <= 0.7 and seq_max_k2 <= 0.7; a repeat is dropped.
    cfg = Cfg(rollout_rs="token_k2,seq_max_k2,token_k2", rollout_rs_threshold="0.7")
    assert [o.name for o in cfg.rs_options()] == ["token_k2", "seq_max_k2"]
    _, mask = run_correct(cfg)
    close(mask, [[0] * 4, [0] * 4, [0] * 4, [1, 0, 0, 0], [0] * 4])


def test_veto_rejects_whole_rows_on_masked_tokens_only():
    # log(1e-4) = -9.2: row 2's -30 vetoes it; row 1's -50 is padding.
    _, mask = run_correct(Cfg(rollout_token_veto_threshold=1e-4))
    close(mask, MASK * np.array([[1], [1], [0], [1], [1]]))
    _, mask = run_correct(Cfg(rollout_rs="token_k1", rollout_rs_threshold=2.5,
                              rollout_token_veto_threshold=1e-4))
    close(mask, [[1, 0, 1, 0], [0, 1, 0, 0], [0] * 4, [0] * 4, [0] * 4])


def test_correct_keeps_the_mask_dtype():
    bool_mask = jnp.asarray(MASK > 0)
    weights, mask = rc.correct(jnp.asarray(OLD), jnp.asarray(ROLLOUT), bool_mask, Cfg())
    assert weights is None and mask.dtype == jnp.bool_
    np.testing.assert_array_equal(mask, MASK > 0)


# ----------------------------------------------------------------------------- presets


def test_presets_are_verls_factories():
    # verl's RolloutCorrectionConfig factory methods and their default arguments.
    geo, k3, ice = "0.999_1.001", "0.01", "0.5_5.0"
    want = {
        "decoupled_token_is": ("token", "2.0", None, None, False, "ppo_clip"),
        "decoupled_seq_is": ("sequence", "2.0", None, None, False, "ppo_clip"),
        "decoupled_token_icepop": ("token", ice, None, None, False, "ppo_clip"),
        "decoupled_seq_is_rs": ("sequence", "2.0", "seq_sum_k1", "0.5_2.0", False, "ppo_clip"),
        "decoupled_geo_rs": (None, "2.0", "seq_mean_k1", geo, False, "ppo_clip"),
        "decoupled_geo_rs_seq_tis": ("sequence", "2.0", "seq_mean_k1", geo, False, "ppo_clip"),
        "decoupled_geo_rs_token_tis": ("token", "2.0", "seq_mean_k1", geo, False, "ppo_clip"),
        "decoupled_k3_rs": (None, "2.0", "seq_mean_k3", k3, False, "ppo_clip"),
        "decoupled_k3_rs_seq_tis": ("sequence", "2.0", "seq_mean_k3", k3, False, "ppo_clip"),
        "decoupled_k3_rs_token_tis": ("token", "2.0", "seq_mean_k3", k3, False, "ppo_clip"),
        "bypass_ppo_clip": (None, "2.0", None, None, True, "ppo_clip"),
        "bypass_ppo_clip_geo_rs": (None, "2.0", "seq_mean_k1", geo, True, "ppo_clip"),
        "bypass_ppo_clip_k3_rs": (None, "2.0", "seq_mean_k3", k3, True, "ppo_clip"),
        "bypass_pg_is": ("sequence", "2.0", None, None, True, "reinforce"),
        "bypass_pg_token_icepop": ("token", ice, None, None, True, "reinforce"),
        "bypass_pg_geo_rs": (None, "2.0", "seq_mean_k1", geo, True, "reinforce"),
        "bypass_pg_geo_rs_seq_tis": ("sequence", "2.0", "seq_mean_k1", geo, True, "reinforce"),
        "bypass_pg_geo_rs_token_tis": ("token", "2.0", "seq_mean_k1", geo, True, "reinforce"),
        "disabled": (None, "2.0", None, None, False, "ppo_clip"),
    }
    assert sorted(rc.PRESETS) == sorted(want)
    for name, fields in want.items():
        cfg = Cfg.from_preset(name, **dataclass_values(Cfg())).validate()
        got = (cfg.rollout_is, cfg.rollout_is_threshold, cfg.rollout_rs,
               cfg.rollout_rs_threshold, cfg.bypass_mode, cfg.loss_type)
        assert got == fields, name


def dataclass_values(cfg):
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


def test_a_preset_yields_to_the_keys_set_away_from_their_defaults():
    values = {**dataclass_values(Cfg()), "rollout_rs_threshold": 0.5}
    cfg = Cfg.from_preset("decoupled_k3_rs_token_tis", **values)
    assert (cfg.rollout_is, cfg.rollout_rs, cfg.rollout_rs_threshold) == (
        "token", "seq_mean_k3", 0.5)
    # decoupled_k3_rs: k3 means .314, 1e8, 5.2, .901 against 0.01 reject every row.
    _, mask = run_correct(Cfg.from_preset("decoupled_k3_rs", **dataclass_values(Cfg())))
    close(mask, np.zeros_like(MASK))
    assert Cfg.from_preset(None, rollout_is="token") == Cfg(rollout_is="token")


def test_pg_token_icepop_preset_weights():
    cfg = Cfg.from_preset("bypass_pg_token_icepop", **dataclass_values(Cfg())).validate()
    w, mask = run_correct(cfg)
    # [0.5, 5]: 2 . 1 | . 1 | 1.5 .6 4 . | 3
    close(w, [[2, 0, 1, 0], [0, 1, 0, 0], [1.5, 0.6, 4, 0], [3, 0, 0, 0], [0] * 4])
    close(mask, MASK)


# ----------------------------------------------------------------------------- metrics


def ref_masked_mean(x, m, axis=None):
    return (x * m).sum(axis) / (m.sum(axis) + 1e-8)


def ref_is_metrics(lr, mask, level, upper, lower=None):
    """verl's `compute_is_metrics` from its documented formulas."""
    lr = lr.astype(np.float64)
    if level == "token":
        raw_log = lr
        raw = np.exp(np.clip(lr, -20, 20)) * mask
    else:
        raw_log = (lr * mask).sum(1)
        raw = np.exp(np.clip(raw_log, -20, 20))[:, None] * mask
    if lower is None:
        w, low = np.minimum(raw, upper), 1.0 / upper
    else:
        w, low = np.where((raw >= lower) & (raw <= upper), raw, 0.0), lower
    m = mask > 0
    out = {"mean": w[m].mean()}
    if level == "token":
        out.update(max=w[m].max(), min=w[m].min(), ratio_fraction_high=(raw[m] > upper).mean(),
                   ratio_fraction_low=(raw[m] < low).mean())
    else:
        out.update(max=np.exp(min(raw_log.max(), 20)), min=np.exp(raw_log.min()),
                   ratio_fraction_high=(raw_log > L(upper)).mean(),
                   ratio_fraction_low=(raw_log < L(low)).mean())
    c = np.clip(w[m], 0, upper)
    out["std"] = np.std(c)
    out["eff_sample_size"] = 1.0 / np.mean((c / (c.mean() + 1e-8)) ** 2)
    seq, raw_seq = ref_masked_mean(w, mask, 1), ref_masked_mean(raw, mask, 1)
    out.update(seq_mean=seq.mean(), seq_std=np.std(seq, ddof=1), seq_max=seq.max(),
               seq_min=seq.min(), seq_max_deviation=np.abs(seq - 1).max(),
               seq_fraction_high=(raw_seq > upper).mean(),
               seq_fraction_low=(raw_seq < low).mean())
    if lower is not None:
        out["oob_ratio"] = ((raw[m] < lower) | (raw[m] > upper)).mean()
    return {f"rollout_corr/rollout_is_{k}": v for k, v in out.items()}


def ref_rs(name, lr, mask, upper, lower=None):
    """(verl's `rollout_rs_<name>_*` metrics, the keep mask) from its formulas."""
    s = np.clip(lr.astype(np.float64), -20, 20)
    k = {"k1": -s, "k2": 0.5 * s ** 2, "k3": np.exp(s) - 1 - s}[name[-2:]]
    level = name[:-3]
    rows = []
    for kb, mb in zip(k, mask > 0, strict=True):
        vals = kb[mb]
        rows.append({"token": vals.mean() if vals.size else 0.0, "seq_sum": vals.sum(),
                     "seq_mean": vals.sum() / (vals.size + 1e-8),
                     "seq_max": vals.max() if vals.size else 0.0}[level])
    rows = np.array(rows)
    value = k if level == "token" else np.repeat(rows[:, None], lr.shape[1], 1)
    hi, lo = (L(upper), L(lower)) if name.endswith("k1") else (upper, None)
    keep = (value <= hi) & ((value >= lo) if lo is not None else True)
    m, valid = mask > 0, mask.sum(1) > 0
    v, r = value[m], rows[valid]
    out = {"mean": v.mean(), "max": v.max(), "min": v.min()}
    if level == "token":
        out.update(fraction_high=(v > hi).mean(),
                   fraction_low=(v < lo).mean() if lo is not None else 0.0)
    else:
        out.update(fraction_high=(r > hi).mean(),
                   fraction_low=(r < lo).mean() if lo is not None else 0.0)
    out["std"] = np.std(np.clip(v, lo if lo is not None else 0.0, hi))
    out.update(seq_mean=r.mean(), seq_std=np.std(r, ddof=1), seq_max=r.max(), seq_min=r.min(),
               seq_max_deviation=np.abs(r).max(), seq_fraction_high=(r > hi).mean())
    if lo is not None:
        out["seq_fraction_low"] = (r < lo).mean()
    out["masked_fraction"] = (~keep[m]).mean()
    out["seq_masked_fraction"] = ((~keep & m).any(1)[valid]).mean()
    return {f"rollout_corr/rollout_rs_{name}_{k}": x for k, x in out.items()}, keep


def ref_metrics(old, rollout, mask):
    old, rollout = old.astype(np.float64), rollout.astype(np.float64)
    m = mask > 0
    po, pr = np.exp(old[m]), np.exp(rollout[m])
    diff = np.abs(po - pr)
    lr = old - rollout
    m_old, m_roll = ref_masked_mean(old, mask, 1), ref_masked_mean(rollout, mask, 1)
    d = m_roll - m_old
    p = "rollout_corr/"
    return {
        "training/rollout_probs_diff_valid": 1.0,
        "training/rollout_probs_diff_max": diff.max(),
        "training/rollout_probs_diff_mean": diff.mean(),
        "training/rollout_probs_diff_std": np.std(diff, ddof=1),
        "training/rollout_actor_probs_pearson_corr": np.corrcoef(po, pr)[0, 1],
        p + "training_ppl": np.exp(-m_old).mean(), p + "training_log_ppl": (-m_old).mean(),
        p + "kl": (rollout - old)[m].mean(),
        p + "k3_kl": (np.exp(lr) - lr - 1)[m].mean(),
        p + "rollout_ppl": np.exp(-m_roll).mean(), p + "rollout_log_ppl": (-m_roll).mean(),
        p + "log_ppl_diff": d.mean(), p + "log_ppl_abs_diff": np.abs(d).mean(),
        p + "log_ppl_diff_max": d.max(), p + "log_ppl_diff_min": d.min(),
        p + "ppl_ratio": np.exp(d).mean(),
        p + "chi2_token": (np.exp(np.clip(lr, -20, 20)) ** 2)[m].mean() - 1,
        p + "chi2_seq": np.mean(np.exp(2 * np.clip((lr * mask).sum(1), -20, 20))) - 1,
        p + "rollout_is_veto_fraction": 0.0, p + "rollout_is_catastrophic_token_fraction": 0.0,
    }


def parse(spec):
    """(upper, lower) of a "l_u" string or a number, for the reference."""
    if isinstance(spec, str) and "_" in spec:
        lower, upper = map(float, spec.split("_"))
        return upper, lower
    return float(spec), None


@pytest.mark.parametrize("is_level,is_threshold,options,thresholds", [
    ("token", 3.1, ["token_k1", "seq_sum_k2"], ["0.45_4.5", 1.3]),
    ("sequence", 3.1, ["seq_sum_k1", "seq_mean_k3"], ["0.3_2.5", 0.35]),
    ("token", "0.5_3.2", ["seq_mean_k1", "token_k2", "seq_max_k3"], ["0.3_1.3", 0.5, 0.95]),
    ("sequence", "0.4_3.5", ["token_k3", "seq_max_k2", "seq_sum_k3", "seq_mean_k2"],
     [0.5, 0.7, 1.0, 0.5]),
])
def test_metrics_match_numpy_reference(is_level, is_threshold, options, thresholds):
    cfg = Cfg(rollout_is=is_level, rollout_is_threshold=is_threshold,
              rollout_rs=",".join(options),
              rollout_rs_threshold=",".join(map(str, thresholds))).validate()
    got = rc.metrics(jnp.asarray(OLD), jnp.asarray(ROLLOUT), jnp.asarray(MASK), cfg)
    lr = OLD.astype(np.float64) - ROLLOUT
    want = {**ref_metrics(OLD, ROLLOUT, MASK), **ref_is_metrics(
        lr, MASK, is_level, *parse(is_threshold))}
    keep = np.ones(MASK.shape, bool)
    for option, spec in zip(options, thresholds, strict=True):
        upper, lower = parse(spec)
        if option.endswith("k1") and lower is None:
            lower = 1 / upper
        option_metrics, option_keep = ref_rs(option, lr, MASK, upper, lower)
        want.update(option_metrics)
        keep &= option_keep
    m = MASK > 0
    want["rollout_corr/rollout_rs_masked_fraction"] = (~keep[m]).mean()
    want["rollout_corr/rollout_rs_seq_masked_fraction"] = (~keep & m).any(1).mean()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        # float32 variances by E[x^2] - E[x]^2 (as verl): an absolute 1e-5.
        np.testing.assert_allclose(float(got[key]), value, rtol=2e-5, atol=1e-5, err_msg=key)


def test_is_metrics_are_those_of_the_applied_weights():
    # Token TIS at 2 with ratios 24.45, 1, e^-1: the weights applied are 2, 1, e^-1.
    old = jnp.array([[L(24.45), 0.0, -1.0]], jnp.float32)
    got = rc.metrics(old, jnp.zeros((1, 3)), jnp.ones((1, 3)), Cfg(
        rollout_is="token", rollout_is_threshold=2.0))
    w = np.array([2.0, 1.0, np.exp(-1.0)])
    mean = w.mean()
    for key, value in {"max": 2.0, "min": np.exp(-1.0), "mean": mean,
                       "std": np.sqrt((w ** 2).mean() - mean ** 2),
                       "eff_sample_size": 1 / ((w / mean) ** 2).mean(),
                       "ratio_fraction_high": 1 / 3, "ratio_fraction_low": 1 / 3,
                       "seq_max": mean,
                       # The row's mean ratio before truncation, (24.45 + 1 + 0.37) / 3 =
                       # 8.6, is above 2: the row counts (its truncated mean, 1.12, is not).
                       "seq_fraction_high": 1.0, "seq_fraction_low": 0.0}.items():
        close(got[f"rollout_corr/rollout_is_{key}"], value)


def test_is_seq_fractions_judge_each_rows_mean_ratio_before_truncation():
    """verl's `rollout_is_seq_fraction_high` / `_low`: the share of rows whose mean of
    the raw token ratios (bounded at e^20 only) is above the upper bound / below the
    lower, whatever the weights applied. Rows of ratios (ones of 3 tokens, a padded row
    of 2, an empty row):
      row 0: 6, 1, 1      mean 8/3 = 2.67
      row 1: 0.1, 0.1, 4  mean 4.2/3 = 1.4
      row 2: 0.05, 0.25   mean 0.15   (third token padding, ratio e^5 not counted)
      row 3: empty        mean 0 (verl's masked mean of no tokens)"""
    ratios = np.array([[6.0, 1.0, 1.0], [0.1, 0.1, 4.0], [0.05, 0.25, np.exp(5.0)],
                       [1.0, 1.0, 1.0]])
    mask = jnp.array([[1.0, 1, 1], [1, 1, 1], [1, 1, 0], [0, 0, 0]])
    old = jnp.asarray(np.log(ratios), jnp.float32)
    p = "rollout_corr/rollout_is_seq_fraction"
    # TIS at 2 (lower 1/2): above 2 row 0 only; below 1/2 rows 2 and 3. Truncated,
    # row 0's mean is (2 + 1 + 1) / 3 = 1.33 and no row would pass 2.
    got = rc.metrics(old, jnp.zeros_like(old), mask, Cfg(rollout_is="token",
                                                          rollout_is_threshold=2.0))
    close(got[f"{p}_high"], 1 / 4)
    close(got[f"{p}_low"], 2 / 4)
    # IcePop within [0.2, 5]: none above 5; below 0.2 rows 2 and 3.
    got = rc.metrics(old, jnp.zeros_like(old), mask, Cfg(rollout_is="token",
                                                          rollout_is_threshold="0.2_5"))
    close(got[f"{p}_high"], 0.0)
    close(got[f"{p}_low"], 2 / 4)
    # IcePop within [1.5, 2.5]: above 2.5 row 0 (2.67); below 1.5 rows 1, 2 and 3.
    # Every weight applied is 0 here (no ratio lies within the bounds), so by the
    # applied weights no row would be above and all four below.
    got = rc.metrics(old, jnp.zeros_like(old), mask, Cfg(rollout_is="token",
                                                          rollout_is_threshold="1.5_2.5"))
    close(got[f"{p}_high"], 1 / 4)
    close(got[f"{p}_low"], 3 / 4)


def test_metric_hand_values():
    # One row, ratios 2 and 0.5 (token IS, threshold 4): w mean 1.25, std 0.75,
    # ESS = 1 / mean((w / 1.25)^2) = 1.5625 / 2.125; probs 0.5, 0.25 vs 0.25, 0.5.
    old = jnp.array([[L(0.5), L(0.25)]], jnp.float32)
    rollout = jnp.array([[L(0.25), L(0.5)]], jnp.float32)
    got = rc.metrics(old, rollout, jnp.ones((1, 2)), Cfg(rollout_is="token",
                                                          rollout_is_threshold=4.0))
    for key, value in {"training/rollout_probs_diff_mean": 0.25,
                       "training/rollout_probs_diff_std": 0.0,
                       "training/rollout_actor_probs_pearson_corr": -1.0,
                       "rollout_corr/kl": 0.0, "rollout_corr/log_ppl_diff": 0.0,
                       "rollout_corr/k3_kl": (2 - L(2) - 1 + 0.5 + L(2) - 1) / 2,
                       "rollout_corr/chi2_token": (4 + 0.25) / 2 - 1,
                       "rollout_corr/chi2_seq": 0.0, "rollout_corr/rollout_is_mean": 1.25,
                       "rollout_corr/rollout_is_std": 0.75,
                       "rollout_corr/rollout_is_eff_sample_size": 1.5625 / 2.125}.items():
        np.testing.assert_allclose(float(got[key]), value, rtol=1e-5, atol=1e-6, err_msg=key)
    # token_k1 within [0.5, 2]: row 0's padding (ratio e^5) does not make it a rejected
    # row; row 1 loses 1 of its 3 tokens (k1 = -log 4). 1 of 5 tokens, 1 of 2 rows.
    old = jnp.array([[0.0, 0.0, 5.0], [L(4.0), 0.0, 0.0]], jnp.float32)
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    got = rc.metrics(old, jnp.zeros_like(old), mask, Cfg(rollout_rs="token_k1",
                                                          rollout_rs_threshold=2.0))
    p = "rollout_corr/rollout_rs"
    for key, value in {"masked_fraction": 0.2, "seq_masked_fraction": 0.5,
                       "token_k1_masked_fraction": 0.2, "token_k1_seq_masked_fraction": 0.5,
                       "token_k1_min": -L(4.0), "token_k1_max": 0.0,
                       "token_k1_mean": -L(4.0) / 5, "token_k1_fraction_low": 0.2,
                       "token_k1_seq_min": -L(4.0) / 3, "token_k1_seq_max": 0.0}.items():
        close(got[f"{p}_{key}"], value)


def test_an_empty_batch_gives_valid_0_and_nan():
    cfg = Cfg(rollout_is="token", rollout_rs="token_k1,seq_max_k2", rollout_rs_threshold=2.0,
              rollout_token_veto_threshold=1e-4)
    got = rc.metrics(jnp.asarray(OLD), jnp.asarray(ROLLOUT), jnp.zeros(MASK.shape), cfg)
    assert float(got.pop("training/rollout_probs_diff_valid")) == 0.0
    assert all(np.isnan(float(v)) for v in got.values()), got
    _, mask = rc.correct(jnp.asarray(OLD), jnp.asarray(ROLLOUT), jnp.zeros(MASK.shape), cfg)
    close(mask, np.zeros(MASK.shape))


def test_one_token_batch():
    # torch's std and corrcoef of one element are NaN; verl's IS and rejection spreads
    # are 0 below two tokens. k2 of log 3: 0.6035.
    got = rc.metrics(jnp.array([[L(3.0), 0.0]]), jnp.zeros((1, 2)), jnp.array([[1.0, 0.0]]),
                     Cfg(rollout_is="token", rollout_rs="seq_max_k2", rollout_rs_threshold=1))
    assert float(got["training/rollout_probs_diff_valid"]) == 1.0
    close(got["training/rollout_probs_diff_mean"], 2.0)
    assert np.isnan(float(got["training/rollout_probs_diff_std"]))
    assert np.isnan(float(got["training/rollout_actor_probs_pearson_corr"]))
    close(got["rollout_corr/rollout_is_std"], 0.0)
    close(got["rollout_corr/rollout_is_max"], 2.0)
    close(got["rollout_corr/rollout_is_eff_sample_size"], 1.0)
    p = "rollout_corr/rollout_rs_seq_max_k2"
    for key, value in {"mean": L(3.0) ** 2 / 2, "max": L(3.0) ** 2 / 2, "std": 0.0,
                       "seq_std": 0.0, "seq_max_deviation": L(3.0) ** 2 / 2,
                       "masked_fraction": 0.0}.items():
        close(got[f"{p}_{key}"], value)


def test_log_ratios_past_20_are_clamped_per_token():
    # Two tokens at +30 and one at -25: k1 -20, -20, 20; k2 200 each; k3 e^20 - 21 twice,
    # and e^-20 + 19. seq_sum_k1 = -20; the sequence IS product exp(35) -> e^20.
    old = jnp.array([[30.0, 30.0, -25.0]], jnp.float32)
    got = rc.metrics(old, jnp.zeros((1, 3)), jnp.ones((1, 3)), Cfg(
        rollout_is="sequence", rollout_is_threshold=1e12,
        rollout_rs="seq_sum_k1,seq_sum_k2,seq_max_k3", rollout_rs_threshold="1e-9_1e9,1e3,1e12"))
    p = "rollout_corr/rollout_"
    close(got[p + "rs_seq_sum_k1_seq_max"], -20.0)
    close(got[p + "rs_seq_sum_k2_seq_max"], 600.0)
    close(got[p + "rs_seq_max_k3_seq_max"], E20 - 21.0)
    close(got[p + "is_max"], E20)
    close(got[p + "is_mean"], E20)
    close(got[p + "rs_masked_fraction"], 0.0)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("kwargs,key,message", [
    ({"rollout_is": "tokens"}, "rollout_is", "not valid"),
    ({"rollout_rs": "seq", "rollout_rs_threshold": 2.0}, "rollout_rs", "'seq' is not valid"),
    ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 2.0}, "rollout_rs", "not valid"),
    ({"rollout_rs": "token", "rollout_rs_threshold": 2.0}, "rollout_rs", "now 'token_k1'"),
    ({"rollout_rs": "geometric", "rollout_rs_threshold": 2.0}, "rollout_rs", "seq_mean_k1"),
    ({"rollout_rs": " , ", "rollout_rs_threshold": 2.0}, "rollout_rs", "not valid"),
    ({"rollout_is": "token", "rollout_is_threshold": 0.0}, "rollout_is_threshold", "positive"),
    ({"rollout_is": "token", "rollout_is_threshold": "2_1"}, "rollout_is_threshold", "lower"),
    ({"rollout_is": "token", "rollout_is_threshold": "a_2"}, "rollout_is_threshold", "'a'"),
    ({"rollout_is": "token", "rollout_is_threshold": True}, "rollout_is_threshold", "number"),
    ({"rollout_rs": "token_k2"}, "rollout_rs_threshold", "is needed"),
    ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.1_1"}, "rollout_rs_threshold",
     "token_k2: '0.1_1': a k2 or k3 option takes one upper bound"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": -1.0}, "rollout_rs_threshold",
     "positive"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": 0.5}, "rollout_rs_threshold", "empty"),
    ({"rollout_rs": "token_k1,token_k3", "rollout_rs_threshold": "1,2,3"},
     "rollout_rs_threshold", "3 thresholds for 2"),
    ({"rollout_token_veto_threshold": 0.0}, "rollout_token_veto_threshold", "positive"),
    ({"loss_type": "ppo"}, "loss_type", "not valid"),
    ({"loss_type": "reinforce"}, "loss_type", "bypass_mode"),
])
def test_config_errors_name_the_key(kwargs, key, message):
    pattern = re.escape(f"algorithm.rollout_correction.{key}:") + ".*" + re.escape(message)
    with pytest.raises(ConfigError, match=pattern):
        Cfg(**kwargs).validate()


def test_an_unknown_preset_names_the_key():
    with pytest.raises(ConfigError, match=r"^algorithm\.rollout_correction\.preset: 'tis'"):
        Cfg.from_preset("tis")


def test_valid_configs():
    assert not Cfg().validate().enabled
    cfg = Cfg(rollout_is="sequence", rollout_is_threshold="0.5_2", rollout_rs="seq_mean_k1",
              rollout_rs_threshold=2.0, rollout_token_veto_threshold=1e-4, bypass_mode=True,
              loss_type="reinforce")
    assert cfg.validate() is cfg and cfg.rejects
    assert cfg.is_bounds() == (2.0, 0.5)
    assert cfg.rs_options() == (rc.RsOption("seq_mean_k1", 2.0, 0.5),)
