"""Many runs in one program (`jrl.rl.runs`): run r of a vmapped program is the single run of
its seed (and learning rate) step for step, K scanned steps are K steps, the vmapped warm
start is each seed's, a multi-run checkpoint resumes, the outputs (a metrics record per
step and run, curves, the table of runs), and the checks that stop a multi-run start
before its workdir exists.

The runs are configs/grpo_arith.py and configs/ppo_arith.py shrunk: a 1-layer model of
width 32, one-digit sums, 3 RL steps of 4 prompts. RL starts from one warm start, made
once (`warm_start`: 60 SFT steps, enough that a few samples per step are right, so the
updates are not zero) and read as `model.path` by every run: over 60 steps at
sft.lr=1e-2 the summation-order differences of a vmapped warm start grow to ~1e-4 of
the weights, which would hide what the RL comparisons test. The vmapped warm start has
its own tests (`test_vmapped_warm_start_is_each_seeds`, and 4 steps inside the runs of
`_with_sft`). The single runs are the host loop (`jrl.rl.trainer.RLTrainer`, the host's
rule scorer); the multi-run programs score with `reward.in_graph_fn=exact_match`. Runs
are made once and shared between tests (`runs`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import grpo_arith, ppo_arith
from jrl import sft, train
from jrl.app import experiment
from jrl.config.settings import experiment_from_config
from jrl.errors import ConfigError
from jrl.metrics import read_jsonl
from jrl.models import hf
from jrl.rl import runs as runs_lib
from tests.eight_devices import cpu_env
from tests.tiny import apply_overrides

ACC = "val-core/synthetic/arithmetic/acc/mean@1"
# The per-step metrics compared between a run of a multi-run program and its single run.
COMPARED = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/entropy",
            "actor/grad_norm", ACC)
# PPO's too: the critic, and the KL penalty in the reward (against the reference).
PPO_COMPARED = COMPARED + ("critic/vf_loss", "critic/values/mean", "actor/reward_kl_penalty")
# Batched matrix products may sum in another order than the single run's.
RTOL, ATOL = 1e-4, 1e-5
IN_GRAPH = {"reward.in_graph_fn": "exact_match"}
STEPS = 3
SFT = {"sft.steps": 4}
CONFIGS = {"grpo": grpo_arith, "ppo": ppo_arith}


def _config(algo: str, warm: str | None = None, **overrides):
    """The shrunk config; `warm`: the warm start RL begins from (None: a fresh model)."""
    n = 8 if algo == "grpo" else 4
    return apply_overrides(CONFIGS[algo].get_config(f"n={n}"), {
        "model.hidden_size": 32, "model.intermediate_size": 64, "model.num_layers": 1,
        "model.num_heads": 2, "model.num_kv_heads": 1, "model.head_dim": 16,
        "data.digits": 1, "data.carry_slip_rate": 0.0, "data.num_val": 8,
        "data.val_batch_size": 8, "data.train_batch_size": 4,
        "rollout.decode_buckets": 1,
        "actor.ppo_mini_batch_size": 2, "actor.ppo_micro_batch_size": 2 * n,
        "critic.ppo_mini_batch_size": 2, "critic.ppo_micro_batch_size": 2 * n,
        "model.path": warm, "sft.steps": 0, "sft.batch_size": 32, "sft.lr": 1e-3,
        "sft.lr_warmup_steps": 0,
        "trainer.total_training_steps": STEPS, "trainer.test_freq": STEPS,
        "trainer.save_freq": 0, "trainer.export_hf": False, "trainer.logger": ("jsonl",),
        **overrides})


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory) -> str:
    """A HF-format checkpoint of the shrunk model after 60 SFT steps at lr 1e-2."""
    config = _config("grpo")
    experiment_settings = experiment_from_config(config)
    tokenizer = experiment.build_tokenizer(experiment_settings)
    rows, _ = experiment.build_data(experiment_settings, tokenizer)
    model, params = experiment.build_model(experiment_settings, tokenizer)
    params = sft.train_sft(params, rows, tokenizer, model=model, steps=60, batch_size=32,
                           lr=1e-2, max_prompt_length=config.data.max_prompt_length,
                           max_response_length=config.rollout.response_length)
    path = str(tmp_path_factory.mktemp("warm_start"))
    hf.save_pretrained(path, model, params)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, warm_start):
    """`runs(algo, **overrides)`: (summary, metrics records) of that run from the warm
    start, made once per module."""
    done = {}

    def get(algo: str, **overrides):
        key = (algo, tuple(sorted(overrides.items())))
        if key not in done:
            workdir = str(tmp_path_factory.mktemp(algo))
            summary = train.run(_config(algo, warm_start, **overrides), workdir)
            done[key] = summary, read_jsonl(os.path.join(workdir, "metrics.jsonl"))
        return done[key]

    return get


def _multi(runs, algo="grpo", **overrides):
    """The R=2 program (seeds 0 and 1)."""
    return runs(algo, **IN_GRAPH, **{"trainer.runs": 2, **overrides})


def _with_sft(runs):
    """The R=2 program with a (vmapped) warm start of 4 steps before RL."""
    return _multi(runs, **SFT)


def _single(runs, algo="grpo", seed=0, lr=1e-4):
    """The host loop's run of `seed` and peak actor learning rate `lr`."""
    return runs(algo, **{"seed": seed, "actor.optim.lr": lr})


