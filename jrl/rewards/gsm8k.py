"""GSM8K's rule reward (verl's `openai/gsm8k` scorer; ReFT, Luong et al. 2024).

The prompt asks for the final answer after "####". Only the last 300 characters
of the response are searched, which bounds the regex cost of very long responses
(the answer comes at the end).

* `strict`: the last `#### <number>` (exactly one space after the marks); commas
  and `$` are removed from the number.
* `flexible`: the last number-like run of digits, `.`, `,` (optionally negative)
  that is not just "."; kept verbatim, so "1,000" or "42." do not equal "1000" or
  "42" (verl compares the same way).

The answer scores `score` (1.0) when it equals the ground-truth string,
`format_score` (0.0) when one was found but differs, and 0 when none was found.
"""

from __future__ import annotations

import re

DATA_SOURCE = "openai/gsm8k"
CLIP_CHARS = 300
METHODS = ("strict", "flexible")
_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9.,]+")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The final answer of a response, or None when there is none.

    Args:
      solution_str: the decoded response.
      method: "strict" (requires `#### <number>`) or "flexible" (last number).

    Raises:
      ValueError: an unknown method.
    """
    if method not in METHODS:
        raise ValueError(f"GSM8K answer extraction method {method!r}; expected one of {METHODS}")
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        matches = _STRICT.findall(tail)
        return matches[-1].replace(",", "").replace("$", "") if matches else None
    numbers = [m for m in _NUMBER.findall(tail) if m != "."]
    return numbers[-1] if numbers else None


def compute_score(data_source, solution_str: str, ground_truth, extra_info=None, *,
                  method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> dict:
    """Scores one response with verl's reward signature.

    Returns:
      `{"score": score | format_score | 0.0, "acc": 1.0 if correct else 0.0}`.
    """
    del data_source, extra_info
    answer = extract_answer(solution_str, method)
    correct = answer is not None and answer == str(ground_truth)
    if answer is None:
        value = 0.0
    else:
        value = score if correct else format_score
    return {"score": float(value), "acc": float(correct)}
