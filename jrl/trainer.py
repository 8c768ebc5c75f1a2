"""The RL trainer: verl's `fit()` loop in JAX, around the pure functions of `jrl.step`.

One step:

    rollout (one jit)
    -> step.forward: old log-probs, reference log-probs (if a KL term is configured),
       critic values (if the estimator needs them)          (one jit; the host scores)
    -> rule rewards at the last token, group ids            (host)
    -> step.learn: KL in reward, advantages, KL controller, critic update, actor
       update (after `critic_warmup`), metrics              (one jit, state donated)

The host only decodes responses, scores them and logs the step's scalars.
Randomness is `fold_in(key(seed), step)`, split by purpose, so a resumed run
repeats exactly what an uninterrupted one would have done.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jrl import advantages as adv_lib
from jrl import kl_control, metrics, rollout, types, update
from jrl import sharding as sharding_lib
from jrl import step as step_lib
from jrl.checkpoint import Checkpointer
from jrl.data import dynamic_sampling
from jrl.data.dataset import BatchIterator, IteratorState, encode_prompts
from jrl.models import CACHE_LOGICAL_AXES, heads, param_logical_axes
from jrl.models.config import ModelConfig
from jrl.optim import make_optimizer
from jrl.rewards import overlong, scoring
from jrl.settings import Settings

Array = jax.Array


class NonFiniteUpdateError(FloatingPointError):
    """Raised with `trainer.nan_policy='raise'` when a loss or gradient is not finite."""


# ----------------------------------------------------------------------------- prompts, rewards


def decode_responses(tokenizer, responses: np.ndarray, response_mask: np.ndarray) -> list[str]:
    """Response texts without the stop token and padding."""
    out = []
    for ids, mask in zip(responses, response_mask, strict=True):
        ids = ids[mask > 0].tolist()
        out.append(tokenizer.decode(ids, skip_special_tokens=True))
    return out


def place_scores(scores: np.ndarray, response_mask: np.ndarray) -> np.ndarray:
    """Token-level scores `[B, R]`: each score at its row's last valid response token."""
    out = np.zeros(response_mask.shape, np.float32)
    last = np.maximum(response_mask.sum(-1).astype(np.int64) - 1, 0)
    out[np.arange(len(scores)), last] = scores
    return out


def _step_keys(root, step):
    """The step's key, `fold_in(root, step)`, and the rollout's part of it (`learn`
    splits the same key for the updates)."""
    key = jax.random.fold_in(root, step)
    return key, jax.random.split(key, 3)[0]


@dataclasses.dataclass
class TrainState:
    """Everything a checkpoint must hold to continue a run exactly."""

    step: int
    actor: update.ModelState
    critic: update.ModelState | None
    kl: kl_control.KLControlState
    data: IteratorState

    def tree(self) -> dict:
        tree = {"actor": self.actor, "kl": self.kl}
        if self.critic is not None:
            tree["critic"] = self.critic
        return tree


