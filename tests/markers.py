"""Markers shared by test modules."""

import pytest

from jrl.kernels import mosaic_backend

# Tests that run the Mosaic GPU kernels (GPU interpret mode off a GPU) need that backend.
NEEDS_MOSAIC = pytest.mark.skipif(not mosaic_backend.available(),
                                  reason="this jax has no Pallas Mosaic GPU backend")


def _has_cpu_backend() -> bool:
    import jax

    try:
        return bool(jax.devices("cpu"))
    except RuntimeError:  # JAX_PLATFORMS names the accelerator alone
        return False


# Pallas' GPU interpret mode runs the kernel's code through callbacks on the CPU backend:
# on a GPU machine the CPU must be listed too (`JAX_PLATFORMS=cuda,cpu`).
INTERPRETS = pytest.mark.skipif(not _has_cpu_backend(),
                                reason="GPU interpret mode needs the CPU backend: "
                                       "JAX_PLATFORMS=cuda,cpu")
