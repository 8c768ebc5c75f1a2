"""The run's batch sizes checked together against its training rows and its mesh.

A step's batch is `data.train_batch_size` prompts x `rollout.n` samples; each update
splits it into mini-batches (`<role>.ppo_mini_batch_size` prompts x `rollout.n`) and
those into micro-batches (`<role>.ppo_micro_batch_size` sequences); the warm start
draws `sft.batch_size` rows at a time, without replacement. Each of these must fit the
training rows, divide the batch above it, and split evenly over the devices of the
mesh's batch axes. `check` makes every such check at once, before the workdir is
claimed and before anything compiles, and stops with one error that lists every size
that does not fit and a set of sizes that does (`fitting`): the largest, at most the
configured ones, that fit this data and this mesh.
"""

from __future__ import annotations

import dataclasses

from jrl.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class BatchSizes:
    """The sizes `check` judges (None: the part is off).

    Attributes:
      train: prompts per step (`data.train_batch_size`).
      n: samples per prompt (`rollout.n`).
      updates: `(role, mini-batch prompts, micro-batch sequences)` of each model updated.
      gen: prompts per generation round of dynamic sampling, and the key that sets it.
      log_prob_micro: sequences per log-prob/value forward.
      sft: rows per warm-start step (None without a warm start).
    """

    train: int
    n: int
    updates: tuple[tuple[str, int, int], ...]
    gen: tuple[str, int] | None = None
    log_prob_micro: int | None = None
    sft: int | None = None


def from_settings(settings, warm_start: bool = True) -> BatchSizes:
    """The sizes of validated `jrl.config.settings.Settings` (without `warm_start`, not
    the warm start's: it has run)."""
    n = settings.rollout.n
    updates = tuple((role, getattr(settings, role).update.mini_batch // n,
                     getattr(settings, role).update.micro_batch)
                    for role in ("actor", "critic") if getattr(settings, role) is not None)
    groups = settings.filter_groups
    sft = settings.experiment.sft
    return BatchSizes(
        train=settings.train_batch_size, n=n, updates=updates,
        gen=None if groups is None else (groups.gen_batch_key, groups.gen_batch_size),
        log_prob_micro=settings.log_prob_micro_batch,
        sft=sft.batch_size if warm_start and sft.steps > 0 else None)


def from_config(config, needs_critic: bool) -> BatchSizes | None:
    """The sizes of a config as given, before its settings are read (which stop at the
    first size that does not fit); None where a size is not a positive integer, which
    the settings report by its key. `needs_critic`: the estimator trains a critic."""
    def get(key):
        node = config
        for part in key.split("."):
            if not hasattr(node, "keys") or part not in node:
                return None
            node = node[part]
        return node

    def size(key):
        value = get(key)
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        return value if ok else None

    train, n = size("data.train_batch_size"), size("rollout.n")
    roles = ("actor", "critic") if needs_critic else ("actor",)
    updates = tuple((role, size(f"{role}.ppo_mini_batch_size"),
                     size(f"{role}.ppo_micro_batch_size")) for role in roles)
    gen = None
    if get("algorithm.filter_groups.enable"):
        key = "data.gen_batch_size" if get("data.gen_batch_size") is not None else \
            "data.train_batch_size"
        gen = (key, size(key))
    sft = size("sft.batch_size") if (size("sft.steps") or 0) > 0 else None
    log_prob_micro = get("rollout.log_prob_micro_batch_size")
    given = [train, n, *(x for u in updates for x in u[1:]), *(gen or ())[1:]]
    if (any(x is None for x in given) or (log_prob_micro is not None and size(
            "rollout.log_prob_micro_batch_size") is None)
            or (get("sft.steps") and sft is None)):
        return None
    return BatchSizes(train=train, n=n, updates=updates, gen=gen,
                      log_prob_micro=log_prob_micro, sft=sft)


def _split(sharder) -> tuple[int, str, int | None]:
    """(devices a batch is split over, the mesh's batch axes, devices the rollout's rows
    are split over where that differs: a `context` axis)."""
    if sharder is None:
        return 1, "data", None
    axes = sharder.batch_axes_named
    rollout = sharder.for_rollout().batch_size_multiple if sharder.context > 1 else None
    return sharder.batch_size_multiple, axes, rollout


