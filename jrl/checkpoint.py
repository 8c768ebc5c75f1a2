"""Checkpoints of a run with orbax: the train state (a pytree) and JSON metadata.

Orbax writes each step into a temporary directory and renames it when complete,
so a process killed in the middle of a save leaves the previous checkpoint as
the latest complete one; `latest_step` never returns a partial save.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


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

    def save(self, step: int, state, meta: dict) -> None:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self.manager.save(step, args=args, force=True)
        self.manager.wait_until_finished()

    def restore(self, step: int, like) -> tuple[object, dict]:
        """Restores step `step` into the structure, shapes and shardings of `like`."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                  meta=ocp.args.JsonRestore())
        restored = self.manager.restore(step, args=args)
        return restored.state, restored.meta

    def read_meta(self, step: int) -> dict:
        """The JSON metadata of step `step`, without reading its arrays."""
        args = ocp.args.Composite(meta=ocp.args.JsonRestore())
        return dict(self.manager.restore(step, args=args).meta)

    def close(self) -> None:
        self.manager.close()
