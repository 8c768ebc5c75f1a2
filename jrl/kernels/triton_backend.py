"""Pallas' Triton backend (`jax.experimental.pallas.triton`), where the installed jax
has it.

jrl's two GPU kernels, the decode step's attention (`decode_attention`) and the
log-prob head (`head_kernel`), were written for it; the head has moved to Mosaic GPU.
jax 0.11 marks it deprecated in favour of Mosaic GPU and says it will be removed.
Without it, `"auto"` takes the decode attention's Mosaic GPU kernel on a Hopper GPU
with a 16-bit cache and the XLA path elsewhere, and a forced `"pallas"` stops with a
ConfigError naming its key: jrl itself still imports and runs.
"""

from __future__ import annotations

import jax

from jrl.errors import ConfigError

try:
    from jax.experimental.pallas import triton as plgpu
    _IMPORT_ERROR = None
except ImportError as e:  # a jax that has dropped it (or a broken install of it)
    plgpu = None
    _IMPORT_ERROR = e


def available() -> bool:
    return plgpu is not None


def require(key: str) -> None:
    """Stops with a ConfigError naming `key` (set to "pallas") where the backend is missing."""
    if not available():
        raise ConfigError(
            f"{key}='pallas' needs Pallas' Triton backend (jax.experimental.pallas.triton), "
            f"which does not import with jax {jax.__version__} ({_IMPORT_ERROR}); use 'auto' "
            "or 'xla'")
