"""Synthetic reasoning tasks that need no download: multi-digit arithmetic.

`arithmetic(...)` returns train and held-out rows in verl's schema; the
held-out problems never appear in the training split.
"""

from __future__ import annotations

import itertools
import json

import numpy as np

from jrl.data.dataset import Row
from jrl.errors import ConfigError

DATA_SOURCE = "synthetic/arithmetic"
# The synthetic `data.task`s.
TASKS = ("arithmetic", "tool_multiplication")

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_row(a: int, op: str, b: int, reverse: bool = False, width: int = 0) -> Row:
    """`a op b =` with operands zero-padded to `width` digits (fixed positions make the
    task learnable by a small model in minutes); with `reverse` the answer is written
    least-significant digit first.

    Reversed answers let a small model compute each digit from the digits and the
    carry before it (Lee et al. 2023, "Teaching Arithmetic to Small Transformers").
    """
    answer = str(_OPS[op](a, b))
    if reverse:
        sign, digits = ("-", answer[1:]) if answer.startswith("-") else ("", answer)
        answer = sign + digits[::-1]
    return {
        "prompt": f"{a:0{width}d}{op}{b:0{width}d}=",
        "data_source": DATA_SOURCE,
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {"a": a, "b": b, "op": op, "reversed": reverse},
    }


def add_without_carry(a: int, b: int) -> int:
    """`a + b` digit by digit with every carry dropped (the classic slip): 47 + 38 -> 75."""
    total, place = 0, 1
    while a or b:
        total += (a % 10 + b % 10) % 10 * place
        a, b, place = a // 10, b // 10, place * 10
    return total


def with_carry_slips(rows: list[Row], rate: float, seed: int) -> list[Row]:
    """Copies of `rows` whose demonstration drops the carries, for a share `rate` of the
    addition problems that have a carry.

    The demonstration (`extra_info["demonstration"]`) is what the supervised warm start
    imitates; the ground truth, which the reward checks, stays the true sum. A model
    that imitates such a teacher with `rate > 1/2` answers carrying sums wrongly when
    decoding greedily but still samples the right answer about `1 - rate` of the time:
    the gap between greedy and sampled accuracy that RL with a verifier closes.
    """
    if not 0.0 <= rate <= 1.0:
        raise ConfigError(f"data.carry_slip_rate must be in [0, 1], got {rate}")
    rng = np.random.default_rng(seed)
    out = []
    for row in rows:
        info = row["extra_info"]
        if info["op"] == "+":
            slip = add_without_carry(info["a"], info["b"])
            if slip != info["a"] + info["b"] and rng.random() < rate:
                shown = str(slip)[::-1] if info["reversed"] else str(slip)
                row = {**row, "extra_info": {**info, "demonstration": shown}}
        out.append(row)
    return out


def arithmetic(digits: int = 2, ops: str = "+", num_val: int = 256, num_train: int | None = None,
               seed: int = 0, reverse: bool = False, carry_slip_rate: float = 0.0
               ) -> tuple[list[Row], list[Row]]:
    """All `a op b` with operands of up to `digits` digits, split into train / held-out.

    Args:
      digits: operand size (numbers in `[0, 10**digits)`).
      ops: which operators to use, from "+-*".
      num_val: held-out problems.
      num_train: cap on training problems (None: all the rest).
      seed: the split and order.
      reverse: write answers least-significant digit first.
      carry_slip_rate: share of the carrying training sums whose demonstration drops
        the carries (`with_carry_slips`); held-out rows are untouched.

    Returns:
      `(train_rows, val_rows)`.
    """
    unknown = set(ops) - set(_OPS)
    if unknown or not ops:
        raise ConfigError(f"data.ops must use characters from {''.join(_OPS)}, got {ops!r}")
    limit = 10**digits
    problems = list(itertools.product(range(limit), ops, range(limit)))
    if num_val >= len(problems):
        raise ConfigError(f"data.num_val={num_val} leaves no training problems ({len(problems)})")
    order = np.random.default_rng(seed).permutation(len(problems))
    val = [arithmetic_row(*problems[i], reverse, digits) for i in order[:num_val]]
    rest = order[num_val:] if num_train is None else order[num_val : num_val + num_train]
    train = [arithmetic_row(*problems[i], reverse, digits) for i in rest]
    if carry_slip_rate:
        train = with_carry_slips(train, carry_slip_rate, seed)
    return train, val


TOOL_DATA_SOURCE = "synthetic/tool_multiplication"


def calculator_call(expression: str) -> str:
    """A calculator call in the hermes format (`<tool_call>{json}</tool_call>`)."""
    payload = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(payload, separators=(',', ':'))}</tool_call>"


def tool_multiplication(digits: int = 3, num_val: int = 256, num_train: int = 4096,
                        seed: int = 0, tool_rate: float = 0.3) -> tuple[list[Row], list[Row]]:
    """`a*b` of two `digits`-digit numbers as a chat prompt, answered with a calculator.

    A small model cannot multiply three-digit numbers in its head; with the calculator
    tool (`jrl.tools.Calculator`) it only has to copy. The warm-start demonstrations
    (`extra_info["demonstration"]`, a multi-turn message list) call the calculator and
    copy its answer for a share `tool_rate` of the training rows, and answer "The
    answer is <a guess of the right length>." for the rest: the warm-started model
    mostly guesses when decoding greedily (every guess starts alike, every call with
    `<tool_call>`) but calls the tool now and then when sampling, the gap RL closes.
    Every row gives the calculator its product, as verl's GSM8K rows give their tool
    the answer: `extra_info["tools_kwargs"] = {"calculator": {"create_kwargs":
    {"ground_truth": product}}}` (the built-in calculator ignores it; a grading one,
    configs/tools/graded_calculator.py, rewards a call that computes it).

    Returns:
      `(train_rows, val_rows)`, disjoint, in verl's schema (the prompt a message list).
    """
    if not 0.0 <= tool_rate <= 1.0:
        raise ConfigError(f"data.tool_rate must be in [0, 1], got {tool_rate}")
    low, high = 10 ** (digits - 1), 10**digits
    rng = np.random.default_rng(seed)
    count = num_val + num_train
    if count > (high - low) ** 2:
        raise ConfigError(f"data.num_val + data.num_train = {count} exceeds the "
                          f"{(high - low) ** 2} problems of {digits} digits")
    chosen = rng.choice((high - low) ** 2, size=count, replace=False)
    rows = []
    for i, index in enumerate(chosen):
        a, b = int(low + index // (high - low)), int(low + index % (high - low))
        product = str(a * b)
        if i >= num_val and rng.random() < tool_rate:
            shown = [{"role": "assistant", "content": calculator_call(f"{a}*{b}")},
                     {"role": "tool", "content": product},
                     {"role": "assistant", "content": product}]
        else:
            guess = rng.integers(10 ** (len(product) - 1), 10 ** len(product))
            shown = [{"role": "assistant", "content": f"The answer is {guess}."}]
        rows.append({
            "prompt": [{"role": "user", "content": f"{a}*{b}"}],
            "data_source": TOOL_DATA_SOURCE,
            "reward_model": {"ground_truth": product, "style": "rule"},
            "extra_info": {"a": a, "b": b, "demonstration": shown,
                           "tools_kwargs": {"calculator": {
                               "create_kwargs": {"ground_truth": product}}}},
        })
    return rows[num_val:], rows[:num_val]
