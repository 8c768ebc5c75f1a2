"""Mesh sizes, logical-axis specs and byte counts of jrl.sharding (no devices needed)."""

import jax
import jax.numpy as jnp
import ml_collections
import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from jrl import sharding
from jrl.sharding import MeshSettings, Sharder
from tests.eight_devices import run_script


@pytest.mark.parametrize(("sizes", "devices", "expected"), [
    # (data, fsdp, tensor[, context[, expert]]) -> sizes in MESH_AXES order (data, fsdp,
    # context, tensor, expert).
    ((-1, 1, 1), 8, (8, 1, 1, 1, 1)),
    ((1, -1, 1), 8, (1, 8, 1, 1, 1)),
    ((2, -1, 2), 8, (2, 2, 1, 2, 1)),
    ((2, 2, 2), 8, (2, 2, 1, 2, 1)),
    ((2, 1, 1, 4), 8, (2, 1, 4, 1, 1)),
    ((1, 2, 2, -1), 8, (1, 2, 2, 2, 1)),
    ((1, 2, 1, 1, -1), 8, (1, 2, 1, 1, 4)),
])
def test_mesh_sizes(sizes, devices, expected):
    assert sharding.MESH_AXES == ("data", "fsdp", "context", "tensor", "expert")
    assert MeshSettings(*sizes).resolve(devices) == expected


@pytest.mark.parametrize(("sizes", "message"), [
    ((-1, -1, 1), "only one axis may be -1"),
    ((0, 1, 1), r"mesh\.data=0 is not valid"),
    ((3, -1, 1), r"8 devices cannot be split .*mesh\.data=3"),
    ((2, 2, 1), r"needs 4 devices but 8 are present"),
    ((2, 1, 1, 0), r"mesh\.context=0 is not valid"),
    ((2, 1, 1, 3), r"mesh\.context=3, mesh\.tensor=1 needs 6 devices"),
])
def test_mesh_size_errors_name_the_keys(sizes, message):
    with pytest.raises(ValueError, match=message):
        MeshSettings(*sizes).resolve(8)


def _sharder(data=2, fsdp=2, tensor=2, context=1):
    return Sharder(AbstractMesh((data, fsdp, context, tensor, 1), sharding.MESH_AXES))


def test_specs_split_what_divides_and_replicate_the_rest():
    sh = _sharder()
    # Embedding [V, D]: 99 rows do not split over tensor=2, the hidden dim does over fsdp.
    assert sh.spec(("vocab", "embed"), (99, 128)) == PartitionSpec(None, "fsdp")
    assert sh.spec(("vocab", "embed"), (100, 128)) == PartitionSpec("tensor", "fsdp")
    # q kernel [L, D, N, H] with 14 heads; k kernel with one KV head stays whole.
    q = sh.spec(("layers", "embed", "heads", "head_dim"), (24, 896, 14, 64))
    assert q == PartitionSpec(None, "fsdp", "tensor", None)
    k = sh.spec(("layers", "embed", "kv_heads", "head_dim"), (24, 896, 1, 64))
    assert k == PartitionSpec(None, "fsdp", None, None)
    # The batch goes over data and fsdp together; a mesh axis is used once per array.
    assert sh.spec(("batch", None), (8, 5)) == PartitionSpec(("data", "fsdp"), None)
    assert sh.spec(("batch", "embed"), (8, 128)) == PartitionSpec(("data", "fsdp"), None)
    assert sh.batch_size_multiple == 4
    with pytest.raises(ValueError, match="multiple of 4"):
        sh.check_batch(6, "data.train_batch_size")


def test_axes_of_size_one_are_not_named():
    assert _sharder(8, 1, 1).spec(("vocab", "embed"), (100, 128)) == PartitionSpec(None, None)
    assert _sharder(1, 8, 1).spec(("batch", None), (16, 3)) == PartitionSpec("fsdp", None)


