"""Ctrl-C and SIGTERM: stop at the next safe point, never from inside XLA.

`install()` (the command-line entry points, as early as they can) replaces the
default handlers of SIGINT and SIGTERM with one that only records the signal. The
training loops call `check(step)` between steps (and the entry point between the
phases that build a run), which raises `Stopped` once a signal has arrived; the loop
saves what it must first, the `with` blocks on the way out close files and release
the workdir's lock, and `jrl.cli` prints one line and exits with 128 + the signal's
number (130 for SIGINT, 143 for SIGTERM). A compilation or step in progress runs to
its end: interrupting a thread inside XLA can crash the process.

A second signal exits at once (`os._exit`, which does not wait for the threads XLA
runs), after the `on_force_exit` callbacks (the workdir's lock) have run.

Library callers that never call `install()` keep Python's default handlers, and
`check` is then a no-op.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_received: list[int] = []  # signal numbers, in order of arrival
_force_exit_callbacks: list[Callable[[], None]] = []


class Stopped(Exception):  # noqa: N818 (a request to stop, not an error)
    """A signal asked the run to stop; raised at a safe point.

    Attributes:
      signum: the first signal received.
      step: the RL step the run stopped at (its checkpoint holds it).
    """

    def __init__(self, signum: int, step: int, resume: str = "run the same command"):
        super().__init__(f"stopped at step {step}; {resume} to resume")
        self.signum, self.step = signum, step

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _handle(signum, frame) -> None:
    del frame
    _received.append(signum)
    if len(_received) == 1:
        name = signal.Signals(signum).name
        os.write(2, f"{_below_progress_bar()}{name}: stopping after the current step (again "
                 "to stop at once)\n".encode())
        return
    for callback in list(_force_exit_callbacks):
        try:
            callback()
        except Exception:  # noqa: BLE001 (exiting anyway; one failed cleanup must not stop it)
            pass
    os.write(2, f"{signal.Signals(signum).name} again: exiting now\n".encode())
    os._exit(128 + _received[0])


def _below_progress_bar() -> str:
    """A newline where a progress bar (tqdm's, on stderr) holds the current line, so
    that the notice starts a line of its own; else nothing."""
    tqdm = sys.modules.get("tqdm")
    bars = getattr(getattr(tqdm, "tqdm", None), "_instances", ())
    return "\n" if any(not getattr(bar, "disable", True) for bar in list(bars)) else ""


def install() -> None:
    """Records SIGINT / SIGTERM instead of acting on them (main thread only)."""
    for signum in SIGNALS:
        signal.signal(signum, _handle)


def requested() -> int | None:
    """The first signal received since `install()` / `reset()`, or None."""
    return _received[0] if _received else None


def check(step: int, resume: str = "run the same command") -> None:
    """Raises `Stopped` if a signal has arrived; `step` is where the run stands, `resume`
    what continues it."""
    if _received:
        raise Stopped(_received[0], step, resume)


def finish() -> None:
    """The run is over, whichever way: signals from here on are ignored. (While Python
    shuts down it puts the default handlers back, and a signal then would kill the
    process with no line and a status of -2; an ignored signal survives that.)"""
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def reset() -> None:
    """Forgets received signals (tests)."""
    _received.clear()


def on_force_exit(callback: Callable[[], None]) -> Callable[[], None]:
    """Runs `callback` before a second signal exits the process; returns a function
    that removes it again."""
    _force_exit_callbacks.append(callback)
    return lambda: _force_exit_callbacks.remove(callback) if callback in \
        _force_exit_callbacks else None


def report(stopped: Stopped) -> None:
    """Prints the stop line and exits with the signal's status."""
    print(str(stopped), file=sys.stderr, flush=True)
    sys.exit(stopped.exit_code)
