"""Checkpoint/resume: a resumed run repeats the uninterrupted one exactly, even after a
SIGKILL in the middle of a checkpoint save."""

import json
import os
import subprocess
import sys
import textwrap

import chex

from jrl.metrics import read_jsonl
from jrl.rl.checkpoint import Checkpointer
from jrl.train import run
from tests.tiny import tiny_config

_VOLATILE = ("timing_s/", "perf/")


def _metrics(workdir):
    records = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    return [{k: v for k, v in r.items() if not k.startswith(_VOLATILE)} for r in records]


def _final_state(workdir, step):
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
    assert ckpt.latest_step() == step
    path = os.path.join(ckpt.directory, str(step), "state")
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer().restore(path)


def _config(**kw):
    return tiny_config(**{"trainer.total_training_steps": 4, "trainer.save_freq": 2,
                          "trainer.test_freq": 2, **kw})


def test_resume_is_bit_identical(tmp_path):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    config = _config(**{"algorithm.adv_estimator": "gae"})  # actor, critic and optimizer states
    run(config, straight)
    first = run(config, resumed, exit_after_steps=2)
    assert first["step"] == 2
    second = run(config, resumed)
    assert second["resumed"] and second["step"] == 4
    chex.assert_trees_all_equal(_final_state(straight, 4), _final_state(resumed, 4))
    assert _metrics(straight) == _metrics(resumed)
    assert [r["step"] for r in _metrics(resumed)] == [1, 2, 3, 4]


_KILL_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    import ml_collections
    from jrl.rl import checkpoint
    from jrl.train import run

    config = ml_collections.ConfigDict(json.loads(sys.argv[1]))
    workdir, kill_step = sys.argv[2], int(sys.argv[3])
    original = checkpoint.Checkpointer.save

    def save(self, step, state, meta):
        if step == kill_step:
            def killer():
                # SIGKILL as soon as orbax has started writing this step's files.
                while not any(n.startswith(f"{step}.") for n in os.listdir(self.directory)):
                    time.sleep(0.0002)
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Thread(target=killer, daemon=True).start()
            time.sleep(0)
        original(self, step, state, meta)

    checkpoint.Checkpointer.save = save
    run(config, workdir)
""")


def test_sigkill_during_save_loses_nothing(tmp_path):
    config = _config(**{"trainer.save_freq": 1})
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    run(config, straight)
    proc = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, config.to_json(), killed, "3"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == -9, proc.stderr[-2000:]
    # The interrupted save is not a complete checkpoint; step 2 is the latest complete one.
    assert Checkpointer(os.path.join(killed, "checkpoints")).latest_step() == 2
    summary = run(config, killed)
    assert summary["resumed"] and summary["step"] == 4
    chex.assert_trees_all_equal(_final_state(straight, 4), _final_state(killed, 4))
    assert _metrics(straight) == _metrics(killed)
    assert json.dumps(_metrics(killed))  # metrics stayed valid JSON lines
