"""Context parallelism (`mesh.context`) end to end: the training passes' log-probs and
gradients, RL steps and a run through the trainer on 8 CPU devices agree with one
device; what it cannot run stops with a ConfigError."""

import textwrap

import pytest

from tests.eight_devices import run_script

_PASSES_SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jrl import experiment, logprobs, packing, sharding
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


@pytest.fixture(scope="module")
def passes():
    return run_script(_PASSES_SCRIPT)


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
