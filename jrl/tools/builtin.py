"""Built-in tools: an exact calculator and a sandboxed Python expression evaluator."""

from __future__ import annotations

import ast
import json
import math
import operator
import os
import re
import subprocess
import sys
from fractions import Fraction

from jrl.errors import ConfigError
from jrl.tools import sandbox
from jrl.tools.base import Tool, ToolError

Number = int | Fraction | float

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_EXPONENT = re.compile(r"[eE]([-+]?\d+)$")


def calculate(expression: str, max_digits: int = 4000) -> str:
    """Evaluates arithmetic exactly and prints the result.

    Integers and decimal literals are exact rationals, so "0.1 + 0.2" is "0.3" and
    "(1/3) * 3" is "1". An exact result prints as an integer, or as a decimal when its
    expansion ends; otherwise (1/3, or a fractional power) as the nearest float.

    Args:
      expression: + - * / // % ** and parentheses over integer and decimal literals,
        with unary minus.
      max_digits: the most digits of any power, literal or result; larger ones are
        refused before they are computed.

    Returns:
      The result, e.g. "56088" for "123 * 456", "3.5" for "7 / 2".

    Raises:
      ToolError: the syntax is not arithmetic, a division by zero, or a result too big.
    """
    source = expression.strip()
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError as err:
        raise ToolError(f"invalid expression: {err.msg}") from None
    except (ValueError, RecursionError) as err:  # e.g. a literal past Python's digit limit
        raise ToolError(f"invalid expression: {err}") from None
    try:
        return _format(_evaluate(tree.body, source, max_digits), max_digits)
    except RecursionError:
        raise ToolError("expression is nested too deeply") from None
    except OverflowError:
        raise ToolError("result too large for a floating-point number") from None


def _evaluate(node: ast.AST, source: str, max_digits: int) -> Number:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _literal(node, source, max_digits)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand, source, max_digits))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ToolError("'^' is not supported; use ** for powers")
    if isinstance(node, ast.BinOp) and (type(node.op) in _BINARY or isinstance(node.op, ast.Pow)):
        left = _evaluate(node.left, source, max_digits)
        right = _evaluate(node.right, source, max_digits)
        try:
            if isinstance(node.op, ast.Pow):
                return _power(left, right, max_digits)
            if isinstance(node.op, ast.Div) and not isinstance(left, float | Fraction):
                left = Fraction(left)  # int / int stays exact
            return _exact(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
    got = ast.get_source_segment(source, node) or type(node).__name__
    raise ToolError(f"unsupported element {got!r}: only numbers, + - * / // % ** and "
                    "parentheses are allowed")


def _literal(node: ast.Constant, source: str, max_digits: int) -> Number:
    if isinstance(node.value, int):
        if _too_long(node.value, max_digits):
            raise ToolError(f"number has more than {max_digits} digits")
        return node.value
    # The literal's text, not the float Python read from it, so "0.1" is exactly 1/10.
    text = (ast.get_source_segment(source, node) or repr(node.value)).replace("_", "")
    exponent = _EXPONENT.search(text)
    if exponent and abs(int(exponent.group(1))) > max_digits:
        raise ToolError(f"number {text!r} has more than {max_digits} digits")
    return _exact(Fraction(text))


def _power(base: Number, exponent: Number, max_digits: int) -> Number:
    if isinstance(exponent, int) and not isinstance(base, float):
        base = Fraction(base)
        size = max(abs(base.numerator), base.denominator)
        if size > 1 and abs(exponent) * math.log10(size) > max_digits:
            raise ToolError(f"result of the power would have more than {max_digits} digits")
        return _exact(base**exponent)
    value = float(base) ** float(exponent)
    if isinstance(value, complex):
        raise ToolError("result is not a real number")
    return value


def _exact(value: Number) -> Number:
    """Rationals with denominator 1 as ints, so the next operation stays on integers."""
    if isinstance(value, Fraction) and value.denominator == 1:
        return value.numerator
    return value


def _format(value: Number, max_digits: int) -> str:
    if isinstance(value, int):
        if _too_long(value, max_digits):
            raise ToolError(f"result has more than {max_digits} digits")
        return str(value)
    if isinstance(value, Fraction):
        return _decimal(value, max_digits) or repr(float(value))
    return repr(value)


def _too_long(integer: int, max_digits: int) -> bool:
    return integer.bit_length() * math.log10(2) > max_digits


def _decimal(value: Fraction, max_digits: int) -> str | None:
    """The exact decimal expansion when it ends within `max_digits` places, else None."""
    denominator, twos, fives = value.denominator, 0, 0
    while denominator % 2 == 0:
        denominator, twos = denominator // 2, twos + 1
    while denominator % 5 == 0:
        denominator, fives = denominator // 5, fives + 1
    places = max(twos, fives)
    if denominator != 1 or places > max_digits:
        return None
    scaled = abs(value.numerator) * 10**places // value.denominator
    if _too_long(scaled, max_digits):
        return None
    digits = str(scaled).rjust(places + 1, "0")
    sign = "-" if value < 0 else ""
    return f"{sign}{digits[:-places]}.{digits[-places:]}"


class Calculator(Tool):
    """Exact arithmetic on an `expression` argument (see `calculate`); no step reward.

    `create` keeps whatever the row's `create_kwargs` hold and reads none of them (the
    `tool_multiplication` rows give a `ground_truth`: configs/tools/graded_calculator.py
    grades calls by it).

    Config:
      max_length: the longest expression accepted, in characters.
      max_digits: the most digits of a power, literal or result.
    """

    default_schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluates an arithmetic expression exactly. Supports + - * / "
                           "// % ** and parentheses on integers and decimals.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {
                    "type": "string", "description": "The expression, e.g. '(12 + 3) * 4'."}},
                "required": ["expression"],
            },
        },
    }
    config_defaults = {"max_length": 1000, "max_digits": 4000}

    def execute(self, instance_id: str, arguments: dict) -> tuple[str, float, dict]:
        """The result's text, reward 0, no metrics; a bad expression raises ToolError."""
        expression = str(arguments["expression"])
        if len(expression) > self.config["max_length"]:
            raise ToolError(f"expression is longer than {self.config['max_length']} characters")
        return calculate(expression, self.config["max_digits"]), 0.0, {}


