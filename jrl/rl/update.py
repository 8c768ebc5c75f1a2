"""PPO-style updates: epochs x shuffled mini-batches x accumulated micro-batches, in one jit.

`run_updates` is generic over the model: it takes a `loss_fn(params, micro, normalizer,
rng) -> (loss, (sums, means, per-token outputs))` and applies one optimizer step per
mini-batch, with the gradient accumulated over its micro-batches by `lax.scan`. Every micro-batch
loss is normalised by the token/sequence counts of its whole mini-batch, so the
mini-batch gradient is the same whatever the micro-batch split. An update whose
loss or gradient is not finite is skipped (parameters and optimizer state kept)
and counted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jrl.algos import advantages as adv_lib
from jrl.algos import losses, masks, rollout_correction
from jrl.config.settings import ActorSettings, CriticSettings, UpdateSettings
from jrl.models import moe
from jrl.models.config import ModelConfig
from jrl.rl import buckets, logprobs, packing
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


def _accumulate_grads(loss_fn: Callable, params, mini: Batch, rng: Array, num_micros: int,
                      bucket_sizes: Sequence[int] = ()):
    """Float32 gradients and loss terms summed over the micro-batches of one mini-batch
    (`[micros, micro, ...]`), each normalised by the whole mini-batch's counts; and the
    loss's per-token outputs, `[micros, micro, ...]`. With `bucket_sizes`, each
    micro-batch runs on the response columns its longest row needs (`jrl.rl.buckets`)."""
    mask = mini["response_mask"]
    normalizer = masks.loss_normalizer(mask.reshape(-1, mask.shape[-1]))
    micro0 = jax.tree.map(lambda x: x[0], mini)
    _, (sums0, means0, _) = jax.eval_shape(loss_fn, params, micro0, normalizer, rng)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), (params, sums0, means0))
    num_columns = mask.shape[-1]

    def branch(size):
        def grads_at(micro, micro_rng):
            grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
            (_, (sums, means, tokens)), grads = grad_fn(
                params, buckets.trim(micro, size), normalizer, micro_rng)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            return grads, sums, means, buckets.pad_columns(tokens, num_columns)
        return grads_at

    def micro_step(carry, xs):
        micro, micro_rng = xs
        length = jnp.max(buckets.used_lengths(_attention(micro)))
        grads, sums, means, tokens = buckets.switch(
            length, bucket_sizes or (num_columns,), branch, micro, micro_rng)
        return jax.tree.map(jnp.add, carry, (grads, sums, means)), tokens

    rngs = jax.random.split(rng, num_micros)
    return jax.lax.scan(micro_step, zeros, (mini, rngs))


def _accumulate_packed(loss_fn: Callable, params, mini: Batch, rng: Array, budget: int):
    """`_accumulate_grads` over token-budget micro-batches (`jrl.rl.packing`, `budget` tokens
    per device): the mini-batch's sequences packed, the loss of each micro-batch taken
    on the mini-batch's grid with only its own sequences live (`micro["packed"]`), so
    its sums and normalisers are the padded path's. The loss's means are averaged over
    the micro-batches that ran; its per-token outputs come back as `[n, ...]`."""
    mask = mini["response_mask"]
    normalizer = masks.loss_normalizer(mask)
    plan = packing.for_sequences(mini["prompt_ids"], mini["prompt_mask"], mini["responses"],
                                 _attention(mini), budget)
    micro0 = {**mini, "packed": packing.Micro(plan, jnp.int32(0))}
    _, (sums0, means0, tokens0) = jax.eval_shape(loss_fn, params, micro0, normalizer, rng)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), (params, sums0, means0))
    zeros += (jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), tokens0),)

    def body(micro: packing.Micro, carry):
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, (sums, means, tokens)), grads = grad_fn(
            params, {**mini, "packed": micro}, normalizer, jax.random.fold_in(rng, micro.index))
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        return jax.tree.map(jnp.add, carry, (grads, sums, means, tokens))

    grads, sums, means, tokens = packing.loop(plan, body, zeros)
    count = jnp.maximum(plan.num_micros, 1).astype(jnp.float32)
    return (grads, sums, jax.tree.map(lambda m: m / count, means)), tokens


def run_updates(
    state: ModelState,
    batch: Batch,
    rng: Array,
    lr: Array,
    *,
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    update: UpdateSettings,
    bucket_sizes: Sequence[int] = (),
    group: int = 1,
) -> tuple[ModelState, dict[str, Array], dict[str, Array]]:
    """Runs `ppo_epochs` passes of mini-batch updates over `batch` (leading dim `N`).

    With more than one of `bucket_sizes` (`jrl.rl.buckets`), the rows of each mini-batch
    are sorted by used response length before it is cut into micro-batches, and each
    micro-batch runs on the response columns its longest row needs. The mini-batch's
    gradient is the same sum either way. With `group` k > 1 (runs of k rows share a
    prompt, and `loss_fn` runs them as one: `logprobs.response_hidden`), the shuffle
    and the sorting move whole runs.

    `optimizer` gives the update direction (`jrl.optim.make_optimizer`); every
    mini-batch step moves the parameters by `-lr` times it.

    Returns:
      The new state and scalar metrics: the loss terms (summed over the
      micro-batches of a mini-batch, i.e. the mini-batch's value), the other loss
      metrics (mean over micro-batches), `grad_norm` (pre-clipping), all averaged
      over mini-batches and epochs, and `nan_skipped`, the number of skipped updates.
      And the loss's per-token outputs (the third part of its aux, e.g. the update's
      log-probs; `{}` for none) of the first epoch, `[N, ...]` in the batch's order: each row's
      from the parameters of the mini-batch step that saw it.
    """
    n = jax.tree.leaves(batch)[0].shape[0]
    num_minis = n // update.mini_batch
    packed = update.max_token_len is not None
    # Token-budget micro-batches: one pass over the mini-batch, its means averaged already.
    num_micros = 1 if packed else update.mini_batch // update.micro_batch
    mini_step = functools.partial(
        _mini_step, loss_fn=loss_fn, optimizer=optimizer, lr=lr, num_micros=num_micros,
        bucket_sizes=bucket_sizes, max_token_len=update.max_token_len)

    def epoch_step(state, epoch_rng):
        perm_rng, mini_rng = jax.random.split(epoch_rng)
        perm = _epoch_order(batch, perm_rng, num_minis, shuffle=update.shuffle, group=group,
                            sort=len(bucket_sizes) > 1 and not packed)
        minis = _reshape_minis(batch, perm, num_minis, num_micros)
        state, (metrics, tokens) = jax.lax.scan(
            mini_step, state, (minis, jax.random.split(mini_rng, num_minis)))
        return state, (metrics, tokens, perm)

    state, (metrics, tokens, perms) = jax.lax.scan(
        epoch_step, state, jax.random.split(rng, update.ppo_epochs))
    skipped = jnp.sum(metrics.pop("nan_skipped"))
    metrics = jax.tree.map(jnp.mean, metrics)
    return state, {**metrics, "nan_skipped": skipped}, _in_batch_order(tokens, perms[0], n)


def _mini_step(state: ModelState, xs, *, loss_fn: Callable,
               optimizer: optax.GradientTransformation, lr: Array, num_micros: int,
               bucket_sizes: Sequence[int], max_token_len: int | None):
    """One optimizer step on a mini-batch (`xs`: its micro-batches `[micros, micro, ...]`
    and its key), skipped when its loss or gradient is not finite; returns the new
    state, the mini-batch's metrics and the loss's per-token outputs
    `[micros, micro, ...]`."""
    mini, mini_rng = xs
    if max_token_len is not None:
        mini = jax.tree.map(lambda x: x[0], mini)  # [1, rows, ...]: one mini-batch
        (grads, sums, means), tokens = _accumulate_packed(
            loss_fn, state.params, mini, mini_rng, max_token_len)
        tokens = jax.tree.map(lambda x: x[None], tokens)  # as one micro-batch of all
    else:
        (grads, sums, means), tokens = _accumulate_grads(
            loss_fn, state.params, mini, mini_rng, num_micros, bucket_sizes)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm) & _all_finite(sums)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, jax.tree.map(lambda u: -lr * u, updates))
    params = jax.tree.map(lambda p, u: u.astype(p.dtype), state.params, params)
    new = ModelState(params=params, opt_state=opt_state)
    new = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, state)
    metrics = {**sums, **{k: v / num_micros for k, v in means.items()},
               "grad_norm": grad_norm, "nan_skipped": 1.0 - finite.astype(jnp.float32)}
    return new, (metrics, tokens)


def _epoch_order(batch: Batch, rng: Array, num_minis: int, *, shuffle: bool, group: int,
                 sort: bool) -> Array:
    """The order `[N]` an epoch visits the batch's rows in: shuffled in runs of `group`
    rows (`shuffle`), then, with `sort`, each mini-batch's rows by used response length
    (`jrl.rl.buckets`)."""
    n = jax.tree.leaves(batch)[0].shape[0]
    perm = jnp.arange(n)
    if shuffle:
        perm = buckets.expand_groups(jax.random.permutation(rng, n // group), group)
    if sort:
        lengths = buckets.used_lengths(_attention(batch))[perm].reshape(num_minis, -1)
        within = jax.vmap(lambda x: buckets.sort_order(x, group))(lengths)
        perm = jnp.take_along_axis(perm.reshape(num_minis, -1), within, axis=1).reshape(n)
    return perm


def _in_batch_order(tokens, perm: Array, n: int):
    """The first epoch's per-token outputs (`[epochs, minis, micros, micro, ...]`) as
    `[N, ...]` in the batch's order: its flattened row i is the batch's row `perm[i]`."""
    return jax.tree.map(
        lambda x: jnp.zeros((n, *x.shape[4:]), x.dtype).at[perm].set(
            x[0].reshape(n, *x.shape[4:])), tokens)


def _live_mask(micro: Batch):
    """The response mask of the tokens this micro-batch trains on: with token-budget
    micro-batches (`micro["packed"]`), the mini-batch's grid less the sequences that
    other micro-batches hold."""
    mask = micro["response_mask"]
    if "packed" in micro:
        mask = mask * micro["packed"].member()[:, None].astype(mask.dtype)
    return mask


def _attention(micro: Batch):
    """The response tokens attended to: all of a multi-turn row's, tool outputs too."""
    return micro.get("response_attention_mask", micro["response_mask"])


