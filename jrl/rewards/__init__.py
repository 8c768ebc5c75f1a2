"""Rule-based reward functions chosen by a row's `data_source`.

A reward function has verl's signature
`fn(data_source, solution_str, ground_truth, extra_info) -> float | dict`
(a dict must hold the score under "score"; its other entries are logged).
"""

from __future__ import annotations

from collections.abc import Callable

from jrl.errors import DataError
from jrl.rewards import arithmetic, gsm8k, math_answers, tool_arithmetic

RewardFn = Callable[..., "float | dict"]

_BY_SOURCE: dict[str, RewardFn] = {
    arithmetic.DATA_SOURCE: arithmetic.compute_score,
    tool_arithmetic.TOOL_DATA_SOURCE: tool_arithmetic.compute_score,
    gsm8k.DATA_SOURCE: gsm8k.compute_score,
    **{source: math_answers.compute_score for source in math_answers.DATA_SOURCES},
}


def default_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Dispatches on `data_source`; unknown sources are an error naming the known ones."""
    if data_source not in _BY_SOURCE:
        raise NotImplementedError(
            f"no reward function for data_source={data_source!r}; known: {sorted(_BY_SOURCE)}. "
            "Set reward.custom_fn=path/to/file.py:name for your own."
        )
    return _BY_SOURCE[data_source](data_source, solution_str, ground_truth, extra_info)


def check_row(row, where: str) -> None:
    """Checks that `default_compute_score` can score `row`: a known `data_source` and a
    `reward_model.ground_truth` that is a non-empty string or a number (every built-in
    scorer compares the answer with `str(ground_truth)`).

    Raises:
      DataError: naming `where`, the field and what would be valid.
    """
    source = row.get("data_source")
    if source not in _BY_SOURCE:
        raise DataError(f"{where}: field 'data_source' is {source!r}, which has no reward "
                        f"function; known: {sorted(_BY_SOURCE)}. Set reward.custom_fn="
                        "path/to/file.py:name to score other sources.")
    truth = (row.get("reward_model") or {}).get("ground_truth")
    number = isinstance(truth, (int, float)) and not isinstance(truth, bool)
    if not number and not (isinstance(truth, str) and truth.strip()):
        got = "nothing" if truth is None else f"{type(truth).__name__} {truth!r}"[:80]
        raise DataError(f"{where}: field 'reward_model.ground_truth' must be a non-empty "
                        f"string or a number (the answer the {source!r} reward compares "
                        f"with); got {got}")


def register(data_source: str, fn: RewardFn) -> None:
    """Makes `default_compute_score` send `data_source` to `fn` (in this process only)."""
    _BY_SOURCE[data_source] = fn
