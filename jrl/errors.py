"""Errors in what the user gave jrl: printed by the command-line entry points as one line.

Each is a `ValueError` (bad config or data) or `RuntimeError` (the run directory, a
failing reward function), so library callers catch them as before; `jrl.train` and
`jrl.sft` print their message without a traceback and exit with status 2 (the
traceback with `--debug`).
"""

from __future__ import annotations

# The command-line entry points' exit status for a `JrlError` (and a missing file).
EXIT_USER_ERROR = 2


class JrlError(Exception):
    """Bad input the user can fix: the message names the key, file or row."""


class ConfigError(JrlError, ValueError):
    """An invalid config value or key."""


class DataError(JrlError, ValueError):
    """A malformed data file or row."""


class CheckpointError(JrlError, ValueError):
    """A missing or mismatched checkpoint or model file."""


class RunDirError(JrlError, RuntimeError):
    """The workdir holds another run, or is in use."""


class RewardError(JrlError, RuntimeError):
    """The reward function raised (or returned a non-number) on a sample, under
    `reward.on_error='raise'`: the message names the sample and the exception."""