def actor_loss(params, micro: Batch, normalizer, rng, *, model_config: ModelConfig,
               actor: ActorSettings, temperature: float, chunk_size: int, group: int = 1):
    """Policy loss - entropy bonus + KL loss of one micro-batch (verl's actor objective).

    The old log-probs are the batch's, or this pass's own, detached (an on-policy update),
    or the rollout's (`bypass_mode`). Rollout correction's IS weights and rejections come
    with the batch (`rollout_is_weights`, the loss mask) when `step.learn` computed them
    from a separate old-log-prob pass, else from this pass's log-probs here. The aux's
    per-token part holds these log-probs, detached, when the old-log-prob pass is skipped
    and the rollout's are there to compare with (the step's mismatch metrics). `group`:
    rows per shared prompt (`logprobs.response_hidden`).
    """
    mask = _live_mask(micro)
    with_entropy = actor.entropy_coeff != 0
    skips_old_pass = actor.skips_old_pass
    log_probs, entropy, router = _micro_log_probs(
        params, micro, model_config, group, temperature=temperature, chunk_size=chunk_size,
        with_entropy=with_entropy or skips_old_pass, entropy_grad=with_entropy)
    agg = lambda x: masks.agg_loss(x, mask, actor.loss.loss_agg_mode, normalizer,
                                   actor.loss.loss_scale_factor)
    current = jax.lax.stop_gradient(log_probs)
    sums, tokens = {}, {}
    if skips_old_pass:
        sums["entropy"] = agg(jax.lax.stop_gradient(entropy))  # the step's entropy metric
        if micro.get("rollout_log_probs") is not None:
            tokens["log_probs"] = current
    pg_loss, means = _policy_loss(log_probs, current, micro, mask, normalizer, rng, actor)
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
    if router is not None:  # an MoE model: the router's load-balancing loss and load
        aux = moe.load_balancing_loss(router)
        # Each micro-batch's loss (over all its tokens, as transformers computes it),
        # weighted by its share of the mini-batch's response tokens: the micro-batches'
        # terms add up to their token-weighted mean.
        share = jnp.sum(mask) / jnp.maximum(normalizer.num_tokens, 1.0)
        sums["router_aux_loss"] = aux * share
        coef = actor.router_aux_loss_coef
        coef = model_config.router_aux_loss_coef if coef is None else coef
        loss = loss + coef * sums["router_aux_loss"]
        means.update(moe.load_metrics(jax.lax.stop_gradient(router)))
    return loss, (sums, means, tokens)


