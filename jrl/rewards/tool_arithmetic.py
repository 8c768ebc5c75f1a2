"""Scorer of the synthetic tool task: the last number of the last assistant turn."""

import re

from jrl.data.synthetic import TOOL_DATA_SOURCE

# The char tokenizer's assistant opening, which starts every turn after a tool block.
_OPENING = "Assistant: "


def final_answer(response: str) -> str:
    """The last integer of the response's last assistant turn ("" when it has none)."""
    numbers = re.findall(r"-?\d+", response.rsplit(_OPENING, 1)[-1])
    return numbers[-1] if numbers else ""


def compute_score(data_source, solution_str: str, ground_truth: str, extra_info=None) -> dict:
    """`{"score": 1 if the last turn's last number is the answer else 0, "acc": same,
    "tool_used": 1 if the response called a tool}`. Only the last turn counts: the
    calculator's own output, earlier in the response, does not."""
    del data_source, extra_info
    exact = float(final_answer(solution_str) == str(ground_truth).strip())
    return {"score": exact, "acc": exact, "tool_used": float("<tool_call>" in solution_str)}


__all__ = ["TOOL_DATA_SOURCE", "compute_score", "final_answer"]
