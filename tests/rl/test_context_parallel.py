"""Context parallelism (`mesh.context`) end to end: the training passes' log-probs and
gradients and RL steps through the trainer on 8 CPU devices agree with one device;
what it cannot run stops with a ConfigError."""

import textwrap

import pytest

from tests.eight_devices import run_script

_PASSES_SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jrl import sharding
    from jrl.app import experiment
    from jrl.rl import logprobs
    from jrl.rl import packing
    from jrl.models import ModelConfig, init_params

    assert jax.device_count() == 8, jax.devices()
    # 14 query heads over 2 KV heads (Qwen2.5-0.5B's ratio): context = 4 splits neither.
    model = ModelConfig.preset("tiny", hidden_size=56, num_heads=14, num_kv_heads=2,
                               head_dim=4, intermediate_size=64, dtype="float32")
    params = init_params(model, jax.random.key(0))
    b, p, r = 8, 6, 9  # P + R = 15: padded to 16 columns (context 2, 4), rows to 16 slots
    keys = jax.random.split(jax.random.key(1), 2)
    prompt_ids = jax.random.randint(keys[0], (b, p), 3, 128)
    responses = jax.random.randint(keys[1], (b, r), 3, 128)
    prompt_len = jnp.array([6, 3, 1, 4, 6, 2, 5, 6])[:, None]
    response_len = jnp.array([9, 2, 7, 9, 1, 5, 3, 8])[:, None]
    prompt_mask = (jnp.arange(p)[None] >= p - prompt_len).astype(jnp.int32)
    response_mask = (jnp.arange(r)[None] < response_len).astype(jnp.int32)
    inputs = (prompt_ids, prompt_mask, responses, response_mask)

    def padded(params, prompt_ids, prompt_mask, responses, response_mask):
        return logprobs.response_log_probs(params, prompt_ids, prompt_mask, responses,
                                           response_mask, config=model, chunk_size=4,
                                           with_entropy=True)

    slot_log_probs = lambda params, micro: logprobs.packed_log_probs(
        params, micro, config=model, chunk_size=4)[0]

    def packed(params, prompt_ids, prompt_mask, responses, response_mask):
        # One micro-batch of 8 rows whatever the batch shards (a plan the meshes share),
        # the sequences packed with segments across the chunk boundaries.
        plan = packing.for_sequences(prompt_ids, prompt_mask, responses, response_mask, 999)
        micro = packing.Micro(plan, jnp.int32(0))
        return micro.responses(slot_log_probs(params, micro), response_mask), plan.length

    def packed_pass(params, prompt_ids, prompt_mask, responses, response_mask):
        # 2 rows of 16 slots a batch shard: several micro-batches (forward only).
        plan = packing.for_sequences(prompt_ids, prompt_mask, responses, response_mask, 32)
        return logprobs.packed_pass(slot_log_probs, params, plan, response_mask)

    def objective(fn):
        def loss(params, *inputs):
            out = fn(params, *inputs)
            lp = out[0]
            return jnp.sum(lp * inputs[3] * jnp.arange(1.0, r + 1)), out
        return jax.value_and_grad(loss, has_aux=True)

    results = {}
    for name, fn in (("padded", padded), ("packed", packed)):
        (want_loss, want_out), want_grad = jax.jit(objective(fn))(params, *inputs)
        for mesh, sizes in (("data2_context4", dict(data=2, context=4)),
                            ("fsdp2_context2_tensor2", dict(data=1, fsdp=2, context=2,
                                                            tensor=2))):
            sharder = sharding.Sharder(sharding.make_mesh(sharding.MeshSettings(**sizes)))
            placed = jax.device_put(params, experiment.param_shardings(sharder, model))
            def run(params, *inputs, sharder=sharder, fn=fn):
                with sharder.active():
                    return objective(fn)(params, *inputs)
            (loss, out), grad = jax.jit(run)(placed, *inputs)
            hlo = jax.jit(run).lower(placed, *inputs).compile().as_text()
            lp_diff = float(jnp.max(jnp.abs((out[0] - want_out[0]) * response_mask)))
            grad_diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                            zip(jax.tree.leaves(grad), jax.tree.leaves(want_grad)))
            entry = {"lp": lp_diff, "loss": abs(float(loss - want_loss)),
                     "grad": grad_diff, "loss_value": float(want_loss),
                     "all_to_all": "all-to-all" in hlo}
            if name == "packed":
                entry["length"] = int(out[1])
                def run_pass(params, *inputs, sharder=sharder):
                    with sharder.active():
                        return packed_pass(params, *inputs)
                entry["pass_lp"] = float(jnp.max(jnp.abs(
                    (jax.jit(run_pass)(placed, *inputs) - want_out[0]) * response_mask)))
            else:
                entry["entropy"] = float(jnp.max(jnp.abs((out[1] - want_out[1])
                                                          * response_mask)))
            results[f"{name}/{mesh}"] = entry
    print(json.dumps(results))
