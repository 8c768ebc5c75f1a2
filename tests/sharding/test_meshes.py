"""The same RL steps on different meshes of 8 CPU devices, and across two processes.

Every run happens in a fresh process (the device count is fixed when JAX starts).
Metrics must agree with the one-device run to within float32 reduction-order
differences: relative 2e-3 or absolute 1e-5, whichever is looser. Sampling does not
depend on the mesh (per-row keys), so the responses, scores and advantages agree
exactly and only reductions (gradients, losses) differ in the last bits.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.eight_devices import cpu_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RTOL, ATOL = 2e-3, 1e-5
# Wall-clock metrics differ between runs by nature.
_SKIP = ("timing_s/", "perf/time_per_step", "perf/throughput", "perf/mfu",
         "multi_turn/tool_latency_s")


def _env(devices_per_process: int) -> dict:
    return cpu_env(devices_per_process,
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


# (fsdp alone over 8 devices is left out: every mesh compiles every program of the step
# again, and (data=2, fsdp=2, tensor=2) and the MoE job's (fsdp=2, expert=4) split fsdp.)
MESHES = ("8,1,1", "2,2,2")


def _run(tmp_path, algo: str, meshes: str, steps: int = 3, *flags) -> dict[str, list[dict]]:
    out = tmp_path / f"{algo}-{steps}.json"
    subprocess.run([sys.executable, "-m", "tests.sharding.runner", "--algo", algo, "--meshes",
                    meshes, "--steps", str(steps), "--out", str(out), *flags],
                   cwd=ROOT, env=_env(8), check=True, timeout=900)
    return json.loads(out.read_text())


# GRPO with decode compaction on one device and the three meshes: the mesh test compares
# them, and the two-process test compares its processes with (data=8) in one. The other
# jobs run on one device and (data=2, fsdp=2, tensor=2), which splits every axis at once
# (a mesh costs a compilation of every program of the step).
ALL_MESHES, GRPO_FLAGS = " ".join(("1,1,1",) + MESHES), ("--compact",)
# The runs the tests compare, by name: the runner's arguments of each.
JOBS = {
    "grpo": ["--algo", "grpo", "--meshes", ALL_MESHES, "--steps", "3", *GRPO_FLAGS],
    "ppo": ["--algo", "ppo", "--meshes", "1,1,1 2,2,2", "--steps", "3"],
    # PPO with the separate value pass: padded on one device and (data=2, fsdp=2,
    # tensor=2), and on that mesh with token-budget micro-batches in every pass.
    "value_pass": ["--algo", "ppo", "--meshes", "1,1,1 2,2,2 2,2,2+packed",
                   "--steps", "2", "--value_pass"],
    # GRPO on a mixture-of-experts model with routing replay: one device, and the experts
    # split over 4 devices (expert=4) beside fsdp=2.
    "moe": ["--algo", "grpo", "--meshes", "1,1,1 1,2,1,1,4", "--steps", "2", "--moe"],
    # Last: the multi-turn config reads every turn as a tool call in its process. On the
    # mesh with either KV cache.
    "multi_turn": ["--algo", "multi_turn", "--meshes", "1,1,1 2,2,2 2,2,2+paged",
                   "--steps", "2"],
}


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory) -> dict[str, dict[str, list[dict]]]:
    """{job: {mesh: per-step metrics}} of `JOBS`, made in one process (a process of 8
    devices costs seconds to start) and shared by the tests."""
    out = tmp_path_factory.mktemp("meshes") / "jobs.json"
    subprocess.run([sys.executable, "-m", "tests.sharding.runner", "--jobs", json.dumps(JOBS),
                    "--out", str(out)], cwd=ROOT, env=_env(8), check=True, timeout=900)
    return json.loads(out.read_text())


def assert_same_metrics(expected: list[dict], actual: list[dict]) -> None:
    assert len(expected) == len(actual)
    compared = 0
    for step, (a, b) in enumerate(zip(expected, actual, strict=True)):
        for key, value in a.items():
            if key.startswith(_SKIP) or not isinstance(value, (int, float)):
                continue
            np.testing.assert_allclose(b[key], value, rtol=RTOL, atol=ATOL,
                                       err_msg=f"step {step + 1}: {key}")
            compared += 1
    assert compared > 20


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_meshes_match_one_device(mesh_runs, algo):
    """3 steps vs one device: GRPO with decode compaction (which gathers each batch
    shard's rows on its own devices) on (data=8) and (data=2, fsdp=2, tensor=2); PPO,
    actor and critic, on (data=2, fsdp=2, tensor=2)."""
    runs = mesh_runs[algo]
    expected = runs["1,1,1"]
    # The runs must have learned something for the comparison to mean anything.
    assert any(abs(r.get("actor/pg_loss", 0.0)) > 1e-4 for r in expected)
    assert len({r["critic/score/mean"] for r in expected}) > 1
    meshes = MESHES if algo == "grpo" else ("2,2,2",)
    assert set(runs) == {"1,1,1", *meshes}
    for mesh in meshes:
        assert_same_metrics(expected, runs[mesh])


def test_ppo_value_pass_meshes_match_one_device(mesh_runs):
    """PPO with the separate value pass and the critic's update in two mini-batches (the
    mesh test above values the batch in the critic's update) on (data=2, fsdp=2,
    tensor=2) vs one device."""
    runs = mesh_runs["value_pass"]
    assert len({r["critic/score/mean"] for r in runs["1,1,1"]}) > 1
    assert_same_metrics(runs["1,1,1"], runs["2,2,2"])


def test_packed_passes_match_padded_on_meshes(mesh_runs):
    """PPO with token-budget micro-batches in every pass (value and log-prob passes, the
    critic's and the actor's updates in two mini-batches each) on (data=2, fsdp=2,
    tensor=2), against the padded passes on one device: the same metrics, whatever the
    mesh and the micro-batching. (Packed against padded on one device:
    tests/rl/test_update.py and tests/rl/test_packing.py.)"""
    runs = mesh_runs["value_pass"]
    assert len({r["critic/score/mean"] for r in runs["1,1,1"]}) > 1
    assert_same_metrics(runs["1,1,1"], runs["2,2,2+packed"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _two_processes(tmp_path, steps: int, resume_from: str | None = None) -> list[dict]:
    """Runs the GRPO config (with decode compaction) in 2 processes x 4 CPU devices on one
    shared workdir."""
    out = tmp_path / f"two_processes_{steps}.json"
    address = f"localhost:{_free_port()}"
    procs = [subprocess.Popen(
        [sys.executable, "-m", "tests.sharding.runner", "--algo", "grpo", "--meshes", "8,1,1",
         "--steps", str(steps), "--out", str(out), "--coordinator", address,
         "--workdir", str(tmp_path / "run"),
         "--num_processes", "2", "--process_id", str(i), *GRPO_FLAGS,
         *(["--resume_from", resume_from] if resume_from else [])],
        cwd=ROOT, env=_env(4)) for i in range(2)]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0, 0]
    return json.loads(out.read_text())["8,1,1"]


def test_multi_turn_meshes_match_one_device(mesh_runs):
    """Multi-turn rollouts with a calculator (every turn ending at a newline or a digit
    calls it) on (data=2, fsdp=2, tensor=2), on the contiguous and on the paged KV
    cache, vs one device on the contiguous cache."""
    runs = mesh_runs["multi_turn"]
    expected = runs["1,1,1"]
    assert all(r["multi_turn/tool_calls/total"] > 0 for r in expected)
    assert max(r["multi_turn/segments"] for r in expected) >= 2
    assert_same_metrics(expected, runs["2,2,2"])
    assert all(r["rollout/page_usage"] > 0 for r in runs["2,2,2+paged"])
    assert_same_metrics(expected, runs["2,2,2+paged"])


def test_expert_parallel_moe_matches_one_device(mesh_runs):
    """A mixture-of-experts model's GRPO steps, with the rollout's routing replayed, on
    (fsdp=2, expert=4: each device holds 2 of the 8 experts of each layer and the tokens
    go to them and back) vs one device."""
    runs = mesh_runs["moe"]
    expected = runs["1,1,1"]
    assert all(r["actor/router_aux_loss"] > 0 for r in expected)
    assert_same_metrics(expected, runs["1,2,1,1,4"])


def test_two_processes_match_one_process(tmp_path, mesh_runs):
    """2 processes x 4 CPU devices (jax.distributed, local coordinator) = 1 process x 8
    (the mesh test's GRPO run); the two write one checkpoint together, and a second launch
    resumes from it."""
    expected = mesh_runs["grpo"]["8,1,1"]
    assert_same_metrics(expected[:2], _two_processes(tmp_path, steps=2))
    # Both processes wrote one orbax checkpoint together (step 2: the last step).
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2"]
    # Relaunched for 3 steps from that checkpoint (a longer run: trainer.resume_mode=
    # "resume_path"), both restore step 2 and run step 3 as the straight run did.
    checkpoint = str(tmp_path / "run" / "checkpoints" / "2")
    assert_same_metrics(expected, _two_processes(tmp_path, steps=3, resume_from=checkpoint))
