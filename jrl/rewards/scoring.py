"""Host-side rule scoring of decoded responses, optionally in worker processes.

Sample `i` of a step answers prompt row `i // n` (the n samples of a prompt are
adjacent). Each is scored with verl's signature
`fn(data_source, solution_str, ground_truth, extra_info) -> float | dict`; a dict
must hold "score", and its other numeric entries (e.g. "acc") come back as extras.
A multi-turn sample's `extra_info` is a copy of its row's with verl's
`"rollout_reward_scores"` added: `{tool name: the tool's reward for this sample}`.

With `num_workers > 0` a persistent pool of worker processes scores contiguous
chunks of samples. Workers are started with "spawn", never forked from a process
that holds JAX, and each loads the reward function from its spec (`None` for the
built-in dispatch on `data_source`, or "path/to/file.py:name"), so functions
defined in a user's file work without being picklable. The pool starts when the
scorer is built; `submit` returns a future, so the trainer can score one batch
while the device works on something else. Results do not depend on the number of
workers: each sample is scored by the same code in either case.

Typical use::

    with RewardScorer(fn_spec=None, num_workers=8) as scorer:
        pending = scorer.submit(rows, texts, n)   # returns at once
        ...                                        # device work
        result = pending.result()                  # ScoreResult
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import multiprocessing
import numbers
import os
import signal
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from jrl.data.dataset import Row, ground_truth
from jrl.errors import RewardError

ON_ERROR = ("raise", "score")
CHUNKS_PER_WORKER = 4


class ScoreResult(NamedTuple):
    """Scores of one batch of responses."""

    scores: np.ndarray  # float32 [N]
    extras: dict[str, np.ndarray]  # {name: float32 [N]}; 0 where a sample lacks the entry
    num_errors: int  # samples whose reward function failed (scored `error_score`)
    first_error: str | None = None  # message of the first failure, for the log


def resolve_fn(fn_spec: str | Callable | None) -> Callable:
    """The reward function of a spec: None -> dispatch on data_source; a callable -> itself;
    else a file's fn."""
    if callable(fn_spec):
        return fn_spec
    if fn_spec is None:
        from jrl.rewards import default_compute_score

        return default_compute_score
    from jrl.rewards.custom import load_custom_fn

    return load_custom_fn(fn_spec)


# --------------------------------------------------------------------------- one sample

# A task is (sample index, data_source, solution_str, ground_truth, extra_info).
# An outcome is ("ok", score, extras) or ("error", message).


def _is_number(value: Any) -> bool:
    return isinstance(value, (numbers.Real, np.bool_))


def _as_outcome(result: Any) -> tuple:
    """Checks a reward function's return value and converts it to floats."""
    extras = {}
    if isinstance(result, Mapping):
        if "score" not in result:
            return ("error", f"ValueError: the reward function returned a dict without "
                             f"'score' (keys: {sorted(result)})")
        extras = {k: float(v) for k, v in result.items() if k != "score" and _is_number(v)}
        result = result["score"]
    if not _is_number(result):
        return ("error", f"TypeError: the reward function returned a score of type "
                         f"{type(result).__name__}; expected a number or a dict with 'score'")
    if not math.isfinite(float(result)):
        return ("error", f"ValueError: the reward function returned a non-finite score {result}")
    return ("ok", float(result), extras)


