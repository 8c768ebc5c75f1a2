"""Advantage estimators, keyed by verl's `algorithm.adv_estimator` names.

Every estimator returns `(advantages, returns)`, both `[B, T]` like the
response, and is a pure, jit-able function of arrays. Outcome-reward estimators
group the samples of one prompt by an integer id per sample (`group_ids [B]`,
verl's `uid`); the ids may come in any order and need not be contiguous.

| name                           | needs           | paper                              |
|--------------------------------|-----------------|------------------------------------|
| `gae`                          | values          | Schulman et al. 2015, 1506.02438   |
| `grpo`                         | group_ids       | Shao et al. 2024, 2402.03300       |
| `grpo_passk`                   | group_ids       | Chen et al. 2025, 2503.19595       |
| `rloo`                         | group_ids       | Ahmadian et al. 2024, 2402.14740   |
| `reinforce_plus_plus`          | -               | Hu 2025, 2501.03262                |
| `reinforce_plus_plus_baseline` | group_ids       | Hu 2025, 2501.03262                |
| `remax`                        | reward_baselines| Li et al. 2023, 2310.10505         |
| `opo`                          | group_ids       | Hao et al. 2025, 2505.23585        |
| `gpg`                          | group_ids       | Chu et al. 2025, 2504.02546        |

Dr. GRPO (2503.20783) is `grpo` with `norm_adv_by_std_in_grpo=False` and the
`seq-mean-token-sum-norm` loss aggregation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jrl.algos import masks

Array = jax.Array


class GroupStats(NamedTuple):
    """Per-sample statistics of the sample's group, all `[B]`."""

    count: Array  # group size
    mean: Array  # group mean; 0 for groups of one (verl)
    std: Array  # unbiased group std; 1 for groups of one (verl)


def dense_group_index(group_ids: Array) -> Array:
    """Maps arbitrary integer ids `[B]` to dense segment ids in `[0, B)`."""
    group_ids = jnp.asarray(group_ids)
    _, inverse = jnp.unique(group_ids, size=group_ids.shape[0], return_inverse=True)
    return inverse.reshape(group_ids.shape)


def _segment_sum(x: Array, seg: Array) -> Array:
    """Sum of `x` over each sample's group, gathered back to `[B]`."""
    return jax.ops.segment_sum(x, seg, num_segments=x.shape[0])[seg]


def group_stats(scores: Array, group_ids: Array) -> GroupStats:
    """Size, mean and unbiased std of each sample's group.

    Follows verl: a group of one has mean 0 and std 1, so its advantage under
    GRPO is the raw score (divided by 1 + epsilon).
    """
    seg = dense_group_index(group_ids)
    count = _segment_sum(jnp.ones_like(scores), seg)
    many = count > 1
    mean = jnp.where(many, _segment_sum(scores, seg) / count, 0.0)
    sq_dev = jnp.square(scores - mean)
    var = _segment_sum(sq_dev, seg) / jnp.maximum(count - 1, 1)
    std = jnp.where(many, jnp.sqrt(var), 1.0)
    return GroupStats(count, mean, std)


def _check_min_group_size(group_ids: Array, min_size: int, estimator: str) -> None:
    """Raises for groups smaller than `min_size` when the ids are concrete.

    Under jit the ids are traced and the check is skipped; the trainer's config
    validation (rollout.n) enforces it before compilation.
    """
    if isinstance(group_ids, jax.core.Tracer):
        return
    ids, counts = np.unique(np.asarray(group_ids), return_counts=True)
    if counts.size and counts.min() < min_size:
        bad = ids[counts < min_size][:5].tolist()
        raise ValueError(
            f"{estimator} needs at least {min_size} samples per group (rollout.n >= {min_size}); "
            f"groups {bad} have fewer."
        )


def _outcome(scores_b: Array, response_mask: Array) -> Array:
    """Broadcasts a per-sequence advantage over its response tokens."""
    return scores_b[:, None] * response_mask


# ----------------------------------------------------------------------------- estimators


def gae(token_level_rewards, response_mask, values, gamma=1.0, lam=1.0):
    """Generalised advantage estimation as a reverse `lax.scan`.

    delta_t = r_t + gamma * V_{t+1} - V_t,  A_t = delta_t + gamma * lam * A_{t+1}.
    Masked positions (holes, padding) are skipped: the running next-value and
    advantage are carried through them unchanged, as verl does. Returns are
    `A + V` before whitening; the advantages are whitened over the mask.

    Args:
      token_level_rewards: `[B, T]`.
      response_mask: `[B, T]`.
      values: critic values `[B, T]`.
      gamma: discount.
      lam: GAE lambda.

    Returns:
      `(advantages [B, T], returns [B, T])`.
    """
    advantages, returns = gae_returns(token_level_rewards, response_mask, values, gamma, lam)
    return masks.masked_whiten(advantages, jnp.asarray(response_mask, values.dtype)), returns


