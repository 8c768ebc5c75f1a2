"""Evaluates one Python expression in a restricted namespace; run as a child process.

`PythonExpression` starts this file with `python -I -S`, so the child imports only the
standard library (never jrl or JAX) and starts in tens of milliseconds. It reads
`{"code", "memory_mb", "cpu_s", "max_output_chars"}` as JSON on stdin and writes
`{"ok": true, "result": repr}` or `{"ok": false, "error": "Type: message"}` on stdout.

The checks here (no imports, no names or attributes that reach Python's internals, a
whitelist of builtins) keep honest mistakes and the usual escapes out; they are not a
security boundary. The containment is the process: its own memory and CPU limits, and
the parent kills it at the time limit.
"""

from __future__ import annotations

import ast
import json
import math
import sys
import types

_BUILTINS = ("abs", "all", "any", "bool", "dict", "divmod", "enumerate", "float", "int",
             "len", "list", "max", "min", "pow", "range", "reversed", "round", "set", "sorted",
             "str", "sum", "tuple", "zip")

# str.format and format_map read attributes from inside the format string, where the
# checks below cannot see them ("{0.__class__}".format(x)).
_FORBIDDEN_ATTRIBUTES = frozenset({"format", "format_map"})


def namespace() -> dict:
    """Globals of the evaluation: whitelisted builtins, math's public names, and `math`."""
    import builtins

    public_math = {k: v for k, v in vars(math).items() if not k.startswith("_")}
    return {"__builtins__": {name: getattr(builtins, name) for name in _BUILTINS},
            "math": types.SimpleNamespace(**public_math), **public_math}


def parse(code: str) -> ast.Expression:
    """The expression's syntax tree, after the checks.

    Raises:
      ValueError: a statement or import instead of an expression, a name starting
        with "__", or an attribute starting with "_" (or str.format).
    """
    try:
        tree = ast.parse(code.strip(), mode="eval")
    except SyntaxError as err:
        try:
            module = ast.parse(code.strip(), mode="exec")
        except SyntaxError:
            raise ValueError(f"invalid syntax: {err.msg}") from None
        if any(isinstance(node, (ast.Import, ast.ImportFrom)) for node in ast.walk(module)):
            raise ValueError("imports are not allowed") from None
        raise ValueError("only a single expression is allowed, not statements") from None
    # In source order, so the first offence is the one named.
    for node in sorted(ast.walk(tree), key=lambda n: (getattr(n, "end_lineno", 0),
                                                      getattr(n, "end_col_offset", 0))):
        if isinstance(node, ast.Name) and node.id.startswith("__"):
            raise ValueError(f"the name {node.id!r} is not allowed")
        if isinstance(node, ast.Attribute) and (node.attr.startswith("_")
                                                or node.attr in _FORBIDDEN_ATTRIBUTES):
            raise ValueError(f"the attribute {node.attr!r} is not allowed")
    return tree


def evaluate(code: str, max_output_chars: int) -> dict:
    """`{"ok": True, "result": repr}` of the expression, or `{"ok": False, "error"}`."""
    try:
        value = eval(compile(parse(code), "<expression>", "eval"), namespace(), {})
        text = repr(value)
    except Exception as err:  # the model's error is the answer
        message = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        return {"ok": False, "error": message}
    if len(text) > max_output_chars:
        text = text[:max_output_chars] + f"... [{len(text) - max_output_chars} more characters]"
    return {"ok": True, "result": text}


def _limit_resources(memory_mb: int, cpu_s: int) -> None:
    try:
        import resource
    except ImportError:  # not on this platform: the parent's time limit still holds
        return
    memory = memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))


def main() -> None:
    """Reads one request on stdin, limits this process, writes the outcome on stdout."""
    request = json.loads(sys.stdin.read())
    _limit_resources(request["memory_mb"], request["cpu_s"])
    json.dump(evaluate(request["code"], request["max_output_chars"]), sys.stdout)


if __name__ == "__main__":
    main()
