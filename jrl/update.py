"""PPO-style updates: epochs x shuffled mini-batches x accumulated micro-batches, in one jit.

`run_updates` is generic over the model: it takes a `loss_fn(params, micro, normalizer,
rng) -> (loss, (sums, means))` and applies one optimizer step per mini-batch, with
the gradient accumulated over its micro-batches by `lax.scan`. Every micro-batch
loss is normalised by the token/sequence counts of its whole mini-batch, so the
mini-batch gradient is the same whatever the micro-batch split. An update whose
loss or gradient is not finite is skipped (parameters and optimizer state kept)
and counted.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jrl import logprobs, losses, masks
from jrl.models.config import ModelConfig
from jrl.settings import ActorSettings, CriticSettings, UpdateSettings
from jrl.sharding import constrain

Array = jax.Array
Batch = dict[str, Array]


@flax.struct.dataclass
class ModelState:
    """Parameters and optimizer state of one trained model (actor or critic)."""

    params: dict
    opt_state: optax.OptState


def _reshape_minis(batch: Batch, perm: Array, num_minis: int, num_micros: int) -> Batch:
    """`[N, ...]` -> `[minis, micros, micro, ...]`, each micro-batch split over the data axes."""
    def one(x):
        x = x[perm]
        x = x.reshape(num_minis, num_micros, x.shape[0] // (num_minis * num_micros),
                      *x.shape[1:])
        return constrain(x, (None, None, "batch") + (None,) * (x.ndim - 3))

    return jax.tree.map(one, batch)


def _all_finite(tree) -> Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.stack(leaves).all()


def _accumulate_grads(loss_fn: Callable, params, mini: Batch, rng: Array, num_micros: int):
    """Float32 gradients and loss terms summed over the micro-batches of one mini-batch
    (`[micros, micro, ...]`), each normalised by the whole mini-batch's counts."""
    mask = mini["response_mask"]
    normalizer = masks.loss_normalizer(mask.reshape(-1, mask.shape[-1]))
    micro0 = jax.tree.map(lambda x: x[0], mini)
    _, (sums0, means0) = jax.eval_shape(loss_fn, params, micro0, normalizer, rng)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), (params, sums0, means0))

    def micro_step(carry, xs):
        micro, micro_rng = xs
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, (sums, means)), grads = grad_fn(params, micro, normalizer, micro_rng)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        return jax.tree.map(jnp.add, carry, (grads, sums, means)), None

    rngs = jax.random.split(rng, num_micros)
    return jax.lax.scan(micro_step, zeros, (mini, rngs))[0]


def run_updates(
    state: ModelState,
    batch: Batch,
    rng: Array,
    lr: Array,
    *,
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    update: UpdateSettings,
) -> tuple[ModelState, dict[str, Array]]:
    """Runs `ppo_epochs` passes of mini-batch updates over `batch` (leading dim `N`).

    `optimizer` gives the update direction (`jrl.optim.make_optimizer`); every
    mini-batch step moves the parameters by `-lr` times it.

    Returns:
      The new state and scalar metrics: the loss terms (summed over the
      micro-batches of a mini-batch, i.e. the mini-batch's value), the other loss
      metrics (mean over micro-batches), `grad_norm` (pre-clipping), all averaged
      over mini-batches and epochs, and `nan_skipped`, the number of skipped updates.
    """
    n = jax.tree.leaves(batch)[0].shape[0]
    num_minis = n // update.mini_batch
    num_micros = update.mini_batch // update.micro_batch

    def mini_step(state: ModelState, xs):
        mini, mini_rng = xs
        grads, sums, means = _accumulate_grads(loss_fn, state.params, mini, mini_rng, num_micros)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm) & _all_finite(sums)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, jax.tree.map(lambda u: -lr * u, updates))
        params = jax.tree.map(lambda p, u: u.astype(p.dtype), state.params, params)
        new = ModelState(params=params, opt_state=opt_state)
        new = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, state)
        metrics = {**sums, **{k: v / num_micros for k, v in means.items()},
                   "grad_norm": grad_norm, "nan_skipped": 1.0 - finite.astype(jnp.float32)}
        return new, metrics

    def epoch_step(state, epoch_rng):
        perm_rng, mini_rng = jax.random.split(epoch_rng)
        perm = jax.random.permutation(perm_rng, n) if update.shuffle else jnp.arange(n)
        minis = _reshape_minis(batch, perm, num_minis, num_micros)
        return jax.lax.scan(mini_step, state, (minis, jax.random.split(mini_rng, num_minis)))

    state, metrics = jax.lax.scan(epoch_step, state, jax.random.split(rng, update.ppo_epochs))
    skipped = jnp.sum(metrics.pop("nan_skipped"))
    metrics = jax.tree.map(jnp.mean, metrics)
    return state, {**metrics, "nan_skipped": skipped}


def _attention(micro: Batch):
    """The response tokens attended to: all of a multi-turn row's, tool outputs too."""
    return micro.get("response_attention_mask", micro["response_mask"])


def actor_loss(params, micro: Batch, normalizer, rng, *, model: ModelConfig,
               actor: ActorSettings, temperature: float, chunk_size: int):
    """Policy loss - entropy bonus + KL loss of one micro-batch (verl's actor objective)."""
    mask = micro["response_mask"]
    hidden = logprobs.response_hidden(params, micro["prompt_ids"], micro["prompt_mask"],
                                      micro["responses"], _attention(micro), config=model)
    with_entropy = actor.entropy_coeff != 0
    log_probs, entropy = logprobs.token_log_probs(
        params, hidden, micro["responses"], temperature=temperature, chunk_size=chunk_size,
        with_entropy=with_entropy or actor.on_policy)
    agg = lambda x: masks.agg_loss(x, mask, actor.loss.loss_agg_mode, normalizer,
                                   actor.loss.loss_scale_factor)
    sums = {}
    if actor.on_policy:  # the old log-probs are these, detached; verl's on-policy actor
        old_log_probs = jax.lax.stop_gradient(log_probs)
        sums["entropy"] = agg(jax.lax.stop_gradient(entropy))  # the step's entropy metric
    else:
        old_log_probs = micro["old_log_probs"]
    pg_loss, means = losses.policy_loss(old_log_probs, log_probs, micro["advantages"], mask,
                                        actor.loss, normalizer, rng)
    loss = pg_loss
    sums["pg_loss"] = pg_loss
    if with_entropy:
        sums["entropy_loss"] = agg(entropy)
        loss = loss - actor.entropy_coeff * sums["entropy_loss"]
    if actor.use_kl_loss:
        kld = losses.kl_penalty(log_probs, micro["ref_log_probs"], actor.kl_loss_type)
        sums["kl_loss"] = agg(kld)
        loss = loss + actor.kl_loss_coef * sums["kl_loss"]
    means = {k.removeprefix("actor/"): v for k, v in means.items()}
    return loss, (sums, means)


def critic_loss(params, micro: Batch, normalizer, rng, *, model: ModelConfig,
                critic: CriticSettings):
    """Clipped value loss of one micro-batch."""
    del rng
    mask = micro["response_mask"]
    vpreds = logprobs.response_values(params, micro["prompt_ids"], micro["prompt_mask"],
                                      micro["responses"], _attention(micro), config=model)
    vf_loss, clipfrac = losses.value_loss(vpreds, micro["returns"], micro["values"], mask,
                                          critic.cliprange_value, critic.loss_agg_mode,
                                          normalizer)
    means = {"vf_clipfrac": clipfrac, "vpred_mean": masks.masked_mean(vpreds, mask)}
    return vf_loss, ({"vf_loss": vf_loss}, means)