class PythonExpression(Tool):
    """Evaluates one Python expression in a child process killed at a time limit.

    The argument is `code` (or `expression`, for a schema that names it so). The
    expression sees whitelisted builtins (abs, min, max, sum, len, range, round, sorted,
    int, float, str, list and a few more), math's functions and constants, and `math`
    itself; imports, dunder names and underscore attributes are refused (see
    `jrl.tools.sandbox`). The text returned is the repr of the value.

    Config:
      timeout_s: wall-clock limit of one evaluation, child start included.
      memory_mb: address-space limit of the child.
      max_output_chars: longer results are cut to this length.
    """

    default_schema = {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Evaluates a single Python expression and returns its value. "
                           "math functions (sqrt, factorial, gcd, ...) and abs, min, max, "
                           "sum, len, range, round, sorted are available; no imports.",
            "parameters": {
                "type": "object",
                "properties": {"code": {
                    "type": "string",
                    "description": "One expression, e.g. 'sum(i * i for i in range(10))'."}},
                "required": ["code"],
            },
        },
    }
    config_defaults = {"timeout_s": 2.0, "memory_mb": 512, "max_output_chars": 2000}

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        super().__init__(config, tool_schema)
        timeout = self.config["timeout_s"]
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ConfigError(f"PythonExpression config timeout_s must be a positive number "
                              f"of seconds, got {timeout!r}")

    def execute(self, instance_id: str, arguments: dict) -> tuple[str, float, dict]:
        """The value's repr, reward 0, no metrics.

        Raises:
          ToolError: no code, refused syntax, an exception in the expression, or the
            time limit.
        """
        code = arguments.get("code", arguments.get("expression"))
        if not isinstance(code, str) or not code.strip():
            raise ToolError("missing argument 'code': a Python expression as a string")
        try:
            sandbox.parse(code)  # refuse early, without starting a process
        except ValueError as err:
            raise ToolError(str(err)) from None
        outcome = self._run_child(code)
        if not outcome["ok"]:
            raise ToolError(outcome["error"])
        return outcome["result"], 0.0, {}

    def _run_child(self, code: str) -> dict:
        timeout = float(self.config["timeout_s"])
        request = {"code": code, "memory_mb": int(self.config["memory_mb"]),
                   "cpu_s": math.ceil(timeout) + 1,
                   "max_output_chars": int(self.config["max_output_chars"])}
        child = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(sandbox.__file__)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = child.communicate(json.dumps(request), timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ToolError(f"the expression ran past the time limit of {timeout:g} s "
                            "and was stopped") from None
        finally:
            if child.poll() is None:
                child.kill()
                child.communicate()  # reaps it
        if child.returncode != 0 or not out:
            last = err.strip().splitlines()[-1:] or [f"exit status {child.returncode}"]
            raise ToolError(f"the evaluation process failed: {last[0]}")
        return json.loads(out)