def describe_error(err: BaseException) -> str:
    """`ValueError: cannot parse '17' (reward.py:12)`: the exception on one line, with
    the file and line where it was raised."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {' '.join(str(err).split())}{where}"


def _score_tasks(fn: Callable, tasks: Sequence[tuple]) -> list[tuple]:
    outcomes = []
    for _, data_source, text, truth, extra_info in tasks:
        try:
            outcomes.append(_as_outcome(fn(data_source, text, truth, extra_info)))
        except Exception as err:  # reported per sample; the caller decides to raise
            outcomes.append(("error", describe_error(err)))
    return outcomes


# --------------------------------------------------------------------------- worker process

_WORKER_FN: Callable | None = None


def _init_worker(fn_spec: str | None) -> None:
    global _WORKER_FN
    # Ctrl-C reaches the terminal's whole process group: the main process stops the run
    # (`jrl.app.interrupt`) and then these workers; they must not die under it first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER_FN = resolve_fn(fn_spec)


def _worker_ping() -> bool:
    return _WORKER_FN is not None


def _worker_score(tasks: Sequence[tuple]) -> list[tuple]:
    return _score_tasks(_WORKER_FN, tasks)


# --------------------------------------------------------------------------- scorer


def _tasks(rows: Sequence[Row], texts: Sequence[str], n: int,
           reward_scores: Sequence[Mapping[str, float]] | None = None) -> list[tuple]:
    if n < 1 or len(texts) != len(rows) * n:
        raise ValueError(f"{len(texts)} responses for {len(rows)} prompts with n={n}; expected "
                         f"{len(rows)} * {n} = {len(rows) * n}")
    if reward_scores is not None and len(reward_scores) != len(texts):
        raise ValueError(f"{len(reward_scores)} tool reward sets for {len(texts)} responses")
    tasks = []
    for i, text in enumerate(texts):
        row = rows[i // n]
        extra_info = row.get("extra_info")
        if reward_scores is not None:  # verl's key, in a copy: the n samples differ
            extra_info = {**(extra_info or {}), "rollout_reward_scores": dict(reward_scores[i])}
        tasks.append((i, row["data_source"], text, ground_truth(row), extra_info))
    return tasks


class RewardScorer:
    """Scores responses with a rule reward function, serially or in a process pool.

    Args:
      fn_spec: None for `jrl.rewards.default_compute_score` (by `data_source`),
        "path/to/file.py:name" for a user function, or the function itself (scored in
        this process only).
      num_workers: worker processes; 0 scores in this process, synchronously.
      on_error: "raise" stops at the first failing sample with a `RewardError` (a
        RuntimeError) naming its index, data source and the exception on one line;
        "score" gives it `error_score` and counts it.
      error_score: score of a failed sample with `on_error="score"`.

    Raises:
      ValueError: a bad `num_workers` / `on_error`, or a bad spec (see `load_custom_fn`).
    """

    def __init__(self, fn_spec: str | Callable | None = None, num_workers: int = 0,
                 on_error: str = "raise", error_score: float = 0.0):
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error={on_error!r}; expected one of {ON_ERROR}")
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be >= 0 (0: score in-process)")
        if callable(fn_spec) and num_workers:
            raise ValueError("a reward function passed as a Python object is scored in this "
                             "process (num_workers=0); give worker processes a "
                             "'path/to/file.py:name' spec instead")
        self.fn_spec, self.num_workers = fn_spec, num_workers
        self.on_error, self.error_score = on_error, float(error_score)
        self._fn = resolve_fn(fn_spec)  # errors in the spec surface here, in this process
        self._closed = False
        self._pool = self._start_pool() if num_workers else None
        self._collector = cf.ThreadPoolExecutor(1, "reward-collect") if num_workers else None

    def _start_pool(self) -> cf.ProcessPoolExecutor:
        pool = cf.ProcessPoolExecutor(
            self.num_workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker, initargs=(self.fn_spec,))
        try:  # start every worker now, not during the first training step
            for ping in [pool.submit(_worker_ping) for _ in range(self.num_workers)]:
                ping.result()
        except cf.process.BrokenProcessPool as err:
            pool.shutdown(cancel_futures=True)
            raise RuntimeError(f"reward worker processes failed to start with fn_spec="
                               f"{self.fn_spec!r}; run with num_workers=0 to see the error "
                               "in this process") from err
        return pool

    def submit(self, rows: Sequence[Row], texts: Sequence[str], n: int,
               reward_scores: Sequence[Mapping[str, float]] | None = None) -> cf.Future:
        """Starts scoring; returns a future of `ScoreResult` (already done without workers).

        Args:
          rows: the B prompt rows (verl schema).
          texts: the B·n decoded responses; sample i answers rows[i // n].
          n: responses per prompt.
          reward_scores: per response, a multi-turn rollout's tool rewards by tool name,
            given as `extra_info["rollout_reward_scores"]` (None: single-turn, no key).
        """
        if self._closed:
            raise RuntimeError("RewardScorer.submit after close()")
        tasks = _tasks(rows, texts, n, reward_scores)
        if self._pool is None:
            future = cf.Future()
            try:
                future.set_result(self._assemble(tasks, _score_tasks(self._fn, tasks)))
            except Exception as err:
                future.set_exception(err)
            return future
        num_chunks = min(len(tasks), self.num_workers * CHUNKS_PER_WORKER) or 1
        bounds = np.linspace(0, len(tasks), num_chunks + 1).astype(int).tolist()
        chunks = [tasks[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
        pending = [self._pool.submit(_worker_score, chunk) for chunk in chunks]
        return self._collector.submit(
            lambda: self._assemble(tasks, [o for f in pending for o in f.result()]))

    def score(self, rows: Sequence[Row], texts: Sequence[str], n: int,
              reward_scores: Sequence[Mapping[str, float]] | None = None) -> ScoreResult:
        """`submit(...).result()`: scores `[N]`, extras `{name: [N]}`, error count."""
        return self.submit(rows, texts, n, reward_scores).result()

    def _assemble(self, tasks: Sequence[tuple], outcomes: Sequence[tuple]) -> ScoreResult:
        scores = np.zeros(len(tasks), np.float32)
        extras: dict[str, np.ndarray] = {}
        num_errors, first_error = 0, None
        for (i, data_source, *_), outcome in zip(tasks, outcomes, strict=True):
            if outcome[0] == "error":
                message = (f"reward function failed on sample {i} "
                           f"(data_source={data_source!r}): {outcome[1]}")
                if self.on_error == "raise":
                    raise RewardError(f"{message}; set reward.on_error=score to give such "
                                      f"samples reward.error_score={self.error_score:g} "
                                      "and go on")
                num_errors, first_error = num_errors + 1, first_error or message
                scores[i] = self.error_score
                continue
            scores[i] = outcome[1]
            for key, value in outcome[2].items():
                extras.setdefault(key, np.zeros(len(tasks), np.float32))[i] = value
        return ScoreResult(scores, extras, num_errors, first_error)

    def close(self) -> None:
        """Stops the worker processes (idempotent); the scorer cannot be used afterwards."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._collector.shutdown()
            self._pool = self._collector = None

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self):
        # A scorer dropped without close() must not leave worker processes behind.
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
