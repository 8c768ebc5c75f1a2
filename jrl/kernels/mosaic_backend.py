"""Pallas' Mosaic GPU backend (`jax.experimental.pallas.mosaic_gpu`), where the
installed jax has it.

Mosaic GPU compiles Pallas kernels for Hopper (sm_90a) with the chip's own
instructions: bulk tensor copies (TMA) completing on barriers, and warpgroup matrix
multiplies (`wgmma`) from shared memory. Off a GPU, its kernels run in Pallas' GPU
interpret mode (`interpret()`), which simulates shared memory, barriers and the
warpgroup matmuls on the CPU: that is how the CPU tests run a kernel's own code.
"""

from __future__ import annotations

import inspect
import os

import jax

from jrl.errors import ConfigError

try:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    from jax.experimental.pallas import mosaic_gpu as plgpu
    _IMPORT_ERROR = None
except ImportError as e:  # an older jax, or one built without it
    plgpu = InterpretGPUParams = None
    _IMPORT_ERROR = e


# jax 0.10 takes `plgpu.load(ref, idx, ...)`; 0.11 `plgpu.load(ref.at[idx], ...)` and
# deprecates the separate index.
_LOAD_TAKES_INDEX = plgpu is not None and inspect.signature(
    plgpu.load).parameters["idx"].default is inspect.Parameter.empty


def load(ref, layout, **kwargs):
    """`plgpu.load` of a whole ref into registers in `layout` (keywords as `plgpu.load`'s),
    on either jax."""
    if _LOAD_TAKES_INDEX:
        return plgpu.load(ref, (), layout=layout, **kwargs)
    return plgpu.load(ref, layout=layout, **kwargs)


def available() -> bool:
    return plgpu is not None


def on_hopper() -> bool:
    """A GPU of compute capability 9.0 (H100, H200): the one Mosaic GPU's Hopper
    kernels (wgmma) compile for."""
    if jax.default_backend() != "gpu":
        return False
    return getattr(jax.devices()[0], "compute_capability", "") == "9.0"


def require(key: str) -> None:
    """Stops with a ConfigError naming `key` where the backend is missing."""
    if not available():
        raise ConfigError(
            f"{key}='mosaic' needs Pallas' Mosaic GPU backend "
            f"(jax.experimental.pallas.mosaic_gpu), which does not import with jax "
            f"{jax.__version__} ({_IMPORT_ERROR}); use 'auto' or 'xla'")


PROFILE_DIR_ENV = "JRL_MOSAIC_PROFILE_DIR"


def compiler_params(regions: int = 64, **kwargs):
    """`plgpu.CompilerParams(approx_math=True, **kwargs)`. Where the environment sets
    `JRL_MOSAIC_PROFILE_DIR` when the kernel's call is built, Mosaic GPU's profiler
    times the kernel's named regions (`jax.named_scope` in its body) in each warpgroup
    and writes a Perfetto trace there (`experiments/profile_decode_kernel.py` reads
    them). `regions`: the most region entries a warpgroup makes (each takes 16 bytes of
    shared memory while profiling). The setting is read when the call is built: a call
    already built (a jitted program, the fused kernel's `_fused_call` cache) keeps the
    one it was built with."""
    directory = os.environ.get(PROFILE_DIR_ENV)
    if directory:
        kwargs = dict(profile_space=regions, profile_dir=directory, **kwargs)
    return plgpu.CompilerParams(approx_math=True, **kwargs)


def interpret(force: bool = False):
    """The `interpret` argument of a kernel call: GPU interpret mode off a GPU (or when
    `force`d), else False (compiled)."""
    if force or jax.default_backend() != "gpu":
        return InterpretGPUParams()
    return False
