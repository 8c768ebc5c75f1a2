"""The device side of RL as pure functions, each one jitted program.

    init(params, key) -> state
    generate(state, prompts, key) -> rollout
    forward(state, reference, rollout) -> experience   (+ host scores)
    learn(state, experience, key) -> new state, metrics

`run_step` is the one order both kinds of step run them in: generate -> forward ->
rewards -> learn, the rewards from the host's scorer between programs
(`jrl.rl.trainer`) or from a JAX reward inside one program (`jrl.rl.runs`).

`generate` samples from the actor in the compute dtype. `forward` computes what the
update needs from the current models: the actor's log-probs and entropy, the
reference's log-probs, the critic's values. `learn` does the rest of verl's step on
the devices: KL in the reward and the advantage estimator, the KL controller, the
critic's update and the actor's (the actor waits out `trainer.critic_warmup` as
data, not Python control flow), learning rates from the schedules at `state.step`,
and the step's scalar metrics.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jrl.algos import advantages as adv_lib
from jrl.algos import kl_control, masks, rollout_correction
from jrl.config.settings import Settings
from jrl.models import heads, lora
from jrl.models.config import ModelConfig
from jrl.optim import learning_rate_schedule
from jrl.rl import logprobs, packing, update
from jrl.rl.types import Experience, Rollout, TrainState
from jrl.rollout import paged
from jrl.rollout.sampler import (
    Prefix,
    RolloutOutput,
    SamplingConfig,
    continue_program,
    generate_program,
)

# The batch fields each model's update reads: the sequences, then each model's own
# (an on-policy critic's update values the batch itself, from the token rewards).
_SEQUENCE_FIELDS = ("prompt_ids", "prompt_mask", "responses", "response_mask",
                    "response_attention_mask")
_ACTOR_FIELDS = _SEQUENCE_FIELDS + ("old_log_probs", "advantages", "ref_log_probs",
                                    "rollout_is_weights", "prompt_routing",
                                    "response_routing")
_CRITIC_FIELDS = _SEQUENCE_FIELDS + ("values", "returns")
_ON_POLICY_CRITIC_FIELDS = _SEQUENCE_FIELDS + ("token_level_rewards",)
# The prefixes of `data_metrics`' keys.
DATA_METRICS = ("critic/score/", "critic/rewards/", "critic/advantages/", "critic/returns/",
                "critic/values/", "critic/vf_explained_var", "response_length/",
                "prompt_length/")
# Update metrics whose verl names differ from `update.run_updates`'s.
_METRIC_NAMES = {"entropy_loss": "entropy_loss", "nan_skipped": "nan_skipped_updates"}


def step_keys(root, step):
    """The step's key, `fold_in(root, step)`, and the rollout's part of it (`learn`
    splits the same key for the updates)."""
    key = jax.random.fold_in(root, step)
    return key, jax.random.split(key, 3)[0]


class Phases(NamedTuple):
    """The four phases of an RL step, as `run_step` composes them: inside one program
    (`jrl.rl.runs`) or as programs with the host between them (`jrl.rl.trainer`)."""

    generate: Callable  # (state, prompts, key) -> sampled: a rollout and what scores it
    forward: Callable  # (state, sampled) -> Experience (log-probs, values)
    rewards: Callable  # (state, sampled, Experience, key) -> (Experience, metrics)
    learn: Callable  # (state, Experience, key) -> (new state, metrics)


def run_step(phases: Phases, state: TrainState, prompts, keys) -> tuple[TrainState, dict, dict]:
    """One RL step: generate -> forward -> rewards -> learn. `keys`: the step's key and
    the rollout's (`step_keys`), which the rewards' phase also gets (ReMax's greedy
    rollout). Returns the new state, the rewards' metrics and `learn`'s."""
    key, rollout_key = keys
    sampled = phases.generate(state, prompts, rollout_key)
    exp = phases.forward(state, sampled)
    exp, reward_metrics = phases.rewards(state, sampled, exp, rollout_key)
    state, learned = phases.learn(state, exp, key)
    return state, reward_metrics, learned


def init(actor_params, key, frozen=None, *, settings: Settings,
         actor_opt: optax.GradientTransformation,
         critic_opt: optax.GradientTransformation | None = None,
         model_config: ModelConfig | None = None) -> TrainState:
    """The state before the first step: the actor with its optimizer state, a critic
    (when the estimator needs one) with its own, the initial KL coefficient, step 0.

    With LoRA, `actor_params` are the adapters (what trains) and `frozen` the base
    they apply to. The critic is the actor's backbone (the base with LoRA) with a value
    head seeded by `key`; with `critic.model.lora_rank` (needs `model_config`) it is the
    frozen base too, and trains adapters of its own and the value head.
    """
    actor = update.ModelState(actor_params, actor_opt.init(actor_params))
    critic = None
    if settings.critic is not None:
        lora_model = critic_model(model_config, settings) if settings.critic.lora_rank else None
        critic_params = init_critic(actor_params if frozen is None else frozen, key, lora_model)
        critic = update.ModelState(critic_params, critic_opt.init(critic_params))
    return TrainState(step=jnp.int32(0), actor=actor, critic=critic,
                      kl=kl_control.init_kl_controller(settings.algorithm.kl_coef))


def critic_model(model_config: ModelConfig, settings: Settings) -> ModelConfig:
    """The critic's architecture: the actor's, with the critic's adapters (if any)."""
    base = lora.without(model_config)
    critic = settings.critic
    if critic is None or not critic.lora_rank:
        return base
    return dataclasses.replace(base, lora_rank=critic.lora_rank, lora_alpha=critic.lora_alpha,
                               lora_targets=critic.lora_targets)