def test_rules_from_config():
    rules = ml_collections.ConfigDict({"batch": "data, fsdp", "embed": "", "mlp": "tensor"})
    assert sharding.rules_from_config(rules) == (
        ("batch", ("data", "fsdp")), ("embed", ()), ("mlp", ("tensor",)))
    with pytest.raises(ValueError, match=r"mesh\.rules\.mlp='model'"):
        sharding.rules_from_config(ml_collections.ConfigDict({"mlp": "model"}))
    rules = dict(sharding.rules_from_config(ml_collections.ConfigDict(
        {"batch": "data,fsdp", "embed": "fsdp"})))
    gathered = dict(Sharder(AbstractMesh((2, 2, 1, 1, 1), sharding.MESH_AXES),
                            tuple(rules.items())).rules_without("fsdp"))
    assert gathered == {"batch": ("data", "fsdp"), "embed": ()}


def test_bytes_per_device_on_one_device():
    sh = Sharder(sharding.make_mesh(MeshSettings(1, 1, 1, 1), jax.devices()[:1]))
    tree = {"a": jax.ShapeDtypeStruct((4, 6), jnp.float32),
            "b": jax.ShapeDtypeStruct((10,), jnp.bfloat16)}
    shardings = {"a": sh.named(("embed", "mlp"), (4, 6)), "b": sh.replicated}
    assert sh.bytes_per_device(tree, shardings) == 4 * 6 * 4 + 10 * 2


def test_context_splits_tokens_in_training_and_rows_in_the_rollout():
    sh = _sharder(data=2, fsdp=1, tensor=1, context=4)
    assert sh.context == 4
    # Activations [B, T, D]: rows over data, tokens over context.
    assert sh.spec(("batch", "length", None), (4, 32, 8)) == PartitionSpec("data", "context",
                                                                           None)
    # A length the context axis does not divide stays whole.
    assert sh.spec(("batch", "length", None), (4, 30, 8)) == PartitionSpec("data", None, None)
    rollout = sh.for_rollout()
    assert rollout.mesh is sh.mesh
    assert rollout.spec(("batch", "length", None), (8, 32, 8)) == PartitionSpec(
        ("data", "context"), None, None)
    assert rollout.batch_size_multiple == 8 and sh.batch_size_multiple == 2
    with pytest.raises(ValueError, match=r"data x fsdp x context = 8\); make it a multiple"):
        rollout.check_batch(12, "data.train_batch_size")
    # Without a context axis the rollout's Sharder is the training one.
    plain = _sharder()
    assert plain.for_rollout() is plain


# Traces a model's loss gradient under a Sharder of devices 0-3, then 4-7, for each remat
# and unrolling, and prints the device ids of the sharding constraints of each trace.
_TWO_GROUPS_SCRIPT = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
from jrl import sharding
from jrl.models import ModelConfig, forward, init_params, positions_from_mask, unembed
from tests.tracing import equations

def device_ids(jaxpr):
    return {tuple(int(i) for i in eqn.params["sharding"].mesh.device_ids.flat)
            for eqn in equations(jaxpr) if eqn.primitive.name == "sharding_constraint"}

tokens, mask = jnp.zeros((4, 5), jnp.int32), jnp.ones((4, 5), jnp.int32)
result = {}
for remat, unroll in (("none", False), ("none", True), ("full", False), ("dots_saveable", False)):
    config = ModelConfig.preset("tiny", remat=remat, scan_unroll=unroll)
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))

    def loss(p):
        hidden, _ = forward(p, tokens, positions_from_mask(mask), mask, config=config)
        return jnp.sum(unembed(p, hidden))

    seen = []
    for devices in (jax.devices()[:4], jax.devices()[4:]):
        mesh = Mesh(np.array(devices).reshape(4, 1, 1, 1, 1), sharding.MESH_AXES)
        with sharding.Sharder(mesh).active():
            seen.append(sorted(device_ids(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)))
    result[f"{remat}-{unroll}"] = seen
print(json.dumps(result))
"""


def test_a_trace_under_one_mesh_pins_nothing_to_another():
    """A sampling group on devices of its own traces the same layers as the training
    group: every sharding constraint of a trace names the mesh active while it was
    traced, none a mesh that an earlier trace (or a cached inner trace) was made under."""
    result = run_script(_TWO_GROUPS_SCRIPT)
    assert set(result) == {"none-False", "none-True", "full-False", "dots_saveable-False"}
    for case, (first, second) in result.items():
        assert first == [[0, 1, 2, 3]], case
        assert second == [[4, 5, 6, 7]], case
