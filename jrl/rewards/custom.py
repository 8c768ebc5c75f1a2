"""User reward functions loaded from a Python file: `"path/to/file.py:function_name"`.

The counterpart of verl's `custom_reward_function.path` / `.name`. The function
must have verl's signature `fn(data_source, solution_str, ground_truth, extra_info)
-> float | dict`. The file is loaded by `jrl.pyfile` (once per process; scorer
worker processes import it again from the same spec, so functions need not be
picklable).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from jrl import pyfile

SPEC_FORMAT = "'path/to/file.py:function_name'"
_WHAT = "custom reward function spec (reward.custom_fn)"


def parse_spec(spec: str) -> tuple[Path, str]:
    """Splits a spec into (file, function name).

    Raises:
      ConfigError: the spec is not a string of the form `path/to/file.py:name`.
    """
    return pyfile.parse_spec(spec, _WHAT, SPEC_FORMAT)


def load_custom_fn(spec: str) -> Callable:
    """The function named by `spec` ("path/to/file.py:name").

    Raises:
      ConfigError: malformed spec, or the file defines no such name (its public
        callables are listed).
      FileNotFoundError: the file does not exist (named).
      ImportError: importing the file raised (the original error is chained).
      TypeError: the name is not callable.
    """
    fn = pyfile.load(spec, _WHAT, SPEC_FORMAT)
    if not callable(fn):
        path, name = parse_spec(spec)
        raise TypeError(f"{name!r} in {str(path)!r} is a {type(fn).__name__}, not a function")
    return fn