def init_critic(backbone, key, lora_model: ModelConfig | None = None) -> dict:
    """A fresh critic in float32: a copy of `backbone` and a value head or, with
    `lora_model` (the critic's architecture with adapters), only fresh adapters and a
    value head (the backbone stays the frozen base)."""
    if lora_model is None:
        return heads.init_critic_params(
            jax.tree.map(lambda x: x.astype(jnp.float32), backbone), key)
    adapter_key, head_key = jax.random.split(key)
    return {**lora.init_adapters(lora_model, adapter_key, "float32"),
            "value_head": heads.init_value_head(head_key, lora_model.hidden_size, jnp.float32)}


def actor_params(state: TrainState, frozen=None):
    """The actor's parameters: the state's, or with LoRA the frozen base with the
    state's adapters."""
    return state.actor.params if frozen is None else lora.combine(frozen, state.actor.params)


def with_frozen(params, frozen, config: ModelConfig):
    """A trained part with the frozen base under it: `params` alone for a full model,
    the base with `params` (adapters, and a head) combined for a LoRA one."""
    return lora.combine(frozen, params) if config.lora_rank else params


def compute_params(params, model_config: ModelConfig):
    """`params` in the model's compute dtype (the layers cast to it anyway: the same
    numbers, half the bytes to read in bfloat16)."""
    dtype = jnp.dtype(model_config.dtype)
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def sampling_model(model_config: ModelConfig) -> ModelConfig:
    """The architecture the sampler runs (`sampling_params`' config)."""
    merged = model_config.lora_rank and model_config.lora_rollout == "merged"
    return lora.without(model_config) if merged else model_config


def sampling_params(params, model_config: ModelConfig) -> tuple[ModelConfig, dict]:
    """(config, params) the sampler runs: the compute dtype, and with LoRA the adapters
    as `model.lora_rollout` says (merged: `W + A B` formed once, for every decode step)."""
    if sampling_model(model_config) is not model_config:
        model_config, params = lora.merge(params, model_config)
    return model_config, compute_params(params, model_config)


def generate(state: TrainState, prompt_ids, prompt_mask, key, frozen=None, *,
             sampling: SamplingConfig, model_config: ModelConfig,
             param_shardings=None) -> Rollout:
    """`sampling.n` responses to each prompt (`[B, P]`, left-padded) from the actor.

    `param_shardings`: where the decoding loop reads the weights (e.g. gathered over
    `fsdp` once here rather than once per token); None: as they are. `frozen`: the
    LoRA base (see `init`); its adapters apply as `model.lora_rollout` says.
    """
    params = rollout_params(state, frozen, model_config=model_config,
                            param_shardings=param_shardings)
    return generate_from(params, prompt_ids, prompt_mask, key, sampling=sampling,
                         model_config=model_config)


def generate_from(params, prompt_ids, prompt_mask, key, *, sampling: SamplingConfig,
                  model_config: ModelConfig) -> Rollout:
    """`generate` from the sampler's weights (`rollout_params`: e.g. a copy on another
    group of devices, one-step asynchronous training)."""
    program = paged.generate_program if sampling.kv_cache == "paged" else generate_program
    out = program(params, prompt_ids, prompt_mask, key, sampling=sampling,
                  config=sampling_model(model_config))
    return rollout_of(out, sampling)


