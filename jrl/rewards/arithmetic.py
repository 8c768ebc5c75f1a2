"""Exact-match scorer of the synthetic arithmetic task."""

from jrl.data.synthetic import DATA_SOURCE


def compute_score(data_source, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """1.0 when the response (surrounding whitespace ignored) is exactly the answer, else 0.0."""
    del data_source, extra_info
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


__all__ = ["DATA_SOURCE", "compute_score"]
