"""The grouped matmul's tiled form (`jrl.kernels.grouped_matmul`, the MoE layers' path off
Hopper GPUs) against `jax.lax.ragged_dot`: outputs and both gradients, with empty groups,
groups smaller and larger than a tile, and rows past the groups (zero, no gradient).
The Mosaic GPU kernels' checks at real sizes are in test_gpu_checks.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels import grouped_matmul as gm

CASES = {  # rows M, K, N, group sizes (their sum may fall short of M)
    "empty groups, small tiles": (60, 16, 24, [10, 0, 5, 20, 0, 15, 10, 0]),
    "rows past the groups": (37, 8, 8, [3, 0, 20, 10]),
    "groups over several tiles": (600, 32, 16, [250, 1, 0, 349]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tiles_equal_ragged_dot(case):
    m, k, n, sizes = CASES[case]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(m, k)).astype(np.float32)
    w = rng.normal(size=(len(sizes), k, n)).astype(np.float32)
    cotangent = rng.normal(size=(m, n)).astype(np.float32)
    sizes = np.asarray(sizes, np.int32)
    valid = np.arange(m) < sizes.sum()

    def run(impl):
        def loss(x, w):
            out = gm.grouped_matmul(x, w, sizes, impl=impl)
            return jnp.sum(jnp.where(valid[:, None], out, 0) * cotangent), out
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)

    (_, got), (got_dx, got_dw) = run("tiles")
    (_, want), (want_dx, want_dw) = run("xla")
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=1e-4)
    assert not np.asarray(got)[~valid].any()
    np.testing.assert_allclose(got_dx, want_dx, atol=1e-4)
    np.testing.assert_allclose(got_dw, want_dw, atol=1e-4)
    assert not np.asarray(got_dx)[~valid].any()


def test_off_hopper_auto_takes_the_tiles():
    x, w = jnp.zeros((4, 64), jnp.bfloat16), jnp.zeros((2, 64, 64), jnp.bfloat16)
    assert gm.choose_impl("auto", x, w) == ("mosaic" if gm.mosaic_backend.on_hopper()
                                            else "tiles")
    assert gm.choose_impl("auto", x.astype(jnp.float32), w.astype(jnp.float32)) == "tiles"


def test_two_column_blocks_a_grid_step_only_for_tall_groups_and_even_blocks():
    """The forward kernel's `grid_block_n` is 2 where groups average 256 rows or more
    and the output width holds an even number of blocks, else 1."""
    tall, short = 768, 16  # an update's micro-batch, a decode step (rows a group)
    assert gm.for_widths(2048, 768, tall) == gm.Tiles(128, 128, grid_block_n=2)
    assert gm.for_widths(768, 2048, tall).grid_block_n == 2
    assert gm.for_widths(2048, 768, short).grid_block_n == 1
    assert gm.for_widths(2048, 128, tall).grid_block_n == 1  # one 128-block (a fused LoRA a)
    assert gm.for_widths(2048, 192, tall) == gm.Tiles(128, 64, grid_block_n=1)  # 3 blocks
    assert gm.for_widths(768, 2048).grid_block_n == 1  # the weight gradient's default
