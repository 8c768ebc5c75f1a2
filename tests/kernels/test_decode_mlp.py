"""The decode step's gated up-projection kernel (`jrl.kernels.decode_mlp.gated_up`, Pallas'
Mosaic GPU backend) against float64 numpy: in Pallas' GPU interpret mode with float32
operands off a GPU, lowered for CUDA without one, and compiled with bfloat16 operands on
a Hopper GPU. Expected values come from numpy's `silu(x Wg) * (x Wu)`, never from the
code under test.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels import decode_mlp as dm
from jrl.kernels import mosaic_backend
from tests.markers import INTERPRETS, NEEDS_MOSAIC

pytestmark = NEEDS_MOSAIC
OFF_GPU = pytest.mark.skipif(jax.default_backend() == "gpu",
                             reason="float32 operands run as tf32 on the GPU")
ON_HOPPER = pytest.mark.skipif(not mosaic_backend.on_hopper(), reason="needs a Hopper GPU")


def _inputs(n, d, f, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    w = rng.normal(size=(d, 2, f)) * d ** -0.5 * 2.0  # gates spread over silu's bend
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype)


def _exact(x, w):
    """float64 `silu(x Wg) * (x Wu)` of the operands' own values."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    gate, up = x @ w[:, 0], x @ w[:, 1]
    return gate / (1.0 + np.exp(-gate)) * up


@INTERPRETS
@OFF_GPU
@pytest.mark.parametrize("n, d, f, blocks", [
    (5, 48, 96, dm.MlpBlocks(v=32, k=16, stages=2)),     # three steps, three blocks
    (70, 64, 64, dm.MlpBlocks(v=64, k=16, stages=3)),    # two row blocks, one feature block
    (8, 16, 32, dm.MlpBlocks(v=16, k=16, stages=2)),     # one pipeline step
    (150, 64, 64, dm.MlpBlocks(t=128, v=32, k=16, stages=2, consumers=2)),
], ids=["steps", "row-blocks", "one-step", "two-consumers"])
def test_interpreted_kernel_matches_float64(n, d, f, blocks):
    x, w = _inputs(n, d, f)
    got = jax.jit(lambda x, w: dm.gated_up(x, w, blocks=blocks, interpret=True))(x, w)
    assert got.shape == (n, f) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), _exact(x, w), rtol=1e-5, atol=1e-5)


def test_refuses_shapes_and_tiles_it_cannot_take():
    x, w = _inputs(4, 48, 96)
    with pytest.raises(ValueError, match="whole 64-wide blocks"):
        dm.gated_up(x, w, blocks=dm.MlpBlocks(v=64, k=16), interpret=True)  # F 96
    with pytest.raises(ValueError, match=r"\[D, 2, F\]"):
        dm.gated_up(x, w.reshape(48, 192), blocks=dm.MlpBlocks(v=32, k=16), interpret=True)
    with pytest.raises(ValueError, match="multiple of k"):
        dm.MlpBlocks(v=96, k=64)
    assert dm.supported((4, 896), (896, 2, 4864), jnp.bfloat16)
    assert not dm.supported((4, 896), (896, 2, 4864), jnp.float32)
    assert not dm.supported((4, 896), (896, 2, 4832), jnp.bfloat16)  # F not whole blocks


@pytest.mark.parametrize("rows, blocks", [
    (8, None), (256, dm.MlpBlocks(v=128, stages=3)),
    (512, dm.MlpBlocks(t=128, v=128, stages=3, consumers=2))])
def test_kernel_lowers_for_the_gpu(rows, blocks, monkeypatch):
    """The compiled path (not the interpreter's) lowers for CUDA without a GPU at the
    Qwen2.5-0.5B layer's shape: one Mosaic GPU call, no other matmul."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    sds = jax.ShapeDtypeStruct
    fn = jax.jit(lambda x, w: dm.gated_up(x, w, blocks=blocks))
    text = fn.trace(sds((rows, 896), jnp.bfloat16),
                    sds((896, 2, 4864), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
    assert "dot_general" not in text


@ON_HOPPER
@pytest.mark.parametrize("rows, blocks", [
    (8, None), (200, None), (256, dm.MlpBlocks(t=128, v=64, stages=4, consumers=2)),
    (512, dm.MlpBlocks(t=128, v=128, stages=3, consumers=2))])
def test_compiled_kernel_on_hopper_matches_float64(rows, blocks):
    """Compiled with bfloat16 operands at the 0.5B layer's shape: within two roundings of
    bfloat16 of the float64 value of the same operands (the product is float32, the
    output rounded once)."""
    x, w = _inputs(rows, 896, 4864, jnp.bfloat16, seed=3)
    got = np.asarray(jax.jit(lambda x, w: dm.gated_up(x, w, blocks=blocks))(x, w), np.float64)
    want = _exact(x, w)
    np.testing.assert_allclose(got, want, rtol=2 * 2.0 ** -8, atol=1e-3)
