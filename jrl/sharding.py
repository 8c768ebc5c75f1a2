"""Meshes, logical-axis rules and the shardings of parameters, optimizer states and batches.

One mesh with four axes serves every step:

    data     pure data parallelism: parameters replicated, the batch split
    fsdp     data parallelism with parameters, gradients and optimizer states split
             (ZeRO-3 / FSDP); the batch is split over it too
    context  sequence (context) parallelism of the training passes: each sequence's
             tokens split, attention run Ulysses-style (`jrl.models.context_attention`);
             the rollout splits its rows over it instead (`Sharder.for_rollout`)
    tensor   tensor (Megatron) parallelism: attention heads, MLP width and vocabulary split
    expert   expert parallelism of mixture-of-experts layers: each device holds a share of
             every MoE layer's experts (`jrl.models.moe`); the batch is split over it too

Model code names the axes of its arrays logically (`vocab`, `embed`, `heads`, `mlp`,
`batch`, `length`, ...); `rules` map those names to mesh axes. A dimension that the mapped mesh
axes do not divide is replicated instead (e.g. 2 KV heads on `tensor=4`), so every
mesh works for every model; `Sharder.report` shows what each device then holds.

Inside jitted model code `constrain(x, axes)` pins an activation's sharding when a
`Sharder` is active (`with sharder.active():` around the call that traces), and is a
no-op otherwise, so the same functions run unsharded in tests and on one device.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Sequence

import jax
import numpy as np
import optax
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrl.errors import ConfigError

MESH_AXES = ("data", "fsdp", "context", "tensor", "expert")
# Mesh axes the batch is split over.
BATCH_AXES = ("data", "fsdp", "expert")

# Logical axis name -> mesh axis (or axes); names not listed are replicated.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", BATCH_AXES),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    # The experts of an MoE layer (each expert's width split as a dense MLP's is).
    ("experts", "expert"),
    ("layers", None),
    ("head_dim", None),
    ("cache_length", None),
    ("length", "context"),
)

_ACTIVE: contextvars.ContextVar[Sharder | None] = contextvars.ContextVar("jrl_sharder",
                                                                          default=None)


@dataclasses.dataclass(frozen=True)
class MeshSettings:
    """Sizes of the mesh axes; one of them may be -1 (all remaining devices)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    context: int = 1  # (after tensor, so that positional `(data, fsdp, tensor)` still reads)
    expert: int = 1

    def resolve(self, num_devices: int) -> tuple[int, ...]:
        """The concrete sizes, in `MESH_AXES` order, for `num_devices` devices.

        Raises:
          ValueError: naming the `mesh.*` key when sizes are not positive (or -1),
            more than one is -1, or their product is not the device count.
        """
        sizes = [getattr(self, axis) for axis in MESH_AXES]
        for axis, size in zip(MESH_AXES, sizes, strict=True):
            if size == 0 or size < -1:
                raise ConfigError(f"mesh.{axis}={size} is not valid; use a positive size or -1 "
                                  "(all remaining devices)")
        free = [axis for axis, size in zip(MESH_AXES, sizes, strict=True) if size == -1]
        if len(free) > 1:
            raise ConfigError(f"mesh: only one axis may be -1, got {free}")
        fixed = math.prod(size for size in sizes if size != -1)
        if free:
            if num_devices % fixed:
                raise ConfigError(
                    f"mesh: {num_devices} devices cannot be split with the fixed axes "
                    f"{self._describe()} (product {fixed}); pick sizes that divide {num_devices}")
            sizes = [num_devices // fixed if size == -1 else size for size in sizes]
        elif fixed != num_devices:
            raise ConfigError(f"mesh: {self._describe()} needs {fixed} devices but "
                              f"{num_devices} are present; set one axis to -1 to fill the rest")
        return tuple(sizes)

    def _describe(self) -> str:
        return ", ".join(f"mesh.{axis}={getattr(self, axis)}" for axis in MESH_AXES
                         if axis != "expert" or self.expert != 1)


def make_mesh(mesh: MeshSettings | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with `MESH_AXES` over `devices` (default: all devices of all processes).

    Args:
      mesh: the axes' sizes (`jrl.config.settings.DeviceSettings.mesh`); None: all
        devices on `data`.
      devices: the devices; defaults to `jax.devices()`.
    """
    mesh = MeshSettings() if mesh is None else mesh
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh.resolve(len(devices))
    try:
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (AssertionError, NotImplementedError, ValueError):
        grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES)


class Sharder:
    """Turns logical axis names into shardings on one mesh.

    Args:
      mesh: the device mesh (`make_mesh`).
      rules: `(logical name, mesh axis | tuple of axes | None)` pairs.
    """

    def __init__(self, mesh: Mesh, rules=DEFAULT_RULES):
        self.mesh = mesh
        self.rules = {name: _as_tuple(axes) for name, axes in rules}
        unknown = {a for axes in self.rules.values() for a in axes} - set(mesh.axis_names)
        if unknown:
            raise ConfigError(f"sharding rules name mesh axes {sorted(unknown)} that the mesh "
                              f"does not have ({mesh.axis_names})")

    def rules_without(self, axis: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """These rules with `axis` removed from every parameter axis (not from `batch`)."""
        return tuple((name, axes if name == "batch" else tuple(a for a in axes if a != axis))
                     for name, axes in self.rules.items())

    @property
    def context(self) -> int:
        """Devices each training sequence is split over (the `context` axis' size)."""
        return self.mesh.shape.get("context", 1)

    def for_rollout(self) -> Sharder:
        """The rollout's `Sharder` on this mesh: rows also split over `context`, no
        sequence split (prefill and decode keep a sequence's tokens, and its KV cache,
        on one device); this one itself without a `context` axis over 1."""
        if self.context == 1:
            return self
        rules = {name: tuple(a for a in axes if a != "context")
                 for name, axes in self.rules.items()}
        rules["batch"] = (*rules.get("batch", ()), "context")
        return Sharder(self.mesh, tuple(rules.items()))

    # -- specs -------------------------------------------------------------------------------

    def spec(self, logical_axes: Sequence[str | None], shape: Sequence[int]) -> PartitionSpec:
        """The `PartitionSpec` of an array with these logical axes and this shape.

        A dimension is split over its mapped mesh axes only if their total size
        divides it (else it is replicated); a mesh axis is used at most once.
        """
        used: set[str] = set()
        out = []
        for name, dim in zip(logical_axes, shape, strict=True):
            axes = tuple(a for a in self.rules.get(name, ()) if a not in used
                         and self.mesh.shape[a] > 1) if name else ()
            if axes and dim % math.prod(self.mesh.shape[a] for a in axes) == 0:
                used.update(axes)
                out.append(axes[0] if len(axes) == 1 else axes)
            else:
                out.append(None)
        return PartitionSpec(*out)

    def named(self, logical_axes, shape) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical_axes, shape))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    @property
    def batch_size_multiple(self) -> int:
        """Batch sizes must be multiples of this to be split evenly."""
        return math.prod(self.mesh.shape[a] for a in self.rules.get("batch", ()))

    def batch(self, ndim: int = 1) -> NamedSharding:
        """Leading (batch) dimension split over the batch axes, the others replicated."""
        axes = tuple(a for a in self.rules.get("batch", ()) if self.mesh.shape[a] > 1)
        lead = axes[0] if len(axes) == 1 else (axes or None)
        return NamedSharding(self.mesh, PartitionSpec(lead, *([None] * (ndim - 1))))

    # -- trees -------------------------------------------------------------------------------

    def params(self, logical_specs, shapes):
        """Shardings of a parameter tree.

        Args:
          logical_specs: `PartitionSpec`s of logical names per leaf
            (`jrl.models.param_logical_axes`).
          shapes: the parameters or their `jax.ShapeDtypeStruct`s (same structure).
        """
        return jax.tree.map(lambda spec, x: self.named(tuple(spec), x.shape), logical_specs,
                            shapes, is_leaf=lambda x: isinstance(x, PartitionSpec))

    def opt_state(self, optimizer: optax.GradientTransformation, param_shapes,
                  param_shardings):
        """Shardings of `optimizer.init(params)`: moments as their parameters, the rest
        (step counts) replicated."""
        state_shapes = jax.eval_shape(optimizer.init, param_shapes)
        return optax.tree_map_params(
            optimizer, lambda _, sharding: sharding, state_shapes, param_shardings,
            transform_non_params=lambda _: self.replicated)

    # -- placement ---------------------------------------------------------------------------

    def put_batch(self, tree):
        """Host arrays (the same on every process) -> global arrays split over the batch axes.

        Each process transfers only the rows its devices hold. This is one of the step's
        designed host-to-device transfers (prompts, scores): allowed under a
        `jax.transfer_guard("disallow")` that catches the others.
        """
        def put(x):
            x = np.asarray(x)
            sharding = self.batch(x.ndim)
            return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

        with jax.transfer_guard_host_to_device("allow"):
            return jax.tree.map(put, tree)

    @property
    def batch_axes_named(self) -> str:
        """The batch's mesh axes for messages, "data x fsdp" (the expert axis only where
        the mesh has one)."""
        axes = [a for a in self.rules.get("batch", ())
                if a != "expert" or self.mesh.shape.get(a, 1) > 1]
        return " x ".join(axes) or "none"

    def check_batch(self, size: int, what: str) -> None:
        multiple = self.batch_size_multiple
        if size % multiple:
            axes = self.batch_axes_named
            raise ConfigError(
                f"{what} = {size} sequences cannot be split over the mesh's batch axes "
                f"({axes} = {multiple}); make it a multiple of {multiple}")

    # -- activations -------------------------------------------------------------------------

    @contextlib.contextmanager
    def active(self) -> Iterator[Sharder]:
        """Makes `constrain` pin activations to this mesh while tracing inside the block."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    # -- memory ------------------------------------------------------------------------------

    @staticmethod
    def bytes_per_device(tree, shardings) -> int:
        """Bytes one device holds of `tree` (arrays or shape structs) under `shardings`."""
        def one(x, sharding):
            shard = sharding.shard_shape(tuple(x.shape))
            return math.prod(shard) * np.dtype(x.dtype).itemsize

        return sum(jax.tree.leaves(jax.tree.map(one, tree, shardings)))


@contextlib.contextmanager
def inactive() -> Iterator[None]:
    """No `Sharder` within the block: programs traced here run where their inputs are."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_sharder() -> Sharder | None:
    """The `Sharder` whose `active()` block is being traced, if any."""
    return _ACTIVE.get()


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Pins `x` to the sharding its logical axes map to, when a `Sharder` is active."""
    sharder = _ACTIVE.get()
    if sharder is None:
        return x
    return jax.lax.with_sharding_constraint(x, sharder.named(logical_axes, x.shape))


def per_shard(fn, specs, *args):
    """`fn(*args)`, run on each device's shard under the active mesh.

    For custom calls (the Pallas kernels): XLA cannot split one over devices, and left
    to itself would gather its operands onto every device. With no active `Sharder`
    or a one-device mesh this is `fn(*args)`; otherwise a `shard_map` of `fn` with
    `(in_specs, out_specs) = specs(sharder)`.
    """
    sharder = _ACTIVE.get()
    if sharder is None or sharder.mesh.size == 1:
        return fn(*args)
    in_specs, out_specs = specs(sharder)
    return jax.shard_map(fn, mesh=sharder.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(*args)


def host_array(x) -> np.ndarray:
    """A global array as a numpy array on every process (gathered when multi-process)."""
    if jax.process_count() == 1 or getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _as_tuple(axes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def rules_from_config(rules_config) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`mesh.rules` (logical name -> "axis,axis" string) as `Sharder` rules.

    Raises:
      ValueError: naming the `mesh.rules.<name>` key that names an unknown mesh axis.
    """
    rules = []
    for name, value in rules_config.items():
        axes = tuple(a.strip() for a in str(value or "").split(",") if a.strip())
        unknown = [a for a in axes if a not in MESH_AXES]
        if unknown:
            raise ConfigError(f"mesh.rules.{name}={value!r} names unknown mesh axes {unknown}; "
                              f"valid axes are {list(MESH_AXES)} (comma-separated, or '')")
        rules.append((name, axes))
    return tuple(rules)


def split_devices(num_sampling: int) -> tuple[list[jax.Device], list[jax.Device]]:
    """(sampling group, training group): the first `num_sampling` devices sample, the
    others train (`rollout.devices`; 0: no sampling group, all train). One process only."""
    devices = list(jax.devices())
    if not num_sampling:
        return [], devices
    if jax.process_count() > 1:
        raise ConfigError(f"rollout.devices={num_sampling}: a sampling group works within one "
                          f"process so far (the weights move between the groups with "
                          f"jax.device_put), and this run has {jax.process_count()}; use "
                          "rollout.devices=0")
    if not 0 < num_sampling < len(devices):
        raise ConfigError(f"rollout.devices={num_sampling}: a sampling group needs at least one "
                          f"device and leaves at least one to train, of the {len(devices)} "
                          f"devices; use 1..{len(devices) - 1}, or 0 for one group")
    return devices[:num_sampling], devices[num_sampling:]


def training_sharder(mesh: MeshSettings, rules, sampling_devices: int = 0) -> Sharder:
    """The `Sharder` of the training devices (all of them without a sampling group,
    `sampling_devices` = 0): a mesh of `mesh`'s sizes with `rules` (`Sharder`'s)."""
    _, training = split_devices(sampling_devices)
    return Sharder(make_mesh(mesh, training), rules)


def sampling_sharder(rules, sampling_devices: int, tensor: int) -> Sharder | None:
    """The sampling group's `Sharder` (`rollout.devices`: the first `sampling_devices`
    devices; its mesh: data x `tensor`, `rollout.tensor_model_parallel_size`), or None
    without a sampling group."""
    sampling, _ = split_devices(sampling_devices)
    if not sampling:
        return None
    if not (isinstance(tensor, int) and tensor > 0 and len(sampling) % tensor == 0):
        raise ConfigError(f"rollout.tensor_model_parallel_size={tensor!r} must be a positive "
                          f"integer dividing the sampling group's {len(sampling)} devices")
    return Sharder(make_mesh(MeshSettings(data=-1, fsdp=1, tensor=tensor), sampling), rules)