def _micro_log_probs(params, micro: Batch, model_config: ModelConfig, group: int, **kwargs):
    """The micro-batch's response log-probs and entropies `[micro, R]`: of its packed
    sequences (token-budget micro-batches, `micro["packed"]`) or of its padded rows; and
    an MoE model's router statistics (`moe.RouterStats`; None for a dense model)."""
    with_router = model_config.is_moe
    if "packed" in micro:
        out = logprobs.packed_log_probs(params, micro["packed"], config=model_config,
                                        with_router=with_router, **kwargs)
        log_probs, entropy = (micro["packed"].responses(x, _attention(micro))
                              for x in out[:2])
        return log_probs, entropy, out[2] if with_router else None
    hidden = logprobs.response_hidden(params, micro["prompt_ids"], micro["prompt_mask"],
                                      micro["responses"], _attention(micro),
                                      micro.get("prompt_routing"), micro.get("response_routing"),
                                      config=model_config, group=group,
                                      with_router=with_router)
    hidden, router = hidden if with_router else (hidden, None)
    log_probs, entropy = logprobs.token_log_probs(
        params, hidden, micro["responses"], impl=model_config.logprob_impl,
        softcap=model_config.final_logit_softcapping, **kwargs)
    return log_probs, entropy, router


def _policy_loss(log_probs, current, micro: Batch, mask, normalizer, rng,
                 actor: ActorSettings):
    """The policy-gradient loss and its metrics, against the old log-probs the settings
    name (`current`: this pass's, detached), with rollout correction's IS weights and
    rejections."""
    correction, rollout = actor.correction, micro.get("rollout_log_probs")
    old_log_probs = rollout if correction.bypass_mode else (
        current if actor.on_policy else micro["old_log_probs"])
    weights, loss_mask = micro.get("rollout_is_weights"), mask
    if actor.skips_old_pass and correction.enabled:  # the correction from this pass
        weights, loss_mask = rollout_correction.correct(current, rollout, mask, correction)
        if correction.bypass_mode and correction.loss_type == "ppo_clip":
            weights = None  # the ratio to the rollout policy is the correction
    if correction.bypass_mode and correction.loss_type == "reinforce":
        return losses.reinforce(rollout, log_probs, micro["advantages"], loss_mask,
                                actor.loss, normalizer, weights)
    return losses.policy_loss(old_log_probs, log_probs, micro["advantages"], loss_mask,
                              actor.loss, normalizer, rng, weights)


