"""What gives a step its experience: the actor's rollouts of prompt rows and their scores.

`Rollouts` samples a batch of prompts from the actor's weights and starts scoring it:
single-turn (`step.generate`, one program; with `rollout.cache_segments > 1` the
programs of the cache's segments with the host between them, `jrl.rollout.segments`)
or multi-turn with tools (`jrl.rollout.multi_turn`: the device decodes, the host runs
the tools between turns). A step's batch is one rollout or, with DAPO's dynamic
sampling (`algorithm.filter_groups`), rounds of rollouts until enough groups vary; its
rewards are the scores placed on the tokens, with ReMax's greedy baselines.

An `ExperienceSource` gives each step its batch: `SyncExperience` samples it on the
training devices when the step asks; `AsyncExperience` (one-step asynchronous
training) samples the next step's on a group of devices of its own, in a thread, while
this step learns.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import NamedTuple, Protocol

import jax
import numpy as np

from jrl import metrics
from jrl import sharding as sharding_lib
from jrl import tools as tools_lib
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
from jrl.models.config import ModelConfig
from jrl.rewards import responses as responses_lib
from jrl.rewards import scoring
from jrl.rl import step as step_lib
from jrl.rl import types
from jrl.rl.programs import Programs
from jrl.rollout import multi_turn, segments
from jrl.rollout.sampler import SamplingConfig, check_inputs


class Sampled(NamedTuple):
    """A step's prompts and rollout, and a function that waits for the rollout's scores."""

    rows: list[Row]
    rollout: types.Rollout
    scores: Callable[[], responses_lib.Scored]
    metrics: dict[str, float]


class Generated(NamedTuple):
    """A rollout, and what a multi-turn one adds: its metrics (turns, tool calls) and the
    tools' rewards (for the scorer); `{}` and None for a single-turn rollout."""

    rollout: types.Rollout
    metrics: dict[str, float]
    reward_scores: object = None


class MultiTurnTools(NamedTuple):
    """What a multi-turn rollout runs with: the tools by name, the turn template, and
    the tool schemas every prompt renders (`prompt_text`, as verl's agent loop)."""

    tools: dict
    template: multi_turn.TurnTemplate | None
    prompt_schemas: list[dict] | None


def multi_turn_tools(settings: Settings, tokenizer) -> MultiTurnTools:
    """`settings.multi_turn`'s tools loaded (none without it)."""
    if settings.multi_turn is None:
        return MultiTurnTools({}, None, None)
    return MultiTurnTools(tools_lib.load_tools(settings.multi_turn.tool_config_path),
                          multi_turn.TurnTemplate(tokenizer),
                          list(settings.multi_turn.tool_schemas) or None)


def response_scorer(settings: Settings, tokenizer, reward_fn,
                    reward_model=None) -> responses_lib.ResponseScorer:
    """The scorer of responses: `reward_fn` (a function, or a `scoring.RewardScorer`)
    or `reward_model`'s scores, and a multi-turn rollout's tool rewards."""
    if not isinstance(reward_fn, scoring.RewardScorer):
        reward_fn = scoring.RewardScorer(reward_fn, on_error=settings.reward.on_error,
                                         error_score=settings.reward.error_score)
    return responses_lib.ResponseScorer(
        tokenizer, reward_fn, reward_model, settings.reward, settings.rollout.max_new_tokens,
        add_tool_rewards=settings.multi_turn is not None
        and settings.multi_turn.add_tool_rewards)


def _fields(tree) -> dict:
    """A dataclass's fields by name (not copied, unlike `dataclasses.asdict`)."""
    return {f.name: getattr(tree, f.name) for f in dataclasses.fields(tree)}


