"""A checkpoint with files missing, truncated or corrupted, or an empty step directory,
stops `python -m jrl.train` with one error (status 2, no traceback) that names the
directory and what to resume from instead; an incomplete newest checkpoint of the
workdir is skipped with a warning. The runs share one saved checkpoint."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jrl.rl import checkpoint
from jrl.rl.checkpoint import Checkpointer, UnreadableCheckpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The main job with a small model, no warm start and no validation: one RL step, saved.
# The starts below read the checkpoint back before anything compiles.
FLAGS = ["--config=configs/grpo_arith.py", "--config.model.hidden_size=32",
         "--config.model.intermediate_size=64", "--config.model.num_heads=2",
         "--config.model.num_kv_heads=1", "--config.model.head_dim=16", "--config.sft.steps=0",
         "--config.trainer.total_training_steps=1", "--config.trainer.save_freq=1",
         "--config.trainer.val_before_train=False", "--config.trainer.test_freq=0",
         "--config.trainer.logger=('jsonl',)"]


def _train(workdir, *args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "jrl.train", *FLAGS, f"--workdir={workdir}",
                           *args], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=300)


def _resume_from(path):
    return ["--config.trainer.resume_mode=resume_path",
            f"--config.trainer.resume_from_path={path}"]


def _error(done) -> str:
    """The one error line of a start that stopped on bad input."""
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, \
        done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A finished one-step run with its checkpoint `checkpoints/1`."""
    workdir = tmp_path_factory.mktemp("saved") / "run"
    done = _train(workdir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(os.listdir(workdir / "checkpoints")) == ["1"]
    return workdir


def _copy(saved, tmp_path, second: bool = True):
    """A copy of the saved run; `second`: its checkpoint also as step 2, to be damaged
    while step 1 stays complete."""
    workdir = tmp_path / "run"
    shutil.copytree(saved, workdir)
    checkpoints = workdir / "checkpoints"
    if second:
        shutil.copytree(checkpoints / "1", checkpoints / "2")
    return workdir, checkpoints


def _largest_array_file(step_dir):
    files = [os.path.join(d, f) for d, _, fs in os.walk(step_dir / "state") for f in fs
             if os.sep + "ocdbt.process_" in d]
    return max(files, key=os.path.getsize)


def test_resume_path_with_deleted_files_stops_before_the_model(saved, tmp_path):
    workdir, checkpoints = _copy(saved, tmp_path)
    shutil.rmtree(checkpoints / "2" / "state" / "d")
    shutil.rmtree(checkpoints / "2" / "state" / "ocdbt.process_0")
    done = _train(workdir, *_resume_from(checkpoints / "2"))
    assert _error(done) == (
        f"error: trainer.resume_from_path: {checkpoints / '2'} is not a complete checkpoint "
        "(missing state/d/, state/ocdbt.process_*/); point --config.trainer.resume_from_path "
        f"at another step directory; complete checkpoints in {checkpoints}: step 1 (e.g. "
        f"--config.trainer.resume_from_path={checkpoints / '1'})")
    assert "mesh" not in done.stdout  # stopped before the model was built
    assert os.path.exists(workdir / "finished.json")  # the run is left as it was


def test_resume_path_with_a_truncated_file_names_it(saved, tmp_path):
    workdir, checkpoints = _copy(saved, tmp_path)
    path = _largest_array_file(checkpoints / "2")
    os.truncate(path, os.path.getsize(path) // 3)
    message = _error(_train(workdir, *_resume_from(checkpoints / "2")))
    assert message.startswith(
        f"error: trainer.resume_from_path: {checkpoints / '2'} could not be read; the "
        "checkpoint is incomplete or damaged (")
    assert f"{checkpoints / '2' / 'state'}" in message  # tensorstore's words, on its file
    assert message.endswith(
        f"; point --config.trainer.resume_from_path at another step directory; complete "
        f"checkpoints in {checkpoints}: step 1 (e.g. "
        f"--config.trainer.resume_from_path={checkpoints / '1'})")


def test_resume_path_to_an_empty_step_directory(tmp_path):
    empty = tmp_path / "copied" / "5"
    empty.mkdir(parents=True)
    workdir = tmp_path / "run"
    assert _error(_train(workdir, *_resume_from(empty))) == (
        f"error: trainer.resume_from_path: {empty} is not a complete checkpoint (the directory "
        f"is empty); {empty.parent} holds no other complete checkpoint; point "
        "--config.trainer.resume_from_path at the step directory of another run")
    assert not workdir.exists()


def test_auto_resume_moves_an_incomplete_newest_checkpoint_aside(saved, tmp_path):
    """An empty `checkpoints/2` (a partial copy) beside a complete step 1: the start
    resumes from step 1, and renames the other out of orbax's sight (where it would
    stop the save of step 2), saying so."""
    workdir, checkpoints = _copy(saved, tmp_path, second=False)
    (checkpoints / "2").mkdir()
    os.remove(workdir / "finished.json")
    done = _train(workdir, "--config.trainer.total_training_steps=2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert (f"warning: {checkpoints / '2'} is an incomplete checkpoint (the directory is "
            f"empty), moved aside to {checkpoints / '2.incomplete'}; resuming from step 1, "
            "the newest complete one") in done.stderr.splitlines()
    assert "resumed from step 1 (of 2)" in done.stdout
    assert sorted(os.listdir(checkpoints)) == ["1", "2", "2.incomplete"]
    assert checkpoint.missing(str(checkpoints / "2")) == []  # this run's step 2, saved


def test_resume_path_to_an_earlier_step_of_the_run_stops_naming_the_later_ones(saved,
                                                                               tmp_path):
    """Its saves would write step 2 again (orbax refuses, after a step) and a later auto
    start would mix the two histories: the start stops, before anything is built."""
    workdir, checkpoints = _copy(saved, tmp_path)
    os.remove(workdir / "finished.json")
    done = _train(workdir, *_resume_from(checkpoints / "1"),
                  "--config.trainer.total_training_steps=2")
    assert _error(done) == (
        f"error: trainer.resume_from_path: resuming from step 1 into {workdir}, whose "
        "checkpoints already go on to step 2, which this run would write again; to continue "
        f"the run in {workdir} from its newest checkpoint use "
        "--config.trainer.resume_mode=auto, or move those step directories out of "
        f"{checkpoints}, or give a fresh --workdir")
    assert "mesh" not in done.stdout  # stopped before the model was built
    assert sorted(os.listdir(checkpoints)) == ["1", "2"]
    assert checkpoint.missing(str(checkpoints / "2")) == []  # left as it was


def test_auto_resume_with_no_complete_checkpoint_stops(saved, tmp_path):
    workdir, checkpoints = _copy(saved, tmp_path, second=False)
    shutil.rmtree(checkpoints / "1" / "meta")
    os.rename(checkpoints / "1", checkpoints / "2")
    os.remove(workdir / "finished.json")
    assert _error(_train(workdir)) == (
        f"error: {checkpoints} holds no complete checkpoint to resume from: "
        f"{checkpoints / '2'} (missing meta/). Copy the checkpoint again in full, or pass "
        "--config.trainer.resume_mode=disable to start the run over (this removes its "
        "checkpoints, warm start and metrics)")


def test_auto_resume_from_a_damaged_newest_checkpoint_names_the_one_before(saved, tmp_path):
    workdir, checkpoints = _copy(saved, tmp_path)
    path = _largest_array_file(checkpoints / "2")
    os.truncate(path, os.path.getsize(path) // 3)
    os.remove(workdir / "finished.json")
    message = _error(_train(workdir))
    assert message.startswith(f"error: {checkpoints / '2'}, the newest checkpoint of this "
                              "run, could not be read; the checkpoint is incomplete or damaged (")
    assert message.endswith(
        f"; move it out of {checkpoints} (rename it, e.g. to {checkpoints / '2'}.damaged) to "
        "resume from step 1, the newest complete one before it, or pass "
        "--config.trainer.resume_mode=disable to start the run over (this removes its "
        "checkpoints, warm start and metrics)")


# -- the checkpointer, in the process (numpy trees: nothing compiles) ---------------------------


@pytest.fixture(autouse=True)
def _reads_reset():
    """A failed read keeps orbax's abandoned reads quiet for the rest of the process;
    the tests after this module's see the state they would alone."""
    yield
    checkpoint._reads.failed = False


def _tree():
    return {"a": np.arange(600, dtype=np.float32).reshape(20, 30),
            "b": np.ones(7, np.float32)}


def test_incomplete_step_directories_are_not_the_latest_and_move_aside(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, _tree(), {"step": 1})
    (tmp_path / "2").mkdir()  # a partial copy
    (tmp_path / "3.orbax-checkpoint-tmp-17").mkdir()  # a save cut short
    assert checkpoint.scan(str(tmp_path)) == ([1], {2: ["the directory is empty"]})
    assert ckpt.latest_step() == 1
    ckpt.close()
    (tmp_path / "2.incomplete").mkdir()  # moved aside by an earlier start
    # As a start does, before the run's checkpointer is made.
    assert checkpoint.move_aside(str(tmp_path), [2], "incomplete") == [
        str(tmp_path / "2.incomplete.2")]
    assert checkpoint.scan(str(tmp_path)) == ([1], {})
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(2, _tree(), {"step": 2})
    assert ckpt.latest_step() == 2 and ckpt.read_meta(2) == {"step": 2}
    (tmp_path / "2" / "meta" / "metadata").write_text('{"step": ')
    assert checkpoint.missing(str(tmp_path / "2")) == ["meta/metadata (not valid JSON)"]
    assert checkpoint.summary(["meta/metadata (not valid JSON)"]) == \
        "missing or damaged: meta/metadata (not valid JSON)"
    ckpt.close()


# Where the flipped byte lands decides tensorstore's error: a failed checksum is a
# "DATA_LOSS: ..." status, a broken compressed frame a ValueError naming the store.
@pytest.mark.parametrize("where", [14, "middle", -5])
def test_a_corrupted_index_is_an_unreadable_checkpoint_chained_to_its_cause(tmp_path, where):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, _tree(), {"step": 1})
    # The b-tree index of the merged arrays (checksummed and compressed): one flipped byte.
    index = tmp_path / "1" / "state" / "d"
    (name,) = os.listdir(index)
    path = index / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if where == "middle" else where] ^= 0xFF
    path.write_bytes(data)
    assert checkpoint.missing(str(tmp_path / "1")) == []  # the names are all there
    with pytest.raises(UnreadableCheckpoint) as raised:
        ckpt.restore(1, _tree())
    err = raised.value
    assert err.step_dir == str(tmp_path / "1") and not err.mismatch
    assert err.__cause__ is err.cause and err.cause is not None  # orbax's error, chained
    assert str(err).startswith(f"{tmp_path / '1'}: the checkpoint could not be read; it is "
                               "incomplete or damaged (")
    assert "b-tree node" in str(err)  # tensorstore's words (a failed checksum or inflate)
    assert "tensorstore_spec" not in str(err)  # the store's spec is cut from the line
    ckpt.close()