def gae_returns(token_level_rewards, response_mask, values, gamma=1.0, lam=1.0):
    """`gae`'s advantages before whitening, and its returns `A + V`: row by row, so a
    micro-batch's returns are those of the whole batch's rows it holds."""
    mask = jnp.asarray(response_mask, values.dtype)

    def step(carry, xs):
        next_value, last_adv = carry
        reward, value, m = xs
        delta = reward + gamma * next_value - value
        adv = delta + gamma * lam * last_adv
        next_value = value * m + (1 - m) * next_value
        last_adv = adv * m + (1 - m) * last_adv
        return (next_value, last_adv), last_adv

    zeros = jnp.zeros(values.shape[0], values.dtype)
    xs = (token_level_rewards.T, values.T, mask.T)
    _, adv_tb = jax.lax.scan(step, (zeros, zeros), xs, reverse=True)
    advantages = adv_tb.T
    return advantages, advantages + values


def grpo(token_level_rewards, response_mask, group_ids, norm_adv_by_std_in_grpo=True,
         epsilon=1e-6):
    """GRPO: `(score - mean_group) / (std_group + eps)` broadcast over the response.

    `score` is the sum of the token-level rewards; std is unbiased. Without
    `norm_adv_by_std_in_grpo` only the mean is removed (Dr. GRPO).
    """
    scores = jnp.sum(token_level_rewards, axis=-1)
    stats = group_stats(scores, group_ids)
    adv = scores - stats.mean
    if norm_adv_by_std_in_grpo:
        adv = adv / (stats.std + epsilon)
    adv = _outcome(adv, response_mask)
    return adv, adv


def grpo_passk(token_level_rewards, response_mask, group_ids, norm_adv_by_std_in_grpo=True,
               epsilon=1e-6):
    """Pass@k GRPO: only the best sample of a group gets `r_max - r_second_max`.

    Divided by the group's unbiased std (+ eps) when `norm_adv_by_std_in_grpo`.
    Every group needs at least two samples. With a tie at the top the
    difference is 0, so which of the tied samples is "best" does not matter.
    """
    _check_min_group_size(group_ids, 2, "grpo_passk")
    scores = jnp.sum(token_level_rewards, axis=-1)
    b = scores.shape[0]
    seg = dense_group_index(group_ids)
    r_max = jax.ops.segment_max(scores, seg, num_segments=b)[seg]
    # One representative of the maximum per group: the lowest index holding it.
    index = jnp.arange(b)
    first_max = jax.ops.segment_min(jnp.where(scores == r_max, index, b), seg, num_segments=b)[seg]
    is_best = index == first_max
    rest = jnp.where(is_best, -jnp.inf, scores)
    r_second = jax.ops.segment_max(rest, seg, num_segments=b)[seg]
    adv = r_max - r_second
    if norm_adv_by_std_in_grpo:
        adv = adv / (group_stats(scores, group_ids).std + epsilon)
    adv = _outcome(jnp.where(is_best, adv, 0.0), response_mask)
    return adv, adv


def rloo(token_level_rewards, response_mask, group_ids):
    """RLOO: `score - mean of the other samples of the group`.

    Written as verl does, `n/(n-1) * (score - mean_group)`; a group of one keeps
    its raw score.
    """
    scores = jnp.sum(token_level_rewards, axis=-1)
    stats = group_stats(scores, group_ids)
    n = stats.count
    adv = jnp.where(n > 1, scores * n / (n - 1) - stats.mean * n / (n - 1), scores)
    adv = _outcome(adv, response_mask)
    return adv, adv


def reinforce_plus_plus(token_level_rewards, response_mask, gamma=1.0):
    """REINFORCE++: discounted returns-to-go, whitened over the mask.

    G_t = r_t + gamma * m_{t+1} * G_{t+1}: the running return is zeroed after
    each masked position, so nothing flows back across padding (verl's
    recursion). Advantages are `whiten(G) * m`; returns are `G`.
    """
    mask = jnp.asarray(response_mask, token_level_rewards.dtype)

    def step(running, xs):
        reward, m = xs
        running = reward + gamma * running
        return running * m, running

    zeros = jnp.zeros(token_level_rewards.shape[0], token_level_rewards.dtype)
    _, returns_tb = jax.lax.scan(step, zeros, (token_level_rewards.T, mask.T), reverse=True)
    returns = returns_tb.T
    advantages = masks.masked_whiten(returns, mask) * mask
    return advantages, returns