def _per_step(records, run=None) -> dict[int, dict]:
    """{step: record} of one run (`run`: its index; None: a single run's records)."""
    out = {r["step"]: r for r in records if r.get("run") == run}
    assert sorted(out) == list(range(STEPS + 1)), sorted(out)  # step 0: before RL
    return out


def _assert_same_steps(got: dict[int, dict], want: dict[int, dict], keys, exact=False):
    for step in want:
        for key in keys:
            assert (key in got[step]) == (key in want[step]), (step, key)
            if key not in want[step]:
                continue
            if exact:
                assert got[step][key] == want[step][key], (step, key)
            else:
                np.testing.assert_allclose(got[step][key], want[step][key], rtol=RTOL,
                                           atol=ATOL, err_msg=f"step {step}: {key}")


def _assert_learning(per_step: dict[int, dict]) -> None:
    """The run is a test of the update: some responses right, some gradient not zero."""
    assert any(per_step[s]["critic/score/mean"] > 0 for s in range(1, STEPS + 1))
    assert any(per_step[s]["actor/grad_norm"] > 0 for s in range(1, STEPS + 1))


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_run_r_is_the_single_run_of_its_seed(runs, algo):
    keys = PPO_COMPARED if algo == "ppo" else COMPARED
    _, multi = _multi(runs, algo)
    per_run = [_per_step(multi, run) for run in range(2)]
    for seed in range(2):
        _, single = _single(runs, algo, seed)
        want = _per_step(single)
        _assert_learning(want)
        assert ACC in want[0] and ACC in want[STEPS]
        assert all(set(keys) - {ACC} <= set(want[s]) for s in range(1, STEPS + 1))
        _assert_same_steps(per_run[seed], want, keys)
    # The seeds differ: the runs are not one run twice.
    assert any(per_run[0][s]["actor/entropy"] != per_run[1][s]["actor/entropy"]
               for s in range(1, STEPS + 1))


def test_scanned_steps_are_single_steps(runs):
    _, scanned = _multi(runs, **{"trainer.steps_per_call": 3})
    _, stepped = _multi(runs)
    for run in range(2):
        _assert_same_steps(_per_step(scanned, run), _per_step(stepped, run), COMPARED)


