"""The RL trainer: verl's `fit()` loop in JAX, around the pure functions of `jrl.rl.step`.

One step (`RLTrainer.train_step`) follows the data path:

    prompts (host) -> step.generate -> rollout                          (one jit)
    responses -> host: decode, score in the background
    step.forward: old log-probs, reference log-probs, values            (one jit)
    scores -> devices: token-level rewards, group ids
    step.learn: KL in reward, advantages, KL controller, critic and
                actor updates, metrics                                  (one jit, state donated)
    metrics -> host (one device_get)

The state (`jrl.rl.types.TrainState`) stays on the devices from step to step; the
host holds only the step count and the data iterator's position. Randomness is
`fold_in(key(seed), step)`, split by purpose, so a resumed run repeats exactly
what an uninterrupted one would have done.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jrl import metrics
from jrl import sharding as sharding_lib
from jrl import tools as tools_lib
from jrl.algos import advantages as adv_lib
from jrl.app import interrupt
from jrl.config.settings import Settings
from jrl.data import dynamic_sampling
from jrl.data.dataset import (
    BatchIterator,
    IteratorState,
    Row,
    encode_prompts,
    ground_truth,
    prompt_text,
)
from jrl.models import CACHE_LOGICAL_AXES, lora, param_logical_axes
from jrl.models.config import ModelConfig
from jrl.optim import make_optimizer
from jrl.rewards import responses as responses_lib
from jrl.rewards import scoring
from jrl.rl import evaluate, logprobs, packing, types
from jrl.rl import step as step_lib
from jrl.rl.checkpoint import Checkpointer
from jrl.rl.update import ModelState
from jrl.rollout import multi_turn, segments
from jrl.rollout.sampler import SamplingConfig, cache_slots, check_inputs, compiler_options


class NonFiniteUpdateError(FloatingPointError):
    """Raised with `trainer.nan_policy='raise'` when a loss or gradient is not finite."""


def _step_keys(root, step):
    """The step's key, `fold_in(root, step)`, and the rollout's part of it (`learn`
    splits the same key for the updates)."""
    key = jax.random.fold_in(root, step)
    return key, jax.random.split(key, 3)[0]


def _fields(tree) -> dict:
    """A dataclass's fields by name (not copied, unlike `dataclasses.asdict`)."""
    return {f.name: getattr(tree, f.name) for f in dataclasses.fields(tree)}