def continue_rows(state: TrainState, prompt_ids, prompt_mask, prefix: Prefix, frozen=None,
                  carried=None, *, sampling: SamplingConfig, model_config: ModelConfig,
                  max_steps: int, keep_cache: bool = False,
                  param_shardings=None) -> RolloutOutput:
    """A round of partial rollouts: the actor's rows of `[N, P]` prompts continued from
    their `prefix` by at most `max_steps` tokens each (`sampler.continue_rows`, or
    `paged.continue_program` over a paged cache; `sampling.n` 1), with the previous
    round's `carried` cache and `keep_cache` as there; `frozen` and `param_shardings` as
    in `generate`. The prefix's keys may come as key data
    (`jax.random.key_data`), as the host keeps them."""
    params = rollout_params(state, frozen, model_config=model_config,
                            param_shardings=param_shardings)
    program = paged.continue_program if sampling.kv_cache == "paged" else continue_program
    return program(params, prompt_ids, prompt_mask, prefix, carried, sampling=sampling,
                   config=sampling_model(model_config), max_steps=max_steps,
                   keep_cache=keep_cache)


def rollout_of(out: RolloutOutput, sampling: SamplingConfig) -> Rollout:
    """The sampler's output as the step's `Rollout` (log-probs only when sampling)."""
    return Rollout(prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask,
                   responses=out.responses, response_mask=out.response_mask,
                   rollout_log_probs=out.rollout_log_probs if sampling.do_sample else None,
                   prompt_routing=out.prompt_routing, response_routing=out.response_routing,
                   preemptions=out.preemptions, page_usage=out.page_usage)


def rollout_params(state: TrainState, frozen=None, *, model_config: ModelConfig,
                   param_shardings=None):
    """The weights the sampler reads (`sampling_params`), placed by `param_shardings`
    (see `generate`)."""
    config, params = sampling_params(actor_params(state, frozen), model_config)
    if param_shardings is None:
        return params
    return jax.lax.with_sharding_constraint(
        params, lora.split(param_shardings)[0] if config is not model_config else param_shardings)


def prompt_group(settings: Settings, micro_batch: int) -> int:
    """Rows per shared prompt in a pass over micro-batches of `micro_batch` rows: the
    samples of a prompt are consecutive rows (`logprobs.prompt_group`); 1 with
    `actor.share_prompts` off."""
    return logprobs.prompt_group(settings.rollout.n, micro_batch) if settings.share_prompts else 1


def prompt_groups(settings: Settings, rows: int) -> dict[str, int]:
    """Rows that share a prompt's forward in each pass of a step over `rows` rows:
    `forward`'s log-prob and value passes, the actor's and the critic's updates."""
    groups = {"log-prob/value passes": prompt_group(settings,
                                                    settings.log_prob_micro_batch or rows),
              "actor update": prompt_group(settings, settings.actor.update.micro_batch)}
    if settings.critic is not None:
        groups["critic update"] = prompt_group(settings, settings.critic.update.micro_batch)
    return groups


def forward_passes(settings: Settings, with_reference: bool) -> tuple[str, ...]:
    """The passes `forward` runs: "old_log_probs" (not for an on-policy update, which
    takes them from its own pass), "ref_log_probs" (`with_reference`) and "values" (a
    critic whose update does not value the batch itself)."""
    runs = {"old_log_probs": not settings.actor.skips_old_pass, "ref_log_probs": with_reference,
            "values": settings.critic is not None and not settings.critic.on_policy}
    return tuple(name for name, on in runs.items() if on)


