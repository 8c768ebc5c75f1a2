r"""MATH's rule reward: the last `\boxed{...}` answer, compared after normalisation.

This is the rule verl applies to the MATH data sources (Hendrycks et al. 2021's
answer normalisation, as in lm-evaluation-harness): both the boxed answer and the
ground truth are rewritten to a canonical string and compared for equality. No
symbolic algebra: `\frac{2}{4}` does not equal `\frac{1}{2}`.

Extraction (`last_boxed`):
  * when the response contains `\boxed ` (command, space, argument), the text
    after the last one up to the next `$`;
  * otherwise the brace-balanced argument of the last `\boxed{`, or, without
    any `\boxed`, of the last `\fbox{` (verl finds `\fbox` too but then fails to
    unwrap it and scores 0; here it counts as an answer).

Normalisation (`normalize_answer`), in order: drop newlines, `\!`; `\\` -> `\`;
`tfrac`/`dfrac` -> `frac`; drop `\left`, `\right`, degree marks `^{\circ}`/`^\circ`,
`\$`; a unit written as `\text{ ...}` at the right is cut off; drop `\%`;
`.5` -> `0.5` (after a space, a brace or at the start); a short left-hand side
`k = ` is dropped; `\sqrt3` -> `\sqrt{3}`; spaces removed; `\frac12` ->
`\frac{1}{2}`, `\frac1{72}` -> `\frac{1}{72}`; `0.5` -> `\frac{1}{2}`; an integer
ratio `3/4` -> `\frac{3}{4}`. A string the rules cannot parse (e.g. two
`\text{ ` units, a dangling `\sqrt`) is compared verbatim.
"""

from __future__ import annotations

DATA_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_UNIT = "\\text{ "


class UnparsableAnswer(ValueError):
    """The normalisation rules do not apply; the strings are compared as they are."""


def _braced_argument(text: str, start: int) -> str | None:
    """Content of the brace group opening at `text[start] == "{"`, or None if unclosed."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1 : i]
    return None


def last_boxed(text: str) -> str | None:
    r"""The final boxed answer of a solution (see the module docstring), or None."""
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0]
    for command in _BOX_COMMANDS:
        index = text.rfind(command)
        if index >= 0:
            brace = index + len(command)
            if brace < len(text) and text[brace] == "{":
                return _braced_argument(text, brace)
            return None
    return None


def _strip_right_unit(s: str) -> str:
    if _UNIT not in s:
        return s
    parts = s.split(_UNIT)
    if len(parts) != 2:
        raise UnparsableAnswer(s)
    return parts[0]


def _fix_sqrt(s: str) -> str:
    pieces = s.split("\\sqrt")
    out = pieces[0]
    for piece in pieces[1:]:
        if not piece:
            raise UnparsableAnswer(s)
        out += "\\sqrt" + (piece if piece[0] == "{" else "{" + piece[0] + "}" + piece[1:])
    return out


def _fix_fracs(s: str) -> str:
    pieces = s.split("\\frac")
    out = pieces[0]
    for piece in pieces[1:]:
        if not piece:
            raise UnparsableAnswer(s)
        if piece[0] == "{":
            out += "\\frac" + piece
        elif len(piece) < 2:
            return s
        elif piece[1] == "{":
            out += "\\frac{" + piece[0] + "}" + piece[1:]
        else:
            out += "\\frac{" + piece[0] + "}{" + piece[1] + "}" + piece[2:]
    return out


def _is_plain_int(s: str) -> bool:
    try:
        return s == str(int(s))
    except ValueError:
        return False


def _fix_slash(s: str) -> str:
    parts = s.split("/")
    if len(parts) == 2 and all(map(_is_plain_int, parts)):
        return "\\frac{" + parts[0] + "}{" + parts[1] + "}"
    return s


def normalize_answer(answer: str) -> str:
    """The canonical form of a MATH answer (rules in the module docstring).

    Raises:
      UnparsableAnswer (a ValueError): the rules do not apply to this string.
    """
    s = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    for mark in ("\\left", "\\right", "^{\\circ}", "^\\circ", "\\$"):
        s = s.replace(mark, "")
    s = _strip_right_unit(s).replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _fix_fracs(_fix_sqrt(s).replace(" ", ""))
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_slash(s)


def is_equiv(answer: str, ground_truth: str) -> bool:
    """Equal after normalisation (or verbatim, when either cannot be normalised)."""
    try:
        return normalize_answer(answer) == normalize_answer(ground_truth)
    except UnparsableAnswer:
        return answer == ground_truth


def compute_score(data_source, solution_str: str, ground_truth, extra_info=None) -> dict:
    """Scores one response with verl's reward signature.

    Returns:
      `{"score": 1.0 if the last boxed answer is equivalent else 0.0, "acc": same}`.
    """
    del data_source, extra_info
    answer = last_boxed(solution_str)
    correct = float(answer is not None and is_equiv(answer, str(ground_truth)))
    return {"score": correct, "acc": correct}
