"""Multi-process start-up: `jax.distributed` from the `distributed.*` settings or the cluster
environment.

One process per host (or per GPU) runs the same program; after `initialize`,
`jax.devices()` lists the devices of all processes and the mesh spans them. On TPU
pods and SLURM, JAX finds the coordinator, process count and index itself.
"""

from __future__ import annotations

import os
from typing import Protocol

import jax

# `distributed.initialize` (`jrl.config.settings.DistributedSettings` checks the key against
# this list).
INITIALIZE_CHOICES = ("auto", "yes", "no")
_started = False


class DistributedSettings(Protocol):
    """What start-up reads of the `distributed` settings
    (`jrl.config.settings.DistributedSettings`; this module imports nothing of
    `jrl.config`, which imports its choices)."""

    initialize: str
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    local_device_ids: str | None


def cluster_detected() -> bool:
    """Whether the environment describes a multi-process job JAX can join by itself."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return True
    return "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")


def maybe_initialize(settings: DistributedSettings) -> bool:
    """Starts `jax.distributed` as the `distributed` section's settings
    (`jrl.config.settings.DistributedSettings`, its `initialize` checked) say.

    Must run before anything touches the devices. Returns whether it started.
    """
    if settings.initialize == "no" or (settings.initialize == "auto"
                                       and not settings.coordinator_address
                                       and not cluster_detected()):
        return False
    global _started
    if _started or jax.distributed.is_initialized():  # already part of a cluster
        return True
    local_ids = None
    if settings.local_device_ids:
        local_ids = [int(i) for i in str(settings.local_device_ids).split(",")]
    jax.distributed.initialize(coordinator_address=settings.coordinator_address,
                               num_processes=settings.num_processes,
                               process_id=settings.process_id, local_device_ids=local_ids)
    _started = True
    return True