def test_run_of_a_sweep_is_the_single_run_of_its_learning_rate(runs):
    summary, swept = runs("grpo", **IN_GRAPH, **{"trainer.sweep": "actor.optim.lr=1e-4,1e-3"})
    assert [(row["seed"], row["lr"]) for row in summary["runs"]] == [(0, 1e-4), (0, 1e-3)]
    for run, lr in enumerate((1e-4, 1e-3)):
        _, single = _single(runs, lr=lr)
        _assert_same_steps(_per_step(swept, run), _per_step(single), COMPARED)
    # The same seed, so step 1 is the same in both; the learning rate shows from step 2.
    slow, fast = _per_step(swept, 0), _per_step(swept, 1)
    assert slow[1]["actor/entropy"] == fast[1]["actor/entropy"]
    assert slow[2]["actor/entropy"] != fast[2]["actor/entropy"]


def test_run_of_a_kl_sweep_is_the_single_run_of_its_coefficient(runs):
    # PPO has the KL penalty in the reward: each run's controller starts at its value.
    key = "algorithm.kl_ctrl.kl_coef"
    summary, swept = runs("ppo", **IN_GRAPH, **{"trainer.sweep": f"{key}=0.001,0.3"})
    assert [row["setting"] for row in summary["runs"]] == ["kl_coef=0.001", "kl_coef=0.3"]
    for run, coef in enumerate((0.001, 0.3)):
        # The config's own coefficient is the single run the seed test made already.
        _, single = _single(runs, "ppo") if coef == 0.001 else runs("ppo", **{key: coef})
        got, want = _per_step(swept, run), _per_step(single)
        _assert_same_steps(got, want, PPO_COMPARED)
        assert got[1]["actor/reward_kl_penalty_coeff"] == pytest.approx(coef)


def test_run_of_a_clip_sweep_is_the_single_run_of_its_clip_ratio(runs):
    summary, swept = runs("grpo", **IN_GRAPH, **{"trainer.sweep": "actor.clip_ratio=0.2,0.01"})
    assert [row["setting"] for row in summary["runs"]] == ["clip_ratio=0.2", "clip_ratio=0.01"]
    clipped = []
    for run, clip in enumerate((0.2, 0.01)):
        _, single = _single(runs) if clip == 0.2 else runs("grpo", **{"actor.clip_ratio": clip})
        got = _per_step(swept, run)
        _assert_same_steps(got, _per_step(single), COMPARED + ("actor/pg_clipfrac",))
        clipped.append(max(got[s]["actor/pg_clipfrac"] for s in range(1, STEPS + 1)))
    assert clipped[1] > clipped[0]  # the narrow clip range does clip more


def test_run_of_a_temperature_sweep_is_the_single_run_of_its_temperature(runs):
    key = "rollout.temperature"
    summary, swept = runs("grpo", **IN_GRAPH, **{"trainer.sweep": f"{key}=1.0,0.5"})
    assert [row["setting"] for row in summary["runs"]] == ["temperature=1", "temperature=0.5"]
    for run, temperature in enumerate((1.0, 0.5)):
        _, single = _single(runs) if temperature == 1.0 else runs("grpo", **{key: temperature})
        _assert_same_steps(_per_step(swept, run), _per_step(single), COMPARED)
    cold, hot = _per_step(swept, 1), _per_step(swept, 0)
    assert cold[1]["actor/entropy"] < hot[1]["actor/entropy"]  # sharper at 0.5


def _run_of(stacked, run: int):
    """Run `run`'s parameters of a stacked tree (`[R, ...]` leaves)."""
    return jax.tree.map(lambda x: x[run], stacked)


