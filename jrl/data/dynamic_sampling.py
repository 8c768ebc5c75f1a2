"""DAPO's dynamic sampling on the host (Yu et al. 2025, "DAPO", section 3.2).

A group (the n responses to one prompt) whose rewards are all equal gives GRPO
zero advantage everywhere, so it only dilutes the batch. Dynamic sampling drops
such groups and generates more batches until `target_groups` groups with varying
rewards are collected; the batch is then cut to exactly `target_groups` groups,
the earliest first (verl's `algorithm.filter_groups`).

`fill_batch` is the loop; `GroupAccumulator` holds the kept groups between rounds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from jrl.data.dataset import Row


def groups_with_variance(metric: np.ndarray, n: int) -> np.ndarray:
    """Which groups to keep: those whose metric values are not all equal.

    A group of one sample (n = 1) is always kept, as verl does.

    Args:
      metric: `[N]` per-sample metric (e.g. sequence score or accuracy), groups of
        `n` adjacent samples.
      n: samples per group.

    Returns:
      bool `[N / n]`.

    Raises:
      ValueError: `metric` is not 1-D or its length is not a multiple of `n`.
    """
    metric = np.asarray(metric)
    if n < 1 or metric.ndim != 1 or metric.shape[0] % n:
        raise ValueError(f"metric of shape {metric.shape} cannot be split into groups of "
                         f"n={n} adjacent samples")
    groups_gn = metric.reshape(-1, n)
    varies_g = (groups_gn != groups_gn[:, :1]).any(axis=1)
    return varies_g | (n == 1)


class FilledBatch(NamedTuple):
    """A full batch of kept groups and what it took to collect it."""

    arrays: dict[str, np.ndarray]  # {name: [target_groups·n, ...]}
    rows: list[Row]  # [target_groups] prompt rows
    num_gen_batches: int  # generation rounds used (verl's train/num_gen_batches)
    num_filtered_groups: int  # groups dropped for equal metrics
    num_surplus_groups: int  # kept groups beyond target_groups, discarded


class GroupAccumulator:
    """Collects kept groups across generation rounds until `target_groups` are in.

    Args:
      target_groups: prompt groups per training batch (data.train_batch_size).
      n: samples per group (actor_rollout_ref.rollout.n).
    """

    def __init__(self, target_groups: int, n: int):
        if target_groups < 1 or n < 1:
            raise ValueError(f"target_groups={target_groups} and n={n} must be positive")
        self.target_groups, self.n = target_groups, n
        self._reset()

    def _reset(self) -> None:
        self._arrays: list[dict[str, np.ndarray]] = []
        self._rows: list[Row] = []
        self.num_gen_batches = 0
        self.num_filtered_groups = 0

    @property
    def num_groups(self) -> int:
        """Kept groups collected so far."""
        return len(self._rows)

    @property
    def is_full(self) -> bool:
        return self.num_groups >= self.target_groups

    def _check(self, arrays: Mapping[str, np.ndarray], rows: Sequence[Row],
               keep: np.ndarray) -> None:
        if keep.shape != (len(rows),) or keep.dtype != bool:
            raise ValueError(f"keep must be bool [{len(rows)}] (one per prompt row); got "
                             f"{keep.dtype} {keep.shape}")
        for key, value in arrays.items():
            if np.shape(value)[:1] != (len(rows) * self.n,):
                raise ValueError(f"array {key!r} has shape {np.shape(value)}; expected a "
                                 f"leading axis of {len(rows)} rows * n={self.n} samples")
        if self._arrays and set(arrays) != set(self._arrays[0]):
            raise ValueError(f"arrays {sorted(arrays)} differ from the keys of the first "
                             f"round {sorted(self._arrays[0])}")

    def add(self, arrays: Mapping[str, np.ndarray], rows: Sequence[Row],
            keep: np.ndarray) -> None:
        """Adds one generation round's kept groups.

        Args:
          arrays: `{name: [B·n, ...]}` host arrays, samples of a group adjacent.
          rows: the B prompt rows of the round.
          keep: bool `[B]`, e.g. from `groups_with_variance`.
        """
        keep = np.asarray(keep)
        self._check(arrays, rows, keep)
        keep_samples = np.repeat(keep, self.n)
        self._arrays.append({k: np.asarray(v)[keep_samples] for k, v in arrays.items()})
        self._rows.extend(row for row, kept in zip(rows, keep, strict=True) if kept)
        self.num_gen_batches += 1
        self.num_filtered_groups += int((~keep).sum())

    def take(self) -> FilledBatch:
        """The first `target_groups` kept groups, in order; resets the accumulator.

        Raises:
          RuntimeError: fewer than `target_groups` groups collected.
        """
        if not self.is_full:
            raise RuntimeError(f"only {self.num_groups} of {self.target_groups} groups "
                               "collected; add more generation rounds before take()")
        size = self.target_groups * self.n
        arrays = {k: np.concatenate([a[k] for a in self._arrays])[:size]
                  for k in self._arrays[0]}
        batch = FilledBatch(arrays, self._rows[:self.target_groups], self.num_gen_batches,
                            self.num_filtered_groups, self.num_groups - self.target_groups)
        self._reset()
        return batch


def check_gen_batches(num_gen_batches: int, max_num_gen_batches: int, num_groups: int,
                      target_groups: int, n: int) -> None:
    """Stops a step that used its generation rounds without filling the batch.

    Args:
      num_gen_batches: generation rounds so far in this step.
      max_num_gen_batches: algorithm.filter_groups.max_num_gen_batches (<= 0: no limit).
      num_groups: groups with varying rewards collected.
      target_groups: groups needed (data.train_batch_size).
      n: samples per group.

    Raises:
      RuntimeError: the limit is reached and the batch is not full; the message says
        how many groups were collected and what to change.
    """
    if num_groups >= target_groups or max_num_gen_batches <= 0:
        return
    if num_gen_batches < max_num_gen_batches:
        return
    raise RuntimeError(
        f"dynamic sampling collected {num_groups} of the {target_groups} prompt groups with "
        f"varying rewards it needs (data.train_batch_size) in {num_gen_batches} generation "
        "batches, the limit set by algorithm.filter_groups.max_num_gen_batches="
        f"{max_num_gen_batches}. The prompts may be too easy or too hard for the model. Raise "
        "algorithm.filter_groups.max_num_gen_batches (0 = no limit), generate more groups per "
        f"round (data.gen_batch_size) or more samples per prompt (rollout.n={n}) so that more "
        "groups vary, or lower data.train_batch_size."
    )


# sample(rows, round) -> (arrays {name: [B·n, ...]}, metric [B·n]): one generation round's
# host arrays and the per-sample values that must vary within a kept group.
Sample = Callable[[list[Row], int], tuple[Mapping[str, np.ndarray], np.ndarray]]


def fill_batch(next_rows: Callable[[], list[Row]], sample: Sample, *, target_groups: int,
               n: int, max_num_gen_batches: int) -> FilledBatch:
    """Generation rounds of `next_rows()` prompts until `target_groups` groups whose metric
    varies are in; the batch is the earliest `target_groups` of them.

    Raises:
      RuntimeError: `max_num_gen_batches` (> 0) rounds did not fill the batch.
    """
    acc = GroupAccumulator(target_groups, n)
    while not acc.is_full:
        rows = next_rows()
        arrays, metric = sample(rows, acc.num_gen_batches)
        acc.add(arrays, rows, groups_with_variance(metric, n))
        check_gen_batches(acc.num_gen_batches, max_num_gen_batches, acc.num_groups,
                          target_groups, n)
    return acc.take()