def problems(sizes: BatchSizes, rows: int | None, sharder=None) -> list[str]:
    """What does not fit, a line per key: against `rows` training rows (None: not
    known yet) and `sharder`'s mesh (None: one device)."""
    multiple, axes, rollout_multiple = _split(sharder)
    out = []
    n, batch = sizes.n, sizes.train * sizes.n
    split = f"{multiple}, the devices of the mesh's batch axes ({axes})"
    if rows is not None and sizes.train > rows:
        out.append(f"data.train_batch_size={sizes.train}: more prompts than the {rows} "
                   "training rows")
    if sizes.train % multiple:
        out.append(f"data.train_batch_size={sizes.train}: not a multiple of {split}")
    if sizes.gen is not None and sizes.gen[0] != "data.train_batch_size":
        key, gen = sizes.gen
        if rows is not None and gen > rows:
            out.append(f"{key}={gen}: more prompts per generation round than the {rows} "
                       "training rows")
        if gen % multiple:
            out.append(f"{key}={gen}: not a multiple of {split}")
    prompts = sizes.train if sizes.gen is None else sizes.gen[1]
    if rollout_multiple and (prompts * n) % rollout_multiple:
        out.append(f"the rollout's {prompts} prompts x rollout.n={n} = {prompts * n} rows: "
                   f"not a multiple of {rollout_multiple}, the devices they are split over "
                   f"({axes} x context)")
    for role, mini, micro in sizes.updates:
        mini_key, micro_key = f"{role}.ppo_mini_batch_size", f"{role}.ppo_micro_batch_size"
        if batch % (mini * n):
            out.append(f"{mini_key}={mini}: {mini} prompts x rollout.n={n} = {mini * n} "
                       f"sequences must divide the batch of {batch} sequences "
                       "(data.train_batch_size x rollout.n)")
        elif (mini * n) % micro:
            out.append(f"{micro_key}={micro}: {micro} sequences must divide the mini-batch "
                       f"of {mini * n} sequences ({mini_key} x rollout.n)")
        if micro % multiple:
            out.append(f"{micro_key}={micro}: not a multiple of {split}")
    if sizes.log_prob_micro is not None:
        key = "rollout.log_prob_micro_batch_size"
        if batch % sizes.log_prob_micro:
            out.append(f"{key}={sizes.log_prob_micro}: must divide the batch of {batch} "
                       "sequences (data.train_batch_size x rollout.n)")
        if sizes.log_prob_micro % multiple:
            out.append(f"{key}={sizes.log_prob_micro}: not a multiple of {split}")
    if sizes.sft is not None:
        if rows is not None and sizes.sft > rows:
            out.append(f"sft.batch_size={sizes.sft}: more than the {rows} training rows (the "
                       "warm start draws a batch without replacement)")
        if sizes.sft % multiple:
            out.append(f"sft.batch_size={sizes.sft}: not a multiple of {split}")
    return out


def _largest(limit: int, ok) -> int | None:
    return next((x for x in range(limit, 0, -1) if ok(x)), None)


def fitting(sizes: BatchSizes, rows: int | None, sharder=None) -> dict[str, int] | None:
    """Sizes that fit, by key (the keys to change only): each the largest at most the
    configured one; None when none fit (fewer rows than the mesh splits a batch over)."""
    multiple, _, rollout_multiple = _split(sharder)
    n, limit = sizes.n, sizes.train if rows is None else min(sizes.train, rows)
    rollout_ok = lambda prompts: not rollout_multiple or (prompts * n) % rollout_multiple == 0
    train = _largest(limit, lambda b: b % multiple == 0 and rollout_ok(b))
    if train is None:
        return None
    out = {"data.train_batch_size": train}
    if sizes.gen is not None and sizes.gen[0] != "data.train_batch_size":
        gen_limit = sizes.gen[1] if rows is None else min(sizes.gen[1], rows)
        gen = _largest(gen_limit, lambda g: g % multiple == 0 and rollout_ok(g))
        if gen is None:
            return None
        out[sizes.gen[0]] = max(gen, train)
    for role, mini, micro in sizes.updates:
        for m in range(min(mini, train), 0, -1):  # the largest mini-batch with a micro-batch
            if train % m:
                continue
            d = _largest(min(micro, m * n),
                         lambda d, m=m: (m * n) % d == 0 and d % multiple == 0)
            if d is not None:
                out[f"{role}.ppo_mini_batch_size"], out[f"{role}.ppo_micro_batch_size"] = m, d
                break
        else:
            return None
    if sizes.log_prob_micro is not None:
        d = _largest(min(sizes.log_prob_micro, train * n),
                     lambda d: (train * n) % d == 0 and d % multiple == 0)
        if d is None:
            return None
        out["rollout.log_prob_micro_batch_size"] = d
    if sizes.sft is not None:
        sft = _largest(sizes.sft if rows is None else min(sizes.sft, rows),
                       lambda s: s % multiple == 0)
        if sft is None:
            return None
        out["sft.batch_size"] = sft
    current = {"data.train_batch_size": sizes.train, "sft.batch_size": sizes.sft,
               "rollout.log_prob_micro_batch_size": sizes.log_prob_micro,
               **({sizes.gen[0]: sizes.gen[1]} if sizes.gen else {}),
               **{f"{r}.ppo_mini_batch_size": m for r, m, _ in sizes.updates},
               **{f"{r}.ppo_micro_batch_size": d for r, _, d in sizes.updates}}
    return {k: v for k, v in out.items() if current.get(k) != v}


def check(sizes: BatchSizes, rows: int | None, sharder=None) -> None:
    """Stops with one `ConfigError` that lists every size that does not fit `rows`
    training rows (None: not known yet) and `sharder`'s mesh (None: one device), and
    the flags of sizes that do."""
    found = problems(sizes, rows, sharder)
    if not found:
        return
    multiple = _split(sharder)[0]
    data = "" if rows is None else f"{rows} training rows, "
    lines = [f"the batch sizes do not fit this run ({data}each batch split over {multiple} "
             f"device{'s' if multiple > 1 else ''}):", *(f"  {line}" for line in found)]
    fit = fitting(sizes, rows, sharder)
    if fit:
        lines.append("these fit: " + " ".join(f"--config.{k}={v}" for k, v in fit.items()))
    elif rows is not None and rows < multiple:
        lines.append(f"no batch fits: the mesh splits each batch over {multiple} devices and "
                     f"there are {rows} training rows; give more rows or fewer devices")
    raise ConfigError("\n".join(lines))