def critic_loss(params, micro: Batch, normalizer, rng, *, model_config: ModelConfig,
                critic: CriticSettings, gamma: float, lam: float, group: int = 1):
    """Clipped value loss of one micro-batch; `group` as in `actor_loss`.

    The old values and the returns are the batch's, or, for an on-policy update
    (`critic.on_policy`), this pass's values, detached, and their GAE returns (`gamma`,
    `lam`) from the micro-batch's `token_level_rewards`; the aux's per-token part then
    holds those values (the step's advantages come from them).
    """
    del rng
    mask = _live_mask(micro)
    if "packed" in micro:
        vpreds = micro["packed"].responses(
            logprobs.packed_values(params, micro["packed"], config=model_config),
            _attention(micro))
    else:
        vpreds = logprobs.response_values(params, micro["prompt_ids"], micro["prompt_mask"],
                                          micro["responses"], _attention(micro),
                                          config=model_config, group=group)
    tokens = {}
    if critic.on_policy:
        values = jax.lax.stop_gradient(vpreds)
        _, returns = adv_lib.gae_returns(micro["token_level_rewards"], mask, values, gamma, lam)
        tokens["values"] = values
    else:
        values, returns = micro["values"], micro["returns"]
    vf_loss, clipfrac = losses.value_loss(vpreds, returns, values, mask, critic.cliprange_value,
                                          critic.loss_agg_mode, normalizer)
    means = {"vf_clipfrac": clipfrac, "vpred_mean": masks.masked_mean(vpreds, mask)}
    return vf_loss, ({"vf_loss": vf_loss}, means, tokens)
