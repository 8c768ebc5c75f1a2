"""Markers shared by test modules."""

import pytest

from jrl.models import mosaic_backend, triton_backend

# Tests that run a Pallas kernel (interpret mode off a GPU) need the Triton backend.
NEEDS_TRITON = pytest.mark.skipif(not triton_backend.available(),
                                  reason="this jax has no Pallas Triton backend")

# Tests that run the Mosaic GPU kernels (GPU interpret mode off a GPU) need that backend.
NEEDS_MOSAIC = pytest.mark.skipif(not mosaic_backend.available(),
                                  reason="this jax has no Pallas Mosaic GPU backend")
