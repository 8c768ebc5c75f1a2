"""What `python -m jrl.train` and `python -m jrl.sft` share: flags, the config's keys
checked before parsing, errors printed as one line, and Ctrl-C.

A config, data, checkpoint, reward-function or run-directory error
(`jrl.errors.JrlError`, a missing file, or a `--config.<key>=<value>` absl cannot
parse) prints `error: <message>` and exits with status 2; `--debug` adds the
traceback. Anything else is unexpected and keeps its traceback. Ctrl-C or SIGTERM
stops the run at its next safe point (`jrl.app.interrupt`): it prints `stopped at step N;
run the same command to resume` (`rundir.resume_command`) and exits with 130 (SIGINT) or
143 (SIGTERM).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence

from absl import app, flags
from ml_collections import config_flags

from jrl.app import interrupt, rundir
from jrl.config import verl_names
from jrl.errors import EXIT_USER_ERROR, ConfigError, JrlError

CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                         lock_config=True)
WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and plots (default: "
                              "runs/<config name>).")
DEBUG = flags.DEFINE_bool("debug", False, "Print the full traceback of config, data and "
                          "checkpoint errors too.")
_UNSAFE = re.compile(r"[^\w.=+-]+")  # characters kept out of workdir names


def config_name() -> str:
    """The config file's name without `.py`, with its `:arg` variant if any:
    `configs/grpo_arith.py:n=16,lr=3e-4` -> `grpo_arith-n=16_lr=3e-4`."""
    path, _, arg = flags.FLAGS["config"].config_filename.partition(":")
    name = os.path.splitext(os.path.basename(path))[0]
    return f"{name}-{_UNSAFE.sub('_', arg)}" if arg else name


def _config_file_arg(argv: Sequence[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _load_module(path: str):
    if not os.path.isfile(path):
        raise ConfigError(f"--config: {path!r} is not a file; give a Python config file such as "
                          "configs/grpo_arith.py")
    module_spec = importlib.util.spec_from_file_location("jrl_user_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _load_config(spec: str, module=None):
    """The config of a `--config=path.py[:arg]` value, as config_flags loads it
    (`module`: the file, when already loaded)."""
    path, _, arg = spec.partition(":")
    module = module or _load_module(path)
    if not callable(getattr(module, "get_config", None)):
        raise ConfigError(f"--config: {path!r} has no get_config() function; a config file "
                          "defines get_config() returning an ml_collections.ConfigDict (see "
                          "configs/grpo_arith.py)")
    return module.get_config(arg) if arg else module.get_config()


def variant_notes(spec: str, overrides: dict[str, str], module=None) -> list[str]:
    """Where a `--config.<key>=<value>` is what one of the config file's variants
    (`ARG_DEFAULTS`, `path.py:name=value`) sets along with other keys that follow it,
    a line that names the variant and those keys (which the override leaves as they were).
    `module`: the config file, when already loaded."""
    path, _, arg = spec.partition(":")
    if arg:
        return []
    module = module or _load_module(path)
    names = getattr(module, "ARG_DEFAULTS", None) or {}
    base = rundir.flatten(module.get_config())
    notes = []
    for key, text in overrides.items():
        for name in names:
            try:
                variant = rundir.flatten(module.get_config(f"{name}={text}"))
            except Exception:  # noqa: BLE001 - a value this variant does not take
                continue
            if str(variant.get(key)) != text or variant.get(key) == base.get(key):
                continue
            follow = {k: v for k, v in variant.items()
                      if k != key and k not in overrides and v != base.get(k)}
            if follow:
                notes.append(
                    f"note: --config.{key}={text} leaves what follows it in {path} as it was; "
                    f"{path}:{name}={text} sets it with "
                    + ", ".join(f"{k}={v}" for k, v in follow.items()))
            break
    return notes


def required_config():
    """The `--config` file's config; without one, a `ConfigError` that says how to give it."""
    if CONFIG.value is None:
        raise ConfigError("--config is required: give an experiment config file, e.g. "
                          "--config=configs/grpo_arith.py (the files in configs/, or your "
                          "own with a get_config() function); --help lists the flags")
    return CONFIG.value


def check_override_keys(config, keys: Sequence[str]) -> None:
    """Stops at the first dotted key that the config does not have, naming the nearest."""
    for key in keys:
        node, seen = config, []
        for part in key.split("."):
            if not hasattr(node, "keys"):
                raise ConfigError(f"--config.{key}: {'.'.join(seen)} is a value, not a section")
            if part not in node.keys():
                known = rundir.flatten(config)
                verl = verl_names.suggestion(key, known)
                nearest = difflib.get_close_matches(key, list(known), n=1, cutoff=0.5)
                hint = (f"; {verl}" if verl else
                        f"; the nearest valid key is {nearest[0]}" if nearest else "")
                raise ConfigError(f"--config.{key}: the config has no key {key}{hint}")
            node, seen = node[part], [*seen, part]


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, after checking every `--config.<key>=...` names a real key."""
    try:
        spec = _config_file_arg(argv[1:])
        keys = [a[len("--config."):].split("=", 1)[0] for a in argv[1:]
                if a.startswith("--config.")]
        if spec:  # a bad file, variant or key is reported here, not by absl
            module = _load_module(spec.partition(":")[0])  # the file runs once here
            check_override_keys(_load_config(spec, module), keys)
            overrides = dict(a[len("--config."):].split("=", 1) for a in argv[1:]
                             if a.startswith("--config.") and "=" in a)
            for note in variant_notes(spec, overrides, module):
                print(note, file=sys.stderr)
    except JrlError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    try:
        return flags.FLAGS(argv)
    except flags.Error as err:  # e.g. `--config.actor.optim.lr=1e-4x`
        print(f"error: {str(err).removeprefix('flag ')}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


def run(main: Callable[[list[str]], None]) -> None:
    """`app.run(main)` with readable errors for bad input, and Ctrl-C / SIGTERM handled by
    `jrl.app.interrupt` (stop at the next safe point, one line, status 130 / 143)."""
    interrupt.install()

    def wrapped(argv):
        try:
            main(argv)
        except interrupt.Stopped as stopped:
            interrupt.report(stopped)
        except (JrlError, FileNotFoundError) as err:
            if DEBUG.value:
                traceback.print_exc()
            print(f"error: {err}", file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)
        finally:
            interrupt.finish()

    app.run(wrapped, flags_parser=parse_flags)