def test_vmapped_warm_start_is_each_seeds():
    config = _config("grpo", **{"sft.steps": 6})  # a fresh model per seed
    experiment_settings = experiment_from_config(config)
    tokenizer = experiment.build_tokenizer(experiment_settings)
    rows, _ = experiment.build_data(experiment_settings, tokenizer)
    model, params = experiment.build_models(experiment_settings, tokenizer, [0, 1])
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # the programs donate their inputs
    # 6 steps: 6 calls of one step; a call of 4 scanned steps and one of 2.
    stacked = {k: runs_lib.train_sft_runs(copy(params), rows, tokenizer, model=model,
                                          experiment_settings=experiment_settings,
                                          seeds=[0, 1], steps_per_call=k)
               for k in (1, 4)}
    chex.assert_trees_all_close(stacked[4], stacked[1], rtol=RTOL, atol=ATOL)
    for seed in range(2):
        _, initial = experiment.build_model(
            experiment_from_config(_config("grpo", seed=seed)), tokenizer)
        chex.assert_trees_all_equal(_run_of(params, seed), initial)
        single = sft.train_sft(copy(initial), rows, tokenizer, model=model, steps=6,
                               batch_size=32, lr=1e-3, seed=seed,
                               max_prompt_length=config.data.max_prompt_length,
                               max_response_length=config.rollout.response_length)
        chex.assert_trees_all_close(_run_of(stacked[1], seed), single, rtol=RTOL, atol=ATOL)
        moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), single, initial)
        assert min(jax.tree.leaves(moved)) > 1e-4  # every weight trained


def test_a_multi_run_checkpoint_resumes_bit_identically(runs, warm_start, tmp_path, capsys):
    config = _config("grpo", warm_start, **IN_GRAPH, **SFT,
                     **{"trainer.runs": 2, "trainer.save_freq": 2})
    first = train.run(config, str(tmp_path), exit_after_steps=2)
    assert first["step"] == 2 and not first["resumed"]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]
    capsys.readouterr()
    second = train.run(config, str(tmp_path))
    assert second["resumed"] and second["step"] == STEPS
    out = capsys.readouterr().out
    assert f"sft: reusing the warm starts in {tmp_path / 'sft'}" in out
    assert "resumed from step 2 (of 3)" in out
    _, straight = _with_sft(runs)
    resumed = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [(r["step"], r["run"]) for r in resumed] == [(s, r) for s in range(STEPS + 1)
                                                        for r in range(2)]
    for run in range(2):
        want = {s: {k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))}
                for s, r in _per_step(straight, run).items()}
        _assert_same_steps(_per_step(resumed, run), want,
                           sorted({k for r in want.values() for k in r}), exact=True)
    # resume_path: step 2's checkpoint, read into another workdir, runs step 3 as the
    # resumed run did.
    checkpoint = str(tmp_path / "checkpoints" / "2")
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "sft", other / "sft")  # the same warm starts
    third = train.run(_config("grpo", warm_start, **IN_GRAPH, **SFT, **{
        "trainer.runs": 2, "trainer.resume_mode": "resume_path",
        "trainer.resume_from_path": checkpoint}), str(other))
    assert third["resumed"] and third["step"] == STEPS
    assert f"resumed from step 2 (of 3) ({checkpoint})" in capsys.readouterr().out
    last = {r["run"]: r for r in read_jsonl(str(other / "metrics.jsonl"))
            if r["step"] == STEPS}
    for run in range(2):
        assert last[run][ACC] == _per_step(resumed, run)[STEPS][ACC]


# --------------------------------------------------------------------------- outputs


def test_outputs_of_a_multi_run(runs, capsys):
    summary, records = _with_sft(runs)
    assert [(r["step"], r["run"]) for r in records] == [(s, r) for s in range(STEPS + 1)
                                                        for r in range(2)]
    assert os.path.getsize(summary["curves"]) > 10_000  # a PNG with the panels
    assert summary["step"] == STEPS and summary["final"] == {}
    assert [(row["run"], row["seed"], row["lr"]) for row in summary["runs"]] == [
        (0, 0, 1e-4), (1, 1, 1e-4)]
    for run, row in enumerate(summary["runs"]):
        per_step = _per_step(records, run)
        assert row["initial"][ACC] == per_step[0][ACC]
        assert row["final"][ACC] == per_step[STEPS][ACC]
    capsys.readouterr()
    train.print_summary(summary)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{ACC}:"
    assert [line.split(" after RL")[0] for line in lines[1:3]] == [
        f"  run   0 seed    0 lr=0.0001    {summary['runs'][0]['final'][ACC]:.3f}",
        f"  run   1 seed    1 lr=0.0001    {summary['runs'][1]['final'][ACC]:.3f}"]
    assert lines[3].startswith("  after RL: mean ") and lines[3].count("over 2 runs") == 1
    assert lines[-1] == f"curves: {summary['curves']}"


