"""Shared test setup: float32 everywhere, deterministic CPU runs."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