class Rollouts:
    """The actor's rollouts of prompt rows, on the training devices or the sampling
    group, and their scores.

    Args:
      settings, model_config: as `RLTrainer`'s.
      tokenizer: encodes prompts, decodes responses.
      scorer: scores responses (`response_scorer`).
      programs: the step's programs (the rollout's, per sampling setting).
      frozen: the LoRA base (None without LoRA).
      chat: encode prompts through the tokenizer's chat template.
      turns: the multi-turn rollout's tools (`multi_turn_tools`).
      needs_baseline: ReMax's greedy rollout gives baselines with the scores.
    """

    def __init__(self, settings: Settings, model_config: ModelConfig, tokenizer,
                 scorer: responses_lib.ResponseScorer, programs: Programs, frozen, *,
                 chat: bool, turns: MultiTurnTools, needs_baseline: bool):
        self.settings, self.model_config, self.tokenizer = settings, model_config, tokenizer
        self.scorer, self.programs, self.frozen = scorer, programs, frozen
        self.chat, self.turns, self.needs_baseline = chat, turns, needs_baseline
        self.sharder, self.sampling_sharder = programs.sharder, programs.sampling_sharder
        self.rollout_sharder = programs.rollout_sharder

    # -- one rollout ---------------------------------------------------------------------------

    def generate(self, state, rows, sampling: SamplingConfig, key, weights=None) -> Generated:
        """Encodes the prompts on the host, splits them over the mesh's batch axes and
        samples from `state`'s actor; the rollout stays on the devices. With `weights`
        (the sampling group's copy, `AsyncExperience`) the sampling group samples, and
        the rollout is on its devices."""
        prompt_ids, prompt_mask = encode_prompts(
            self.tokenizer, rows, self.settings.max_prompt_length, self.chat,
            self.turns.prompt_schemas)
        check_inputs(prompt_ids, prompt_mask, sampling, self.model_config)
        if self.settings.multi_turn is not None:
            return self._generate_turns(state, rows, prompt_ids, prompt_mask, sampling, key,
                                        weights)
        if weights is not None:
            prompt_ids, prompt_mask = self.rollout_sharder.put_batch((prompt_ids, prompt_mask))
            key = jax.device_put(key, self.rollout_sharder.replicated)
            program = self._rollout_program(sampling, group=True)
            return Generated(program(weights, prompt_ids, prompt_mask, key), {})
        prompt_ids, prompt_mask = self.sharder.put_batch((prompt_ids, prompt_mask))
        with self.sampling_sharder.active():  # traced with the rollout's layout
            program = self._rollout_program(sampling)
            return Generated(program(state, prompt_ids, prompt_mask, key, self.frozen), {})

    def _rollout_program(self, sampling: SamplingConfig, group: bool = False) -> Callable:
        """The rollout of `sampling`: its program (`Programs.generator`) or, with
        `rollout.cache_segments > 1`, the segments' (`_generate_segments`)."""
        if sampling.cache_segments > 1:
            return functools.partial(self._generate_segments, sampling=sampling, group=group)
        return self.programs.generator(sampling, group)

    def _generate_segments(self, *args, sampling: SamplingConfig, group: bool
                           ) -> types.Rollout:
        """A rollout with `rollout.cache_segments > 1`: the sampler's weights from one
        program, then the segments' programs (`jrl.rollout.segments`), the host between
        them. `args` as the rollout program's."""
        if group:
            weights, prompt_ids, prompt_mask, key = args
        else:
            state, prompt_ids, prompt_mask, key, frozen = args
            weights = self.programs.rollout_params(state, frozen)
        out = segments.generate(weights, prompt_ids, prompt_mask, key, sampling,
                                config=step_lib.sampling_model(self.model_config))
        sharder = self.rollout_sharder if group else self.sharder
        return jax.tree.map(lambda x: jax.device_put(x, sharder.batch(x.ndim)),
                            step_lib.rollout_of(out, sampling))

    def _generate_turns(self, state, rows, prompt_ids, prompt_mask, sampling, key,
                        weights) -> Generated:
        """A multi-turn rollout with tools (`jrl.rollout.multi_turn`): the device decodes,
        the host runs the tools between turns."""
        sharder = self.sharder if weights is None else self.rollout_sharder
        if weights is None:
            weights = self.programs.rollout_params(state, self.frozen)
        else:
            key = jax.device_put(key, sharder.replicated)
        layout = self.sampling_sharder if sharder is self.sharder else sharder
        with layout.active():
            out = multi_turn.generate(
                weights, prompt_ids, prompt_mask, key,
                sampling=sampling, config=step_lib.sampling_model(self.model_config),
                tokenizer=self.tokenizer, tools=self.turns.tools,
                mt=self.settings.multi_turn.config,
                tools_kwargs=[(row.get("extra_info") or {}).get("tools_kwargs")
                              for row in rows],
                put=sharder.put_batch, template=self.turns.template)
        pages = {}
        if out.page_usage is not None:  # the paged cache's
            pages = dict(preemptions=out.preemptions.astype(np.int32),
                         page_usage=np.full(len(out.preemptions), out.page_usage, np.float32))
        rollout = types.Rollout(**sharder.put_batch(dict(
            prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, responses=out.responses,
            response_mask=out.response_mask, response_attention_mask=out.attention_mask,
            rollout_log_probs=out.rollout_log_probs if sampling.do_sample else None,
            **pages)))
        return Generated(rollout, out.metrics, out.reward_scores)

    def score(self, rows, generated: Generated, n: int) -> Callable[[], responses_lib.Scored]:
        """Starts scoring a rollout of `rows`, `n` responses each
        (`ResponseScorer.submit`), with a multi-turn rollout's tool rewards."""
        rollout = generated.rollout
        return self.scorer.submit(rows, rollout.responses, rollout.attention_mask(), n,
                                  generated.reward_scores)

    # -- a step's batch ------------------------------------------------------------------------

    def sample(self, state, iterator: BatchIterator, key, weights=None) -> Sampled:
        """The step's rollout, its scoring started; with `algorithm.filter_groups`, DAPO's
        rounds of `data.gen_batch_size` prompts until `train_batch_size` groups vary.
        `weights`: sample on the sampling group (`generate`)."""
        if self.settings.filter_groups is not None:
            return self._sample_rounds(state, iterator, key, weights)
        rows = iterator.next_batch()
        generated = self.generate(state, rows, self.settings.rollout, key, weights)
        scores = self.score(rows, generated, self.settings.rollout.n)
        return Sampled(rows, generated.rollout, scores, dict(generated.metrics))

    def _sample_rounds(self, state, iterator: BatchIterator, key, weights) -> Sampled:
        """DAPO's dynamic sampling (`jrl.data.dynamic_sampling`): each round's rollout
        scored on the host, its groups kept while they vary, the batch put back on the
        devices."""
        settings, n = self.settings, self.settings.rollout.n
        filter_groups = settings.filter_groups
        errors, turns = [], [{}]  # multi-turn: each round's metrics

        def sample(rows, round_):
            generated = self.generate(state, rows, settings.rollout,
                                      jax.random.fold_in(key, round_), weights)
            turns.append(generated.metrics)
            scores, extras, num_errors, texts = self.score(rows, generated, n)()
            errors.append(num_errors)
            arrays = {k: sharding_lib.host_array(v)[:len(rows) * n]
                      for k, v in _fields(generated.rollout).items() if v is not None}
            arrays.update(score=scores, text=np.asarray(texts, dtype=object),
                          **{f"extra/{k}": v for k, v in extras.items()})
            return arrays, responses_lib.filter_metric(filter_groups.metric, scores, extras)

        filled = dynamic_sampling.fill_batch(
            iterator.next_batch, sample, target_groups=settings.train_batch_size, n=n,
            max_num_gen_batches=filter_groups.max_num_gen_batches)
        arrays = filled.arrays
        rollout = types.Rollout(**self.sharder.put_batch(
            {f.name: arrays.get(f.name) for f in dataclasses.fields(types.Rollout)}))
        extras = {k.removeprefix("extra/"): v for k, v in arrays.items()
                  if k.startswith("extra/")}
        scored = (arrays["score"], extras, sum(errors), list(arrays["text"]))
        return Sampled(filled.rows, rollout, lambda: scored,
                       {**turns[-1],  # multi-turn: the last round's
                        "train/num_gen_batches": float(filled.num_gen_batches),
                        "train/num_filtered_groups": float(filled.num_filtered_groups)})

    def rewards(self, state, sampled: Sampled, exp: types.Experience, key, step: int
                ) -> tuple[types.Experience, dict[str, float]]:
        """Waits for the scores of step `step`'s rollout (counted from 0); returns the
        experience with token-level scores, group ids (and ReMax's greedy baselines, from
        a rollout with `key`), and the step's host metrics."""
        settings, n, rows = self.settings, self.settings.rollout.n, sampled.rows
        scores, extras, num_errors, texts = sampled.scores()
        self.write_samples(settings.trainer.rollout_data_dir, step + 1,
                           [(rows, (scores, extras, num_errors, texts))], n)
        host = {"token_level_scores": responses_lib.place_scores(
            scores, sharding_lib.host_array(exp.response_mask)),
            "uid": np.repeat(np.arange(len(rows)), n).astype(np.int32)}
        if self.needs_baseline:
            greedy = dataclasses.replace(settings.rollout, n=1, do_sample=False)
            baseline = self.generate(state, rows, greedy, key)
            host["reward_baselines"] = np.repeat(self.score(rows, baseline, 1)()[0], n)
        out = {**sampled.metrics,
               **{f"reward_extra/{k}/mean": float(np.mean(v)) for k, v in extras.items()}}
        if sampled.rollout.preemptions is not None:  # the paged cache's, of the rows trained
            out["rollout/preemptions"] = float(np.sum(
                sharding_lib.host_array(sampled.rollout.preemptions)))
            out["rollout/page_usage"] = float(np.max(
                sharding_lib.host_array(sampled.rollout.page_usage)))
        if settings.reward.on_error == "score":
            out["reward/num_errors"] = float(num_errors)
        return exp.replace(**self.sharder.put_batch(host)), out

    def write_samples(self, directory: str | None, step: int, batches, n: int) -> None:
        """`<directory>/<step>.jsonl` (`metrics.write_samples`) of scored batches
        `[(rows, Scored)]`, `n` responses per row; nothing without a directory."""
        if directory is None or jax.process_index() != 0 or not batches:
            return
        metrics.write_samples(directory, step, self.sample_columns(step, batches, n))

    def sample_columns(self, step: int, batches, n: int) -> dict[str, list]:
        """The samples of scored batches `[(rows, Scored)]` by column, as
        `metrics.write_samples` takes them."""
        columns: dict[str, list] = {}
        for rows, (scores, extras, _, texts) in batches:
            prompts = [prompt_text(self.tokenizer, row, self.chat, self.turns.prompt_schemas)
                       for row in rows]
            for i, text in enumerate(texts):
                sample = {"input": prompts[i // n], "output": text,
                          "gts": ground_truth(rows[i // n]), "score": float(scores[i]),
                          "step": step, **{k: np.asarray(v)[i].item() for k, v in extras.items()}}
                for name, value in sample.items():
                    columns.setdefault(name, []).append(value)
        return columns


# -- where a step's batch comes from -------------------------------------------------------------


class ExperienceSource(Protocol):
    """Where each step's batch comes from (`SyncExperience`, `AsyncExperience`)."""

    def next(self, state, iterator: BatchIterator, key, *, step: int, timer) -> Sampled:
        """Step `step`'s batch (counted from 0) on the training devices, its scoring
        started; `key`: the step's rollout key; `timer` (`jrl.rl.trainer.Timer`) times
        its phases."""

    def rewards(self, state, sampled: Sampled, exp: types.Experience, key, *, step: int
                ) -> tuple[types.Experience, dict[str, float]]:
        """The experience scored (`Rollouts.rewards`), and the step's host metrics."""

    def position(self, iterator: BatchIterator) -> IteratorState:
        """The data position a checkpoint after this step keeps."""

    def checkpoint_items(self) -> dict:
        """What a checkpoint after this step keeps besides the state, by item name."""

    def restore(self, checkpointer, step: int) -> None:
        """Reads `checkpoint_items` back from checkpoint `step`."""

    def close(self) -> None:
        """Waits for a rollout in flight."""


class SyncExperience:
    """Samples each step's batch on the training devices when the step asks
    (`ExperienceSource`)."""

    def __init__(self, rollouts: Rollouts):
        self.rollouts = rollouts

    def next(self, state, iterator: BatchIterator, key, *, step: int, timer) -> Sampled:
        del step
        return timer("gen", self.rollouts.sample, state, iterator, key)

    def rewards(self, state, sampled: Sampled, exp: types.Experience, key, *, step: int):
        return self.rollouts.rewards(state, sampled, exp, key, step)

    def position(self, iterator: BatchIterator) -> IteratorState:
        return iterator.state

    def checkpoint_items(self) -> dict:
        return {}

    def restore(self, checkpointer, step: int) -> None:
        del checkpointer, step

    def close(self) -> None:
        pass


class _Pending(NamedTuple):
    """A rollout running on the sampling group (one-step asynchronous training)."""

    future: concurrent.futures.Future  # -> (Sampled, seconds it took)
    weights: object  # the sampling group's weights it reads
    step: int  # the RL step it is for
    version: int  # the RL step whose weights it reads (step - staleness)
    data: concurrent.futures.Future  # -> the data position before its prompts


class AsyncExperience:
    """One-step asynchronous training (`ExperienceSource`): a step's rollout is sampled
    on the sampling group from the previous step's weights (`rollout.staleness=1`; the
    first step's from its own), and the next step's starts there, from this step's
    weights, before this step learns; the two groups work at once. One thread runs the
    sampling group's rollouts, drawing their prompts in order; a checkpoint keeps the
    weights of the rollout in flight, so a resumed run samples it again exactly."""

    def __init__(self, rollouts: Rollouts, root_key):
        self.rollouts, self.programs, self.root_key = rollouts, rollouts.programs, root_key
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "jrl-rollout")
        self._pending: _Pending | None = None
        self._resume_weights = None

    def next(self, state, iterator: BatchIterator, key, *, step: int, timer) -> Sampled:
        """Step `step`'s batch, sampled on the sampling group (waited for) and moved to
        the training devices; the next step's starts first. Its metrics add the seconds
        it took (`timing_s/gen`) and the steps its weights are behind
        (`async/staleness`)."""
        del key  # the rollout's is drawn in its thread (`_submit`)
        # The sampling group's weights are placed by its own shardings, not by the
        # training mesh's rules.
        with sharding_lib.inactive():
            pending, self._pending = self._pending, None
            if pending is None:  # the first step, after a resume, or staleness 0
                pending = timer("sync_rollout_weights", self._first, state, iterator, step)
            if self.rollouts.settings.staleness == 1 and \
                    step + 1 < self.rollouts.settings.total_steps:
                # Until the new weights are on the sampling group, which can wait behind
                # the rollout still running there.
                self._pending = timer("sync_rollout_weights", lambda: self._submit(
                    self._sampler_weights(state), iterator, step + 1, step))
        received = []

        def receive():  # the rollout, on the training devices (the timer waits on
            received.extend(pending.future.result())  # its arrays, not on the rows)
            sharder = self.rollouts.sharder
            return jax.tree.map(lambda x: jax.device_put(x, sharder.batch(x.ndim)),
                                received[0].rollout)

        rollout = timer("wait_rollout", receive)
        sampled, gen_seconds = received
        return sampled._replace(rollout=rollout, metrics={
            **sampled.metrics, "timing_s/gen": gen_seconds,
            "async/staleness": float(pending.step - pending.version)})

    def _first(self, state, iterator: BatchIterator, step: int) -> _Pending:
        """The rollout of the first step, of a resumed run's (from the saved sampling
        weights), or of every step with staleness 0."""
        resumed, self._resume_weights = self._resume_weights, None
        if resumed is not None:
            return self._submit(resumed, iterator, step, step - 1)
        return self._submit(self._sampler_weights(state), iterator, step, step)

    def _sampler_weights(self, state):
        """The actor's weights as the sampler reads them, moved to the sampling group
        (device to device)."""
        return jax.device_put(self.programs.rollout_params(state, self.rollouts.frozen),
                              self.programs.sampler_shardings)

    def _submit(self, weights, iterator: BatchIterator, step: int, version: int) -> _Pending:
        """Starts step `step`'s rollout on the sampling group, from `weights` (those of
        step `version`), in the rollout thread; its prompts are drawn there, in order."""
        data = concurrent.futures.Future()

        def job():
            data.set_result(iterator.state)
            key = step_lib.step_keys(self.root_key, step)[1]
            start = time.perf_counter()
            with self.programs.rollout_sharder.active():
                sampled = self.rollouts.sample(None, iterator, key, weights)
                jax.block_until_ready(sampled.rollout)
            return sampled, time.perf_counter() - start

        return _Pending(self._executor.submit(job), weights, step, version, data)

    def position(self, iterator: BatchIterator) -> IteratorState:
        """Before the prompts of the rollout in flight: a resumed run draws them again
        and samples them from the saved sampling weights."""
        return iterator.state if self._pending is None else self._pending.data.result()

    def rewards(self, state, sampled: Sampled, exp: types.Experience, key, *, step: int):
        return self.rollouts.rewards(state, sampled, exp, key, step)

    def checkpoint_items(self) -> dict:
        return {} if self._pending is None else {"rollout_weights": self._pending.weights}

    def restore(self, checkpointer, step: int) -> None:
        if not checkpointer.has_item(step, "rollout_weights"):
            return
        like = jax.tree.map(
            lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
            self.programs.sampler_shapes, self.programs.sampler_shardings)
        self._resume_weights = checkpointer.restore_item(step, "rollout_weights", like)

    def close(self) -> None:
        self._pending = None
        self._executor.shutdown(wait=True)
