"""Rollout correction (verl's): truncated IS weights, rejection sampling, the veto, the
metrics and the config checks, against hand-computed values and a plain-numpy reference
written here from verl's definitions."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import rollout_correction as rc
from jrl.errors import ConfigError

Cfg = rc.RolloutCorrectionConfig
L = np.log
E20 = np.exp(20.0)

# Log-ratios (old - rollout); the padding (mask 0) holds garbage that must not matter.
LR = np.array([[L(2.0), L(0.25), 0.0, 5.0],
               [30.0, 0.0, 7.0, -50.0],
               [L(1.5), L(0.6), L(4.0), -30.0]], np.float32)
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], np.float32)
ROLLOUT = np.array([[-1.0, -2.0, -0.5, -3.0],
                    [-31.0, -1.5, -2.0, -1.0],
                    [-0.7, -1.2, -2.5, -30.5]], np.float32)
OLD = ROLLOUT + LR


def close(got, want):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-12)


# ----------------------------------------------------------------------------- IS weights


def test_token_weights_truncate_mask_and_clamp():
    w = rc.is_weights(jnp.asarray(LR), jnp.asarray(MASK), Cfg(rollout_is="token",
                                                              rollout_is_threshold=3.0))
    close(w, [[2, 0.25, 1, 0], [3, 1, 0, 0], [1.5, 0.6, 3, np.exp(-20.0)]])
    # A huge threshold shows the +20 clamp: exp(30) -> exp(20).
    w = rc.is_weights(jnp.asarray(LR), jnp.asarray(MASK), Cfg(rollout_is="token",
                                                              rollout_is_threshold=1e12))
    close(w[1], [E20, 1, 0, 0])


def test_sequence_weights_one_per_row():
    # Row sums: log(0.5); 30 -> clamped 20; log(3.6) - 30 -> clamped -20.
    cfg = Cfg(rollout_is="sequence", rollout_is_threshold=3.0)
    w = rc.is_weights(jnp.asarray(LR), jnp.asarray(MASK), cfg)
    close(w, [[0.5, 0.5, 0.5, 0], [3, 3, 0, 0], [np.exp(-20.0)] * 4])
    w = rc.is_weights(jnp.asarray(LR), jnp.asarray(MASK),
                      Cfg(rollout_is="sequence", rollout_is_threshold=1e12))
    close(w[1], [E20, E20, 0, 0])


def test_batch_normalize_token_and_sequence():
    tok = np.array([[2, 0.25, 1, 0], [3, 1, 0, 0], [1.5, 0.6, 3, np.exp(-20.0)]])
    w = rc.is_weights(jnp.asarray(LR), jnp.asarray(MASK), Cfg(
        rollout_is="token", rollout_is_threshold=3.0, rollout_is_batch_normalize=True))
    close(w, tok / (tok.sum() / 9.0))
    # A fourth, empty row does not count in the mean over rows: (0.5 + 3 + e^-20) / 3.
    lr = np.concatenate([LR, np.full((1, 4), 2.0, np.float32)])
    mask = np.concatenate([MASK, np.zeros((1, 4), np.float32)])
    w = rc.is_weights(jnp.asarray(lr), jnp.asarray(mask), Cfg(
        rollout_is="sequence", rollout_is_threshold=3.0, rollout_is_batch_normalize=True))
    seq = np.array([[0.5] * 3 + [0], [3, 3, 0, 0], [np.exp(-20.0)] * 4, [0] * 4])
    close(w, seq / ((0.5 + 3 + np.exp(-20.0)) / 3))


def test_batch_normalize_skips_a_zero_mean():
    mask = jnp.zeros((2, 3))
    w = rc.is_weights(jnp.ones((2, 3)), mask, Cfg(rollout_is="token",
                                                  rollout_is_batch_normalize=True))
    close(w, np.zeros((2, 3)))


# ----------------------------------------------------------------------------- rejection


@pytest.mark.parametrize("level,lower,want", [
    # ratios 2, .25, 1 | e^20, 1 | 1.5, .6, 4, e^-20 against [0.4, 2.5] or [0.2, 2.5]
    ("token", None, [[1, 0, 1, 0], [0, 1, 0, 0], [1, 1, 0, 0]]),
    ("token", 0.2, [[1, 1, 1, 0], [0, 1, 0, 0], [1, 1, 0, 0]]),
    # row products 0.5, e^20, e^-20
    ("sequence", None, [[1, 1, 1, 0], [0] * 4, [0] * 4]),
    ("sequence", 0.6, [[0] * 4, [0] * 4, [0] * 4]),
    # row geometric means 0.5^(1/3) = 0.79, e^15, exp((log 3.6 - 30) / 4)
    ("geometric", 0.6, [[1, 1, 1, 0], [0] * 4, [0] * 4]),
    ("geometric", 0.8, [[0] * 4, [0] * 4, [0] * 4]),
])
def test_rejection_levels(level, lower, want):
    cfg = Cfg(rollout_rs=level, rollout_rs_threshold=2.5, rollout_rs_threshold_lower=lower)
    weights, mask = rc.correct(jnp.asarray(OLD), jnp.asarray(ROLLOUT), jnp.asarray(MASK), cfg)
    assert weights is None
    close(mask, want)


def test_geometric_accepts_what_sequence_rejects():
    lr = jnp.array([[L(3.0), L(3.0), L(0.5)]], jnp.float32)  # product 4.5, geometric 1.65
    mask = jnp.ones((1, 3))
    close(rc.keep_mask(lr, mask, Cfg(rollout_rs="sequence", rollout_rs_threshold=2.0)), 0.0)
    close(rc.keep_mask(lr, mask, Cfg(rollout_rs="geometric", rollout_rs_threshold=2.0)), 1.0)


def test_veto_rejects_whole_rows_on_masked_tokens_only():
    # log(1e-4) = -9.2: row 2's -30 vetoes it; row 1's -50 is padding.
    cfg = Cfg(rollout_token_veto_threshold=1e-4)
    _, mask = rc.correct(jnp.asarray(OLD), jnp.asarray(ROLLOUT), jnp.asarray(MASK), cfg)
    close(mask, MASK * np.array([[1], [1], [0]]))
    cfg = Cfg(rollout_rs="token", rollout_rs_threshold=2.5, rollout_token_veto_threshold=1e-4)
    _, mask = rc.correct(jnp.asarray(OLD), jnp.asarray(ROLLOUT), jnp.asarray(MASK), cfg)
    close(mask, [[1, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]])


def test_correct_without_is_and_dtype():
    bool_mask = jnp.asarray(MASK > 0)
    weights, mask = rc.correct(jnp.asarray(OLD), jnp.asarray(ROLLOUT), bool_mask, Cfg())
    assert weights is None and mask.dtype == jnp.bool_
    np.testing.assert_array_equal(mask, MASK > 0)
    weights, mask = rc.correct(jnp.asarray(OLD), jnp.asarray(ROLLOUT), jnp.asarray(MASK),
                               Cfg(rollout_is="token", rollout_is_threshold=3.0))
    close(weights[0], [2, 0.25, 1, 0])
    close(mask, MASK)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("normalize", [False, True])
def test_weights_are_detached(level, normalize):
    cfg = Cfg(rollout_is=level, rollout_is_threshold=1e3, rollout_is_batch_normalize=normalize)

    def total(old):
        return jnp.sum(rc.correct(old, jnp.asarray(ROLLOUT), jnp.asarray(MASK), cfg)[0])

    assert float(total(jnp.asarray(OLD))) > 0
    close(jax.grad(total)(jnp.asarray(OLD)), np.zeros(OLD.shape))


# ----------------------------------------------------------------------------- metrics


def level_logs(lr, mask, level):
    """The log-ratios a level judges: per token `[B, T]`, else per row `[B]`."""
    if level == "token":
        return lr
    total = (lr * mask).sum(1)
    return total if level == "sequence" else total / (mask.sum(1) + 1e-8)


def ref_weight_metrics(name, lr, mask, level, upper, lower):
    raw = level_logs(lr, mask, level)
    ratio = np.exp(np.clip(raw, -20, 20))
    w = (ratio if level == "token" else np.repeat(ratio[:, None], lr.shape[1], 1)) * mask
    m = mask > 0
    flat = w[m]
    out = {"mean": flat.mean()}
    if level == "token":
        out.update(max=flat.max(), min=flat.min(), ratio_fraction_high=(flat > upper).mean(),
                   ratio_fraction_low=(flat < lower).mean())
    else:
        out.update(max=np.exp(min(raw.max(), 20)), min=np.exp(raw.min()),
                   ratio_fraction_high=(raw > L(upper)).mean(),
                   ratio_fraction_low=(raw < L(lower)).mean())
    c = np.clip(flat, lower, upper)
    out["std"] = np.std(c)
    out["eff_sample_size"] = 1.0 / np.mean((c / c.mean()) ** 2)
    seq = np.array([row[k].mean() for row, k in zip(w, m, strict=True)])
    out.update(seq_mean=seq.mean(), seq_std=np.std(seq, ddof=1), seq_max=seq.max(),
               seq_min=seq.min(), seq_max_deviation=np.abs(seq - 1).max(),
               seq_fraction_high=(seq > upper).mean(), seq_fraction_low=(seq < lower).mean())
    return {f"rollout_corr/{name}_{k}": v for k, v in out.items()}


def ref_metrics(old, rollout, mask):
    old, rollout = old.astype(np.float64), rollout.astype(np.float64)
    m = mask > 0
    po, pr = np.exp(old[m]), np.exp(rollout[m])
    diff = np.abs(po - pr)
    lr = old - rollout
    m_old = (old * mask).sum(1) / mask.sum(1)
    m_roll = (rollout * mask).sum(1) / mask.sum(1)
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
    }


@pytest.mark.parametrize("is_level,rs_level", [("token", "token"), ("sequence", "sequence"),
                                               ("sequence", "geometric")])
def test_metrics_match_numpy_reference(is_level, rs_level):
    cfg = Cfg(rollout_is=is_level, rollout_is_threshold=3.0, rollout_rs=rs_level,
              rollout_rs_threshold=2.5, rollout_rs_threshold_lower=0.7,
              rollout_token_veto_threshold=1e-4)
    got = rc.metrics(jnp.asarray(OLD), jnp.asarray(ROLLOUT), jnp.asarray(MASK), cfg)
    lr = OLD.astype(np.float64) - ROLLOUT
    want = {**ref_metrics(OLD, ROLLOUT, MASK),
            **ref_weight_metrics("rollout_is", lr, MASK, is_level, 3.0, 1 / 3.0),
            **ref_weight_metrics("rollout_rs", lr, MASK, rs_level, 2.5, 0.7)}
    # Hand: row 2 alone is vetoed, by 1 of the 9 response tokens.
    want["rollout_corr/rollout_is_veto_fraction"] = 1 / 3
    want["rollout_corr/rollout_is_catastrophic_token_fraction"] = 1 / 9
    # Token level rejects 0.25 | e^20 | 0.6, 4, e^-20 of [0.7, 2.5]: 5 of 9 tokens, every
    # row; sequence level (0.5, e^20, e^-20) and geometric (0.79, e^15, e^-7.2) reject
    # all rows, except row 0 for geometric (its 3 of 9 tokens stay).
    rejected = {"token": (5 / 9, 1.0), "sequence": (1.0, 1.0), "geometric": (6 / 9, 2 / 3)}
    want["rollout_corr/rollout_rs_masked_fraction"] = rejected[rs_level][0]
    want["rollout_corr/rollout_rs_seq_masked_fraction"] = rejected[rs_level][1]
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        np.testing.assert_allclose(float(got[key]), value, rtol=1e-5, atol=1e-12, err_msg=key)


def test_metric_hand_values():
    # One row, ratios 2 and 0.5 (token IS, threshold 4): w mean 1.25, c = w, std 0.75,
    # ESS = 1 / mean((c / 1.25)^2) = 1.5625 / 2.125; probs 0.5, 0.25 vs 0.25, 0.5.
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
    # Token rejection in [0.5, 2]: row 0's padding (ratio e^5) does not make it a rejected
    # row; row 1 loses 1 of its 3 tokens. 1 of 5 tokens, 1 of 2 rows.
    old = jnp.array([[0.0, 0.0, 5.0], [L(4.0), 0.0, 0.0]], jnp.float32)
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    got = rc.metrics(old, jnp.zeros_like(old), mask, Cfg(rollout_rs="token",
                                                          rollout_rs_threshold=2.0))
    close(got["rollout_corr/rollout_rs_masked_fraction"], 0.2)
    close(got["rollout_corr/rollout_rs_seq_masked_fraction"], 0.5)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("kwargs,key", [
    ({"rollout_is": "tokens"}, "rollout_is"),
    ({"rollout_rs": "seq", "rollout_rs_threshold": 2.0}, "rollout_rs"),
    ({"rollout_is": "token", "rollout_is_threshold": 0.0}, "rollout_is_threshold"),
    ({"rollout_rs": "token", "rollout_rs_threshold": -1.0}, "rollout_rs_threshold"),
    ({"rollout_rs": "token", "rollout_rs_threshold": 2.0, "rollout_rs_threshold_lower": 0.0},
     "rollout_rs_threshold_lower"),
    ({"rollout_token_veto_threshold": 0.0}, "rollout_token_veto_threshold"),
    ({"rollout_rs": "geometric"}, "rollout_rs_threshold"),
    ({"rollout_rs": "token", "rollout_rs_threshold": 2.0, "rollout_rs_threshold_lower": 3.0},
     "rollout_rs_threshold_lower"),
    ({"rollout_rs": "token", "rollout_rs_threshold": 0.5}, "rollout_rs_threshold_lower"),
    ({"loss_type": "ppo"}, "loss_type"),
    ({"loss_type": "reinforce"}, "loss_type"),
])
def test_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=re.escape(f"algorithm.rollout_correction.{key}:")):
        Cfg(**kwargs).validate()


def test_valid_configs():
    assert not Cfg().validate().enabled
    cfg = Cfg(rollout_is="sequence", rollout_rs="geometric", rollout_rs_threshold=2.0,
              rollout_token_veto_threshold=1e-4, bypass_mode=True, loss_type="reinforce")
    assert cfg.validate() is cfg and cfg.rejects and cfg.rs_lower == 0.5
