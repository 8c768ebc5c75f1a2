"""Checkpoints of a run with orbax: the train state (a pytree) and JSON metadata.

Orbax writes each step into a temporary directory and renames it when complete,
so a process killed in the middle of a save leaves the previous checkpoint as
the latest complete one; `latest_step` never returns a partial save.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from jrl.data.dataset import IteratorState
from jrl.rl.types import TrainState


class Checkpointer:
    """Saves and restores `(state, meta)` pairs under `directory/<step>`."""

    def __init__(self, directory: str, max_to_keep: int | None = None):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep or None, create=True, enable_async_checkpointing=False
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        self.manager.reload()
        return self.manager.latest_step()

    def save(self, step: int, state, meta: dict, **extra) -> None:
        """Saves `state` and `meta`, and each `extra` pytree as an item of its own."""
        items = {name: ocp.args.StandardSave(tree) for name, tree in extra.items()}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  meta=ocp.args.JsonSave(meta), **items)
        self.manager.save(step, args=args, force=True)
        self.manager.wait_until_finished()

    def restore(self, step: int, like) -> tuple[object, dict]:
        """Restores step `step` into the structure, shapes and shardings of `like`."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                  meta=ocp.args.JsonRestore())
        restored = self.manager.restore(step, args=args)
        return restored.state, restored.meta

    def has_item(self, step: int, name: str) -> bool:
        return os.path.isdir(os.path.join(self.directory, str(step), name))

    def restore_item(self, step: int, name: str, like):
        """One extra item of checkpoint `step` in the shapes and shardings of `like`."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        args = ocp.args.Composite(**{name: ocp.args.StandardRestore(abstract)})
        return self.manager.restore(step, args=args)[name]

    def read_meta(self, step: int) -> dict:
        """The JSON metadata of step `step`, without reading its arrays."""
        args = ocp.args.Composite(meta=ocp.args.JsonRestore())
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
        count = jax.device_put(np.int32(meta["step"]), replicated)
        state = TrainState(step=count, actor=tree["actor"], critic=tree.get("critic"),
                           kl=tree["kl"])
        return state, int(meta["step"]), IteratorState(**meta["data"])

    def close(self) -> None:
        self.manager.close()


def _tree(state: TrainState) -> dict:
    """What a checkpoint holds of the state (the step is in the metadata)."""
    tree = {"actor": state.actor, "kl": state.kl}
    if state.critic is not None:
        tree["critic"] = state.critic
    return tree
