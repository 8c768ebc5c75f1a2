"""Runs a test script on 8 CPU devices in a subprocess (the device count is fixed when
JAX starts, so a test process that already holds one device cannot make eight)."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_env(devices: int, **variables) -> dict:
    """The environment of a subprocess that runs JAX on `devices` CPU devices with the
    tests' other XLA flags (`tests/conftest.py`); `XLA_FLAGS` sets the device count when
    JAX starts."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    return {**os.environ, "JAX_PLATFORMS": "cpu", **variables,
            "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])}


def run_script(script: str, timeout: int = 300) -> dict:
    """Runs `script` with `python -c` from the repository root on 8 CPU devices and
    returns the JSON object its last line of output prints."""
    env = cpu_env(8)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), f"the script printed nothing; stderr: {proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
