"""Scorer of the synthetic arithmetic task: exact match, with digit credit reported beside it."""

from jrl.data.synthetic import DATA_SOURCE


def digit_credit(response: str, answer: str) -> float:
    """Share of answer positions, aligned by place value (from the right), that match.

    Divided by the longer of the two strings, so extra or missing digits cost.
    """
    if not response:
        return 0.0
    matches = sum(a == b for a, b in zip(reversed(response), reversed(answer), strict=False))
    return matches / max(len(response), len(answer))


def compute_score(data_source, solution_str: str, ground_truth: str, extra_info=None) -> dict:
    """`{"score": 1 if exact else 0, "acc": same, "digits": digit credit}`.

    Exact match ignores surrounding whitespace. `digits` is logged, not rewarded:
    partial credit for almost-right sums slowed learning in our runs.
    """
    del data_source, extra_info
    response, answer = solution_str.strip(), str(ground_truth).strip()
    exact = float(response == answer)
    return {"score": exact, "acc": exact, "digits": digit_credit(response, answer)}


__all__ = ["DATA_SOURCE", "compute_score", "digit_credit"]
