"""User code named as `"path/to/file.py:name"`: a Python file, no package on PYTHONPATH.

`reward.custom_fn` names a reward function this way, and a tool config's `class_name`
a tool class. A file is imported once per process, under a module name unique to its
path (two files named `reward.py` do not clash); worker processes import it again
from the same spec, so what it defines need not be picklable. A relative path is
taken from the current directory; `~` is expanded.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from jrl.errors import ConfigError


def is_file_spec(spec: Any) -> bool:
    """Whether `spec` names a file and a name (`...py:name`), not a dotted import path."""
    return isinstance(spec, str) and ":" in spec


def parse_spec(spec: Any, what: str, form: str) -> tuple[Path, str]:
    """Splits a spec into (file, name).

    Args:
      spec: "path/to/file.py:name".
      what: how errors name the spec, e.g. "custom reward function spec ... (reward.custom_fn)".
      form: the valid form, for errors, e.g. "'path/to/file.py:function_name'".

    Raises:
      ConfigError: the spec is not a string of the form `path/to/file.py:name`.
    """
    if not is_file_spec(spec):
        raise ConfigError(f"{what} {spec!r} must be {form}")
    path, name = spec.rsplit(":", 1)
    if not path or not name.isidentifier():
        raise ConfigError(f"{what} {spec!r} must be {form}, with a Python identifier after "
                          "the colon")
    if not path.endswith(".py"):
        raise ConfigError(f"{what} {spec!r}: {path!r} is not a .py file; expected {form}")
    return Path(path).expanduser(), name


def _module_name(path: Path) -> str:
    """A unique, stable module name per file."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    return f"jrl_user_{path.stem}_{digest}"


@functools.cache
def import_file(path: Path):
    """The module of a Python file (an absolute path), imported once per process.

    Raises:
      ImportError: running the file raised (the original error is chained).
    """
    name = _module_name(path)
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ImportError(f"importing {str(path)!r} failed: {type(err).__name__}: "
                          f"{err}") from err
    return module


def load(spec: str, what: str, form: str, kind: type | None = None) -> Any:
    """The object named by `spec` ("path/to/file.py:name").

    Args:
      spec, what, form: as `parse_spec` takes them.
      kind: when given, the public names listed in a "defines no" error are those of
        this kind (e.g. `type` for classes); else the public callables.

    Raises:
      ConfigError: a malformed spec, or the file defines no such name (its public
        names of the kind listed).
      FileNotFoundError: the file does not exist (named).
      ImportError: importing the file raised.
    """
    path, name = parse_spec(spec, what, form)
    if not path.is_file():
        raise FileNotFoundError(f"{what}: file {str(path)!r} (from {spec!r}) does not exist")
    module = import_file(path.resolve())
    if not hasattr(module, name):
        fits = (lambda v: isinstance(v, kind)) if kind is not None else callable
        names = sorted(k for k, v in vars(module).items() if fits(v) and not k.startswith("_"))
        raise ConfigError(f"{what}: {str(path)!r} defines no {name!r}; its public "
                          f"{'classes' if kind is type else 'callables'} are {names}")
    return getattr(module, name)
