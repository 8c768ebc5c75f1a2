"""`evaluate`: every row answered once, batches padded to one size (a multiple of the
mesh's batch split) with the padding never scored, metrics as `validation_metrics`."""

import numpy as np
import pytest

from jrl import metrics
from jrl.rl import evaluate


def _rows(k):
    return [{"data_source": "src", "prompt": f"q{i}", "answer": float(i % 2)} for i in range(k)]


def test_every_row_is_scored_once_and_batches_are_padded():
    rows, n, calls = _rows(5), 2, []

    def respond(batch, padded, start):
        calls.append((start, [r["prompt"] for r in batch], [r["prompt"] for r in padded]))
        scores = np.repeat([r["answer"] for r in batch], n)  # rows 1 and 3 score 1
        texts = [f"{r['prompt']}-{j}" for r in batch for j in range(n)]
        return scores, {"acc": scores}, 0, texts

    out = evaluate.evaluate(rows, respond, batch_size=2, n=n, batch_multiple=4)
    # Batches of 2 prompts padded to 4 (the multiple); the last batch holds one row.
    assert [c[0] for c in calls] == [0, 2, 4]
    assert calls[2][1] == ["q4"] and calls[2][2] == ["q4"] * 4
    assert all(len(c[2]) == 4 for c in calls)
    assert out["val-core/src/acc/mean@2"] == pytest.approx(2 / 5)
    # The same numbers straight from validation_metrics.
    scores = np.repeat([r["answer"] for r in rows], n).tolist()
    want = metrics.validation_metrics(
        ["src"] * 10, np.repeat(np.arange(5), n).tolist(), {"reward": scores, "acc": scores},
        [f"q{i}-{j}" for i in range(5) for j in range(n)], n)
    assert out == want


def test_a_batch_larger_than_the_rows_is_one_call():
    calls = []

    def respond(batch, padded, start):
        calls.append(len(padded))
        return np.zeros(len(batch)), {}, 0, [""] * len(batch)

    evaluate.evaluate(_rows(3), respond, batch_size=8, n=1, batch_multiple=2)
    assert calls == [4]  # 3 rows rounded up to the multiple of 2, not to batch_size