def test_print_summary_of_runs(capsys):
    key = "val-core/x/acc/mean@1"
    summary = {"runs": [
        {"run": 0, "seed": 0, "lr": 1e-4, "initial": {key: 0.25}, "final": {key: 0.75}},
        {"run": 1, "seed": 1, "lr": 1e-4, "initial": {key: 0.5}, "final": {key: 0.5}},
        {"run": 2, "seed": 0, "lr": 3e-4, "setting": "lr=0.0003 kl_coef=0.01", "initial": {},
         "final": {key: 1.0}},
    ], "curves": "w/curves.png"}
    train.print_summary(summary)
    assert capsys.readouterr().out.splitlines() == [
        f"{key}:",
        "  run   0 seed    0 lr=0.0001    0.750 after RL, 0.250 before (+50.0 points)",
        "  run   1 seed    1 lr=0.0001    0.500 after RL, 0.500 before (+0.0 points)",
        "  run   2 seed    0 lr=0.0003 kl_coef=0.01 1.000 after RL",
        "  after RL: mean 0.750, min 0.500, max 1.000 over 3 runs; gain mean +25.0 points",
        "curves: w/curves.png",
    ]


# --------------------------------------------------------------------------- checks


@pytest.mark.parametrize("overrides, message", [
    ({"trainer.runs": 2}, "reward.in_graph_fn: is needed by trainer.runs=2: runs and steps "
                          "in one device program score their responses on the device"),
    ({"trainer.steps_per_call": 4}, "reward.in_graph_fn: is needed by "
                                    "trainer.steps_per_call=4"),
    ({"trainer.sweep": "actor.optim.lr=1e-4"}, "reward.in_graph_fn: is needed by "
                                               "trainer.sweep='actor.optim.lr=1e-4'"),
    ({**IN_GRAPH, "trainer.runs": 0}, "trainer.runs: must be a positive number, got 0"),
    ({**IN_GRAPH, "trainer.sweep": "critic.optim.lr=1e-3"},
     "trainer.sweep: 'critic.optim.lr' cannot vary per run; sweepable keys: actor.optim.lr, "
     "algorithm.kl_ctrl.kl_coef, actor.clip_ratio, rollout.temperature"),
    ({**IN_GRAPH, "trainer.sweep": "algorithm.kl_ctrl.kl_coef=0.01,0.1"},
     "trainer.sweep: algorithm.kl_ctrl.kl_coef is the KL penalty in the reward, which "
     "algorithm.use_kl_in_reward=False leaves out"),
    ({**IN_GRAPH, "trainer.sweep": "actor.clip_ratio=0.1,0.3", "actor.clip_ratio_high": 0.28},
     "trainer.sweep: actor.clip_ratio is overridden by actor.clip_ratio_high=0.28"),
    ({**IN_GRAPH, "trainer.sweep": "actor.optim.lr=1e-4,fast"},
     "trainer.sweep: 'actor.optim.lr=1e-4,fast' must be key=v1,v2,... with numbers"),
    ({**IN_GRAPH, "trainer.sweep": "actor.optim.lr="},
     "trainer.sweep: 'actor.optim.lr=' needs at least one finite value >= 0"),
    ({**IN_GRAPH, "trainer.sweep": "actor.optim.lr=1e-4,-1"},
     "trainer.sweep: 'actor.optim.lr=1e-4,-1' needs at least one finite value >= 0"),
    ({**IN_GRAPH, "trainer.sweep": "actor.optim.lr=1e-4;actor.optim.lr=3e-4"},
     "trainer.sweep: 'actor.optim.lr' is given twice; give its values once"),
    ({**IN_GRAPH, "trainer.runs": 3, "mesh.runs": 2},
     "mesh.runs=2: the runs are split over this many of the"),
    ({"mesh.runs": 2}, "mesh.runs=2: splits runs in one program"),
    ({**IN_GRAPH, "model.lora_rank": 4},
     "model.lora_rank=4: LoRA is not supported with reward.in_graph_fn"),
    ({**IN_GRAPH, "trainer.rollout_data_dir": "samples"},
     "trainer.rollout_data_dir='samples': runs in one program (reward.in_graph_fn) do not "
     "write samples"),
    ({**IN_GRAPH, "trainer.validation_data_dir": "samples"},
     "trainer.validation_data_dir='samples': runs in one program"),
    ({**IN_GRAPH, "rollout.devices": 1},
     "reward.in_graph_fn: 'exact_match' scores on the device and cannot be combined with "
     "rollout.devices=1"),
    ({**IN_GRAPH, "model.attention_impl": "cudnn"},
     "model.attention_impl='cudnn': runs in one program (trainer.runs, reward.in_graph_fn) "
     "are vmapped"),
    ({**IN_GRAPH, "model.decode_head_impl": "mosaic"},
     "model.decode_head_impl='mosaic': runs in one program (trainer.runs, reward.in_graph_fn) "
     "are vmapped"),
], ids=["runs", "steps_per_call", "sweep", "zero_runs", "sweep_key", "sweep_kl_unused",
        "sweep_clip_overridden", "sweep_value", "sweep_empty", "sweep_negative", "sweep_twice",
        "mesh_runs_divisor", "mesh_runs_host_loop", "lora", "rollout_data_dir",
        "validation_data_dir", "rollout_devices", "cudnn", "decode_head"])