def reinforce_plus_plus_baseline(token_level_rewards, response_mask, group_ids):
    """REINFORCE++ with a group-mean baseline, whitened over the whole batch."""
    scores = jnp.sum(token_level_rewards, axis=-1)
    adv = _outcome(scores - group_stats(scores, group_ids).mean, response_mask)
    adv = masks.masked_whiten(adv, response_mask) * response_mask
    return adv, adv


def remax(token_level_rewards, response_mask, reward_baselines):
    """ReMax: returns-to-go minus the greedy rollout's reward (`reward_baselines [B]`)."""
    mask = jnp.asarray(response_mask, token_level_rewards.dtype)
    returns = jnp.flip(jnp.cumsum(jnp.flip(token_level_rewards * mask, -1), -1), -1)
    advantages = returns - reward_baselines[:, None] * mask
    return advantages, returns


def opo(token_level_rewards, response_mask, group_ids):
    """OPO: baseline is the length-weighted group mean `sum(len * r) / sum(len)`."""
    scores = jnp.sum(token_level_rewards, axis=-1)
    lengths = jnp.sum(jnp.asarray(response_mask, scores.dtype), axis=-1)
    seg = dense_group_index(group_ids)
    count = _segment_sum(jnp.ones_like(scores), seg)
    baseline = _segment_sum(lengths * scores, seg) / _segment_sum(lengths, seg)
    adv = _outcome(scores - jnp.where(count > 1, baseline, 0.0), response_mask)
    return adv, adv


def gpg(token_level_rewards, response_mask, group_ids):
    """GPG: `alpha * (score - mean_group)` with `alpha = B / #(nonzero scores)`.

    No std normalisation (`f_norm = 1`, as verl).
    """
    scores = jnp.sum(token_level_rewards, axis=-1)
    alpha = scores.shape[0] / jnp.maximum(jnp.count_nonzero(scores), 1)
    adv = _outcome(alpha * (scores - group_stats(scores, group_ids).mean), response_mask)
    return adv, adv


# ----------------------------------------------------------------------------- registry


@dataclasses.dataclass(frozen=True)
class Estimator:
    """A registered estimator and the optional inputs it reads."""

    fn: Callable[..., tuple[Array, Array]]
    needs_values: bool = False  # needs a critic
    needs_groups: bool = False  # needs rollout.n samples per prompt, grouped by uid
    needs_baseline: bool = False  # needs a greedy rollout's reward (ReMax)
    min_group_size: int = 1


ESTIMATORS: dict[str, Estimator] = {
    "gae": Estimator(gae, needs_values=True),
    "grpo": Estimator(grpo, needs_groups=True),
    "grpo_passk": Estimator(grpo_passk, needs_groups=True, min_group_size=2),
    "rloo": Estimator(rloo, needs_groups=True),
    "reinforce_plus_plus": Estimator(reinforce_plus_plus),
    "reinforce_plus_plus_baseline": Estimator(reinforce_plus_plus_baseline, needs_groups=True),
    "remax": Estimator(remax, needs_baseline=True),
    "opo": Estimator(opo, needs_groups=True),
    "gpg": Estimator(gpg, needs_groups=True),
}


def get_estimator(name: str) -> Estimator:
    """The estimator registered under `name`; a clear error otherwise."""
    if name not in ESTIMATORS:
        raise ValueError(
            f"algorithm.adv_estimator={name!r} is not known; valid: {sorted(ESTIMATORS)}"
        )
    return ESTIMATORS[name]


def register_estimator(name: str, estimator: Estimator) -> None:
    """Adds a user estimator (same contract: returns `(advantages, returns)`)."""
    if name in ESTIMATORS:
        raise ValueError(f"advantage estimator {name!r} is already registered")
    ESTIMATORS[name] = estimator


def compute_advantages(
    name: str,
    token_level_rewards: Array,
    response_mask: Array,
    *,
    values: Array | None = None,
    group_ids: Array | None = None,
    reward_baselines: Array | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[Array, Array]:
    """Runs estimator `name`, passing each the inputs and settings it uses."""
    est = get_estimator(name)
    kwargs = {}
    for flag, key, value in (
        (est.needs_values, "values", values),
        (est.needs_groups, "group_ids", group_ids),
        (est.needs_baseline, "reward_baselines", reward_baselines),
    ):
        if flag:
            if value is None:
                raise ValueError(f"advantage estimator {name!r} needs `{key}`")
            kwargs[key] = value
    params = {"gamma": gamma, "lam": lam, "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo}
    code = est.fn.__code__
    kwargs.update({k: v for k, v in params.items() if k in code.co_varnames[: code.co_argcount]})
    return est.fn(token_level_rewards, response_mask, **kwargs)