def forward(state: TrainState, ref_params, rollout: Rollout, frozen=None, *, settings: Settings,
            model_config: ModelConfig) -> Experience:
    """Old log-probs and entropy (the actor; not for an on-policy update, which takes
    them from its own forward pass), reference log-probs (when `ref_params`) and values
    (when the state has a critic, unless its on-policy update values the batch itself) of
    a rollout, in micro-batches of `rollout.log_prob_micro_batch_size` sequences or,
    with `rollout.log_prob_use_dynamic_bsz`, of a token budget (`jrl.rl.packing`: one plan
    for every pass). With LoRA the reference is the
    frozen base, adapters off (`ref_params` is `frozen`: no second copy). These
    passes take no gradient, so their scan over layers stays rolled whatever
    `model.scan_unroll` says (unrolled, nothing is saved for a backward pass to gain)."""
    model_config = dataclasses.replace(model_config, scan_unroll=False)
    critic = None if state.critic is None else critic_model(model_config, settings)
    seq = (rollout.prompt_ids, rollout.prompt_mask, rollout.responses, rollout.attention_mask())
    sizes = settings.bucket_sizes(rollout.responses.shape[1])
    group = prompt_group(settings, settings.log_prob_micro_batch or rollout.responses.shape[0])

    plan = (None if settings.log_prob_max_token_len is None
            else packing.for_sequences(*seq, settings.log_prob_max_token_len))

    def passes(padded_fn, packed_fn):
        """The pass over micro-batches: of a token budget (`jrl.rl.packing`), or padded."""
        if plan is not None:
            return lambda params, *_: logprobs.packed_pass(packed_fn, params, plan, seq[3])
        return logprobs.in_micro_batches(padded_fn, settings.log_prob_micro_batch, sizes, group)

    def log_probs(params, config, with_entropy, routing=(), record=False):
        kwargs = dict(config=config, temperature=settings.rollout.temperature,
                      chunk_size=settings.logprob_chunk_size, with_entropy=with_entropy)
        padded = functools.partial(logprobs.response_log_probs, **kwargs, record=record)
        return passes(padded, functools.partial(logprobs.packed_log_probs, **kwargs))(
            params, *seq, *routing)

    runs = forward_passes(settings, ref_params is not None)
    old_log_probs, entropy = None, None
    if "old_log_probs" in runs:  # else the update's pass or the rollout gives them
        # The actor's experts are the rollout's where it recorded them (routing replay,
        # "rollout"); with "old_log_prob" this pass routes for itself and its experts are
        # the ones the update replays. The reference routes for itself.
        record = settings.actor.router_replay == "old_log_prob"
        out = log_probs(compute_params(actor_params(state, frozen), model_config),
                        model_config, True, rollout.routing(), record)
        if record:
            rollout = rollout.replace(prompt_routing=out.prompt_routing,
                                      response_routing=out.response_routing)
            out = out.outputs
        old_log_probs, entropy = out
    base_model = lora.without(model_config)
    ref_log_probs = None
    if "ref_log_probs" in runs:
        ref_log_probs = log_probs(ref_params, base_model, False)[0]
    values = None
    if critic is not None and "values" in runs:  # else the critic's update values it
        values = passes(functools.partial(logprobs.response_values, config=critic),
                        functools.partial(logprobs.packed_values, config=critic))(
            with_frozen(state.critic.params, frozen, critic), *seq)
    return Experience.of(rollout, old_log_probs=old_log_probs, entropy=entropy,
                         ref_log_probs=ref_log_probs, values=values)


def token_rewards(exp: Experience, beta, *, settings: Settings):
    """(token rewards, current KL): the scores, less the KL penalty when
    `algorithm.use_kl_in_reward`."""
    if not settings.algorithm.use_kl_in_reward:
        return exp.token_level_scores, jnp.float32(0.0)
    return kl_control.apply_kl_penalty(
        exp.token_level_scores, exp.old_log_probs, exp.ref_log_probs,
        exp.response_mask.astype(jnp.float32), beta, settings.algorithm.kl_penalty)


def estimate_advantages(exp: Experience, rewards, *, settings: Settings):
    """(advantages, returns) of the token rewards (`token_rewards`) by the advantage
    estimator."""
    return adv_lib.compute_advantages(
        settings.algorithm.adv_estimator, rewards, exp.response_mask.astype(jnp.float32),
        values=exp.values, group_ids=exp.uid, reward_baselines=exp.reward_baselines,
        gamma=settings.algorithm.gamma, lam=settings.algorithm.lam,
        norm_adv_by_std_in_grpo=settings.algorithm.norm_adv_by_std_in_grpo)


def _stats(prefix: str, values, mask=None) -> dict:
    """Mean, max and min of `values` (where `mask`); NaN when nothing is selected."""
    values = values.astype(jnp.float32)
    mask = jnp.ones(values.shape, bool) if mask is None else mask
    count = mask.sum()
    empty = jnp.where(count > 0, 0.0, jnp.nan)
    return {f"{prefix}/mean": jnp.where(mask, values, 0).sum() / jnp.maximum(count, 1) + empty,
            f"{prefix}/max": jnp.where(mask, values, -jnp.inf).max() + empty,
            f"{prefix}/min": jnp.where(mask, values, jnp.inf).min() + empty}


