"""Multi-process start-up: `jax.distributed` from the config or the cluster environment.

One process per host (or per GPU) runs the same program; after `initialize`,
`jax.devices()` lists the devices of all processes and the mesh spans them. On TPU
pods and SLURM, JAX finds the coordinator, process count and index itself.
"""

from __future__ import annotations

import os

import jax

from jrl.errors import ConfigError

INITIALIZE_CHOICES = ("auto", "yes", "no")
_started = False


def cluster_detected() -> bool:
    """Whether the environment describes a multi-process job JAX can join by itself."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return True
    return "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")


def maybe_initialize(config) -> bool:
    """Starts `jax.distributed` as the `distributed` config section says.

    Must run before anything touches the devices. Returns whether it started.

    Raises:
      ValueError: naming `distributed.initialize` when its value is not a choice.
    """
    d = config.distributed
    if d.initialize not in INITIALIZE_CHOICES:
        raise ConfigError(f"distributed.initialize={d.initialize!r} is not valid; choose one of "
                          f"{list(INITIALIZE_CHOICES)}")
    if d.initialize == "no" or (d.initialize == "auto" and not d.coordinator_address
                                and not cluster_detected()):
        return False
    global _started
    if _started or jax.distributed.is_initialized():  # already part of a cluster
        return True
    local_ids = None
    if d.local_device_ids:
        local_ids = [int(i) for i in str(d.local_device_ids).split(",")]
    jax.distributed.initialize(coordinator_address=d.coordinator_address,
                               num_processes=d.num_processes, process_id=d.process_id,
                               local_device_ids=local_ids)
    _started = True
    return True
