"""Checkpoints of a run with orbax: the train state (a pytree) and JSON metadata.

Orbax writes each step into a temporary directory and renames it when complete,
so a process killed in the middle of a save leaves the previous checkpoint as
the latest complete one. A step directory can still be incomplete afterwards (a
partial copy, files deleted by hand): `missing` checks what one holds without
reading its arrays, `latest_step` never returns one that lacks something, and
reading a checkpoint that fails anyway (a truncated or corrupted file) raises
`UnreadableCheckpoint` naming the directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp

from jrl.data.dataset import IteratorState
from jrl.errors import CheckpointError
from jrl.rl.types import TrainState

# The items every checkpoint of `Checkpointer` holds (one directory each).
ITEMS = ("state", "meta")
# What orbax writes into each kind of item: the JSON item's one file; a pytree's
# structure file, and its arrays in OCDBT form (the merged manifest with its index in
# d/, over one ocdbt.process_<i>/ directory of each process that wrote, which the
# merged index reads from).
_JSON_FILE = "metadata"
_TREE_FILE = "_METADATA"
_OCDBT_MANIFEST = "manifest.ocdbt"
_OCDBT_PROCESS_PREFIX = "ocdbt.process_"
# The step's own record of its items, written by orbax when the save began.
_STEP_METADATA = "_CHECKPOINT_METADATA"
# How `missing` words an empty step directory, and a JSON file it could not parse.
_EMPTY = "the directory is empty"
_DAMAGED = " (not valid JSON)"
# How orbax words a checkpoint whose tree differs from the one asked for (a run of
# another algorithm or model), which is not damage.
_MISMATCH = ("tree structures do not match", "Structure mismatch")
# A path inside the orbax package: how a report is told to come from orbax's code.
_ORBAX_DIR = f"{os.sep}orbax{os.sep}"


class UnreadableCheckpoint(CheckpointError):
    """Reading a checkpoint's files failed (orbax or tensorstore raised).

    Attributes:
      step_dir: the checkpoint's step directory.
      cause: the exception raised.
      mismatch: whether it failed because its tree is not the one asked for.
    """

    def __init__(self, step_dir: str, cause: BaseException):
        self.step_dir, self.cause = step_dir, cause
        self.mismatch = any(_is_mismatch(err) for err in _chain(cause))
        why = ("it holds the state of another model or algorithm" if self.mismatch else
               "it is incomplete or damaged")
        super().__init__(f"{step_dir}: the checkpoint could not be read; {why} "
                         f"({describe(cause)})")


def _chain(err: BaseException) -> list[BaseException]:
    """`err` and the exceptions it was raised from, outermost first."""
    chain, seen = [err], {id(err)}
    while (inner := err.__cause__ or (None if err.__suppress_context__ else err.__context__)
           ) is not None and id(inner) not in seen:
        seen.add(id(inner))
        chain.append(inner)
        err = inner
    return chain


# Tensorstore's errors start with a status code ("NOT_FOUND: ...", "DATA_LOSS: ..."),
# or, where it maps the status to ValueError alone (a store that fails to open: "Error
# opening "zarr" driver: ..."), end with the spec of the store it was reading.
_STATUS = re.compile(r"^[A-Z][A-Z_]+: ")
_STORE_SPEC = "[tensorstore_spec"  # also "[tensorstore_spec[1]=...]", before the spec


def _of_the_files(err: BaseException) -> bool:
    """Whether `err` is about a checkpoint's files or contents: an OS error, a missing
    item (KeyError), JSON that does not parse, a tensorstore error (a status, or a
    store's spec), a metadata record without the fields read (TypeError), or a tree
    other than the one asked for."""
    if isinstance(err, (OSError, KeyError, TypeError, json.JSONDecodeError)):
        return True
    text = str(err)
    return isinstance(err, ValueError) and (bool(_STATUS.match(text)) or _STORE_SPEC in text
                                            or _is_mismatch(err))


def _is_mismatch(err: BaseException) -> bool:
    """Whether `err` is orbax's word for a tree other than the one asked for."""
    return any(words in str(err) for words in _MISMATCH)


def _origin(err: BaseException) -> BaseException:
    """The exception `err` was raised from, through its chain."""
    return _chain(err)[-1]


def describe(err: BaseException) -> str:
    """One short line of an orbax / tensorstore error: the first line of the error it
    started from (tensorstore's, naming the file; orbax wraps it in errors that name
    array slices), with the next line where the first ends in a colon, without the
    tensorstore spec it appends, the end kept where that is still long."""
    err = _origin(err)
    lines = [line.strip() for line in str(err).strip().splitlines()] or [""]
    text = lines[0]
    if text.endswith(":") and len(lines) > 1:
        text += " " + lines[1]
    text = text.split(" " + _STORE_SPEC, 1)[0]
    if len(text) > 300:
        text = "..." + text[-300:].partition(" ")[2]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def summary(lacks: list[str]) -> str:
    """`missing`'s list as words: "missing state/d/, meta/metadata"."""
    if lacks == [_EMPTY]:
        return _EMPTY
    damaged = any(part.endswith(_DAMAGED) for part in lacks)
    return ("missing or damaged: " if damaged else "missing ") + ", ".join(lacks)


def missing(step_dir: str) -> list[str]:
    """What step directory `step_dir` lacks of a complete checkpoint, by path relative
    to it (empty: nothing is missing). Only names and the small JSON files are read,
    not the arrays: a truncated or corrupted array file shows only when restored."""
    if not os.path.isdir(step_dir):
        return ["the directory itself"]
    if not os.listdir(step_dir):
        return [_EMPTY]
    items, lacks = list(ITEMS), []
    recorded = os.path.join(step_dir, _STEP_METADATA)
    if os.path.isfile(recorded):
        try:
            with open(recorded) as f:
                items += [n for n in json.load(f).get("item_handlers") or {} if n not in items]
        except (OSError, ValueError, AttributeError):
            lacks.append(_STEP_METADATA + _DAMAGED)
    for item in items:
        path = os.path.join(step_dir, item)
        if not os.path.isdir(path):
            lacks.append(f"{item}/")
        elif item == "meta":
            lacks += _json_item_lacks(path, item)
        else:
            lacks += _tree_item_lacks(path, item)
    return lacks


def _json_item_lacks(path: str, item: str) -> list[str]:
    file = os.path.join(path, _JSON_FILE)
    if not os.path.isfile(file):
        return [f"{item}/{_JSON_FILE}"]
    try:
        with open(file) as f:
            json.load(f)
    except (OSError, ValueError):
        return [f"{item}/{_JSON_FILE}{_DAMAGED}"]
    return []


def _tree_item_lacks(path: str, item: str) -> list[str]:
    lacks = [] if os.path.isfile(os.path.join(path, _TREE_FILE)) else [f"{item}/{_TREE_FILE}"]
    if not os.path.isfile(os.path.join(path, _OCDBT_MANIFEST)):
        return lacks  # not OCDBT (or its manifest is gone): the restore tells
    if not os.path.isdir(os.path.join(path, "d")):
        lacks.append(f"{item}/d/")
    processes = [n for n in os.listdir(path) if n.startswith(_OCDBT_PROCESS_PREFIX)]
    if not processes:
        lacks.append(f"{item}/{_OCDBT_PROCESS_PREFIX}*/")
    for name in sorted(processes):
        for part in (_OCDBT_MANIFEST, "d"):
            if not os.path.exists(os.path.join(path, name, part)):
                lacks.append(f"{item}/{name}/{part}")
    return lacks


class _Reads:
    """Checkpoint reads in progress, and whether one failed (what it abandoned may
    still be finishing)."""

    open = 0
    failed = False


_reads = _Reads()


def _quiet_abandoned_reads() -> None:
    """Keeps what orbax's abandoned reads report off stderr, while a checkpoint is read
    and after a read failed.

    When one array fails to read, orbax raises at once and closes its event loop while
    the checkpoint's other reads still run in tensorstore's threads; as each finishes
    it reports, with a traceback, "Event loop is closed" (unraisable), a task or future
    whose exception was never retrieved (asyncio's log) or a coroutine that raised when
    it was collected, as late as the interpreter's exit. The error raised already names
    the checkpoint, so these are dropped. The hook goes in before the read (the first
    reports can come before the failure reaches the caller) and refers to nothing of
    this module's globals, which are gone by the time the last coroutines are
    collected at exit."""
    if not getattr(sys.unraisablehook, "_abandoned_reads", False):
        previous, reads, orbax_dir = sys.unraisablehook, _reads, _ORBAX_DIR

        def hook(unraisable):
            exc, code = unraisable.exc_value, getattr(unraisable.object, "cr_code", None)
            abandoned = ((isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed")
                         or (code is not None and orbax_dir in code.co_filename))
            if not (abandoned and (reads.open or reads.failed)):
                previous(unraisable)

        hook._abandoned_reads = True
        sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_ABANDONED_TASKS)  # once: filters are a set


class _AbandonedTasks(logging.Filter):
    """Drops asyncio's reports of tasks and futures nobody awaits any more (orbax's,
    wrapping tensorstore's reads), while `reads` are open or after one failed."""

    def __init__(self, reads: _Reads):
        super().__init__()
        self.reads = reads

    def filter(self, record: logging.LogRecord) -> bool:
        return not ((self.reads.open or self.reads.failed) and str(record.msg).startswith((
            "Task exception was never retrieved", "Future exception was never retrieved",
            "Task was destroyed but it is pending")) and _orbax_report(record))


def _orbax_report(record: logging.LogRecord) -> bool:
    """Whether asyncio's report is of orbax's work: its exception was raised through
    orbax or tensorstore code, or (no exception: a task destroyed pending) it names an
    orbax coroutine."""
    exc = record.exc_info[1] if record.exc_info else None
    if exc is None:
        return _ORBAX_DIR in record.getMessage()
    for err in _chain(exc):
        tb = err.__traceback__
        while tb is not None:
            name = tb.tb_frame.f_code.co_filename
            if _ORBAX_DIR in name or "tensorstore" in name:
                return True
            tb = tb.tb_next
    return False


_ABANDONED_TASKS = _AbandonedTasks(_reads)


def scan(directory: str) -> tuple[list[int], dict[int, list[str]]]:
    """The steps of `directory`'s complete checkpoints (ascending), and its incomplete
    ones with what each lacks (`missing`). Only directories named by a step count
    (orbax's temporary `<step>.orbax-checkpoint-tmp-*` ones do not)."""
    if not os.path.isdir(directory):
        return [], {}
    complete, incomplete = [], {}
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if not name.isdigit() or not os.path.isdir(path):
            continue
        lacks = missing(path)
        if lacks:
            incomplete[int(name)] = lacks
        else:
            complete.append(int(name))
    return sorted(complete), dict(sorted(incomplete.items()))


def latest_complete(directory: str) -> int | None:
    """The step of `directory`'s newest complete checkpoint (`scan`), or None."""
    complete, _ = scan(directory)
    return complete[-1] if complete else None


def move_aside(directory: str, steps, suffix: str) -> list[str]:
    """Renames the step directories `steps` of `directory` to `<step>.<suffix>`, where
    orbax, which reads only step-named directories, no longer counts or deletes them
    (an incomplete one would otherwise take a place of `max_to_keep` and block a save
    of its step); returns the new paths."""
    moved = []
    for step in steps:
        source = os.path.join(directory, str(step))
        target = f"{source}.{suffix}"
        n = 1
        while os.path.exists(target):  # an earlier start moved one of this step aside
            n += 1
            target = f"{source}.{suffix}.{n}"
        os.rename(source, target)
        moved.append(target)
    return moved


class Checkpointer:
    """Saves and restores `(state, meta)` pairs under `directory/<step>`."""

    def __init__(self, directory: str, max_to_keep: int | None = None):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep or None, create=True, enable_async_checkpointing=False
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        """The step of the latest complete checkpoint (`scan`), or None."""
        self.manager.reload()
        return latest_complete(self.directory)

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def save(self, step: int, state, meta: dict, **extra) -> None:
        """Saves `state` and `meta`, and each `extra` pytree as an item of its own."""
        items = {name: ocp.args.StandardSave(tree) for name, tree in extra.items()}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  meta=ocp.args.JsonSave(meta), **items)
        self.manager.save(step, args=args, force=True)
        self.manager.wait_until_finished()

    @contextlib.contextmanager
    def _reading(self, step: int):
        """An error of checkpoint `step`'s files becomes `UnreadableCheckpoint`: one
        that is, or was raised from, what tensorstore and orbax raise for a file
        missing, truncated or not in the format read (`_of_the_files`; orbax wraps
        tensorstore's in a bare Exception). Others (out of device memory, a sharding
        error) keep their own type: they say nothing of the files."""
        _quiet_abandoned_reads()
        _reads.open += 1
        try:
            yield
        except CheckpointError:
            raise
        except Exception as err:
            if not any(_of_the_files(e) for e in _chain(err)):
                raise
            _reads.failed = True
            raise UnreadableCheckpoint(self.step_dir(step), err) from err
        finally:
            _reads.open -= 1

    def restore(self, step: int, like) -> tuple[object, dict]:
        """Restores step `step` into the structure, shapes and shardings of `like`."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                  meta=ocp.args.JsonRestore())
        with self._reading(step):
            restored = self.manager.restore(step, args=args)
        return restored.state, restored.meta

    def has_item(self, step: int, name: str) -> bool:
        return os.path.isdir(os.path.join(self.step_dir(step), name))

    def restore_item(self, step: int, name: str, like):
        """One extra item of checkpoint `step` in the shapes and shardings of `like`."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        args = ocp.args.Composite(**{name: ocp.args.StandardRestore(abstract)})
        with self._reading(step):
            return self.manager.restore(step, args=args)[name]

    def read_meta(self, step: int) -> dict:
        """The JSON metadata of step `step`, without reading its arrays."""
        args = ocp.args.Composite(meta=ocp.args.JsonRestore())
        with self._reading(step):
            return dict(self.manager.restore(step, args=args).meta)

    def save_train_state(self, step: int, state: TrainState, data: IteratorState,
                         **extra) -> None:
        """Saves a run after `step` RL steps: the models, optimizer states and KL
        coefficient as arrays, the step and the data iterator's position as metadata
        (and `extra` items: a one-step asynchronous run's sampling weights)."""
        self.save(step, _tree(state), {"step": step, "data": dataclasses.asdict(data)},
                  **extra)

    def restore_train_state(self, step: int, like: TrainState, replicated
                            ) -> tuple[TrainState, int, IteratorState]:
        """(state, step, data position) of checkpoint `step`, in the structure, shapes
        and shardings of `like` (the step counter placed with `replicated`)."""
        tree, meta = self.restore(step, _tree(like))
        with self._reading(step):  # metadata without the keys a run writes
            done, data = int(meta["step"]), IteratorState(**meta["data"])
        count = jax.device_put(np.int32(done), replicated)
        state = TrainState(step=count, actor=tree["actor"], critic=tree.get("critic"),
                           kl=tree["kl"])
        return state, done, data

    def close(self) -> None:
        self.manager.close()


def _tree(state: TrainState) -> dict:
    """What a checkpoint holds of the state (the step is in the metadata)."""
    tree = {"actor": state.actor, "kl": state.kl}
    if state.critic is not None:
        tree["critic"] = state.critic
    return tree
