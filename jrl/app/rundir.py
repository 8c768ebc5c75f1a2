"""The run directory (`--workdir`): one run, the config it was started with, and its lock.

    <workdir>/config.json     the resolved config, written when the run first starts
    <workdir>/run.lock        pid, host and start time of the process running it
    <workdir>/finished.json   written when the run reaches its last step
    <workdir>/sft/            the warm start; its checkpoint records the settings it used
    <workdir>/checkpoints/    RL checkpoints; metrics.jsonl, curves.png, tensorboard/

A later start into the same workdir compares its config with `config.json`
(`check_config`): the same config resumes (or reports a finished run), a changed one
stops with the changed keys, unless `trainer.resume_mode` says otherwise (verl's
names): `disable` starts over, `resume_path` resumes from `trainer.resume_from_path`
whatever changed. A resume takes the newest complete checkpoint (`latest_checkpoint`:
a newer step directory that lacks files, such as a partial copy, is moved aside with a
warning); a `resume_path` start into a workdir whose checkpoints go past the step
resumed from stops, rather than write over or mix them. Keys that cannot change what the
steps already taken computed (`may_change`: loggers, devices, checkpoint and
validation cadence, what to do on a reward or NaN error, a longer run under a constant
learning rate) may differ.

A start claims the workdir (`claimed`) only after everything that can be checked
beforehand passed; a start that fails or is stopped before it wrote any output
removes the `config.json` it wrote, and the workdir itself if it made it and left
it empty, so the corrected command starts afresh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator, Mapping
from typing import Any

import ml_collections

from jrl.app import interrupt
from jrl.config import defaults, docs
from jrl.errors import CheckpointError, ConfigError, RunDirError

CONFIG_FILE = "config.json"
LOCK_FILE = "run.lock"
FINISHED_FILE = "finished.json"
RESUME_MODES = ("auto", "disable", "resume_path")
# What a run leaves in its workdir; `resume_mode=disable` removes these.
RUN_OUTPUTS = ("checkpoints", "sft", "metrics.jsonl", "curves.png", "tensorboard", "hf_export",
               FINISHED_FILE, CONFIG_FILE)
# Keys that choose how a run is started, logged, checkpointed, validated, placed on devices
# or exported, or what stops it, not what its steps compute: they may differ between the
# starts of one run. (Validation has its own random keys; under on_error="raise" or
# nan_policy="raise" every step taken had no error to treat otherwise.)
CONTROL_KEYS = ("trainer.resume_mode", "trainer.resume_from_path", "trainer.logger",
                "trainer.export_hf", "trainer.save_freq", "trainer.test_freq",
                "trainer.val_before_train", "trainer.max_actor_ckpt_to_keep",
                "trainer.nan_policy", "trainer.rollout_data_dir", "trainer.validation_data_dir",
                "trainer.compilation_cache_dir",
                "reward.num_workers", "reward.on_error", "mesh.",
                "distributed.")
# The config keys a warm start depends on (prefixes); any change means a different one.
# (The tool config: multi-turn prompts render its schemas through the chat template.)
WARM_START_KEYS = ("seed", "tokenizer.", "model.", "sft.", "data.", "rollout.response_length",
                   "rollout.multi_turn.tool_config_path")
# data.* keys that only the RL loop reads.
_RL_ONLY_DATA_KEYS = ("data.train_batch_size", "data.val_batch_size", "data.gen_batch_size",
                      "data.val_files")
ABSENT = "<absent>"


def checkpoints_dir(workdir: str) -> str:
    """Where a run in `workdir` keeps its RL checkpoints, one `<step>` directory each."""
    return os.path.join(workdir, "checkpoints")


def step_of(step_dir: str) -> int:
    """The step of checkpoint directory `step_dir` (`.../checkpoints/<step>`)."""
    return int(os.path.basename(os.path.normpath(step_dir)))


def flatten(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """`{"actor.optim.lr": 1e-6, ...}` (`docs.flatten`) with JSON values (tuples
    become lists), as `config.json` stores them."""
    return {key: json.loads(json.dumps(value, default=str))
            for key, value in docs.flatten(config).items()}


def _matches(key: str, prefixes) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in prefixes)


def changed_keys(old: Mapping[str, Any], new: Mapping[str, Any],
                 ignore=CONTROL_KEYS) -> list[tuple[str, Any, Any]]:
    """`(key, old value, new value)` for each key whose value differs, sorted by key."""
    keys = sorted(set(old) | set(new))
    return [(k, old.get(k, ABSENT), new.get(k, ABSENT)) for k in keys
            if not _matches(k, ignore) and old.get(k, ABSENT) != new.get(k, ABSENT)]


def _constant_lr(config: Mapping[str, Any]) -> bool:
    return all(config.get(f"{role}.optim.lr_scheduler_type", "constant") == "constant"
               for role in ("actor", "critic"))


def extends(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether `new` only runs `old` for more steps: a larger `trainer.total_training_steps`
    under constant learning rates (a cosine schedule is computed from the total)."""
    key = "trainer.total_training_steps"
    before, after = old.get(key), new.get(key)
    return (isinstance(before, int) and isinstance(after, int) and 0 < before < after
            and _constant_lr(old) and _constant_lr(new))