def test_what_a_multi_run_cannot_do_stops_before_the_workdir(tmp_path, overrides, message):
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        train.run(_config("grpo", **overrides), str(workdir))
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)
    assert not workdir.exists()


def test_vmapped_programs_take_xla_attention_and_head_where_auto_would_take_kernels():
    from jrl.models import ModelConfig

    vmapped = runs_lib.vmapped_model(ModelConfig.preset("tiny"))
    assert (vmapped.attention_impl, vmapped.decode_head_impl) == ("xla", "xla")
    forced = ModelConfig.preset("tiny", attention_impl="splash", decode_head_impl="mosaic")
    assert runs_lib.vmapped_model(forced) is forced


# --------------------------------------------------------------------------- devices

_SPLIT_RUNS = """
import json, os, sys
from jrl import train
from jrl.metrics import read_jsonl
from tests.rl.test_runs import IN_GRAPH, _config
out = {}
for devices in (2, 1):
    workdir = os.path.join(sys.argv[1], str(devices))
    train.run(_config("grpo", **IN_GRAPH, **{"trainer.runs": 4, "mesh.runs": devices,
                                             "sft.steps": 3}), workdir)
    out[devices] = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
print(json.dumps(out))
"""


def test_runs_split_over_devices_are_the_runs_on_one(tmp_path):
    """`mesh.runs=2` on two CPU devices (a fresh process: the device count is fixed at
    start-up) gives every run's steps as one device does."""
    env = cpu_env(2, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _SPLIT_RUNS, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    split, single = out["2"], out["1"]
    assert len(split) == len(single) == 4 * (STEPS + 1)
    for run in range(4):
        _assert_same_steps(_per_step(split, run), _per_step(single, run), COMPARED)