class Timer:
    """Seconds of a step's phases, each until its device work is done, and of the step."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    def __call__(self, name: str, fn: Callable, *args):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        return out

    def done(self) -> dict[str, float]:
        self.seconds["step"] = time.perf_counter() - self._start
        return {f"timing_s/{k}": v for k, v in self.seconds.items()}


class Sampled(NamedTuple):
    """A step's prompts and rollout, and a function that waits for the rollout's scores."""

    rows: list[Row]
    rollout: types.Rollout
    scores: Callable[[], responses_lib.Scored]
    metrics: dict[str, float]


class _Pending(NamedTuple):
    """A rollout running on the sampling group (one-step asynchronous training)."""

    future: concurrent.futures.Future  # -> (Sampled, seconds it took)
    weights: object  # the sampling group's weights it reads
    step: int  # the RL step it is for
    version: int  # the RL step whose weights it reads (step - staleness)
    data: concurrent.futures.Future  # -> the data position before its prompts


def check_batch_sizes(s: Settings, sharder: sharding_lib.Sharder) -> None:
    """Every batch the steps split over the mesh must divide evenly (checked before the
    run claims its workdir, and again by the trainer, before compiling)."""
    check = sharder.check_batch
    check(s.train_batch_size, "data.train_batch_size (prompts)")
    if s.filter_groups is not None:
        check(s.filter_groups.gen_batch_size, "data.gen_batch_size (prompts)")
    if sharder.context > 1:  # the rollout splits its rows over `context` too
        prompts = s.train_batch_size if s.filter_groups is None else \
            s.filter_groups.gen_batch_size
        sharder.for_rollout().check_batch(
            prompts * s.rollout.n, f"the rollout's rows ({prompts} prompts x rollout.n)")
    if s.log_prob_micro_batch is not None:
        check(s.log_prob_micro_batch, "rollout.log_prob_micro_batch_size")
    for role, settings in (("actor", s.actor), ("critic", s.critic)):
        if settings is not None:
            check(settings.update.micro_batch, f"{role}.ppo_micro_batch_size")


# Metrics of `step.learn` that are not the actor's update (kept during critic warm-up).
_NOT_ACTOR_UPDATE = ("actor/entropy", "actor/reward_kl_penalty",
                     "actor/reward_kl_penalty_coeff")


def learn_metrics(m: dict, s: Settings, step: int) -> dict[str, float]:
    """`step.learn`'s metrics of step `step` (counted from 0) as floats, without the
    actor's while it waits out the critic warm-up; raises under
    `trainer.nan_policy='raise'` after a skipped update."""
    # A data statistic over an empty selection (no response tokens at all) is NaN: left out.
    m = {k: float(v) for k, v in m.items()
         if not (np.isnan(v) and k.startswith(step_lib.DATA_METRICS))}
    if not m.pop("actor/updated"):
        # Without an old-log-prob pass the mismatch is measured by the update's pass.
        from_update = ("actor/", "rollout_corr/", "training/rollout_") if \
            s.actor.skips_old_pass else ("actor/",)
        m = {k: v for k, v in m.items()
             if not k.startswith(from_update) or k in _NOT_ACTOR_UPDATE}
    for role in ("critic", "actor"):
        skipped = m.get(f"{role}/nan_skipped_updates", 0.0)
        if skipped and s.actor.update.nan_policy == "raise":
            raise NonFiniteUpdateError(
                f"step {step}: non-finite {role} loss or gradient in "
                f"{int(skipped)} update(s); parameters were left unchanged")
    return m


class RLTrainer:
    """Builds the jitted step functions for a mesh and runs the loop.

    Args:
      settings: validated static settings (`jrl.config.settings.from_config`).
      model: the architecture of actor, reference and critic.
      actor_params: initial actor parameters (also the reference's).
      tokenizer: encodes prompts, decodes responses.
      train_rows, val_rows: prompt rows in verl's schema.
      reward_fn: `fn(data_source, solution_str, ground_truth, extra_info)`, or a
        `jrl.rewards.scoring.RewardScorer` (parallel workers, error policy).
      workdir: checkpoints, metrics, plots.
      seed: root of all randomness.
      apply_chat_template: encode prompts through the tokenizer's chat template.
      data_seed: seed of the per-epoch shuffling of the training rows.
      sharder: the mesh and its rules (default: every device on the `data` axis).
      reward_model: a `jrl.rewards.reward_model.RewardModel` whose scores replace the
        rule rewards (None: rule rewards).
      rollout_sharder: the sampling group's mesh for one-step asynchronous training
        (`jrl.app.experiment.build_rollout_sharder`; None: the training devices also
        sample).
    """

    def __init__(self, settings: Settings, model: ModelConfig, actor_params, tokenizer,
                 train_rows, val_rows, reward_fn, workdir: str, seed: int,
                 apply_chat_template: bool = False, data_seed: int = 0,
                 sharder: sharding_lib.Sharder | None = None, reward_model=None,
                 rollout_sharder: sharding_lib.Sharder | None = None):
        self.s = settings
        self.sharder = sharder or sharding_lib.Sharder(sharding_lib.make_mesh())
        # The rollout on the training devices: rows split over `context` as well, tokens
        # whole (`Sharder.for_rollout`); the training sharder itself without `context`.
        self.sampling_sharder = self.sharder.for_rollout()
        self.rollout_sharder = rollout_sharder
        if rollout_sharder is not None:
            overlap = set(rollout_sharder.mesh.devices.flat) & set(self.sharder.mesh.devices.flat)
            if overlap:
                raise ValueError(f"the sampling group and the training mesh share devices "
                                 f"{sorted(d.id for d in overlap)}")
        # One thread runs the sampling group's rollouts; `_local` keeps each thread's
        # multi-turn metrics apart.
        self._local, self._pending, self._resume_weights = threading.local(), None, None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "jrl-rollout") \
            if rollout_sharder is not None else None
        check_batch_sizes(settings, self.sharder)
        self.model, self.tokenizer = model, tokenizer
        self.train_rows, self.val_rows = train_rows, val_rows
        if not isinstance(reward_fn, scoring.RewardScorer):
            reward_fn = scoring.RewardScorer(
                reward_fn, on_error=settings.reward.on_error,
                error_score=settings.reward.error_score)
        self.scorer = responses_lib.ResponseScorer(
            tokenizer, reward_fn, reward_model, settings.reward,
            settings.rollout.max_new_tokens,
            add_tool_rewards=settings.multi_turn is not None
            and settings.multi_turn.add_tool_rewards)
        self.chat, self.data_seed = apply_chat_template, data_seed
        self.tools, self.turn_template, self.prompt_tools = {}, None, None
        if settings.multi_turn is not None:
            self.tools = tools_lib.load_tools(settings.multi_turn.tool_config_path)
            self.turn_template = multi_turn.TurnTemplate(tokenizer)
            # Every prompt renders the tool schemas (`prompt_text`), as verl's agent loop.
            self.prompt_tools = list(settings.multi_turn.tool_schemas) or None
        self.root_key = jax.random.key(seed)
        self.estimator = adv_lib.get_estimator(settings.algorithm.adv_estimator)
        self._build_shardings(actor_params)
        self._build_programs()
        actor_params = jax.device_put(actor_params, self.full_shardings)
        # The reference keeps its own copy of the weights in the compute dtype (the
        # actor's become the state's, donated). With LoRA the state holds only the
        # adapters, and the base, frozen in the compute dtype, is also the reference.
        copy = lambda p: jax.tree.map(jnp.copy, step_lib.compute_params(p, self.model))
        self.frozen, self.ref_params = None, None
        if model.lora_rank:
            base, actor_params = lora.split(actor_params)
            # Never donated nor written: a base built in the compute dtype is kept as is.
            in_dtype = {x.dtype for x in jax.tree.leaves(base)} == {jnp.dtype(model.dtype)}
            self.frozen = base if in_dtype else jax.jit(
                copy, out_shardings=self.frozen_shardings)(base)
            self.ref_params = self.frozen if settings.needs_reference else None
        elif settings.needs_reference:
            self.ref_params = jax.jit(copy, out_shardings=self.actor_shardings)(actor_params)
        key = jax.random.fold_in(jax.random.key(seed), 2**31 - 1)
        self.state: types.TrainState = self._init(actor_params, key, self.frozen)
        self.step, self.data = 0, IteratorState()  # the host's part of the state
        self._saved_step = 0  # the step of the latest checkpoint (saved or restored)
        self._programs_compiled = False  # `compile_programs` has run
        self._compile_s = None  # its seconds, until the first step reports them
        self.checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"),
                                         max_to_keep=settings.trainer.max_ckpt_to_keep)

    # -- construction --------------------------------------------------------------------------

    def _build_shardings(self, actor_params) -> None:
        """Shardings of parameters, optimizer states and the train state from their
        logical axes; the rollout reads the actor's weights gathered over `fsdp`."""
        sh, s = self.sharder, self.s
        self.actor_opt = make_optimizer(s.actor.optim)
        full_shapes = jax.eval_shape(lambda p: p, actor_params)
        self.full_shardings = sh.params(param_logical_axes(self.model, "lm"), full_shapes)
        # With LoRA the state trains the adapters; the frozen base is apart.
        base_shapes, shapes = full_shapes, full_shapes
        self.frozen_shardings, self.actor_shardings = None, self.full_shardings
        if self.model.lora_rank:
            base_shapes, shapes = lora.split(full_shapes)
            self.frozen_shardings, self.actor_shardings = lora.split(self.full_shardings)
        actor = ModelState(self.actor_shardings,
                           sh.opt_state(self.actor_opt, shapes, self.actor_shardings))
        self.rollout_shardings = None
        if sh.mesh.shape["fsdp"] > 1:
            gathered = sharding_lib.Sharder(sh.mesh, sh.rules_without("fsdp"))
            self.rollout_shardings = gathered.params(param_logical_axes(self.model, "lm"),
                                                     full_shapes)
        critic, self.critic_opt = None, None
        if s.critic is not None:
            self.critic_opt = make_optimizer(s.critic.optim)
            critic_model = step_lib.critic_model(self.model, s)
            lora_model = critic_model if critic_model.lora_rank else None
            critic_shapes = jax.eval_shape(
                functools.partial(step_lib.init_critic, lora_model=lora_model), base_shapes,
                jax.random.key(0))
            axes = param_logical_axes(critic_model, "value")
            if lora_model is not None:  # the trained part: adapters and the value head
                axes = {**lora.split(axes)[1], "value_head": axes["value_head"]}
            critic_shardings = sh.params(axes, critic_shapes)
            critic = ModelState(critic_shardings,
                                sh.opt_state(self.critic_opt, critic_shapes, critic_shardings))
        self.state_shardings = types.TrainState(step=sh.replicated, actor=actor, critic=critic,
                                                kl=sh.replicated)
        self.sampler_shardings = None
        if self.rollout_sharder is not None:  # the sampling group's copy of the weights
            self._sampler_shapes = jax.eval_shape(
                lambda p: step_lib.sampling_params(p, self.model)[1], full_shapes)
            self.sampler_shardings = self.rollout_sharder.params(
                param_logical_axes(step_lib.sampling_model(self.model), "lm"),
                self._sampler_shapes)

    def _build_programs(self) -> None:
        """`step.init`, `step.forward` and `step.learn` jitted with the mesh's shardings
        (the actor's initial parameters donated to `init`, the state to `learn`);
        `step.generate` is compiled per sampling setting (`_generator`)."""
        s, b, rep, states = self.s, self.sharder.batch(), self.sharder.replicated, \
            self.state_shardings
        fns = dict(s=s, actor_opt=self.actor_opt, critic_opt=self.critic_opt)
        frozen = self.frozen_shardings
        ref = (frozen or self.actor_shardings) if s.needs_reference else None
        self._init = jax.jit(functools.partial(step_lib.init, **fns, model=self.model),
                             in_shardings=(self.actor_shardings, rep, frozen),
                             out_shardings=states, donate_argnums=0)
        self._forward = jax.jit(
            functools.partial(step_lib.forward, s=s, model=self.model),
            in_shardings=(states, ref, b, frozen), out_shardings=b)
        self._learn = jax.jit(
            functools.partial(step_lib.learn, **fns, model=self.model,
                              critic_warmup=s.trainer.critic_warmup),
            in_shardings=(states, b, rep, frozen), out_shardings=(states, rep),
            donate_argnums=0)
        self._generators: dict[tuple[SamplingConfig, bool], Callable] = {}
        self._rollout_params = jax.jit(
            functools.partial(step_lib.rollout_params, model=self.model,
                              param_shardings=self.rollout_shardings),
            in_shardings=(states, frozen))
        self._step_keys = jax.jit(_step_keys)

    def _generator(self, sampling: SamplingConfig, group: bool = False) -> Callable:
        """`step.generate` for `sampling`, compiled with the mesh's shardings and the
        sampler's compiler options (`rollout.compiler_options`); with `group`,
        `step.generate_from` on the sampling group."""
        key = (sampling, group)
        if key in self._generators:
            return self._generators[key]
        if sampling.cache_segments > 1:
            self._generators[key] = functools.partial(self._generate_segments,
                                                      sampling=sampling, group=group)
            return self._generators[key]
        if group:
            b = self.rollout_sharder.batch()
            self._generators[key] = jax.jit(
                functools.partial(step_lib.generate_from, sampling=sampling, model=self.model),
                in_shardings=(self.sampler_shardings, b, b, self.rollout_sharder.replicated),
                out_shardings=b, compiler_options=compiler_options(sampling))
        else:
            b = self.sharder.batch()
            self._generators[key] = jax.jit(
                functools.partial(step_lib.generate, sampling=sampling, model=self.model,
                                  param_shardings=self.rollout_shardings),
                in_shardings=(self.state_shardings, b, b, self.sharder.replicated,
                              self.frozen_shardings),
                out_shardings=b, compiler_options=compiler_options(sampling))
        return self._generators[key]

    def _generate_segments(self, *args, sampling: SamplingConfig, group: bool
                           ) -> types.Rollout:
        """`_generator`'s rollout with `rollout.cache_segments > 1`: the sampler's weights
        from one program, then the segments' programs (`jrl.rollout.segments`), the host
        between them."""
        if group:
            weights, prompt_ids, prompt_mask, key = args
        else:
            state, prompt_ids, prompt_mask, key, frozen = args
            weights = self._rollout_params(state, frozen)
        out = segments.generate(weights, prompt_ids, prompt_mask, key, sampling,
                                        config=step_lib.sampling_model(self.model))
        sharder = self.rollout_sharder if group else self.sharder
        return jax.tree.map(lambda x: jax.device_put(x, sharder.batch(x.ndim)),
                            step_lib.rollout_of(out, sampling))

    @property
    def batch_sequences(self) -> int:
        return self.s.train_batch_size * self.s.rollout.n

    @functools.cached_property
    def prompt_groups(self) -> dict[str, int]:
        """Rows that share a prompt's forward in each of the step's passes
        (`step.prompt_groups`; all 1 with `actor.share_prompts` off)."""
        with self.sharder.active():
            return step_lib.prompt_groups(self.s, self.batch_sequences)

    @property
    def shared_prompt_group(self) -> int:
        """The most rows that share a prompt's forward in any of the step's passes."""
        return max(self.prompt_groups.values())

    def prompt_sharing_report(self) -> str:
        """One line: how many rows share a prompt's forward in each pass, and why none do
        when sharing is on but no micro-batch allows it."""
        s = self.s
        if not s.share_prompts:
            return "shared prompts: off (actor.share_prompts=False)"
        line = "shared prompts, rows per prompt forward: " + ", ".join(
            f"{name} {k}" for name, k in self.prompt_groups.items())
        if self.shared_prompt_group == 1 and self.sharder.context > 1:
            line += (f" (none: mesh.context={self.sharder.context} splits the plain layout "
                     "only)")
        elif self.shared_prompt_group == 1:
            line += (f" (none: in every pass the rows a micro-batch puts on each of the "
                     f"{self.sharder.batch_size_multiple} batch shards have no factor above 1 "
                     f"in common with rollout.n={s.rollout.n})")
        return line

    def packing_report(self) -> str | None:
        """One line: the packed rows each batch shard runs per micro-batch in every pass
        with token-budget micro-batches (None: no pass packs; `mesh.context` splits each
        row over its devices). A budget of one row runs one full-length sequence a
        micro-batch."""
        s, sh = self.s, self.sharder
        names = {"rollout": "log-prob/value passes", "actor": "actor update",
                 "critic": "critic update"}
        forward_runs = bool(step_lib.forward_passes(s, self.ref_params is not None))
        passes = [(names[key.split(".")[0]], key, budget, n)
                  for key, budget, n in s.token_budgets()
                  if forward_runs or not key.startswith("rollout.")]
        if not passes:
            return None
        length = packing.row_length(s.max_sequence_length, sh.context)
        shards = sh.batch_size_multiple
        rows = {name: packing.rows_per_device(budget, length, n, shards)
                for name, _, budget, n in passes}
        line = f"token-budget micro-batches, rows of {length} slots: " + ", ".join(
            f"{name} {rows[name]} ({key}={budget})" for name, key, budget, _ in passes)
        single = [key for name, key, _, n in passes if rows[name] == 1 and n > shards]
        if single:
            line += (f"; one row a micro-batch runs one full-length sequence: "
                     f"{2 * length} tokens or more in "
                     f"{', '.join(single)} give two (docs/guide.md, 'Long responses')")
        return line

    @functools.cached_property
    def _prompt_mismatch(self):
        return jax.jit(logprobs.prompt_mismatch, static_argnums=2)

    def _check_shared_prompts(self, rollout: types.Rollout) -> None:
        """Stops before any pass runs when the rows that share a prompt's forward do not
        hold the same prompt (ids and mask)."""
        group = self.shared_prompt_group
        if group == 1:
            return
        mismatched = int(sharding_lib.host_array(self._prompt_mismatch(
            rollout.prompt_ids, rollout.prompt_mask, group)))
        if mismatched:
            raise ValueError(
                f"step {self.step}: {mismatched} rows of the batch do not hold the prompt of "
                f"the first row of their group of {group} rows, which actor.share_prompts "
                "needs (the log-prob, value and update passes read each group's prompt from "
                "its first row); lay the rollout.n samples of a prompt out as consecutive "
                "rows with the same prompt ids and mask, or set actor.share_prompts=False")

    def close(self) -> None:
        """Waits for a rollout in flight, stops reward workers and closes the checkpointer."""
        if self._executor is not None:
            self._pending = None
            self._executor.shutdown(wait=True)
        self.scorer.close()
        self.checkpointer.close()

    def memory_report(self) -> str:
        """Per-device bytes of parameters, optimizer states and the rollout's KV cache."""
        sh, s, m, states = self.sharder, self.s, self.model, self.state_shardings
        parts = [("actor params", self.state.actor.params, states.actor.params),
                 ("actor optimizer", self.state.actor.opt_state, states.actor.opt_state)]
        if self.frozen is not None:
            parts.append(("frozen base (LoRA; the reference)", self.frozen,
                          self.frozen_shardings))
            if m.lora_rollout == "merged":
                kernels = lambda tree: {g: {n: tree["layers"][g][n] for n in tree["layers"][g]
                                            if n in m.lora_targets}
                                        for g in ("attn", "mlp")}
                parts.append(("merged kernels (during rollouts)", kernels(self.frozen),
                              kernels(self.frozen_shardings)))
        elif self.ref_params is not None:
            parts.append(("reference params", self.ref_params, self.actor_shardings))
        if self.state.critic is not None:
            parts += [("critic params", self.state.critic.params, states.critic.params),
                      ("critic optimizer", self.state.critic.opt_state,
                       states.critic.opt_state)]
        prompts = s.train_batch_size if s.filter_groups is None else s.filter_groups.gen_batch_size
        rows = prompts * s.rollout.n
        # A multi-turn rollout's cache also holds one tool block (`jrl.rollout.multi_turn`).
        block = 0 if s.multi_turn is None else s.multi_turn.config.max_tool_response_tokens + 1
        slots = cache_slots(m, s.max_sequence_length + block)
        name = f"KV cache, {rows} rows x {slots} slots"
        if s.rollout.cache_segments > 1:  # the first segment's; later ones follow the tokens
            first = segments.segment_slots(m, s.max_prompt_length, s.rollout)[0]
            name = (f"KV cache, {rows} rows x {first} slots (segment 1 of "
                    f"{s.rollout.cache_segments}; then the rows still running, at most "
                    f"{rows} x {slots})")
            slots = first
        shape = (rows, m.num_kv_heads, slots, m.head_dim)
        cache = [jax.ShapeDtypeStruct(shape, jnp.dtype(m.dtype))] * (2 * m.num_layers)
        cache_shardings = [self.sampling_sharder.named(CACHE_LOGICAL_AXES, shape)] * (
            2 * m.num_layers)
        parts.append((name, cache, cache_shardings))
        if self.sampler_shardings is not None:  # per device of the sampling group
            parts.append(("sampling group: weights (x2)", self._sampler_shapes,
                          self.sampler_shardings))
            rollout_cache = [self.rollout_sharder.named(CACHE_LOGICAL_AXES, shape)] * len(cache)
            parts.append(("sampling group: KV cache", cache, rollout_cache))
        lines = [f"mesh {dict(sh.mesh.shape)} over {sh.mesh.devices.size} devices; per device:"]
        for name, tree, shardings in parts:
            nbytes = sh.bytes_per_device(tree, shardings)
            lines.append(f"  {name:<34} {sharding_lib.format_bytes(nbytes)}")
        return "\n".join(lines)

    # -- checkpoints ---------------------------------------------------------------------------

    def maybe_restore(self, resume_from: str | None = None) -> bool:
        """Continues from a checkpoint: `resume_from` (a `<dir>/<step>` checkpoint directory,
        possibly of another run) or else the workdir's latest complete one, if any."""
        checkpointer, step = self.checkpointer, self.checkpointer.latest_step()
        if resume_from is not None:
            checkpointer = Checkpointer(os.path.dirname(resume_from))
            step = int(os.path.basename(resume_from))
        if step is None:
            return False
        try:
            self.state, self.step, self.data = checkpointer.restore_train_state(
                step, self.state, self.sharder.replicated)
            self._saved_step = self.step
            if self.rollout_sharder is not None and checkpointer.has_item(
                    step, "rollout_weights"):
                like = jax.tree.map(
                    lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                             sharding=sharding),
                    self._sampler_shapes, self.sampler_shardings)
                self._resume_weights = checkpointer.restore_item(step, "rollout_weights", like)
        finally:
            if checkpointer is not self.checkpointer:
                checkpointer.close()
        if jax.process_index() == 0:
            source = f" ({resume_from})" if resume_from else ""
            print(f"resumed from step {self.step} (of {self.s.total_steps}){source}",
                  flush=True)
        return True

    def save(self) -> None:
        """Checkpoints the run; with a rollout in flight (one-step asynchronous), also the
        sampling weights it reads, so that a resumed run samples it again exactly."""
        extra = {} if self._pending is None else {"rollout_weights": self._pending.weights}
        self.checkpointer.save_train_state(self.step, self.state, self.data, **extra)
        self._saved_step = self.step

    def _stop_if_asked(self) -> None:
        """Between steps: after Ctrl-C / SIGTERM (`jrl.app.interrupt`), checkpoints the last
        step (unless saved already) and raises `interrupt.Stopped`."""
        if interrupt.requested() is None:
            return
        if self.step > 0 and self.step != self._saved_step:
            self.save()
        interrupt.check(self.step)

    # -- one step ------------------------------------------------------------------------------

    def compile_programs(self, val_batch_size: int | None = None) -> list[str]:
        """Compiles the first step's programs before it runs (`trainer.parallel_compile`):
        the rollout, `step.forward` and `step.learn` (ReMax's greedy rollout too), and with
        `val_batch_size` the validation's rollout for batches of that many prompts.

        Each is traced on the shapes the step will give it (one after another: tracing
        and lowering are Python's), then lowered, the update first (the slowest to
        compile), and handed to a thread that compiles it while the next lowers (XLA
        compiles outside the GIL). The compiles slow each other down, but the first step
        waits for less than their sum. The step's own calls then find the programs in
        jit's cache (small ones, such as a reward model's, still compile in the step).
        Returns the names of the programs compiled; none (and nothing done) after the
        first call, with the setting off, or for a step of another shape: one-step
        asynchronous, multi-turn or a segmented cache, whose programs compile when first
        called. The first step's metrics carry the seconds this took as
        `timing_s/compile`."""
        s, fg = self.s, self.s.filter_groups
        enabled = s.trainer.parallel_compile
        if enabled is None:  # a CPU's compiles share its cores: one at a time is as fast
            enabled = jax.default_backend() != "cpu"
        if (self._programs_compiled or not enabled or self.rollout_sharder is not None
                or s.multi_turn is not None or s.rollout.cache_segments > 1):
            return []
        self._programs_compiled, start = True, time.perf_counter()
        state, b = self.state, self.sharder.batch
        struct = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=b(len(shape)))
        traced = {}
        with self.sharder.active():
            key, gen_key = self._step_keys(self.root_key, state.step)

            # The key as each caller passes it: the step's from a program, the validation's
            # made eagerly. jit tells the two apart, so with the same sampling and rows
            # (ReMax's greedy rollout and a greedy validation) they are two programs.
            def rollout(name, sampling, rows, key=gen_key):
                ids = struct((rows, s.max_prompt_length), jnp.int32)
                with self.sampling_sharder.active():  # as `_generate` traces it
                    traced[name] = self._generator(sampling).trace(state, ids, ids, key,
                                                                   self.frozen)
                return traced[name].out_info

            out = rollout("generate", s.rollout,
                          s.train_batch_size if fg is None else fg.gen_batch_size)
            if fg is not None:  # the batch DAPO's rounds fill on the host (`_sample`)
                out = jax.tree.map(lambda x: struct((self.batch_sequences, *x.shape[1:]),
                                                    x.dtype), out)
            traced["forward"] = self._forward.trace(state, self.ref_params, out, self.frozen)
            n, r = out.responses.shape
            host = dict(token_level_scores=struct((n, r), jnp.float32),
                        uid=struct((n,), jnp.int32))
            if self.estimator.needs_baseline:  # over the step's prompts (`_rewards`)
                rollout("generate_greedy", dataclasses.replace(s.rollout, n=1, do_sample=False),
                        s.train_batch_size)
                host["reward_baselines"] = struct((n,), jnp.float32)
            exp = traced["forward"].out_info.replace(**host)
            traced["learn"] = self._learn.trace(state, exp, key, self.frozen)
            if val_batch_size and self.val_rows:
                multiple = self.sampling_sharder.batch_size_multiple
                rows = -(-min(val_batch_size, len(self.val_rows)) // multiple) * multiple
                rollout("validate", s.validation, rows, self._validation_key(0))
            order = sorted(traced, key=lambda name: name != "learn")
            with concurrent.futures.ThreadPoolExecutor(len(order), "jrl-compile") as pool:
                compiles = [pool.submit(traced[name].lower().compile) for name in order]
                for done in compiles:
                    done.result()  # a compile's error, raised here
        self._compile_s = time.perf_counter() - start
        return order

    def train_step(self, iterator: BatchIterator) -> dict[str, float]:
        """One RL step (the module docstring's data path); returns its metrics."""
        if self.rollout_sharder is not None:
            return self._train_step_async(iterator)
        self.compile_programs()
        timer, state = Timer(), self.state
        with self.sharder.active():
            key, gen_key = self._step_keys(self.root_key, state.step)
            sampled = timer("gen", self._sample, state, iterator, gen_key)
            self._check_shared_prompts(sampled.rollout)
            exp = timer("forward", self._forward, state, self.ref_params, sampled.rollout,
                        self.frozen)
            exp, step_metrics = timer("reward", self._rewards, state, sampled, exp, gen_key)
            state, learned = timer("learn", self._learn, state, exp, key, self.frozen)
            step_metrics.update(self._learn_metrics(jax.device_get(learned)))
        self.state, self.step, self.data = state, self.step + 1, iterator.state
        timing = timer.done()
        if self._compile_s is not None:  # `compile_programs`' seconds, before this step
            timing["timing_s/compile"], self._compile_s = self._compile_s, None
        return {**step_metrics, **timing, **self._perf_metrics(step_metrics, timer.seconds)}

    def _train_step_async(self, iterator: BatchIterator) -> dict[str, float]:
        """One step of one-step asynchronous training: this step's rollout was sampled on
        the sampling group from the previous step's weights (`rollout.staleness=1`; the
        first step's from its own), and the next step's starts there, from this step's
        weights, before this step learns; the training group then learns as `train_step`
        does, the two groups working at once."""
        timer, state, s = Timer(), self.state, self.s
        if self._pending is None:  # the first step, after a resume, or staleness 0
            resumed, self._resume_weights = self._resume_weights, None

            def first():  # a resumed run samples from the saved sampling weights
                if resumed is not None:
                    return self._submit(resumed, iterator, self.step, self.step - 1)
                return self._submit(self._sampler_weights(state), iterator, self.step,
                                    self.step)

            self._pending = timer("sync_rollout_weights", first)
        pending = self._pending
        self._pending = None
        if s.staleness == 1 and self.step + 1 < s.total_steps:
            # Until the new weights are on the sampling group, which can wait behind the
            # rollout still running there.
            self._pending = timer("sync_rollout_weights", lambda: self._submit(
                self._sampler_weights(state), iterator, self.step + 1, self.step))
        with self.sharder.active():
            key, gen_key = self._step_keys(self.root_key, state.step)
            received = []

            def receive():  # the rollout, on the training devices (the timer waits on
                received.extend(pending.future.result())  # its arrays, not on the rows)
                return jax.tree.map(lambda x: jax.device_put(x, self.sharder.batch(x.ndim)),
                                    received[0].rollout)

            rollout = timer("wait_rollout", receive)
            sampled, gen_seconds = received
            self._check_shared_prompts(rollout)
            exp = timer("forward", self._forward, state, self.ref_params, rollout, self.frozen)
            exp, step_metrics = timer("reward", self._rewards, state, sampled, exp, gen_key)
            state, learned = timer("learn", self._learn, state, exp, key, self.frozen)
            step_metrics.update(self._learn_metrics(jax.device_get(learned)))
        self.state, self.step = state, self.step + 1
        # A checkpoint's data position is before the pending rollout's prompts: a resumed
        # run draws them again and samples them from the saved sampling weights.
        self.data = iterator.state if self._pending is None else self._pending.data.result()
        timing = timer.done()
        step_metrics.update({"timing_s/gen": gen_seconds,
                             "async/staleness": float(pending.step - pending.version)})
        return {**step_metrics, **timing, **self._perf_metrics(step_metrics, timer.seconds)}

    def _sampler_weights(self, state):
        """The actor's weights as the sampler reads them, moved to the sampling group
        (device to device)."""
        return jax.device_put(self._rollout_params(state, self.frozen), self.sampler_shardings)

    def _submit(self, weights, iterator: BatchIterator, step: int, version: int) -> _Pending:
        """Starts step `step`'s rollout on the sampling group, from `weights` (those of
        step `version`), in the rollout thread; its prompts are drawn there, in order."""
        data = concurrent.futures.Future()

        def job():
            data.set_result(iterator.state)
            key = _step_keys(self.root_key, step)[1]
            start = time.perf_counter()
            with self.rollout_sharder.active():
                sampled = self._sample(None, iterator, key, weights)
                jax.block_until_ready(sampled.rollout)
            return sampled, time.perf_counter() - start

        return _Pending(self._executor.submit(job), weights, step, version, data)

    def _generate(self, state, rows, sampling: SamplingConfig, key,
                  weights=None) -> types.Rollout:
        """Encodes the prompts on the host, splits them over the mesh's batch axes and
        samples from `state`'s actor; the rollout stays on the devices. With `weights`
        (the sampling group's copy, `_sampler_weights`) the sampling group samples, and
        the rollout is on its devices."""
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, rows, self.s.max_prompt_length,
                                                 self.chat, self.prompt_tools)
        check_inputs(prompt_ids, prompt_mask, sampling, self.model)
        if self.s.multi_turn is not None:
            return self._generate_turns(state, rows, prompt_ids, prompt_mask, sampling, key,
                                        weights)
        if weights is not None:
            prompt_ids, prompt_mask = self.rollout_sharder.put_batch((prompt_ids, prompt_mask))
            key = jax.device_put(key, self.rollout_sharder.replicated)
            return self._generator(sampling, group=True)(weights, prompt_ids, prompt_mask, key)
        prompt_ids, prompt_mask = self.sharder.put_batch((prompt_ids, prompt_mask))
        with self.sampling_sharder.active():  # traced with the rollout's layout
            return self._generator(sampling)(state, prompt_ids, prompt_mask, key, self.frozen)

    def _generate_turns(self, state, rows, prompt_ids, prompt_mask, sampling, key, weights):
        """A multi-turn rollout with tools (`jrl.rollout.multi_turn`): the device decodes, the
        host runs the tools between turns. Its metrics go to `_local.metrics`, the tools'
        rewards to `_local.reward_scores` (for `_score`)."""
        sharder = self.sharder if weights is None else self.rollout_sharder
        if weights is None:
            weights = self._rollout_params(state, self.frozen)
        else:
            key = jax.device_put(key, sharder.replicated)
        layout = self.sampling_sharder if sharder is self.sharder else sharder
        with layout.active():
            out = self._turns(weights, rows, prompt_ids, prompt_mask, key, sampling, sharder)
        self._local.metrics, self._local.reward_scores = out.metrics, out.reward_scores
        return types.Rollout(**sharder.put_batch(dict(
            prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, responses=out.responses,
            response_mask=out.response_mask, response_attention_mask=out.attention_mask,
            rollout_log_probs=out.rollout_log_probs if sampling.do_sample else None)))

    def _turns(self, weights, rows, prompt_ids, prompt_mask, key, sampling, sharder):
        """`multi_turn.generate` of the prompts, the inputs placed by `sharder`."""
        return multi_turn.generate(
            weights, prompt_ids, prompt_mask, key,
            sampling=sampling, config=step_lib.sampling_model(self.model),
            tokenizer=self.tokenizer, tools=self.tools, mt=self.s.multi_turn.config,
            tools_kwargs=[(row.get("extra_info") or {}).get("tools_kwargs") for row in rows],
            put=sharder.put_batch, template=self.turn_template)

    def _score(self, rows, out: types.Rollout, n: int):
        """Starts scoring the rollout `_generate` just made on this thread
        (`ResponseScorer.submit`), with a multi-turn rollout's tool rewards."""
        reward_scores = self._local.__dict__.pop("reward_scores", None)
        return self.scorer.submit(rows, out.responses, out.attention_mask(), n, reward_scores)

    def _sample(self, state, iterator: BatchIterator, key, weights=None) -> Sampled:
        """The step's rollout, its scoring started; with `algorithm.filter_groups`, DAPO's
        rounds of `data.gen_batch_size` prompts until `train_batch_size` groups vary.
        `weights`: sample on the sampling group (`_generate`)."""
        n, fg = self.s.rollout.n, self.s.filter_groups
        self._local.metrics = {}
        if fg is None:
            rows = iterator.next_batch()
            out = self._generate(state, rows, self.s.rollout, key, weights)
            return Sampled(rows, out, self._score(rows, out, n), dict(self._local.metrics))
        errors = []

        def sample(rows, round_):
            out = self._generate(state, rows, self.s.rollout, jax.random.fold_in(key, round_),
                                 weights)
            scores, extras, num_errors, texts = self._score(rows, out, n)()
            errors.append(num_errors)
            arrays = {k: sharding_lib.host_array(v)[:len(rows) * n]
                      for k, v in _fields(out).items() if v is not None}
            arrays.update(score=scores, text=np.asarray(texts, dtype=object),
                          **{f"extra/{k}": v for k, v in extras.items()})
            return arrays, responses_lib.filter_metric(fg.metric, scores, extras)

        filled = dynamic_sampling.fill_batch(
            iterator.next_batch, sample, target_groups=self.s.train_batch_size, n=n,
            max_num_gen_batches=fg.max_num_gen_batches)
        a = filled.arrays
        out = types.Rollout(**self.sharder.put_batch(
            {f.name: a.get(f.name) for f in dataclasses.fields(types.Rollout)}))
        extras = {k.removeprefix("extra/"): v for k, v in a.items() if k.startswith("extra/")}
        return Sampled(filled.rows, out, lambda: (a["score"], extras, sum(errors), list(a["text"])),
                       {**self._local.metrics,  # multi-turn: the last round's
                        "train/num_gen_batches": float(filled.num_gen_batches),
                        "train/num_filtered_groups": float(filled.num_filtered_groups)})

    def _rewards(self, state, sampled: Sampled, exp: types.Experience, gen_key):
        """Waits for the scores; returns the experience with token-level scores, group ids
        (and ReMax's greedy baselines), and the step's host metrics."""
        s, n, rows = self.s, self.s.rollout.n, sampled.rows
        scores, extras, num_errors, texts = sampled.scores()
        self._write_samples(s.trainer.rollout_data_dir, self.step + 1,
                            [(rows, (scores, extras, num_errors, texts))], n)
        host = {"token_level_scores": responses_lib.place_scores(
            scores, sharding_lib.host_array(exp.response_mask)),
            "uid": np.repeat(np.arange(len(rows)), n).astype(np.int32)}
        if self.estimator.needs_baseline:
            greedy = dataclasses.replace(s.rollout, n=1, do_sample=False)
            base = self._generate(state, rows, greedy, gen_key)
            base_scores = self._score(rows, base, 1)()[0]
            host["reward_baselines"] = np.repeat(base_scores, n)
        out = {**sampled.metrics,
               **{f"reward_extra/{k}/mean": float(np.mean(v)) for k, v in extras.items()}}
        if s.reward.on_error == "score":
            out["reward/num_errors"] = float(num_errors)
        return exp.replace(**self.sharder.put_batch(host)), out

    def _learn_metrics(self, m: dict) -> dict[str, float]:
        return learn_metrics(m, self.s, self.step)

    def _perf_metrics(self, m: dict, seconds: dict[str, float]) -> dict[str, float]:
        tokens = (m["prompt_length/mean"] + m["response_length/mean"]) * self.batch_sequences
        devices = jax.device_count()
        out = {"perf/total_num_tokens": tokens, "perf/time_per_step": seconds["step"],
               "perf/throughput": tokens / seconds["step"] / devices}
        peak = metrics.peak_flops(jax.devices()[0].device_kind)
        if peak:
            # The critic's update (PPO) shares `learn` with the actor's: a lower bound then.
            flops = self.train_flops_per_token * tokens * self.s.actor.update.ppo_epochs
            out["perf/mfu/actor"] = flops / seconds["learn"] / (peak * devices)
        return out

    def actor_params(self):
        """The actor's parameters on the devices (with LoRA: the base and the adapters)."""
        return step_lib.actor_params(self.state, self.frozen)

    @functools.cached_property
    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves((self.state.actor.params, self.frozen)))

    @functools.cached_property
    def train_flops_per_token(self) -> float:
        """Model FLOPs of one token's forward and backward pass in the actor's update:
        2 per weight forward and 2 backward (the input's gradient), plus 2 for the
        gradient of each weight that trains (6N in full; 4N + 2 x adapters with LoRA,
        whose frozen base needs no weight gradient)."""
        trained = sum(x.size for x in jax.tree.leaves(self.state.actor.params))
        return 4.0 * self.num_params + 2.0 * trained

    # -- validation and the loop ---------------------------------------------------------------

    def validate(self, batch_size: int) -> dict[str, float]:
        """Scores the validation set with `rollout.val_kwargs` sampling (`jrl.rl.evaluate`).

        Multi-turn rollouts add their metrics as training logs them, under `val-aux/`
        (`val-aux/num_turns/mean`, `val-aux/multi_turn/tool_calls/mean`, ...; over the
        generated rows, the last batch's padding copies included). With
        `trainer.validation_data_dir` the samples go to `<dir>/<step>.jsonl`.
        """
        sampling, state = self.s.validation, self.state
        turns, samples = [], []

        def respond(rows, padded, start):
            self._local.metrics = {}
            out = self._generate(state, padded, sampling, self._validation_key(start))
            turns.append(dict(self._local.metrics))
            scored = self._score(rows, out, sampling.n)()
            if self.s.trainer.validation_data_dir is not None:
                samples.append((rows, scored))
            return scored

        with self.sharder.active():
            result = evaluate.evaluate(self.val_rows, respond, batch_size=batch_size,
                                       n=sampling.n,
                                       batch_multiple=self.sampling_sharder.batch_size_multiple)
        result.update({f"val-aux/{k}": v for k, v in multi_turn.combine_metrics(turns).items()})
        self._write_samples(self.s.trainer.validation_data_dir, self.step, samples, sampling.n)
        return result

    def _validation_key(self, start: int):
        """The key of the validation batch from row `start` at this step."""
        key = jax.random.fold_in(jax.random.fold_in(self.root_key, 2**31 - 2), self.step)
        return jax.random.fold_in(key, start)

    def _write_samples(self, directory: str | None, step: int, batches, n: int) -> None:
        """`<directory>/<step>.jsonl` (`metrics.write_samples`) of scored batches
        `[(rows, Scored)]`, `n` responses per row; nothing without a directory."""
        if directory is None or jax.process_index() != 0 or not batches:
            return
        columns: dict[str, list] = {}
        for rows, (scores, extras, _, texts) in batches:
            prompts = [prompt_text(self.tokenizer, row, self.chat, self.prompt_tools)
                       for row in rows]
            for i, text in enumerate(texts):
                sample = {"input": prompts[i // n], "output": text,
                          "gts": ground_truth(rows[i // n]), "score": float(scores[i]),
                          "step": step, **{k: np.asarray(v)[i].item() for k, v in extras.items()}}
                for name, value in sample.items():
                    columns.setdefault(name, []).append(value)
        metrics.write_samples(directory, step, columns)

    def fit(self, val_batch_size: int, writer: metrics.MetricsWriter | None = None,
            exit_after_steps: int | None = None) -> dict[str, float]:
        """Runs until `total_steps` (or `exit_after_steps` more); returns the last
        validation metrics."""
        s, t = self.s, self.s.trainer
        prompts = s.train_batch_size if s.filter_groups is None else s.filter_groups.gen_batch_size
        iterator = BatchIterator(self.train_rows, prompts, self.data_seed, shuffle=True,
                                 state=self.data)
        due = lambda every: every and (self.step % every == 0 or self.step == s.total_steps)
        last_val = {}
        validate_first = t.val_before_train and self.step == 0 and bool(self.val_rows)
        if self.step < s.total_steps and exit_after_steps != 0:
            self.compile_programs(val_batch_size if validate_first else None)
        if validate_first:
            last_val = self.validate(val_batch_size)
            if writer:
                writer.write(0, last_val)
        for _ in itertools.islice(itertools.count(), exit_after_steps):
            if self.step >= s.total_steps:
                break
            self._stop_if_asked()
            step_metrics = self.train_step(iterator)
            if self.val_rows and due(t.test_freq):
                last_val = self.validate(val_batch_size)
                step_metrics.update(last_val)
            if writer:
                writer.write(self.step, step_metrics)
            if due(t.save_freq):
                self.save()
        return last_val
