"""Validation: the held-out prompts answered with `rollout.val_kwargs` sampling and
scored, as verl's `val-core/*` and `val-aux/*` metrics.

`evaluate` is a function of a `respond` callable (the current weights' rollout and
the scorer), so the trainer, a benchmark or a test can evaluate any weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jrl import metrics
from jrl.data.dataset import Row
from jrl.rewards.responses import Scored

# respond(rows, padded_rows, start) -> what `ResponseScorer.submit`'s function returns
# for the n samples of each of `rows`; `padded_rows` (rows plus copies of the last) is
# what to generate for, `start` the index of rows[0] (to fold into the sampling key).
Respond = Callable[[Sequence[Row], Sequence[Row], int], Scored]


def evaluate(rows: Sequence[Row], respond: Respond, *, batch_size: int, n: int,
             batch_multiple: int = 1) -> dict[str, float]:
    """Answers and scores every row in batches of `batch_size`; returns the metrics.

    Every batch has the same number of prompts (one compilation), a multiple of
    `batch_multiple` (the mesh's batch split): the last one is padded with copies of
    its last row, which are generated but not scored.
    """
    sources, index, answers = [], [], []
    values: dict[str, list[float]] = {}
    padded_size = -(-min(batch_size, len(rows)) // batch_multiple) * batch_multiple
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        padded = list(batch) + [batch[-1]] * (padded_size - len(batch))
        scores, extras, _, texts = respond(batch, padded, start)
        values.setdefault("reward", []).extend(scores.tolist())
        for name, column in extras.items():
            values.setdefault(name, []).extend(column.tolist())
        for i, text in enumerate(texts):
            sources.append(batch[i // n]["data_source"])
            index.append(start + i // n)
            answers.append(text.strip())
    return metrics.validation_metrics(sources, index, values, answers, n)
