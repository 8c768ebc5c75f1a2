"""Rule-based reward functions chosen by a row's `data_source`.

A reward function has verl's signature
`fn(data_source, solution_str, ground_truth, extra_info) -> float | dict`
(a dict must hold the score under "score"; its other entries are logged).
"""

from __future__ import annotations

from collections.abc import Callable

from jrl.rewards import arithmetic, gsm8k, math_answers

RewardFn = Callable[..., "float | dict"]

_BY_SOURCE: dict[str, RewardFn] = {
    arithmetic.DATA_SOURCE: arithmetic.compute_score,
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


def register(data_source: str, fn: RewardFn) -> None:
    """Makes `default_compute_score` send `data_source` to `fn` (in this process only)."""
    _BY_SOURCE[data_source] = fn
