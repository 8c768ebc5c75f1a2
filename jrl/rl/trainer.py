"""The RL trainer: verl's `fit()` loop in JAX, around the pure functions of `jrl.rl.step`.

One step (`RLTrainer.train_step`, in `step.run_step`'s order) follows the data path:

    prompts (host) -> step.generate -> rollout                          (one jit)
    responses -> host: decode, score in the background
    step.forward: old log-probs, reference log-probs, values            (one jit)
    scores -> devices: token-level rewards, group ids
    step.learn: KL in reward, advantages, KL controller, critic and
                actor updates, metrics                                  (one jit, state donated)
    metrics -> host (one device_get)

The trainer is the loop with its checkpoints, validation and metrics; the programs it
runs are `jrl.rl.programs`'s (jitted for the mesh, compiled ahead), its batches of
experience `jrl.rl.experience`'s (sampled when the step asks, or one step ahead on a
sampling group of devices). The state (`jrl.rl.types.TrainState`) stays on the devices
from step to step; the host holds only the step count and the data iterator's
position. Randomness is `fold_in(key(seed), step)`, split by purpose, so a resumed run
repeats exactly what an uninterrupted one would have done.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jrl import metrics
from jrl import sharding as sharding_lib
from jrl.algos import advantages as adv_lib
from jrl.app import interrupt, rundir
from jrl.config import batches
from jrl.config.settings import Settings
from jrl.data.dataset import BatchIterator, IteratorState
from jrl.models import lora, moe
from jrl.models.config import ModelConfig
from jrl.rl import evaluate, experience, partial, types
from jrl.rl import programs as programs_lib
from jrl.rl import step as step_lib
from jrl.rl.checkpoint import Checkpointer
from jrl.rollout import multi_turn


class NonFiniteUpdateError(FloatingPointError):
    """Raised with `trainer.nan_policy='raise'` when a loss or gradient is not finite."""


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


# Metrics of `step.learn` that are not the actor's update (kept during critic warm-up).
_NOT_ACTOR_UPDATE = ("actor/entropy", "actor/reward_kl_penalty",
                     "actor/reward_kl_penalty_coeff")


def learn_metrics(learned: dict, settings: Settings, step: int) -> dict[str, float]:
    """`step.learn`'s metrics of step `step` (counted from 0) as floats, without the
    actor's while it waits out the critic warm-up; raises under
    `trainer.nan_policy='raise'` after a skipped update."""
    # A data statistic over an empty selection (no response tokens at all) is NaN: left out.
    out = {k: float(v) for k, v in learned.items()
           if not (np.isnan(v) and k.startswith(step_lib.DATA_METRICS))}
    if not out.pop("actor/updated"):
        # Without an old-log-prob pass the mismatch is measured by the update's pass.
        from_update = ("actor/", "rollout_corr/", "training/rollout_") if \
            settings.actor.skips_old_pass else ("actor/",)
        out = {k: v for k, v in out.items()
               if not k.startswith(from_update) or k in _NOT_ACTOR_UPDATE}
    for role in ("critic", "actor"):
        skipped = out.get(f"{role}/nan_skipped_updates", 0.0)
        if skipped and settings.actor.update.nan_policy == "raise":
            raise NonFiniteUpdateError(
                f"step {step}: non-finite {role} loss or gradient in "
                f"{int(skipped)} update(s); parameters were left unchanged")
    return out


def _check_apart(sharder: sharding_lib.Sharder, rollout_sharder: sharding_lib.Sharder | None):
    """The sampling group (one-step asynchronous training) has devices of its own."""
    if rollout_sharder is None:
        return
    overlap = set(rollout_sharder.mesh.devices.flat) & set(sharder.mesh.devices.flat)
    if overlap:
        raise ValueError(f"the sampling group and the training mesh share devices "
                         f"{sorted(d.id for d in overlap)}")


class RLTrainer:
    """Runs the RL loop over the step's programs (`jrl.rl.programs`) and a source of
    experience (`jrl.rl.experience`), with validation and checkpoints.

    Args:
      settings: validated static settings (`jrl.config.settings.from_config`).
      model_config: the architecture of actor, reference and critic.
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

    def __init__(self, settings: Settings, model_config: ModelConfig, actor_params, tokenizer,
                 train_rows, val_rows, reward_fn, workdir: str, seed: int,
                 apply_chat_template: bool = False, data_seed: int = 0,
                 sharder: sharding_lib.Sharder | None = None, reward_model=None,
                 rollout_sharder: sharding_lib.Sharder | None = None):
        self.settings = settings
        self.sharder = sharder or sharding_lib.Sharder(sharding_lib.make_mesh())
        _check_apart(self.sharder, rollout_sharder)
        # Against the mesh before anything compiles (`jrl.train` has checked them against
        # the rows too, before the warm start; `fit` needs a batch of rows).
        batches.check(batches.from_settings(settings, warm_start=False), None, self.sharder)
        self.model_config, self.tokenizer = model_config, tokenizer
        self.train_rows, self.val_rows = train_rows, val_rows
        scorer = experience.response_scorer(settings, tokenizer, reward_fn, reward_model)
        turns = experience.multi_turn_tools(settings, tokenizer)
        self.data_seed, self.root_key = data_seed, jax.random.key(seed)
        estimator = adv_lib.get_estimator(settings.algorithm.adv_estimator)
        self.programs = programs_lib.Programs(settings, model_config, actor_params,
                                              self.sharder, rollout_sharder)
        self.state, self.frozen, self.ref_params = self._place_models(actor_params, seed)
        self.rollouts = experience.Rollouts(
            settings, model_config, tokenizer, scorer, self.programs, self.frozen,
            chat=apply_chat_template, turns=turns, needs_baseline=estimator.needs_baseline)
        self.experience: experience.ExperienceSource = (
            experience.AsyncExperience(self.rollouts, self.root_key)
            if rollout_sharder is not None else
            partial.PartialExperience(self.rollouts) if settings.partial_tokens else
            experience.SyncExperience(self.rollouts))
        self.step, self.data = 0, IteratorState()  # the host's part of the state
        self._saved_step = 0  # the step of the latest checkpoint (saved or restored)
        self._resumed_from: str | None = None  # the resume_path checkpoint started from
        self._programs_compiled = False  # `compile_programs` has run
        self._compile_s = None  # its seconds, until the first step reports them
        self.checkpointer = Checkpointer(rundir.checkpoints_dir(workdir),
                                         max_to_keep=settings.trainer.max_ckpt_to_keep)

    def _place_models(self, actor_params, seed: int):
        """(initial state, LoRA base, reference) on the devices. The reference keeps its
        own copy of the weights in the compute dtype (the actor's become the state's,
        donated). With LoRA the state holds only the adapters, and the base, frozen in
        the compute dtype, is also the reference."""
        programs, model_config = self.programs, self.model_config
        actor_params = jax.device_put(actor_params, programs.full_shardings)
        copy = lambda p: jax.tree.map(jnp.copy, step_lib.compute_params(p, model_config))
        frozen, ref_params = None, None
        if model_config.lora_rank:
            base, actor_params = lora.split(actor_params)
            # Never donated nor written: a base built in the compute dtype is kept as is.
            dtypes = {x.dtype for x in jax.tree.leaves(base)}
            frozen = base if dtypes == {jnp.dtype(model_config.dtype)} else jax.jit(
                copy, out_shardings=programs.frozen_shardings)(base)
            ref_params = frozen if self.settings.needs_reference else None
        elif self.settings.needs_reference:
            ref_params = jax.jit(copy, out_shardings=programs.actor_shardings)(actor_params)
        key = jax.random.fold_in(jax.random.key(seed), 2**31 - 1)
        return programs.init(actor_params, key, frozen), frozen, ref_params

    # -- what the run holds --------------------------------------------------------------------

    @property
    def batch_sequences(self) -> int:
        return self.programs.batch_sequences

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
        whose frozen base needs no weight gradient); an MoE model's weights counted as
        a token uses them (its k experts of E: `moe.active_size`)."""
        config = self.model_config
        total = moe.active_size((self.state.actor.params, self.frozen), config)
        return 4.0 * total + 2.0 * moe.active_size(self.state.actor.params, config)

    def memory_report(self) -> str:
        """Per-device bytes of parameters, optimizer states and the rollout's KV cache."""
        return programs_lib.memory_report(self.programs, self.state, self.frozen,
                                          self.ref_params)

    def packing_report(self) -> str | None:
        """The packed rows of the passes with token-budget micro-batches
        (`programs.packing_report`; None: no pass packs)."""
        return programs_lib.packing_report(self.settings, self.sharder,
                                           self.ref_params is not None)

    def prompt_sharing_report(self) -> str:
        """How many rows share a prompt's forward in each pass
        (`programs.prompt_sharing_report`)."""
        return programs_lib.prompt_sharing_report(self.programs)

    def close(self) -> None:
        """Waits for a rollout in flight, stops reward workers and closes the checkpointer."""
        self.experience.close()
        self.rollouts.scorer.close()
        self.checkpointer.close()

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
        With partial rollouts the rollout is the rounds' programs, one for each prefix
        width a round may take, which later steps' rounds meet for the first time
        otherwise (with `rollout.partial_keep_cache`, a round handed a cache compiles
        its own when first met).
        Returns the names of the programs compiled; none (and nothing done) after the
        first call, with the setting off, or for a step of another shape: one-step
        asynchronous, multi-turn or a segmented cache, whose programs compile when first
        called. The first step's metrics carry the seconds this took as
        `timing_s/compile`."""
        if self._programs_compiled or not self._compiles_ahead():
            return []
        self._programs_compiled, start = True, time.perf_counter()
        programs = self.programs
        with self.sharder.active():
            traced = programs.trace_step(self.state, self.ref_params, self.frozen,
                                         self.root_key, self.rollouts.needs_baseline)
            if val_batch_size and self.val_rows:
                multiple = programs.sampling_sharder.batch_size_multiple
                rows = -(-min(val_batch_size, len(self.val_rows)) // multiple) * multiple
                traced["validate"] = programs.trace_rollout(
                    self.state, self.frozen, self.settings.validation, rows,
                    self._validation_key(0))
            order = programs_lib.compile_traced(traced)
        self._compile_s = time.perf_counter() - start
        return order

    def _compiles_ahead(self) -> bool:
        """`compile_programs` compiles with `trainer.parallel_compile` on (None: off on a
        CPU, whose compiles share its cores: one at a time is as fast) for a step of the
        plain shape."""
        settings = self.settings
        enabled = settings.trainer.parallel_compile
        if enabled is None:
            enabled = jax.default_backend() != "cpu"
        return bool(enabled) and self.programs.rollout_sharder is None and \
            settings.multi_turn is None and settings.rollout.cache_segments <= 1

    def train_step(self, iterator: BatchIterator) -> dict[str, float]:
        """One RL step (the module docstring's data path); returns its metrics."""
        self.compile_programs()
        timer = Timer()
        with self.sharder.active():
            keys = self.programs.step_keys(self.root_key, self.state.step)
            state, step_metrics, learned = step_lib.run_step(
                self._phases(timer), self.state, iterator, keys)
            step_metrics.update(learn_metrics(jax.device_get(learned), self.settings,
                                              self.step))
        self.state, self.step = state, self.step + 1
        self.data = self.experience.position(iterator)
        timing = timer.done()
        if self._compile_s is not None:  # `compile_programs`' seconds, before this step
            timing["timing_s/compile"], self._compile_s = self._compile_s, None
        return {**step_metrics, **timing, **self._perf_metrics(step_metrics, timer.seconds)}

    def _phases(self, timer: Timer) -> step_lib.Phases:
        """The step's phases on the host, each timed: the batch from the source of
        experience, the programs with the trainer's models, the scores between them."""
        programs, source, step = self.programs, self.experience, self.step

        def generate(state, iterator: BatchIterator, key) -> experience.Sampled:
            return source.next(state, iterator, key, step=step, timer=timer)

        def forward(state, sampled: experience.Sampled) -> types.Experience:
            programs.check_shared_prompts(sampled.rollout, step)
            return timer("forward", programs.forward, state, self.ref_params, sampled.rollout,
                         self.frozen)

        def rewards(state, sampled: experience.Sampled, exp: types.Experience, key):
            return timer("reward", lambda: source.rewards(state, sampled, exp, key, step=step))

        def learn(state, exp: types.Experience, key):
            return timer("learn", programs.learn, state, exp, key, self.frozen)

        return step_lib.Phases(generate, forward, rewards, learn)

    def _perf_metrics(self, step_metrics: dict, seconds: dict[str, float]) -> dict[str, float]:
        tokens = (step_metrics["prompt_length/mean"] + step_metrics["response_length/mean"]) \
            * self.batch_sequences
        devices = jax.device_count()
        out = {"perf/total_num_tokens": tokens, "perf/time_per_step": seconds["step"],
               "perf/throughput": tokens / seconds["step"] / devices}
        peak = metrics.peak_flops(jax.devices()[0].device_kind)
        if peak:
            # The critic's update (PPO) shares `learn` with the actor's: a lower bound then.
            flops = self.train_flops_per_token * tokens * self.settings.actor.update.ppo_epochs
            out["perf/mfu/actor"] = flops / seconds["learn"] / (peak * devices)
        return out

    # -- validation and the loop ---------------------------------------------------------------

    def validate(self, batch_size: int) -> dict[str, float]:
        """Scores the validation set with `rollout.val_kwargs` sampling (`jrl.rl.evaluate`).

        Multi-turn rollouts add their metrics as training logs them, under `val-aux/`
        (`val-aux/num_turns/mean`, `val-aux/multi_turn/tool_calls/mean`, ...; over the
        generated rows, the last batch's padding copies included). With
        `trainer.validation_data_dir` the samples go to `<dir>/<step>.jsonl`; with
        `trainer.log_val_generations` the first ones are printed.
        """
        sampling, state, rollouts = self.settings.validation, self.state, self.rollouts
        samples_dir = self.settings.trainer.validation_data_dir
        shown = self.settings.trainer.log_val_generations
        turns, samples = [], []

        def respond(rows, padded, start):
            generated = rollouts.generate(state, padded, sampling, self._validation_key(start))
            turns.append(dict(generated.metrics))
            scored = rollouts.score(rows, generated, sampling.n)()
            if samples_dir is not None or shown:
                samples.append((rows, scored))
            return scored

        with self.sharder.active():
            result = evaluate.evaluate(
                self.val_rows, respond, batch_size=batch_size, n=sampling.n,
                batch_multiple=self.programs.sampling_sharder.batch_size_multiple)
        result.update({f"val-aux/{k}": v for k, v in multi_turn.combine_metrics(turns).items()})
        rollouts.write_samples(samples_dir, self.step, samples, sampling.n)
        if shown and samples and jax.process_index() == 0:
            from tqdm import tqdm

            columns = rollouts.sample_columns(self.step, samples, sampling.n)
            # One write: the progress bar, if any, is redrawn once, below the samples.
            tqdm.write("\n".join(metrics.sample_lines(self.step, columns, shown)))
        return result

    def _validation_key(self, start: int):
        """The key of the validation batch from row `start` at this step."""
        key = jax.random.fold_in(jax.random.fold_in(self.root_key, 2**31 - 2), self.step)
        return jax.random.fold_in(key, start)

    def fit(self, val_batch_size: int, writer: metrics.MetricsWriter | None = None,
            exit_after_steps: int | None = None) -> dict[str, float]:
        """Runs until `total_steps` (or `exit_after_steps` more); returns the last
        validation metrics."""
        settings, trainer_settings = self.settings, self.settings.trainer
        prompts = settings.train_batch_size if settings.filter_groups is None else \
            settings.filter_groups.gen_batch_size
        iterator = BatchIterator(self.train_rows, prompts, self.data_seed, shuffle=True,
                                 state=self.data)
        due = lambda every: every and (self.step % every == 0
                                       or self.step == settings.total_steps)
        last_val = {}
        validate_first = trainer_settings.val_before_train and self.step == 0 and \
            bool(self.val_rows)
        if self.step < settings.total_steps and exit_after_steps != 0:
            self.compile_programs(val_batch_size if validate_first else None)
        if validate_first:
            last_val = self.validate(val_batch_size)
            if writer:
                writer.write(0, last_val)
        for _ in itertools.islice(itertools.count(), exit_after_steps):
            if self.step >= settings.total_steps:
                break
            self._stop_if_asked()
            step_metrics = self.train_step(iterator)
            if self.val_rows and due(trainer_settings.test_freq):
                last_val = self.validate(val_batch_size)
                step_metrics.update(last_val)
            if writer:
                writer.write(self.step, step_metrics)
            if due(trainer_settings.save_freq):
                self.save()
        return last_val

    # -- checkpoints ---------------------------------------------------------------------------

    def maybe_restore(self, resume_from: str | None = None) -> bool:
        """Continues from a checkpoint: `resume_from` (a `<dir>/<step>` checkpoint directory,
        possibly of another run) or else the workdir's latest complete one, if any.

        Raises:
          CheckpointError: the checkpoint's files could not be read (truncated, corrupted
            or missing ones), with what to resume from instead.
        """
        self._resumed_from = resume_from
        with rundir.restoring(self.checkpointer, resume_from,
                              self.settings.total_steps) as (checkpointer, step):
            if step is None:
                return False
            self.state, self.step, self.data = checkpointer.restore_train_state(
                step, self.state, self.sharder.replicated)
            self._saved_step = self.step
            self.experience.restore(checkpointer, step)
        return True

    def save(self) -> None:
        """Checkpoints the run; with a rollout in flight (one-step asynchronous), also the
        sampling weights it reads, so that a resumed run samples it again exactly."""
        self.checkpointer.save_train_state(self.step, self.state, self.data,
                                           **self.experience.checkpoint_items())
        self._saved_step = self.step

    def _stop_if_asked(self) -> None:
        """Between steps: after Ctrl-C / SIGTERM (`jrl.app.interrupt`), checkpoints the last
        step (unless saved already) and raises `interrupt.Stopped`."""
        if interrupt.requested() is None:
            return
        if self.step > 0 and self.step != self._saved_step:
            self.save()
        interrupt.check(self.step, rundir.resume_command(self._resumed_from, self._saved_step))