def _var(x, mask):
    """Population variance of `x` where `mask` (numpy's `x[mask].var()`)."""
    count = jnp.maximum(mask.sum(), 1)
    mean = jnp.where(mask, x, 0).sum() / count
    return jnp.where(mask, (x - mean) ** 2, 0).sum() / count


def data_metrics(exp: Experience, rewards, adv, returns, *, settings: Settings) -> dict:
    """verl's `compute_data_metrics` as device reductions: scores, rewards, advantages,
    returns, values and lengths of the batch."""
    mask = exp.response_mask > 0
    out = {**_stats("critic/score", exp.token_level_scores.sum(-1)),
           **_stats("critic/rewards", rewards.sum(-1)),
           **_stats("critic/advantages", adv, mask), **_stats("critic/returns", returns, mask)}
    if exp.values is not None:
        out.update(_stats("critic/values", exp.values, mask))
        out["critic/vf_explained_var"] = 1.0 - _var(returns - exp.values, mask) / (
            _var(returns, mask) + 1e-5)
    response_length = exp.attention_mask().sum(-1).astype(jnp.float32)
    prompt_length = exp.prompt_mask.sum(-1).astype(jnp.float32)
    return {**out, **_stats("response_length", response_length),
            "response_length/clip_ratio": jnp.mean(
                response_length >= settings.rollout.max_new_tokens),
            **_stats("prompt_length", prompt_length),
            "prompt_length/clip_ratio": jnp.mean(prompt_length >= settings.max_prompt_length)}


def _named(role: str, update_metrics: dict, lr) -> dict:
    """`update.run_updates`' metrics of `role`'s update under verl's names, with its
    learning rate."""
    return {**{f"{role}/{_METRIC_NAMES.get(k, k)}": v for k, v in update_metrics.items()},
            f"{role}/lr": lr}


def learn(state: TrainState, exp: Experience, key, frozen=None, *, settings: Settings,
          model_config: ModelConfig,
          actor_opt: optax.GradientTransformation,
          critic_opt: optax.GradientTransformation | None, critic_warmup: int = 0
          ) -> tuple[TrainState, dict]:
    """One step's update from its experience; `key` is the step's key (`fold_in(seed, step)`).

    Returns the new state and the step's scalar metrics (verl's names: the update's, the
    entropy, the batch's data metrics, the rollout/training mismatch), among them
    `actor/updated` (1 once the critic warm-up is over: the actor's update metrics count
    only then). With LoRA (`frozen`, the base) only the adapters in `state.actor` are
    updated. Rollout correction (`algorithm.rollout_correction`) with a separate
    old-log-prob pass applies here, to the whole batch, before the advantages: its
    rejections leave the loss mask and its IS weights go to the update.
    """
    _, actor_key, critic_key = jax.random.split(key, 3)
    correction, response_mask = settings.actor.correction, exp.response_mask
    algorithm, is_weights = settings.algorithm, None
    if correction.enabled and not settings.actor.skips_old_pass:
        is_weights, kept = rollout_correction.correct(exp.old_log_probs, exp.rollout_log_probs,
                                                      exp.response_mask, correction)
        # Rejected tokens leave the loss, not the context of the tokens after them.
        exp = exp.replace(response_mask=kept, response_attention_mask=exp.attention_mask())
    rewards, current_kl = token_rewards(exp, state.kl.value, settings=settings)
    critic, critic_metrics = state.critic, {}
    if critic is not None and settings.critic.on_policy:  # values the batch as it learns
        critic, critic_metrics, tokens = _critic_update(
            state, {**_fields(exp), "token_level_rewards": rewards}, critic_key, frozen,
            settings=settings, model_config=model_config, critic_opt=critic_opt)
        exp = exp.replace(values=tokens["values"])
    adv, returns = estimate_advantages(exp, rewards, settings=settings)
    batch = {**_fields(exp), "advantages": adv, "returns": returns,
             "rollout_is_weights": is_weights}
    metrics = data_metrics(exp, rewards, adv, returns, settings=settings)
    if exp.entropy is not None:  # else the on-policy update reports it
        metrics["actor/entropy"] = masks.agg_loss(exp.entropy, exp.response_mask,
                                                  settings.actor.loss.loss_agg_mode)
    kl = state.kl
    if algorithm.use_kl_in_reward:
        metrics.update({"actor/reward_kl_penalty": current_kl,
                        "actor/reward_kl_penalty_coeff": kl.value})
        kl = kl_control.update_kl_controller(
            kl, current_kl, settings.train_batch_size * settings.rollout.n,
            algorithm.kl_ctrl_type, algorithm.target_kl, algorithm.horizon)
    if critic is not None and not settings.critic.on_policy:
        critic, critic_metrics, _ = _critic_update(
            state, batch, critic_key, frozen, settings=settings, model_config=model_config,
            critic_opt=critic_opt)
    metrics.update(critic_metrics)
    actor, actor_metrics, tokens = _actor_update(
        state, batch, actor_key, frozen, settings=settings, model_config=model_config,
        actor_opt=actor_opt, critic_warmup=critic_warmup)
    metrics.update(actor_metrics)
    if exp.rollout_log_probs is not None:  # the trainer's log-probs against the sampler's
        trained = exp.old_log_probs if exp.old_log_probs is not None else tokens["log_probs"]
        metrics.update(rollout_correction.metrics(trained, exp.rollout_log_probs,
                                                  response_mask, correction))
    if settings.actor.use_kl_loss:
        metrics["actor/kl_coef"] = jnp.float32(settings.actor.kl_loss_coef)
    return TrainState(step=state.step + 1, actor=actor, critic=critic, kl=kl), metrics