class RLTrainer:
    """Holds the jitted stages and runs the loop.

    Args:
      settings: validated static settings (`jrl.settings.from_config`).
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
    """

    def __init__(self, settings: Settings, model: ModelConfig, actor_params, tokenizer,
                 train_rows, val_rows, reward_fn, workdir: str, seed: int,
                 apply_chat_template: bool = False, data_seed: int = 0,
                 sharder: sharding_lib.Sharder | None = None, reward_model=None):
        self.s = settings
        self.sharder = sharder or sharding_lib.Sharder(sharding_lib.make_mesh())
        self._check_batch_sizes()
        self.model = model
        self.tokenizer = tokenizer
        self.train_rows, self.val_rows = train_rows, val_rows
        if not isinstance(reward_fn, scoring.RewardScorer):
            reward_fn = scoring.RewardScorer(
                reward_fn, on_error=settings.reward.on_error,
                error_score=settings.reward.error_score)
        self.scorer = reward_fn
        self.reward_model = reward_model
        # Rule scoring runs beside the device stages; workers (if any) are the scorer's.
        self._score_thread = concurrent.futures.ThreadPoolExecutor(1, "jrl-reward")
        self.workdir = workdir
        self.chat = apply_chat_template
        self.data_seed = data_seed
        self.root_key = jax.random.key(seed)
        self.estimator = adv_lib.get_estimator(settings.algorithm.adv_estimator)
        self._build_shardings(actor_params)
        actor_params = jax.device_put(actor_params, self.actor_shardings)
        self.ref_params = None
        if settings.needs_reference:
            # The actor update donates its parameters; the reference keeps its own copy,
            # in the compute dtype (the layers cast to it anyway: the same numbers).
            self.ref_params = self._compute_params(actor_params)
            if self.ref_params is actor_params:
                self.ref_params = jax.jit(lambda p: jax.tree.map(jnp.copy, p),
                                          out_shardings=self.actor_shardings)(actor_params)
        self._build_stages()
        self.state = self._initial_state(actor_params, seed)
        self.checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"),
                                         max_to_keep=settings.trainer.max_ckpt_to_keep)

    # -- construction --------------------------------------------------------------------------

    def _check_batch_sizes(self) -> None:
        """Every batch the steps split over the mesh must divide evenly (before compiling)."""
        s, check = self.s, self.sharder.check_batch
        check(s.train_batch_size, "data.train_batch_size (prompts)")
        if s.filter_groups is not None:
            check(s.filter_groups.gen_batch_size, "data.gen_batch_size (prompts)")
        if s.log_prob_micro_batch is not None:
            check(s.log_prob_micro_batch, "rollout.log_prob_micro_batch_size")
        for role, settings in (("actor", s.actor), ("critic", s.critic)):
            if settings is not None:
                check(settings.update.micro_batch, f"{role}.ppo_micro_batch_size")

    def _build_shardings(self, actor_params) -> None:
        """Shardings of parameters and optimizer states from their logical axes."""
        sh, s = self.sharder, self.s
        self.actor_opt = make_optimizer(s.actor.optim)
        shapes = jax.eval_shape(lambda p: p, actor_params)
        self.actor_shardings = sh.params(param_logical_axes(self.model, "lm"), shapes)
        self.actor_state_shardings = update.ModelState(
            self.actor_shardings, sh.opt_state(self.actor_opt, shapes, self.actor_shardings))
        self.batch_sharding = sh.batch()
        # Rollout and log-prob passes read the weights in the compute dtype; the rollout
        # gets them gathered over `fsdp` once per step rather than once per token.
        compute = jnp.dtype(self.model.dtype)
        cast = lambda p: jax.tree.map(
            lambda x: x.astype(compute) if jnp.issubdtype(x.dtype, jnp.floating) else x, p)
        self._cast = None
        if compute != jnp.dtype(self.model.param_dtype):
            self._cast = jax.jit(cast, in_shardings=(self.actor_shardings,),
                                 out_shardings=self.actor_shardings)
        self.rollout_shardings = self.actor_shardings
        self._gather = None
        if sh.mesh.shape["fsdp"] > 1:
            gathered = sharding_lib.Sharder(sh.mesh, sh.rules_without("fsdp"))
            self.rollout_shardings = gathered.params(param_logical_axes(self.model, "lm"),
                                                     shapes)
            self._gather = jax.jit(cast, in_shardings=(self.actor_shardings,),
                                   out_shardings=self.rollout_shardings)
        if s.critic is not None:
            self.critic_opt = make_optimizer(s.critic.optim)
            key = jax.random.key(0)
            self.critic_shapes = jax.eval_shape(heads.init_critic_params, shapes, key)
            self.critic_shardings = sh.params(param_logical_axes(self.model, "value"),
                                              self.critic_shapes)
            self.critic_state_shardings = update.ModelState(
                self.critic_shardings,
                sh.opt_state(self.critic_opt, self.critic_shapes, self.critic_shardings))

    def _build_stages(self):
        """`step.forward` and `step.learn` jitted with the mesh's shardings (the state
        donated to `learn`); the rollout programs are compiled per sampling setting."""
        s, b, rep = self.s, self.batch_sharding, self.sharder.replicated
        critic = s.critic is not None
        self._forward = jax.jit(
            functools.partial(step_lib.forward, s=s, model=self.model),
            in_shardings=(self.actor_shardings,
                          self.actor_shardings if self.ref_params is not None else None,
                          self.critic_shardings if critic else None, b),
            out_shardings=b)
        state_shardings = types.TrainState(
            step=rep, actor=self.actor_state_shardings,
            critic=self.critic_state_shardings if critic else None, kl=rep)
        self._learn = jax.jit(
            functools.partial(step_lib.learn, s=s, model=self.model, actor_opt=self.actor_opt,
                              critic_opt=self.critic_opt if critic else None,
                              critic_warmup=s.trainer.critic_warmup),
            in_shardings=(state_shardings, b, rep), out_shardings=(state_shardings, rep),
            donate_argnums=0)
        self._generators: dict[rollout.SamplingConfig, Callable] = {}
        self._step_keys = jax.jit(_step_keys)

    def _compute_params(self, params):
        """`params` in the compute dtype, same shardings (the same array when equal)."""
        return params if self._cast is None else self._cast(params)

    def _rollout_params(self, compute_params):
        """The compute-dtype weights gathered for decoding (the same array without fsdp)."""
        return compute_params if self._gather is None else self._gather(compute_params)

    def _generator(self, sampling: rollout.SamplingConfig) -> Callable:
        """The rollout program for `sampling`, compiled with the mesh's shardings."""
        if sampling not in self._generators:
            b = self.batch_sharding
            self._generators[sampling] = jax.jit(
                functools.partial(rollout.generate_program, sampling=sampling,
                                  config=self.model),
                in_shardings=(self.rollout_shardings, b, b, self.sharder.replicated),
                out_shardings=b)
        return self._generators[sampling]

    @property
    def batch_sequences(self) -> int:
        return self.s.train_batch_size * self.s.rollout.n

    def _initial_state(self, actor_params, seed) -> TrainState:
        """`step.init` as one jit that writes every part straight into its sharding (the
        actor's parameters are donated: they become the state's)."""
        s, rep = self.s, self.sharder.replicated
        critic = s.critic is not None
        shardings = types.TrainState(
            step=rep, actor=self.actor_state_shardings,
            critic=self.critic_state_shardings if critic else None, kl=rep)
        init = jax.jit(functools.partial(step_lib.init, s=s, actor_opt=self.actor_opt,
                                         critic_opt=self.critic_opt if critic else None),
                       in_shardings=(self.actor_shardings, rep), out_shardings=shardings,
                       donate_argnums=0)
        state = init(actor_params, jax.random.fold_in(jax.random.key(seed), 2**31 - 1))
        return TrainState(step=0, actor=state.actor, critic=state.critic, kl=state.kl,
                          data=IteratorState())

    def close(self) -> None:
        """Stops reward workers and closes the checkpointer."""
        self._score_thread.shutdown()
        self.scorer.close()
        self.checkpointer.close()

    def memory_report(self) -> str:
        """Per-device bytes of parameters, optimizer states and the rollout's KV cache."""
        sh, s, m = self.sharder, self.s, self.model
        parts = [("actor params", self.state.actor.params, self.actor_shardings),
                 ("actor optimizer", self.state.actor.opt_state,
                  self.actor_state_shardings.opt_state)]
        if self.ref_params is not None:
            parts.append(("reference params", self.ref_params, self.actor_shardings))
        if self.state.critic is not None:
            parts += [("critic params", self.state.critic.params, self.critic_shardings),
                      ("critic optimizer", self.state.critic.opt_state,
                       self.critic_state_shardings.opt_state)]
        prompts = s.train_batch_size if s.filter_groups is None else s.filter_groups.gen_batch_size
        rows, slots = prompts * s.rollout.n, s.max_prompt_length + s.rollout.max_new_tokens
        shape = (m.num_layers, rows, m.num_kv_heads, slots, m.head_dim)
        cache = jax.ShapeDtypeStruct(shape, jnp.dtype(m.dtype))
        cache_sharding = sh.named(CACHE_LOGICAL_AXES, shape)
        parts.append((f"KV cache, {rows} rows x {slots} slots", (cache, cache),
                      (cache_sharding, cache_sharding)))
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
            tree, meta = checkpointer.restore(step, self.state.tree())
        finally:
            if checkpointer is not self.checkpointer:
                checkpointer.close()
        self.state = TrainState(step=int(meta["step"]), actor=tree["actor"],
                                critic=tree.get("critic"), kl=tree["kl"],
                                data=IteratorState(**meta["data"]))
        if jax.process_index() == 0:
            source = f" ({resume_from})" if resume_from else ""
            print(f"resumed from step {self.state.step} (of {self.s.total_steps}){source}",
                  flush=True)
        return True

    def save(self) -> None:
        meta = {"step": self.state.step, "data": dataclasses.asdict(self.state.data)}
        self.checkpointer.save(self.state.step, self.state.tree(), meta)

    # -- one step ------------------------------------------------------------------------------

    def _generate(self, params, rows, sampling: rollout.SamplingConfig, key):
        """Encodes the prompts on the host, splits them over the mesh's batch axes and
        samples; the rollout stays on the devices. `params` are the rollout's copy."""
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, rows, self.s.max_prompt_length,
                                                 self.chat)
        rollout.check_inputs(prompt_ids, prompt_mask, sampling, self.model)
        prompt_ids, prompt_mask = self.sharder.put_batch((prompt_ids, prompt_mask))
        with self.sharder.active():
            return self._generator(sampling)(params, prompt_ids, prompt_mask, key)

    def _submit_scores(self, rows, out, n) -> Callable[[], tuple]:
        """Starts scoring a rollout; returns a function that waits for
        `(scores [N], extras {name: [N]}, num_errors, texts)`. `scores` include DAPO's
        overlong penalty; `extras["score"]` is then the reward function's own score.

        Only the responses come to the host. Rule scoring runs in the background (and in
        the scorer's worker processes), so the device stages that follow overlap it;
        rows padded for the mesh are not scored.
        """
        count = len(rows) * n
        responses = sharding_lib.host_array(out.responses)[:count]
        response_mask = sharding_lib.host_array(out.response_mask)[:count]
        texts = decode_responses(self.tokenizer, responses, response_mask)
        if self.reward_model is None:
            future = self._score_thread.submit(self.scorer.score, rows, texts, n)
        reward = self.s.reward

        def collect():
            if self.reward_model is not None:
                result = scoring.ScoreResult(self.reward_model.score(rows, texts, n), {}, 0)
            else:
                result = future.result()
            scores, extras = result.scores, dict(result.extras)
            if reward.overlong_buffer_len:
                penalty = overlong.overlong_penalty(
                    response_mask.sum(-1), self.s.rollout.max_new_tokens,
                    reward.overlong_buffer_len, reward.overlong_penalty_factor)
                extras.update(overlong.overlong_extras(penalty), score=scores)
                scores = scores + penalty
            if result.num_errors:
                logging.warning("%d reward failures scored %s; first: %s", result.num_errors,
                                reward.error_score, result.first_error)
            return scores, extras, result.num_errors, texts

        return collect

    def _rollout(self, iterator: BatchIterator, params, key):
        """Rows, rollout arrays (on the devices), a score collector and rollout metrics.

        With `algorithm.filter_groups`, generates rounds of `data.gen_batch_size`
        prompts and keeps the groups whose metric varies until `train_batch_size` are in.
        """
        n, fg = self.s.rollout.n, self.s.filter_groups
        names = ("prompt_ids", "prompt_mask", "responses", "response_mask")
        if fg is None:
            rows = iterator.next_batch()
            out = self._generate(params, rows, self.s.rollout, key)
            collect = self._submit_scores(rows, out, n)
            return rows, {k: getattr(out, k) for k in names}, collect, {}
        acc = dynamic_sampling.GroupAccumulator(self.s.train_batch_size, n)
        num_errors = 0
        while not acc.is_full:
            rows = iterator.next_batch()
            out = self._generate(params, rows, self.s.rollout,
                                 jax.random.fold_in(key, acc.num_gen_batches))
            scores, extras, errors, _ = self._submit_scores(rows, out, n)()
            num_errors += errors
            metric = self._filter_metric(fg.metric, scores, extras)
            arrays = {k: sharding_lib.host_array(getattr(out, k))[:len(rows) * n]
                      for k in names}
            arrays.update({"score": scores, **{f"extra/{k}": v for k, v in extras.items()}})
            acc.add(arrays, rows, dynamic_sampling.groups_with_variance(metric, n))
            dynamic_sampling.check_gen_batches(acc.num_gen_batches, fg.max_num_gen_batches,
                                               acc.num_groups, self.s.train_batch_size, n)
        filled = acc.take()
        a = filled.arrays
        extras = {k.removeprefix("extra/"): v for k, v in a.items() if k.startswith("extra/")}
        batch = self.sharder.put_batch({k: a[k] for k in names})
        rollout_metrics = {"train/num_gen_batches": float(filled.num_gen_batches),
                           "train/num_filtered_groups": float(filled.num_filtered_groups)}
        texts = decode_responses(self.tokenizer, a["responses"], a["response_mask"])
        return (filled.rows, batch, lambda: (a["score"], extras, num_errors, texts),
                rollout_metrics)

    @staticmethod
    def _filter_metric(name: str, scores, extras):
        """What must vary within a group, by verl's names: "seq_reward" / "seq_final_reward"
        the sequence's reward (with the overlong penalty), "score" the reward function's
        score, "acc" its "acc" field (the score itself when it returns a number)."""
        if name in ("seq_reward", "seq_final_reward"):
            return scores
        if name in extras:
            return extras[name]
        if name in ("score", "acc"):
            return extras.get("score", scores)
        raise ValueError(f"algorithm.filter_groups.metric={name!r} is not among the reward's "
                         f"fields {['score', 'seq_reward', *sorted(extras)]}")

    def train_step(self, iterator: BatchIterator) -> dict[str, float]:
        """One RL step; returns its metrics."""
        with self.sharder.active():
            return self._train_step(iterator)

    def _train_step(self, iterator: BatchIterator) -> dict[str, float]:
        """rollout -> forward (while the host scores) -> rewards -> learn -> metrics."""
        st = self.state
        timing = {}
        t_step = time.perf_counter()
        step = jax.device_put(np.uint32(st.step), self.sharder.replicated)
        key, gen_key = self._step_keys(self.root_key, step)

        t = time.perf_counter()
        compute_params = self._compute_params(st.actor.params)
        rows, batch, collect_scores, step_metrics = self._rollout(
            iterator, self._rollout_params(compute_params), gen_key)
        out = jax.block_until_ready(types.Rollout(**batch))
        timing["gen"] = time.perf_counter() - t

        t = time.perf_counter()
        critic_params = None if st.critic is None else st.critic.params
        exp = jax.block_until_ready(
            self._forward(compute_params, self.ref_params, critic_params, out))
        timing["forward"] = time.perf_counter() - t
        del compute_params
        exp, reward_metrics = self._rewards(rows, exp, collect_scores, gen_key, timing)
        step_metrics.update(reward_metrics)

        t = time.perf_counter()
        state = types.TrainState(step=step.astype(jnp.int32), actor=st.actor, critic=st.critic,
                                 kl=st.kl)
        state, learn_metrics = self._learn(state, exp, key)
        step_metrics.update(self._learn_metrics(jax.device_get(learn_metrics)))
        timing["learn"] = time.perf_counter() - t
        st.actor, st.critic, st.kl = state.actor, state.critic, state.kl
        st.step += 1
        st.data = iterator.state
        timing["step"] = time.perf_counter() - t_step
        step_metrics.update({f"timing_s/{k}": v for k, v in timing.items()})
        step_metrics.update(self._perf_metrics(step_metrics, timing))
        return step_metrics

    def _rewards(self, rows, exp: types.Experience, collect_scores, gen_key, timing: dict):
        """Waits for the scores; returns the experience with token-level scores, group ids
        (and ReMax's baselines), and the reward metrics."""
        s, n = self.s, self.s.rollout.n
        t = time.perf_counter()
        scores, extras, num_errors, _ = collect_scores()
        host = {"token_level_scores": place_scores(
            scores, sharding_lib.host_array(exp.response_mask))}
        if self.estimator.needs_baseline:
            greedy = dataclasses.replace(s.rollout, n=1, do_sample=False)
            base_params = self._rollout_params(self._compute_params(self.state.actor.params))
            base_out = self._generate(base_params, rows, greedy, gen_key)
            host["reward_baselines"] = np.repeat(self._submit_scores(rows, base_out, 1)()[0], n)
        timing["reward"] = time.perf_counter() - t
        host["uid"] = np.repeat(np.arange(len(rows)), n).astype(np.int32)
        exp = exp.replace(**self.sharder.put_batch(host))
        out = {f"reward_extra/{k}/mean": float(np.mean(v)) for k, v in extras.items()}
        if s.reward.on_error == "score":
            out["reward/num_errors"] = float(num_errors)
        return exp, out

    # Metrics of `step.learn` that are not the actor's update (kept during critic warm-up).
    _NOT_ACTOR_UPDATE = ("actor/entropy", "actor/reward_kl_penalty",
                         "actor/reward_kl_penalty_coeff")

    def _learn_metrics(self, m: dict) -> dict[str, float]:
        """`learn`'s metrics as floats, without the actor's while it waits out the critic
        warm-up; raises under `trainer.nan_policy='raise'` after a skipped update."""
        # A data statistic over an empty selection (no response tokens at all) is NaN: left out.
        m = {k: float(v) for k, v in m.items()
             if not (np.isnan(v) and k.startswith(step_lib.DATA_METRICS))}
        if not m.pop("actor/updated"):
            m = {k: v for k, v in m.items()
                 if not k.startswith("actor/") or k in self._NOT_ACTOR_UPDATE}
        for role in ("critic", "actor"):
            skipped = m.get(f"{role}/nan_skipped_updates", 0.0)
            if skipped and self.s.actor.update.nan_policy == "raise":
                raise NonFiniteUpdateError(
                    f"step {self.state.step}: non-finite {role} loss or gradient in "
                    f"{int(skipped)} update(s); parameters were left unchanged")
        return m

    def _perf_metrics(self, m: dict, timing) -> dict[str, float]:
        sequences = self.batch_sequences
        tokens = (m["prompt_length/mean"] + m["response_length/mean"]) * sequences
        devices = jax.device_count()
        out = {"perf/total_num_tokens": tokens, "perf/time_per_step": timing["step"],
               "perf/throughput": tokens / timing["step"] / devices}
        peak = metrics.peak_flops(jax.devices()[0].device_kind)
        if peak and "learn" in timing:
            # The critic's update (PPO) shares `learn` with the actor's: a lower bound then.
            flops = 6.0 * self.num_params * tokens * self.s.actor.update.ppo_epochs
            out["perf/mfu/actor"] = flops / timing["learn"] / (peak * devices)
        return out

    @functools.cached_property
    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(self.state.actor.params))

    # -- validation ----------------------------------------------------------------------------

    def validate(self, batch_size: int) -> dict[str, float]:
        """Scores the validation set with `rollout.val_kwargs` sampling."""
        with self.sharder.active():
            return self._validate(batch_size)

    def _validate(self, batch_size: int) -> dict[str, float]:
        sampling = self.s.validation
        key = jax.random.fold_in(jax.random.fold_in(self.root_key, 2**31 - 2), self.state.step)
        sources, index, answers = [], [], []
        values: dict[str, list[float]] = {}
        # Every generate call gets the same number of prompts (one compilation), a
        # multiple of the mesh's batch split; the last batch is padded with copies.
        multiple = self.sharder.batch_size_multiple
        padded_size = -(-min(batch_size, len(self.val_rows)) // multiple) * multiple
        params = self._rollout_params(self._compute_params(self.state.actor.params))
        for start in range(0, len(self.val_rows), batch_size):
            rows = self.val_rows[start:start + batch_size]
            padded = list(rows) + [rows[-1]] * (padded_size - len(rows))
            out = self._generate(params, padded, sampling, jax.random.fold_in(key, start))
            batch_scores, extras, _, texts = self._submit_scores(rows, out, sampling.n)()
            values.setdefault("reward", []).extend(batch_scores.tolist())
            for name, column in extras.items():
                values.setdefault(name, []).extend(column.tolist())
            for i, text in enumerate(texts):
                sources.append(rows[i // sampling.n]["data_source"])
                index.append(start + i // sampling.n)
                answers.append(text.strip())
        return metrics.validation_metrics(sources, index, values, answers, sampling.n)

    # -- the loop ------------------------------------------------------------------------------

    def fit(self, val_batch_size: int, writer: metrics.MetricsWriter | None = None,
            exit_after_steps: int | None = None) -> dict[str, float]:
        """Runs until `total_steps`; returns the last validation metrics."""
        cfg = self.s.trainer
        fg = self.s.filter_groups
        batch_size = self.s.train_batch_size if fg is None else fg.gen_batch_size
        iterator = BatchIterator(self.train_rows, batch_size, self.data_seed,
                                 shuffle=True, state=self.state.data)
        last_val = {}
        if cfg.val_before_train and self.state.step == 0 and self.val_rows:
            last_val = self.validate(val_batch_size)
            if writer:
                writer.write(0, last_val)
        steps_run = 0
        while self.state.step < self.s.total_steps:
            step_metrics = self.train_step(iterator)
            step = self.state.step
            last = step == self.s.total_steps
            if self.val_rows and cfg.test_freq and (step % cfg.test_freq == 0 or last):
                last_val = self.validate(val_batch_size)
                step_metrics.update(last_val)
            if writer:
                writer.write(step, step_metrics)
            if cfg.save_freq and (step % cfg.save_freq == 0 or last):
                self.save()
            steps_run += 1
            if exit_after_steps is not None and steps_run >= exit_after_steps:
                break
        return last_val