""")


# `data,fsdp,tensor,context`, as MeshSettings reads them in order: two GRPO steps on one
# device and two context meshes.
_RL_STEPS_SCRIPT = textwrap.dedent("""
    import os, tempfile
    from tests.sharding.runner import main

    out = os.path.join(tempfile.mkdtemp(prefix="jrl-context-"), "metrics.json")
    main(["--algo", "grpo", "--meshes", "1,1,1 2,1,1,4 1,2,2,2+packed", "--steps", "2",
          "--out", out])
    print(open(out).read())
""")

# Runs scripts one after another in this process, each in a namespace of its own, and
# prints {name: the JSON object the script printed last}.
_EACH_SCRIPT = textwrap.dedent("""
    import contextlib, io, json
    results = {}
    for name, script in SCRIPTS.items():
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(script, {"__name__": "__main__"})
        results[name] = json.loads(printed.getvalue().strip().splitlines()[-1])
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def context_runs():
    """{script: its JSON} of the passes and the RL steps, made in one process of 8
    devices (a process costs seconds to start)."""
    scripts = {"passes": _PASSES_SCRIPT, "rl_steps": _RL_STEPS_SCRIPT}
    return run_script(f"SCRIPTS = {scripts!r}\n" + _EACH_SCRIPT)


@pytest.fixture(scope="module")
def passes(context_runs):
    return context_runs["passes"]


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("mesh", ["data2_context4", "fsdp2_context2_tensor2"])
def test_log_probs_and_gradients_match_one_device(passes, layout, mesh):
    got = passes[f"{layout}/{mesh}"]
    assert abs(got["loss_value"]) > 10.0, got  # a real objective, not zeros
    assert got["lp"] < 1e-4, got
    assert got["loss"] < 1e-3, got
    assert got["grad"] < 1e-4, got
    assert got["all_to_all"], "attention did not run split over context"
    if layout == "packed":  # rows of P + R = 15 slots, rounded up for context 2 and 4
        assert got["length"] == 16, got
        assert got["pass_lp"] < 1e-4, got
    else:
        assert got["entropy"] < 1e-4, got


def test_rl_steps_on_context_meshes_match_one_device(context_runs):
    """Two GRPO steps through the trainer (`train.run`: rollout, log-prob passes,
    updates with the KL loss and entropy) on (data=2, context=4) and, with token-budget
    micro-batches in every pass, on (fsdp=2, context=2, tensor=2) vs one device with
    padded micro-batches."""
    from tests.sharding.test_meshes import assert_same_metrics

    runs = context_runs["rl_steps"]
    expected = runs["1,1,1"]
    assert any(abs(r.get("actor/pg_loss", 0.0)) > 1e-4 for r in expected)
    assert_same_metrics(expected, runs["2,1,1,4"])
    assert_same_metrics(expected, runs["1,2,2,2+packed"])


def test_rollout_rows_must_split_over_context_too():
    from jax.sharding import AbstractMesh

    from jrl import sharding
    from jrl.config import batches, settings
    from jrl.errors import ConfigError
    from tests.tiny import tiny_config

    def sizes_of(prompts):
        return batches.from_settings(settings.from_config(
            tiny_config(**{"data.train_batch_size": prompts}), stop_token_ids=(2,),
            pad_token_id=0, num_train_rows=64))

    sharder = sharding.Sharder(AbstractMesh((2, 1, 4, 1, 1), sharding.MESH_AXES))
    batches.check(sizes_of(4), 64, sharder)  # 4 prompts x 2 = 8 rows: data x context
    with pytest.raises(ConfigError, match=r"the rollout's 2 prompts x rollout\.n=2 = 4 rows: "
                       r"not a multiple of 8, the devices they are split over \(data x fsdp "
                       r"x context\)"):
        batches.check(sizes_of(2), 64, sharder)


def test_mesh_context_errors_stop_before_the_workdir(tmp_path):
    from jrl import train
    from jrl.errors import ConfigError
    from tests.rl.test_runs import IN_GRAPH, _config
    from tests.tiny import tiny_config

    workdir = tmp_path / "run"
    # One device cannot hold a context axis of 2.
    with pytest.raises(ConfigError, match=r"mesh: 1 devices cannot be split .*"
                       r"mesh\.context=2.* pick sizes that divide 1"):
        train.run(tiny_config(**{"mesh.context": 2}), str(workdir))
    with pytest.raises(ConfigError, match=r"mesh\.context=0 is not valid"):
        train.run(tiny_config(**{"mesh.context": 0}), str(workdir))
    with pytest.raises(ConfigError, match=r"^mesh\.context=2: runs in one program"):
        train.run(_config("grpo", **IN_GRAPH, **{"trainer.runs": 2, "mesh.context": 2}),
                  str(workdir))
    assert not workdir.exists()