def _fields(exp: Experience) -> dict:
    return {f.name: getattr(exp, f.name) for f in dataclasses.fields(exp)}


def _critic_update(state: TrainState, batch: dict, key, frozen, *, settings: Settings,
                   model_config: ModelConfig, critic_opt):
    """The critic's update: (new critic, its metrics, the loss's per-token outputs: the
    values it computed when on-policy)."""
    lr = learning_rate_schedule(settings.critic.optim)(state.step)
    config = critic_model(model_config, settings)
    group = prompt_group(settings, settings.critic.update.micro_batch)
    critic_loss = lambda params, *a: update.critic_loss(
        with_frozen(params, frozen, config), *a, model_config=config, critic=settings.critic,
        gamma=settings.algorithm.gamma, lam=settings.algorithm.lam, group=group)
    names = _ON_POLICY_CRITIC_FIELDS if settings.critic.on_policy else _CRITIC_FIELDS
    critic, critic_metrics, tokens = update.run_updates(
        state.critic, {k: batch[k] for k in names if batch.get(k) is not None}, key, lr,
        loss_fn=critic_loss, optimizer=critic_opt, update=settings.critic.update,
        bucket_sizes=settings.bucket_sizes(batch["response_mask"].shape[1]), group=group)
    return critic, _named("critic", critic_metrics, lr), tokens


def _actor_update(state: TrainState, batch: dict, key, frozen, *, settings: Settings,
                  model_config: ModelConfig, actor_opt, critic_warmup: int):
    """The actor's update, from the step where verl's does (it counts steps from 1 and
    updates the actor once `critic_warmup <= step`); before it, the actor unchanged."""
    first = max(critic_warmup - 1, 0)
    lr = learning_rate_schedule(settings.actor.optim)(jnp.maximum(state.step - first, 0))
    with_base = (lambda params: params) if frozen is None else (
        lambda adapters: lora.combine(frozen, adapters))
    group = prompt_group(settings, settings.actor.update.micro_batch)
    actor_loss = lambda params, *a: update.actor_loss(
        with_base(params), *a, model_config=model_config, actor=settings.actor,
        temperature=settings.rollout.temperature, chunk_size=settings.logprob_chunk_size,
        group=group)
    names = _ACTOR_FIELDS + (("rollout_log_probs",) if settings.actor.skips_old_pass else ())
    fields = {k: batch[k] for k in names if batch.get(k) is not None}

    def run(actor):
        actor, actor_metrics, tokens = update.run_updates(
            actor, fields, key, lr, loss_fn=actor_loss, optimizer=actor_opt,
            update=settings.actor.update,
            bucket_sizes=settings.bucket_sizes(fields["responses"].shape[1]), group=group)
        actor_metrics = {**_named("actor", actor_metrics, lr), "actor/updated": jnp.float32(1)}
        return actor, actor_metrics, tokens

    if first == 0:
        return run(state.actor)
    shapes = jax.eval_shape(run, state.actor)[1:]
    skip = lambda actor: (actor, *jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes))
    return jax.lax.cond(state.step >= first, run, skip, state.actor)