def may_change(key: str, old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether `key` may differ between two starts of one run (flattened configs): the
    `CONTROL_KEYS`, `reward.error_score` while the old start stopped on reward errors
    (it scored none), `trainer.total_training_steps` when it `extends` the run, and
    `rollout.decode_buckets` between its default (None) and the number that stands for."""
    if _matches(key, CONTROL_KEYS):
        return True
    if key == "rollout.decode_buckets":  # the default (None) and the number it stands for
        resolve = lambda c: defaults.decode_buckets(c.get(key),
                                                           c.get("rollout.response_length"))
        return resolve(old) == resolve(new)
    if key == "reward.error_score":
        return old.get("reward.on_error", "raise") == "raise"
    return key == "trainer.total_training_steps" and extends(old, new)


def run_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """The `changed_keys` that stop a resume under `resume_mode=auto` (not `may_change`)."""
    return [c for c in changed_keys(old, new, ignore=()) if not may_change(c[0], old, new)]


def format_changes(changes) -> str:
    return "\n".join(f"  {key}: {json.dumps(old)} -> {json.dumps(new)}"
                     for key, old, new in changes)


def warm_start_settings(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The flattened config keys that decide what the supervised warm start computes."""
    return {k: v for k, v in flatten(config).items()
            if _matches(k, WARM_START_KEYS) and k not in _RL_ONLY_DATA_KEYS}


# ----------------------------------------------------------------------------- config.json


@dataclasses.dataclass(frozen=True)
class Start:
    """How this start of a run proceeds.

    Attributes:
      kind: "new" (nothing to resume), "resume" (continue from the latest checkpoint
        of the workdir, or from `resume_from`) or "finished" (the run is complete).
      resume_from: the checkpoint step directory of `resume_mode=resume_path`.
      notes: lines to print (what was removed, which keys changed).
      warnings: lines to print on stderr (incomplete checkpoints skipped).
    """

    kind: str
    resume_from: str | None = None
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def _read_json(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def check_config(workdir: str, config: ml_collections.ConfigDict, *,
                 write: bool = True) -> Start:
    """Compares `config` with the run already in `workdir` and decides how to start.

    Under `resume_mode=auto` the run resumes from the newest complete checkpoint of
    `workdir/checkpoints` (`latest_checkpoint`: newer incomplete ones are moved aside,
    with a warning); under `resume_path`, `workdir/checkpoints` must hold no step after
    the one resumed from.

    Args:
      workdir: the run directory.
      config: this start's config.
      write: record the config (and remove old outputs for `disable`): process 0 only.

    Raises:
      RunDirError: the workdir's run used another config (the changed keys listed),
        under `resume_mode=auto`.
      ConfigError / CheckpointError: a bad `resume_mode` or `resume_from_path`,
        (`auto`) checkpoints of which none is complete, or (`resume_path`) checkpoints
        after the step resumed from.
    """
    mode = config.trainer.resume_mode
    if mode not in RESUME_MODES:
        raise ConfigError(f"trainer.resume_mode: {mode!r} is not valid; choose one of "
                          f"{list(RESUME_MODES)}")
    new = flatten(config)
    config_path = os.path.join(workdir, CONFIG_FILE)
    old = _read_json(config_path)
    notes: list[str] = []
    latest, skipped = latest_checkpoint(workdir) if mode == "auto" else (None, {})
    has_checkpoint, warnings = latest is not None, []
    if mode == "disable":
        removed = clear_run(workdir) if write else []
        if removed:
            notes.append(f"trainer.resume_mode=disable: removed the previous run's "
                         f"{', '.join(removed)} from {workdir}")
        old, has_checkpoint = None, False
    resume_from = None
    if mode == "resume_path":
        resume_from = checkpoint_step_dir(config.trainer.resume_from_path)
        _check_no_later_steps(workdir, resume_from)
        if old is not None:
            changes = changed_keys(old, new)
            if changes:
                notes.append(f"resuming from {resume_from} with changed keys:\n"
                             + format_changes(changes))
    elif old is not None:
        _refuse_changes(workdir, old, new)
    elif has_checkpoint:
        notes.append(f"{workdir} has checkpoints but no {CONFIG_FILE}; recording this config")
    finished = _read_json(os.path.join(workdir, FINISHED_FILE))
    extended = old is not None and finished is not None and extends(old, new)
    if extended:
        notes.append(f"trainer.total_training_steps: {old['trainer.total_training_steps']} "
                     f"-> {new['trainer.total_training_steps']}: continuing the finished run")
    if write:
        os.makedirs(workdir, exist_ok=True)
        _write_json(config_path, new)
        if skipped:
            warnings += _move_incomplete_aside(workdir, skipped, latest)

        if finished is not None and (mode == "resume_path" or extended):
            os.remove(os.path.join(workdir, FINISHED_FILE))
    if extended:
        finished = None
    if mode == "resume_path":
        return Start("resume", resume_from, tuple(notes))
    if finished is not None:
        return Start("finished", notes=tuple(notes), warnings=tuple(warnings))
    return Start("resume" if has_checkpoint else "new", notes=tuple(notes),
                 warnings=tuple(warnings))


def _move_incomplete_aside(workdir: str, skipped: dict[int, list[str]], latest: int
                           ) -> list[str]:
    """Moves the incomplete checkpoints after the one resumed from out of orbax's sight
    (`checkpoint.move_aside`); a warning line for each."""
    from jrl.rl import checkpoint

    directory = checkpoints_dir(workdir)
    moved = checkpoint.move_aside(directory, skipped, "incomplete")
    return [f"warning: {os.path.join(directory, str(step))} is an incomplete checkpoint "
            f"({checkpoint.summary(lacks)}), moved aside to {target}; resuming from step "
            f"{latest}, the newest complete one"
            for (step, lacks), target in zip(skipped.items(), moved, strict=True)]


def _check_no_later_steps(workdir: str, resume_from: str) -> None:
    """A `resume_path` start writes its steps into `workdir/checkpoints`: steps there
    after the one resumed from (another history of this run, or of the run this workdir
    held) would be written over, or resumed from by a later start; the user chooses."""
    from jrl.rl import checkpoint

    directory = checkpoints_dir(workdir)
    step = step_of(resume_from)
    complete, incomplete = checkpoint.scan(directory)
    later = sorted(s for s in [*complete, *incomplete] if s > step)
    if later:
        raise CheckpointError(
            f"trainer.resume_from_path: resuming from step {step} into {workdir}, whose "
            f"checkpoints already go on to step{'s' if len(later) > 1 else ''} "
            f"{', '.join(map(str, later))}, which this run would write again; to continue "
            f"the run in {workdir} from its newest checkpoint use "
            "--config.trainer.resume_mode=auto, or move those step directories out of "
            f"{directory}, or give a fresh --workdir")


def _refuse_changes(workdir: str, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    """Raises `RunDirError` listing the `run_changes` (`resume_mode=auto`), if any."""
    changes = run_changes(old, new)
    if changes:
        raise RunDirError(
            f"{workdir} holds a run started with another config "
            f"({os.path.join(workdir, CONFIG_FILE)}); changed keys, old -> new:\n"
            f"{format_changes(changes)}\nPass a new --workdir for a new run, "
            "--config.trainer.resume_mode=disable to start this one over (its checkpoints, warm "
            "start and metrics are removed), or --config.trainer.resume_mode=resume_path "
            "--config.trainer.resume_from_path=<checkpoint dir> to continue from a checkpoint "
            "with this config.")


def clear_run(workdir: str) -> list[str]:
    """Removes what an earlier run left in `workdir` (`RUN_OUTPUTS`); returns their names."""
    present = [n for n in RUN_OUTPUTS if os.path.exists(os.path.join(workdir, n))]
    for name in present:
        path = os.path.join(workdir, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    return present


def checkpoint_step_dir(path: str | None) -> str:
    """The checkpoint directory `trainer.resume_from_path` names (`.../checkpoints/<step>`),
    checked to hold a complete checkpoint (`jrl.rl.checkpoint.missing`)."""
    if not path:
        raise ConfigError("trainer.resume_mode='resume_path' needs trainer.resume_from_path: a "
                          "checkpoint directory such as <workdir>/checkpoints/<step>")
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path) or not os.path.basename(path).isdigit():
        raise CheckpointError(f"trainer.resume_from_path: {path} is not a checkpoint directory; "
                              "expected <workdir>/checkpoints/<step> of an earlier run")
    from jrl.rl import checkpoint  # orbax: imported once a checkpoint is looked at

    lacks = checkpoint.missing(path)
    if lacks:
        raise CheckpointError(f"trainer.resume_from_path: {path} is not a complete checkpoint "
                              f"({checkpoint.summary(lacks)}); {_other_steps(path)}")
    return path


def _other_steps(step_dir: str) -> str:
    """What to give `trainer.resume_from_path` instead of `step_dir`: the complete
    checkpoints beside it."""
    parent = os.path.dirname(step_dir)
    others = [s for s in _complete_beside(step_dir) if s != step_of(step_dir)]
    if not others:
        return (f"{parent} holds no other complete checkpoint; point "
                "--config.trainer.resume_from_path at the step directory of another run")
    return (f"point --config.trainer.resume_from_path at another step directory; complete "
            f"checkpoints in {parent}: step{'s' if len(others) > 1 else ''} "
            f"{', '.join(map(str, others))} (e.g. "
            f"--config.trainer.resume_from_path={os.path.join(parent, str(others[-1]))})")


def _complete_beside(step_dir: str) -> list[int]:
    """The steps of the complete checkpoints in `step_dir`'s directory (its own too)."""
    from jrl.rl import checkpoint

    return checkpoint.scan(os.path.dirname(step_dir))[0]


# What `resume_mode=disable` removes, as the errors that suggest it say.
_DISABLE_REMOVES = "this removes its checkpoints, warm start and metrics"


def latest_checkpoint(workdir: str) -> tuple[int | None, dict[int, list[str]]]:
    """The step of the newest complete checkpoint in `workdir/checkpoints` (None: none),
    where `resume_mode=auto` resumes, and the incomplete step directories after it (a
    partial copy, files deleted), each with what it lacks (`checkpoint.missing`).

    Raises:
      CheckpointError: step directories are there but none is complete (starting over
        silently would discard what the user meant to resume).
    """
    from jrl.rl import checkpoint

    directory = checkpoints_dir(workdir)
    complete, incomplete = checkpoint.scan(directory)
    latest = complete[-1] if complete else None
    if latest is None and incomplete:
        listed = "; ".join(f"{os.path.join(directory, str(step))} ({checkpoint.summary(lacks)})"
                           for step, lacks in incomplete.items())
        raise CheckpointError(
            f"{directory} holds no complete checkpoint to resume from: {listed}. Copy the "
            f"checkpoint again in full, or pass --config.trainer.resume_mode=disable to start "
            f"the run over ({_DISABLE_REMOVES})")
    return latest, {step: lacks for step, lacks in incomplete.items() if step > latest}


@contextlib.contextmanager
def restoring(checkpointer, resume_from: str | None, total_steps: int):
    """`(checkpointer, step)` a trainer restores from: `resume_from`'s (a `<dir>/<step>`
    checkpoint directory of `resume_mode=resume_path`, read by a checkpointer of its
    own, closed after) or else `checkpointer`'s latest complete step (None: none). An
    `UnreadableCheckpoint` inside becomes `unreadable_checkpoint`'s error; a restore
    prints which step (of `total_steps`) the run resumed from."""
    import jax

    from jrl.rl import checkpoint

    source, step = checkpointer, None
    if resume_from is None:
        step = checkpointer.latest_step()
    else:
        source = checkpoint.Checkpointer(os.path.dirname(resume_from))
        step = step_of(resume_from)
    try:
        yield source, step
    except checkpoint.UnreadableCheckpoint as err:
        raise unreadable_checkpoint(err, from_path=resume_from is not None) from err
    finally:
        if source is not checkpointer:
            source.close()
    if step is not None and jax.process_index() == 0:
        where = f" ({resume_from})" if resume_from else ""
        print(f"resumed from step {step} (of {total_steps}){where}", flush=True)


def resume_command(resume_from: str | None, saved_step: int) -> str:
    """What continues a run stopped after its checkpoint of `saved_step` (0: none saved
    yet) was written: the same command, unless it started from `resume_from`
    (`resume_mode=resume_path`) and has saved later steps in its workdir since, which
    that command would refuse to write over."""
    if resume_from is not None and saved_step > step_of(resume_from):
        return "run the same command with --config.trainer.resume_mode=auto"
    return "run the same command"


def unreadable_checkpoint(err, *, from_path: bool) -> CheckpointError:
    """The error for a checkpoint that looked complete but failed to restore
    (`jrl.rl.checkpoint.UnreadableCheckpoint` `err`: a truncated or corrupted file, or
    the state of another model or algorithm), with what to do: under
    `resume_mode=resume_path` (`from_path`) another step directory, else removing it to
    resume from the one before, or starting over."""
    from jrl.rl import checkpoint

    step_dir, cause = err.step_dir, checkpoint.describe(err.cause)
    head = (f"trainer.resume_from_path: {step_dir}" if from_path else
            f"{step_dir}, the newest checkpoint of this run,")
    if err.mismatch:
        return CheckpointError(
            f"{head} holds the state of another model or algorithm than this run's "
            f"({cause}); resume from a checkpoint of a run with this config's model.* and "
            "algorithm.* settings")
    message = f"{head} could not be read; the checkpoint is incomplete or damaged ({cause}); "
    if from_path:
        return CheckpointError(message + _other_steps(step_dir))
    earlier = [s for s in _complete_beside(step_dir) if s < step_of(step_dir)]
    if earlier:
        message += (f"move it out of {os.path.dirname(step_dir)} (rename it, e.g. to "
                    f"{step_dir}.damaged) to resume from step {earlier[-1]}, the newest "
                    "complete one before it, or ")
    return CheckpointError(message + "pass --config.trainer.resume_mode=disable to start the "
                           f"run over ({_DISABLE_REMOVES})")


def read_finished(workdir: str) -> dict | None:
    return _read_json(os.path.join(workdir, FINISHED_FILE))


def mark_finished(workdir: str, step: int, total_steps: int) -> None:
    _write_json(os.path.join(workdir, FINISHED_FILE),
                {"step": step, "total_steps": total_steps, "time": _now()})


# ----------------------------------------------------------------------------- lock


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_lock(path: str, attempts: int = 20) -> dict | None:
    """The lock's holder, or None once the file is gone; waits out a holder mid-write."""
    for _ in range(attempts):
        try:
            with open(path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except json.JSONDecodeError:
            time.sleep(0.05)
    return {"pid": None, "host": None, "started": None}


def acquire_lock(workdir: str) -> str:
    """Takes `workdir/run.lock` for this process; returns its path.

    Raises:
      RunDirError: another live process holds it (named).
    """
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, LOCK_FILE)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": _now()}
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read_lock(path)
            if holder is None:
                continue  # released meanwhile
            pid, host = holder.get("pid"), holder.get("host")
            if host == me["host"] and isinstance(pid, int) and not _alive(pid):
                print(f"{workdir}: taking over the stale lock of pid {pid} (started "
                      f"{holder.get('started')}; that process is gone)", flush=True)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                continue
            where = "this host" if host == me["host"] else f"host {host}"
            hint = "" if host == me["host"] else (
                "; if no run is alive there, delete the lock file")
            raise RunDirError(f"{workdir} is in use by pid {pid} on {where} since "
                              f"{holder.get('started')} ({path}); wait for that run to end "
                              f"or pass another --workdir{hint}") from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return path
    raise RunDirError(f"{workdir}: could not take {path}; other processes keep taking it")


def release_lock(path: str) -> None:
    """Removes the lock if this process still holds it."""
    holder = _read_lock(path, attempts=1)
    if holder is not None and holder.get("pid") == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


@contextlib.contextmanager
def locked(workdir: str, enabled: bool = True) -> Iterator[None]:
    """Holds `workdir/run.lock` for the block (every exit path releases it, and so does a
    second Ctrl-C that exits at once: `jrl.app.interrupt.on_force_exit`)."""
    if not enabled:
        yield
        return
    check_writable(workdir)
    path = acquire_lock(workdir)
    forget = interrupt.on_force_exit(lambda: release_lock(path))
    try:
        yield
    finally:
        forget()
        release_lock(path)


def check_writable(workdir: str) -> None:
    """Raises `RunDirError` unless this process can create files in `workdir` (or create
    it: its nearest existing parent is writable)."""
    path = os.path.abspath(workdir)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise RunDirError(f"--workdir {workdir}: {path} is a file, not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        what = "the workdir" if path == os.path.abspath(workdir) else f"its parent {path}"
        why = "a read-only file system" if _read_only_fs(path) else "permission denied"
        raise RunDirError(f"--workdir {workdir}: {what} is not writable ({why}); pass a "
                          "--workdir this user can write to")


def _read_only_fs(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _has_outputs(workdir: str) -> bool:
    """Whether `workdir` holds anything a run wrote besides its config (empty directories
    do not count)."""
    for name in RUN_OUTPUTS:
        path = os.path.join(workdir, name)
        if name == CONFIG_FILE or not os.path.exists(path):
            continue
        if not os.path.isdir(path) or any(os.scandir(path)):
            return True
    return False


def _unclaim(workdir: str, had_config: bool) -> None:
    """Removes the traces of a start that wrote no output: its `config.json` and the
    empty output directories."""
    if _has_outputs(workdir):
        return
    for name in RUN_OUTPUTS:
        path = os.path.join(workdir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
    if not had_config:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(workdir, CONFIG_FILE))


@contextlib.contextmanager
def claimed(workdir: str, enabled: bool = True) -> Iterator[None]:
    """`locked(workdir)`; a start that fails or is stopped before it wrote any output
    leaves nothing that would stop the next one: `config.json` is removed if this start
    wrote the first one, and the workdir if this start made it and it is left empty."""
    if not enabled:
        yield
        return
    made_workdir = not os.path.exists(workdir)
    had_config = os.path.exists(os.path.join(workdir, CONFIG_FILE))
    try:
        with locked(workdir):
            try:
                yield
            except BaseException:
                _unclaim(workdir, had_config)
                raise
    except BaseException:
        if made_workdir:
            with contextlib.suppress(OSError):  # not empty: kept
                os.rmdir(workdir)
        raise
