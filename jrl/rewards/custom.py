"""User reward functions loaded from a Python file: `"path/to/file.py:function_name"`.

The counterpart of verl's `custom_reward_function.path` / `.name`. The function
must have verl's signature `fn(data_source, solution_str, ground_truth, extra_info)
-> float | dict`. A file is imported once per process; scorer worker processes
import it again from the same spec, so functions need not be picklable.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from jrl.errors import ConfigError

SPEC_FORMAT = "'path/to/file.py:function_name'"


def parse_spec(spec: str) -> tuple[Path, str]:
    """Splits a spec into (file, function name).

    Raises:
      ValueError: the spec is not a string of the form `path/to/file.py:name`.
    """
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(f"custom reward function spec {spec!r} (reward.custom_fn) must be "
                          f"{SPEC_FORMAT}")
    path, name = spec.rsplit(":", 1)
    if not path or not name.isidentifier():
        raise ConfigError(f"custom reward function spec {spec!r} (reward.custom_fn) must be "
                          f"{SPEC_FORMAT}, with a Python identifier after the colon")
    if not path.endswith(".py"):
        raise ConfigError(f"custom reward function spec {spec!r}: {path!r} is not a .py file; "
                          f"expected {SPEC_FORMAT}")
    return Path(path).expanduser(), name


def _module_name(path: Path) -> str:
    """A unique, stable module name per file, so two files named `reward.py` do not clash."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    return f"jrl_custom_reward_{path.stem}_{digest}"


@functools.cache
def _import_file(path: Path):
    name = _module_name(path)
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ImportError(f"importing custom reward file {str(path)!r} failed: "
                          f"{type(err).__name__}: {err}") from err
    return module


def load_custom_fn(spec: str) -> Callable:
    """The function named by `spec` ("path/to/file.py:name").

    Raises:
      ValueError: malformed spec, or the file defines no such name (its public
        callables are listed).
      FileNotFoundError: the file does not exist (named).
      ImportError: importing the file raised (the original error is chained).
      TypeError: the name is not callable.
    """
    path, name = parse_spec(spec)
    if not path.is_file():
        raise FileNotFoundError(f"custom reward file {str(path)!r} (from spec {spec!r}) "
                                "does not exist")
    module = _import_file(path.resolve())
    if not hasattr(module, name):
        callables = sorted(k for k, v in vars(module).items()
                           if callable(v) and not k.startswith("_"))
        raise ConfigError(f"{str(path)!r} defines no {name!r}; its public callables are "
                          f"{callables}")
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{name!r} in {str(path)!r} is a {type(fn).__name__}, not a function")
    return fn
