"""One-step asynchronous training on 8 CPU devices: 4 sample, 4 train.

With `rollout.staleness=0` the split run is the synchronous trainer on the training
devices, step for step; with `staleness=1` the first step is, and every later step
learns from a rollout of the previous step's weights, which the mismatch metrics then
see; a resumed asynchronous run repeats the uninterrupted one exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import chex
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from .test_meshes import ROOT, _env

_SKIP = ("timing_s/", "perf/time_per_step", "perf/throughput", "perf/mfu")
_SPLIT = {"rollout.devices": 4}
_C = "algorithm.rollout_correction"


def _run(tmp_path, jobs: dict[str, dict]) -> dict[str, list[dict]]:
    """Runs `jobs` (see `async_runner`) one after another in one fresh process; returns
    each job's metrics records by name."""
    out = tmp_path / f"{'-'.join(jobs)}.json"
    subprocess.run([sys.executable, "-m", "tests.sharding.async_runner", "--jobs",
                    json.dumps(jobs), "--out", str(out)],
                   cwd=ROOT, env=_env(8), check=True, timeout=900)
    return json.loads(out.read_text())


def _values(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(_SKIP)}


def _assert_same(expected: dict, actual: dict) -> None:
    expected, actual = _values(expected), _values(actual)
    assert set(expected) <= set(actual), set(expected) - set(actual)
    for key, value in expected.items():
        np.testing.assert_allclose(actual[key], value, rtol=1e-6, atol=1e-7, err_msg=key)


# Short runs of other configs, split with token-level importance sampling.
_WITH = [
    ("multi_turn", {}),  # tools run in the rollout thread, beside the update
    ("grpo", {"model.lora_rank": 4, "model.lora_alpha": 8.0}),  # merged adapters move
    ("grpo", {"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "score",
              "data.gen_batch_size": 8}),  # DAPO's rounds on the sampling group
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple:
    """(directory, {job: metrics records}): the runs the tests compare, made in one
    process: the synchronous trainer on the 4 devices that train in the split runs, the
    split run without staleness (with one sampling program, and with cache segments), the
    one-step-off-policy run and the same run stopped
    after step 2 (in `directory / "full"` and `directory / "half"`), and the short
    runs of `_WITH` (the multi-turn one last: it reads every turn as a tool call)."""
    tmp = tmp_path_factory.mktemp("async")
    jobs = {"sync": {"train_devices": "4,8"},
            "split": {"overrides": {**_SPLIT, "rollout.staleness": 0}},
            "segments": {"overrides": {**_SPLIT, "rollout.staleness": 0,
                                       "rollout.cache_segments": 3}},
            "full": {"overrides": _SPLIT, "workdir": str(tmp / "full")},
            "first": {"overrides": _SPLIT, "workdir": str(tmp / "half"), "exit_after": 2}}
    for i, (algo, overrides) in sorted(enumerate(_WITH), key=lambda x: x[1][0] == "multi_turn"):
        jobs[f"with{i}"] = {"algo": algo, "steps": 2,
                            "overrides": {**_SPLIT, f"{_C}.rollout_is": "token", **overrides}}
    return tmp, _run(tmp, jobs)


@pytest.mark.parametrize("job", [
    "split",
    # The sampling group decoding in segments (caches of the rows still running) samples
    # the single program's tokens and log-probs, so the run is still the synchronous one.
    "segments",
])
def test_split_without_staleness_is_the_synchronous_trainer(runs, job):
    sync, split = runs[1]["sync"], [dict(r) for r in runs[1][job]]
    assert len(sync) == len(split) == 4
    for a, b in zip(sync, split, strict=True):
        assert b.pop("async/staleness") == 0.0
        _assert_same(a, b)
    assert sync[-1]["actor/pg_loss"] != 0.0  # the runs learned something


def test_one_step_off_policy_and_its_resume(runs):
    tmp, got = runs
    full, sync = got["full"], got["sync"]
    assert [r["async/staleness"] for r in full] == [0.0, 1.0, 1.0, 1.0]
    # Every step's phases are timed, the hand-over of the weights to the sampling group
    # included: together within the step's time.
    phases = ("sync_rollout_weights", "wait_rollout", "forward", "reward", "learn")
    for r in full:
        assert sum(r.get(f"timing_s/{p}", 0.0) for p in phases) <= r["timing_s/step"]
    assert all("timing_s/sync_rollout_weights" in r for r in full[:-1])
    assert "timing_s/sync_rollout_weights" not in full[-1]  # no rollout after the last
    # The first step samples from the initial weights, as the synchronous trainer does.
    full0 = dict(full[0])
    full0.pop("async/staleness")
    _assert_same(sync[0], full0)
    # Later rollouts come from the weights before the last update: the trainer's log-probs
    # of them differ from the sampler's by that update (on step 1 only by rounding).
    assert abs(full[0]["rollout_corr/kl"]) < 1e-6
    assert all(abs(r["rollout_corr/kl"]) > 1e-4 for r in full[1:])
    assert full[2]["training/rollout_probs_diff_max"] > 1e-3
    # Stopped after step 2 (checkpointed with the rollout in flight); resumed in a fresh
    # process, it finishes as the uninterrupted run did.
    half = tmp / "half"
    assert [r["step"] for r in got["first"]] == [1, 2]
    assert os.path.isdir(half / "checkpoints" / "2" / "rollout_weights")
    resumed = _run(tmp, {"second": {"overrides": _SPLIT, "workdir": str(half)}})["second"]
    assert len(resumed) == 4
    for a, b in zip(full, resumed, strict=True):
        _assert_same(a, b)
    chex.assert_trees_all_equal(_final_state(tmp / "full"), _final_state(half))


@pytest.mark.parametrize("job", range(len(_WITH)),
                         ids=["multi_turn", "grpo-lora", "grpo-filter_groups"])
def test_one_step_off_policy_runs_with(runs, job):
    records = runs[1][f"with{job}"]
    assert [r["async/staleness"] for r in records] == [0.0, 1.0]
    for r in records:
        assert np.isfinite(r["actor/pg_loss"]) and np.isfinite(r["rollout_corr/kl"])
        assert 0.0 < r["rollout_corr/rollout_is_mean"] <= 2.0
    if _WITH[job][0] == "multi_turn":
        assert all(r["multi_turn/tool_calls/total"] > 0 for r in records)


def _final_state(workdir):
    """Step 4's saved state, read onto this process's one device."""
    path = str(workdir / "checkpoints" / "4" / "state")
    checkpointer = ocp.StandardCheckpointer()
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    like = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                        checkpointer.metadata(path).item_metadata.tree)
    return checkpointer.restore(path, like)
