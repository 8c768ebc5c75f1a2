"""Partial rollouts (`rollout.partial`): generation in rounds of a token budget, rows
that run long carried on across steps.

A step's rollout normally runs until its longest row stops, so a few long responses
hold the whole batch. Here the rollout runs in rounds over a fixed batch of decode rows
(`data.train_batch_size x rollout.n`, the step's batch): each round draws at most
`rollout.partial_max_tokens` tokens a row (`sampler.continue_rows`, one program), then
the host

- keeps each finished row's tokens and log-probs with its group (the n samples of a
  prompt) and frees its decode row;
- marks a group complete once all n of its samples have finished;
- fills free decode rows with the next prompts' samples, n rows a prompt (rows left
  over stay empty: finished rows of length 0 on a live row's prompt, prefilled with the
  rest but drawing nothing, and dropped by the decode loop's compaction);
- leaves unfinished rows where they are, to go on in the next round.

Rounds run until `data.train_batch_size` groups are complete; the step trains on the
first that many to complete, and the rest wait for the next step. A row still running
at the end of a step goes on in the next step's rounds, under the new weights: each
round prefills its prompt and its tokens so far (the keys and values of the current
weights) and draws on. Its earlier tokens keep the log-probs they were drawn with
(`rollout_log_probs`), which `algorithm.rollout_correction.*` weighs against the
current policy's as for any off-policy rollout; `rollout/partial_staleness/*` reports
how many steps back a trained row began.

Row `j` of a prompt's samples draws token i with `fold_in(k, i)`, its key `k` fixed when
the prompt enters (from the step's rollout key, the round and the prompt's place in
it), so a row's tokens do not depend on how its rounds fall (with the same weights, the
tokens of one rollout: `sampler.continue_rows`).

What a checkpoint keeps is the data position after the prompts drawn so far. The rows in
flight and the complete groups waiting are not saved: a resumed run starts the next
prompts, and says how many prompts it left behind.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

from jrl import sharding as sharding_lib
from jrl.data.dataset import BatchIterator, Row, encode_prompts
from jrl.errors import ConfigError
from jrl.rl import programs, types
from jrl.rl.experience import Generated, Rollouts, Sampled, SyncExperience
from jrl.rollout import sampler

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Group:
    """A prompt's n samples: its row, encoded prompt, and each finished sample's
    tokens, log-probs, length and the step of its first token."""

    row: Row
    prompt_ids: np.ndarray  # [P]
    prompt_mask: np.ndarray  # [P]
    done: dict[int, tuple[np.ndarray, np.ndarray, int, int]] = dataclasses.field(
        default_factory=dict)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _group_keys(key, groups: int, n: int) -> jax.Array:
    """Key data `[groups * n, ...]`: sample j of a round's new prompt i keyed
    `row_keys(fold_in(key, i), n)[j]` (one program for any number of new prompts)."""
    keys = jax.vmap(lambda i: sampler.row_keys(jax.random.fold_in(key, i), n))(
        jnp.arange(groups))
    return jax.random.key_data(keys.reshape(-1))


class PartialExperience(SyncExperience):
    """Partial rollouts (`ExperienceSource`, see the module docstring).

    Args:
      rollouts: the actor's rollouts (`Rollouts`): its settings, tokenizer, programs
        and scorer.
    """

    def __init__(self, rollouts: Rollouts):
        super().__init__(rollouts)
        settings = rollouts.settings
        self.n, self.groups_per_step = settings.rollout.n, settings.train_batch_size
        self.budget = settings.partial_tokens
        self.sampling = dataclasses.replace(settings.rollout, n=1)
        rows, width = self.groups_per_step * self.n, settings.rollout.max_new_tokens
        # The decode rows: each its group (-1: free) and sample index, its tokens so
        # far, their log-probs, its length, key and the step of its first token.
        self.group = np.full(rows, -1, np.int64)
        self.member = np.zeros(rows, np.int64)
        self.tokens = np.zeros((rows, width), np.int32)
        self.log_probs = np.zeros((rows, width), np.float32)
        self.lengths = np.zeros(rows, np.int32)
        self.keys: np.ndarray | None = None  # [rows, ...] key data, once known
        self.began = np.zeros(rows, np.int64)
        # With the paged cache, the step's rounds' preemptions and most pages held.
        self.pages: tuple[float, float] | None = None
        # With `rollout.partial_keep_cache`, the last round's cache (`sampler.Carried`)
        # and the rows it holds, running on under the same weights: the next round of
        # the step prefills only their last token. Not across steps (new weights); the
        # settings refuse it with the heads split over the mesh (the cache would leave
        # the program gathered), and so does this for sliding-window layers, whose
        # rings `continue_rows` cannot move.
        self.carried = None
        self.cached = np.zeros(rows, bool)
        self.keep_cache = settings.partial_keep_cache
        if self.keep_cache and not sampler.carries_cache(rollouts.model_config):
            raise ConfigError("rollout.partial_keep_cache: =True is not supported for "
                              "models with sliding-window layers (their ring caches hold "
                              "slots by index and cannot be moved between rounds); set it "
                              "to False")
        self.groups: dict[int, _Group] = {}
        self.complete: collections.deque[int] = collections.deque()
        self.drawn: collections.deque[Row] = collections.deque()  # drawn, not started
        self.next_group = 0

    # -- a step ---------------------------------------------------------------------------

    def next(self, state, iterator: BatchIterator, key, *, step: int, timer) -> Sampled:
        return timer("gen", self._sample, state, iterator, key, step)

    def _sample(self, state, iterator: BatchIterator, key, step: int) -> Sampled:
        """Rounds until `train_batch_size` groups are complete; the batch of the first
        that many, its scoring started."""
        # Every row finishes within ceil(R / budget) rounds of starting, so that many
        # rounds and one to start them complete every group in the decode rows: at
        # least train_batch_size.
        most = math.ceil(self.sampling.max_new_tokens / self.budget) + 1
        rounds, self.pages = 0, None
        while len(self.complete) < self.groups_per_step:
            if rounds == most:
                raise RuntimeError(f"partial rollouts: {len(self.complete)} groups complete "
                                   f"after {rounds} rounds, fewer than "
                                   f"{self.groups_per_step}")
            self._round(state, iterator, jax.random.fold_in(key, rounds), step)
            rounds += 1
        # No cache across steps: the update changes the weights (and needs the memory).
        self.carried, self.cached[:] = None, False
        ids = [self.complete.popleft() for _ in range(self.groups_per_step)]
        groups = [self.groups.pop(i) for i in ids]
        rollout, began = self._batch(groups)
        rows = [g.row for g in groups]
        scores = self.rollouts.score(rows, Generated(rollout, {}), self.n)
        lag = step - began
        metrics = {
            "rollout/partial_rounds": float(rounds),
            "rollout/partial_in_flight_rows": float(np.sum(self.group >= 0)),
            "rollout/partial_waiting_groups": float(len(self.complete)),
            "rollout/partial_continued_fraction": float(np.mean(lag > 0)),
            "rollout/partial_staleness/mean": float(np.mean(lag)),
            "rollout/partial_staleness/max": float(np.max(lag)),
        }
        if self.pages is not None:  # the paged cache's, over the step's rounds
            metrics["rollout/preemptions"], metrics["rollout/page_usage"] = self.pages
        return Sampled(rows, rollout, scores, metrics)

    def _round(self, state, iterator: BatchIterator, key, step: int) -> None:
        """Fills the free decode rows with new prompts' samples, continues every row by
        at most `budget` tokens and files the rows that finished."""
        rollouts, n = self.rollouts, self.n
        free = np.flatnonzero(self.group < 0)
        new_rows = self._draw(iterator, len(free) // n)
        if new_rows:
            settings = rollouts.settings
            prompt_ids, prompt_mask = encode_prompts(
                rollouts.tokenizer, new_rows, settings.max_prompt_length, rollouts.chat,
                rollouts.turns.prompt_schemas)
            sampler.check_inputs(prompt_ids, prompt_mask, self.sampling, rollouts.model_config)
            keys = np.asarray(_group_keys(key, self.groups_per_step, n))
            if self.keys is None:
                self.keys = np.zeros((len(self.group), *keys.shape[1:]), keys.dtype)
            for j, row in enumerate(new_rows):
                self.groups[self.next_group] = _Group(row, prompt_ids[j], prompt_mask[j])
                slots = free[j * n:(j + 1) * n]
                self.group[slots], self.member[slots] = self.next_group, np.arange(n)
                self.tokens[slots], self.log_probs[slots], self.lengths[slots] = 0, 0.0, 0
                self.keys[slots], self.began[slots] = np.asarray(keys[j * n:(j + 1) * n]), step
                self.cached[slots] = False
                self.next_group += 1
        out = self._continue(state)
        self.carried = out.carried
        if out.preemptions is not None:  # the paged cache's: summed, and the most held
            preempted = float(np.sum(sharding_lib.host_array(out.preemptions)))
            usage = float(np.max(sharding_lib.host_array(out.page_usage)))
            before = self.pages or (0.0, 0.0)
            self.pages = (before[0] + preempted, max(before[1], usage))
        finished = np.asarray(sharding_lib.host_array(out.finished)).astype(bool)
        self.tokens = np.array(sharding_lib.host_array(out.responses))
        self.log_probs = np.array(sharding_lib.host_array(out.rollout_log_probs))
        self.lengths = np.array(sharding_lib.host_array(out.response_lengths))
        for slot in np.flatnonzero(finished & (self.group >= 0)):
            group = self.groups[self.group[slot]]
            group.done[int(self.member[slot])] = (
                self.tokens[slot].copy(), self.log_probs[slot].copy(),
                int(self.lengths[slot]), int(self.began[slot]))
            if len(group.done) == n:
                self.complete.append(int(self.group[slot]))
            self.group[slot] = -1
        self.cached = (self.group >= 0) & (self.carried is not None)

    def _continue(self, state) -> sampler.RolloutOutput:
        """One round on the devices: every decode row continued (free rows as finished
        rows of length 0 on a live row's prompt: prefilled, drawing nothing)."""
        rollouts = self.rollouts
        live = self.group >= 0
        stand_in = self.groups[int(self.group[np.argmax(live)])]
        prompts = [self.groups[int(g)] if g >= 0 else stand_in for g in self.group]
        prompt_ids = np.stack([g.prompt_ids for g in prompts])
        prompt_mask = np.stack([g.prompt_mask for g in prompts])
        longest = int(np.max(np.where(live, self.lengths, 0)))
        width = programs.prefix_width(longest, self.budget, self.sampling.max_new_tokens)
        prefix = sampler.Prefix(
            responses=self.tokens[:, :width], log_probs=self.log_probs[:, :width],
            lengths=np.where(live, self.lengths, 0).astype(np.int32), finished=~live,
            keys=self.keys, cached=self.cached & live)
        put = rollouts.sharder.put_batch
        prompt_ids, prompt_mask = put((prompt_ids, prompt_mask))
        prefix = put(prefix)
        with rollouts.sampling_sharder.active():  # traced with the rollout's layout
            program = rollouts.programs.continuer(self.sampling, self.budget, self.keep_cache)
            carried, self.carried = self.carried, None  # freed once the round has read it
            return program(state, prompt_ids, prompt_mask, prefix, rollouts.frozen, carried)

    def _draw(self, iterator: BatchIterator, count: int) -> list[Row]:
        """The next `count` prompt rows (the iterator's batches, taken in order)."""
        while len(self.drawn) < count:
            self.drawn.extend(iterator.next_batch())
        return [self.drawn.popleft() for _ in range(count)]

    def _batch(self, groups: list[_Group]) -> tuple[types.Rollout, np.ndarray]:
        """The step's `Rollout` of complete groups (samples in order), on the devices,
        and the step of each row's first token."""
        n, width = self.n, self.sampling.max_new_tokens
        samples = [g.done[j] for g in groups for j in range(n)]
        lengths = np.array([s[2] for s in samples])
        mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int32)
        arrays = dict(
            prompt_ids=np.repeat(np.stack([g.prompt_ids for g in groups]), n, axis=0),
            prompt_mask=np.repeat(np.stack([g.prompt_mask for g in groups]), n, axis=0),
            responses=np.where(mask > 0, np.stack([s[0] for s in samples]),
                               self.sampling.pad_token_id).astype(np.int32),
            response_mask=mask,
            rollout_log_probs=(np.where(mask > 0, np.stack([s[1] for s in samples]), 0.0)
                               .astype(np.float32) if self.sampling.do_sample else None))
        # (the shapes and types `programs.continued_rollout` gives the programs compiled
        # ahead)
        rollout = types.Rollout(**self.rollouts.sharder.put_batch(arrays))
        return rollout, np.array([s[3] for s in samples])

    # -- checkpoints ----------------------------------------------------------------------

    def checkpoint_items(self) -> dict:
        left = int(np.sum(self.group >= 0)) + len(self.complete) * self.n
        if left or self.drawn:
            _log.warning(
                "partial rollouts: a checkpoint keeps the data position after the prompts "
                "drawn; %d samples in flight or waiting (%d prompts begun) and %d prompts "
                "drawn but not begun are not saved, and a run resumed from it goes on "
                "with the next prompts", left, len(self.groups), len(self.drawn))
        return {}
