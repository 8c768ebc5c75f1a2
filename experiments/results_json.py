"""The JSON file a GPU script here writes its results to."""

from __future__ import annotations

import json

import jax


def write(path: str | None, **fields) -> None:
    """Writes `fields` to `path` as JSON after the device kind and jax version (nothing
    when `path` is empty)."""
    if not path:
        return
    with open(path, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, **fields},
                  f, indent=1)
