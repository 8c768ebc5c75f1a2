"""The Pallas decode-step kernel on its Mosaic GPU backend ("mosaic": unfused, split over
slots, several rows a program, and fused with the cache write), compiled on a Hopper GPU
and in GPU interpret mode elsewhere, against the XLA reference (the cache write and the
attention), and the sampler run through it against the sampler on the XLA path."""

import dataclasses
import functools
import re
import textwrap
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jrl.errors import ConfigError
from jrl.kernels import decode_attention as da
from jrl.kernels import mosaic_backend
from jrl.models import ModelConfig, init_params, transformer
from jrl.models.cache import PagedCache
from jrl.models.config import RopeScaling
from jrl.rollout import paged, sampler
from jrl.rollout.sampler import SamplingConfig
from tests.eight_devices import run_script
from tests.markers import NEEDS_MOSAIC

# On a GPU the kernels run compiled, elsewhere in Pallas' GPU interpret mode.
INTERPRET = jax.default_backend() != "gpu"
pytestmark = NEEDS_MOSAIC
# The Mosaic GPU kernel compiles for Hopper only; on other GPUs the tests that run it
# are skipped.
NEEDS_HOPPER_OFF_CPU = pytest.mark.skipif(
    jax.default_backend() == "gpu" and not mosaic_backend.on_hopper(),
    reason="the Mosaic GPU kernel compiles for Hopper GPUs only")
KERNELS = [pytest.param("mosaic", id="mosaic", marks=NEEDS_HOPPER_OFF_CPU),
           pytest.param("mosaic_fused", id="mosaic_fused", marks=NEEDS_HOPPER_OFF_CPU)]
# The unfused kernel split over slots (`MosaicTiles.splits`): 3 parts, so a cache of two
# blocks leaves one part without blocks.
SPLIT = pytest.param("mosaic_split", id="mosaic_split", marks=NEEDS_HOPPER_OFF_CPU)


def kernel_args(kernel, tiles=None):
    """`append_and_attend`'s keywords for a `KERNELS` value or "xla": "mosaic" is the
    unfused kernel at `tiles` (None: `MOSAIC_TILES` unfused), "mosaic_fused" the fused
    one at `tiles`' block, stages and layout, "mosaic_split" the unfused one in 3 parts."""
    if kernel == "xla":
        return dict(impl="xla")
    tiles = tiles or dataclasses.replace(da.MOSAIC_TILES, fused=False)
    if kernel == "mosaic_fused":
        tiles = da.MosaicTiles(tiles.block, tiles.stages, tiles.compact, fused=True)
    elif kernel == "mosaic_split":
        tiles = dataclasses.replace(tiles, splits=3)
    return dict(impl="mosaic", interpret=INTERPRET, tiles=tiles)


# The kernels and the XLA path compiled as the sampler runs them, inside `jax.jit`, with
# the slot traced: one program per shape and setting serves every slot a test visits
# (called eagerly, each op of the interpreted kernel is dispatched one by one, several
# times slower). `test_kernel_matches_reference`, one slot per call, calls it eagerly, with
# the Python int slot that `append_and_attend` checks.
_STATIC = ("impl", "interpret", "tiles")
_attend = jax.jit(da.append_and_attend, static_argnames=_STATIC)
_attend_qkv = jax.jit(da.append_and_attend_qkv, static_argnames=("num_heads", *_STATIC))
_MOSAIC = da._mosaic  # the kernel's call, for tests that count it


def attend(*args, impl, interpret=False, tiles=None):
    """`append_and_attend` through `_attend` (the XLA path takes no tiles: one program
    for all of a test's tiles)."""
    return _attend(*args, impl=impl, interpret=interpret,
                   tiles=None if impl == "xla" else tiles)


def naive_attention(q_bnh, k_bksh, v_bksh, start_b, end):
    """Per row and query head, in float64 numpy: softmax(q . k / sqrt(H)) over [start, end)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q_bnh, k_bksh, v_bksh))
    b, n, h = q.shape
    group = n // k.shape[1]
    out = np.zeros((b, n, h))
    for row in range(b):
        for head in range(n):
            keys = k[row, head // group, start_b[row]:end]
            values = v[row, head // group, start_b[row]:end]
            logits = keys @ q[row, head] / np.sqrt(h)
            weights = np.exp(logits - logits.max())
            out[row, head] = weights @ values / weights.sum()
    return out


def naive_rope(x, angles):
    """RoPE of `x [B, M, H]` in float64 numpy: pair (i, i + H/2) rotated by `angles [B, H/2]`."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    sin, cos = np.sin(angles)[:, None], np.cos(angles)[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@pytest.mark.parametrize("kernel", [*KERNELS, SPLIT])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,slots", [
    (14, 2, 64, 128),   # Qwen2.5-0.5B's grouping (7 queries per kv head)
    (4, 4, 32, 64),     # one query per kv head, one block
    (8, 2, 32, 192),    # three blocks
    (40, 2, 32, 64),    # 20 queries per kv head
    (28, 4, 128, 128),  # Qwen2.5-7B's heads
])
def test_kernel_matches_reference(kernel, num_heads, num_kv_heads, head_dim, slots):
    """A bf16 cache (wgmma takes 16-bit operands): the kernel and the XLA path against a
    float64 reference, the output within bf16 rounding and the cache written alike."""
    dtype = jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), 6)
    b = 4
    q = jax.random.normal(keys[0], (b, num_heads, head_dim), dtype)
    k_new = jax.random.normal(keys[1], (b, num_kv_heads, head_dim), dtype)
    v_new = jax.random.normal(keys[2], (b, num_kv_heads, head_dim), dtype)
    k = jax.random.normal(keys[3], (b, num_kv_heads, slots, head_dim), dtype)
    v = jax.random.normal(keys[4], (b, num_kv_heads, slots, head_dim), dtype)
    angles = np.asarray(jax.random.uniform(keys[5], (b, head_dim // 2), maxval=40.0))
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    # The new token in the last block, not on its edge; rows starting in the first
    # block, on a block edge, in the slot's own block, and a row whose only token is
    # the new one.
    slot = slots - 37
    start = np.array([3, 64 % slots, slot - 5, slot], np.int32)
    want_k = np.array(k, np.float64)
    want_v = np.array(v, np.float64)
    want_k[:, :, slot], want_v[:, :, slot] = naive_rope(k_new, angles), v_new
    want = naive_attention(naive_rope(q, angles), want_k, want_v, start, slot + 1)
    tol = 2e-2
    others = np.arange(slots) != slot
    for impl in ("xla", kernel):
        out, k_out, v_out = da.append_and_attend(q, k_new, v_new, sin, cos, k, v,
                                                 jnp.asarray(start), slot, **kernel_args(impl))
        assert out.shape == q.shape and out.dtype == q.dtype
        assert k_out.dtype == k.dtype and v_out.dtype == v.dtype
        np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=tol, atol=tol,
                                   err_msg=impl)
        # One slot of each row and head is written, with the new (rotated) token.
        np.testing.assert_array_equal(np.asarray(k_out)[:, :, others], np.asarray(k)[:, :, others])
        np.testing.assert_array_equal(np.asarray(v_out)[:, :, others], np.asarray(v)[:, :, others])
        np.testing.assert_allclose(np.asarray(k_out, np.float64), want_k, rtol=tol, atol=tol)
        np.testing.assert_array_equal(np.asarray(v_out, np.float64), want_v, err_msg=impl)
    # What lies outside [start, slot] does not matter.
    junk_k = k.at[:, :, slot + 1:].set(1e3).at[0, :, :3].set(1e3)
    junk_v = v.at[:, :, slot:].set(-1e3).at[3, :, :slot].set(1e3)
    out, _, _ = da.append_and_attend(q, k_new, v_new, sin, cos, junk_k, junk_v,
                                     jnp.asarray(start), slot, **kernel_args(kernel))
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("tiles", [da.MosaicTiles(128, 2), da.MosaicTiles(64, 3)])
@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_at_block_edges_and_mixed_dtypes(kernel, tiles, q_dtype):
    """Slots at the first and last of the cache and on either side of a block edge,
    16 queries per key/value head, and queries in float32 or bf16 over a bf16 cache (the
    kernel's wgmma operands are 16-bit): the kernel matches the XLA path, and both write
    the new token in the cache's dtype."""
    cache_dtype = jnp.bfloat16
    keys = jax.random.split(jax.random.key(1), 6)
    b, n, kv, h, slots = 3, 32, 2, 32, 128
    q = jax.random.normal(keys[0], (b, n, h), q_dtype)
    k_new, v_new = (jax.random.normal(key, (b, kv, h), q_dtype) for key in keys[1:3])
    k, v = (jax.random.normal(key, (b, kv, slots, h), cache_dtype) for key in keys[3:5])
    angles = jax.random.uniform(keys[5], (b, h // 2), maxval=300.0)
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    for slot in (0, 63, 64, 65, 127):
        start = jnp.asarray([0, slot // 2, slot], jnp.int32)
        outs = {impl: attend(q, k_new, v_new, sin, cos, k, v, start, slot,
                             **kernel_args(impl, tiles))
                for impl in ("xla", kernel)}
        tol = 2e-2
        for got, want in zip(outs[kernel], outs["xla"], strict=True):
            assert got.dtype == want.dtype
            np.testing.assert_allclose(np.asarray(got, np.float64),
                                       np.asarray(want, np.float64), rtol=tol, atol=tol,
                                       err_msg=f"slot {slot}")
        np.testing.assert_array_equal(np.asarray(outs[kernel][2]),
                                      np.asarray(outs["xla"][2]), err_msg=f"slot {slot}")


@NEEDS_HOPPER_OFF_CPU
@pytest.mark.parametrize("splits", [2, 5, 16])
def test_kernel_split_over_slots_matches_one_program(splits):
    """A long cache's filled blocks split over parts (rows whose blocks are fewer than the
    parts, a row starting mid-block, the new token in a block of its own) give the
    attention of one program per (row, key/value head) and write the cache alike."""
    keys = jax.random.split(jax.random.key(2), 6)
    b, n, kv, h, slots = 4, 14, 2, 64, 1024
    q = jax.random.normal(keys[0], (b, n, h), jnp.bfloat16)
    k_new, v_new = (jax.random.normal(key, (b, kv, h), jnp.bfloat16) for key in keys[1:3])
    k, v = (jax.random.normal(key, (b, kv, slots, h), jnp.bfloat16) for key in keys[3:5])
    angles = jax.random.uniform(keys[5], (b, h // 2), maxval=300.0)
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    for slot in (640, 1000):
        start = jnp.asarray([0, 301, slot - 70, slot], jnp.int32)
        run = lambda splits, start=start, slot=slot: da.append_and_attend(
            q, k_new, v_new, sin, cos, k, v, start, slot, impl="mosaic", interpret=INTERPRET,
            tiles=da.MosaicTiles(128, 2, compact=True, splits=splits))
        (want, want_k, want_v), (got, got_k, got_v) = run(1), run(splits)
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                                   rtol=1e-2, atol=1e-2, err_msg=f"slot {slot}")
        np.testing.assert_array_equal(np.asarray(got_k), np.asarray(want_k))
        np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))


def test_slot_splits_fill_the_multiprocessors_with_long_caches_only():
    # Two programs a multiprocessor on 132: 264. 4 rows x 2 key/value heads: ceil(264 / 8)
    # = 33 parts, each over at least 1,024 of 65,600 slots (64 would fit).
    assert da.slot_splits(8, 65_600, multiprocessors=132) == 33
    # ... but a 16,384-slot cache holds only 16 parts of 1,024 slots.
    assert da.slot_splits(8, 16_384, multiprocessors=132) == 16
    # 128 rows (256 pairs): ceil(264 / 256) = 2; 96 rows: ceil(264 / 192) = 2; 32 rows:
    # ceil(264 / 64) = 5, under the 8 parts of 1,024 that 8,704 slots hold.
    assert da.slot_splits(256, 8_704, multiprocessors=132) == 2
    assert da.slot_splits(192, 8_704, multiprocessors=132) == 2
    assert da.slot_splits(64, 8_704, multiprocessors=132) == 5
    # Pairs that fill the multiprocessors twice, or caches under two parts' slots: one
    # program (the docs workload's 384-slot cache never splits).
    assert da.slot_splits(264, 65_600, multiprocessors=132) == 1
    assert da.slot_splits(1024, 65_600, multiprocessors=132) == 1
    assert da.slot_splits(8, 2_047, multiprocessors=132) == 1
    assert da.slot_splits(128, 384, multiprocessors=132) == 1
    assert da.slot_splits(8, 3_072, multiprocessors=132) == 3
    assert da.slot_splits(100, 65_600, multiprocessors=78) == 2  # ceil(156 / 100)


def test_impl_choice_and_cache_slots():
    """A forced impl is returned as is (off a GPU the kernel runs in interpret mode, at
    any head_dim); the kernel needs whole 64-slot blocks and a slot inside the cache;
    "pallas", the kernel's version on Pallas' Triton backend, is no choice now: the
    error names the choices and the port, and the model's config the key."""
    hopper = jax.default_backend() == "gpu" and mosaic_backend.on_hopper()
    assert da.choose_impl("auto", 64, dtype=jnp.bfloat16) == ("mosaic" if hopper else "xla")
    assert da.choose_impl("xla", 64) == "xla"
    if jax.default_backend() != "gpu":
        assert da.choose_impl("mosaic", 48) == "mosaic"
    assert da.cache_slots("xla", 64, 200) == 200
    assert da.cache_slots("mosaic", 64, 200) == 256 and da.cache_slots("mosaic", 64, 256) == 256
    for impl in ("pallas", "cudnn"):
        with pytest.raises(ValueError, match=rf"^model\.decode_attention_impl must be one of "
                                             rf"'auto', 'xla', 'mosaic', got '{impl}'"):
            da.choose_impl(impl, 64)
    with pytest.raises(ValueError, match="Triton backend was removed; 'mosaic' is its port"):
        da.choose_impl("pallas", 64)
    with pytest.raises(ConfigError, match=r"decode_attention_impl='pallas' is not supported; "
                                          r"choose one of \['auto', 'xla', 'mosaic'\]"):
        ModelConfig.preset("tiny", decode_attention_impl="pallas")
    new, start = jnp.zeros((1, 1, 32), jnp.bfloat16), jnp.zeros((1,), jnp.int32)
    angle = jnp.zeros((1, 16))
    cache = lambda slots: jnp.zeros((1, 1, slots, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 64"):
        da.append_and_attend(jnp.zeros((1, 2, 32), jnp.bfloat16), new, new, angle, angle,
                             cache(40), cache(40), start, 3, impl="mosaic")
    with pytest.raises(ValueError, match="'xla' or 'mosaic', got 'cudnn'"):
        da.append_and_attend(jnp.zeros((1, 2, 32)), new, new, angle, angle, cache(64),
                             cache(64), start, 3, impl="cudnn")
    with pytest.raises(ValueError, match="decode slot 64 outside the cache's 64 slots"):
        da.append_and_attend(jnp.zeros((1, 2, 32), jnp.bfloat16), new, new, angle, angle,
                             cache(64), cache(64), start, 64, impl="mosaic")


def _lower_for_cuda(fn, args):
    """`fn` lowered for CUDA as text, with the kernel path chosen as on a GPU. Where a
    CUDA plugin is installed but the tests keep JAX on the CPU (tests/conftest.py),
    jaxlib may not lower a GPU kernel's call without a device; the test is skipped
    there and runs on CPU-only installs such as CI's."""
    with mock.patch.object(jax, "default_backend", lambda: "gpu"):
        try:
            return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        except RuntimeError as e:
            if "No supported GPU devices found" in str(e):
                pytest.skip(f"a CUDA plugin without a GPU backend in use: {e}")
            raise


def _step_shapes(*, b, n, kv, h, s):
    """`append_and_attend`'s arguments as shapes: bf16 queries, new keys and values and
    caches, float32 RoPE tables, int32 row starts and slot."""
    sds = jax.ShapeDtypeStruct
    return (sds((b, n, h), jnp.bfloat16), sds((b, kv, h), jnp.bfloat16),
            sds((b, kv, h), jnp.bfloat16), sds((b, h // 2), jnp.float32),
            sds((b, h // 2), jnp.float32), sds((b, kv, s, h), jnp.bfloat16),
            sds((b, kv, s, h), jnp.bfloat16), sds((b,), jnp.int32), sds((), jnp.int32))


@pytest.mark.parametrize("spec", ["128,2", "64,2,compact", "64,2,compact,fused",
                                  "128,2,compact,splits2", "128,2,compact,rows4"])
def test_mosaic_kernels_lower_for_the_gpu(spec):
    """The Mosaic GPU kernel's compiled path (not the interpreter's, which the other
    tests run: no `layout_cast`, dots instead of wgmmas from registers and into a
    carried accumulator) lowers for CUDA without a GPU, to one Mosaic GPU call a step;
    the fused tiles write the cache in the kernel (no `dynamic_update_slice`)."""
    tiles = da.MosaicTiles.from_spec(spec)
    fn = lambda *a: da.append_and_attend(*a, impl="mosaic", tiles=tiles)
    with mock.patch.object(mosaic_backend, "on_hopper", lambda: True):
        text = _lower_for_cuda(fn, _step_shapes(b=8, n=14, kv=2, h=64, s=256))
    assert text.count("custom_call @mosaic_gpu") == 1
    assert ("dynamic_update_slice" in text) != tiles.fused


@NEEDS_HOPPER_OFF_CPU
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(14, 2), (4, 4)])
def test_fused_operand_with_its_bias_equals_three_operands(with_bias, num_heads,
                                                          num_kv_heads):
    """`append_and_attend_qkv` on a fused projection's bf16 output before its bias gives
    what `append_and_attend` gives on q, k and v split from the output with the bias
    added by XLA, to the bit, through the fused kernel (it rounds the sum as XLA's bf16
    add does); its XLA path too. Slots 0, 64 (a block edge) and 100, rows starting at
    0, mid-block and at the new token."""
    keys = jax.random.split(jax.random.key(2), 6)
    b, h, slots = 3, 64, 128
    j = num_heads + 2 * num_kv_heads
    qkv = jax.random.normal(keys[0], (b, j, h), jnp.bfloat16)
    bias = jax.random.normal(keys[1], (j, h), jnp.bfloat16) if with_bias else None
    k, v = (jax.random.normal(key, (b, num_kv_heads, slots, h), jnp.bfloat16)
            for key in keys[2:4])
    angles = jax.random.uniform(keys[4], (b, h // 2), maxval=300.0)
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    biased = qkv if bias is None else qkv + bias
    parts = jnp.split(biased, [num_heads, num_heads + num_kv_heads], axis=1)
    for slot in (0, 64, 100):
        start = jnp.asarray([0, slot // 2, slot], jnp.int32)
        want = attend(*parts, sin, cos, k, v, start, slot, **kernel_args("mosaic_fused"))
        for impl in ("mosaic_fused", "xla"):
            got = _attend_qkv(qkv, bias, sin, cos, k, v, start, slot, num_heads=num_heads,
                              **kernel_args(impl))
            for g, w, name in zip(got, want, ("out", "k", "v"), strict=True):
                assert g.shape == w.shape and g.dtype == w.dtype
                if impl == "mosaic_fused":
                    np.testing.assert_array_equal(np.asarray(g, np.float32),
                                                  np.asarray(w, np.float32),
                                                  err_msg=f"{name}, slot {slot}")
                else:  # the XLA path's attention sums in another order
                    np.testing.assert_allclose(np.asarray(g, np.float32),
                                               np.asarray(w, np.float32), rtol=2e-2,
                                               atol=2e-2, err_msg=f"{name}, slot {slot}")
    with pytest.raises(ValueError, match=rf"{num_heads - 1} query heads.* got qkv \(3, {j}, 64\)"):
        da.append_and_attend_qkv(qkv, bias, sin, cos, k, v, start, 100,
                                 num_heads=num_heads - 1, **kernel_args("mosaic_fused"))
    # The bias with the kernel's operand made ahead (`kernel_bias`, as the sampler makes
    # it once a rollout), or made in another dtype (so remade at the step): the same bits
    # (at the last slot, rows starting at 0, mid-block and at the new token).
    if with_bias:
        made, other = jax.jit(lambda bias: (lambda made: (made, made._replace(by_parts={
            p: x.astype(jnp.float32) for p, x in made.by_parts.items()})))(da.kernel_bias(
                bias, num_heads=num_heads, num_kv=num_kv_heads, dtype=jnp.bfloat16)))(bias)
        for kernel_bias in (made, other):
            got = _attend_qkv(qkv, kernel_bias, sin, cos, k, v, start, slot,
                              num_heads=num_heads, **kernel_args("mosaic_fused"))
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(np.asarray(g, np.float32),
                                              np.asarray(w, np.float32))
    # A bias that is not applied shows: the kernel reads it.
    if with_bias:
        plain = _attend_qkv(qkv, None, sin, cos, k, v, start, 100, num_heads=num_heads,
                            **kernel_args("mosaic_fused"))
        assert float(jnp.max(jnp.abs(plain[0].astype(jnp.float32)
                                     - want[0].astype(jnp.float32)))) > 0.1


def _qkv_operands(with_bias, n=14, kv=2, h=64, s=128):
    """`n` query heads and `append_and_attend_qkv`'s operands as shapes (bf16, 8 rows,
    `kv` key/value heads, head_dim `h`, `s` slots), for lowering without a GPU."""
    sds = jax.ShapeDtypeStruct
    b = 8
    bias = sds((n + 2 * kv, h), jnp.bfloat16) if with_bias else None
    return n, (sds((b, n + 2 * kv, h), jnp.bfloat16), bias, sds((b, h // 2), jnp.float32),
               sds((b, h // 2), jnp.float32), sds((b, kv, s, h), jnp.bfloat16),
               sds((b, kv, s, h), jnp.bfloat16), sds((b,), jnp.int32), sds((), jnp.int32))


def _random_biases(params, key):
    """`params` with every bias leaf drawn from N(0, 0.5) (init_params starts them at 0)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree_util.tree_unflatten(treedef, [
        0.5 * jax.random.normal(k, x.shape, x.dtype)
        if any(getattr(p, "key", None) == "bias" for p in path) else x
        for (path, x), k in zip(leaves, keys, strict=True)])


@NEEDS_HOPPER_OFF_CPU
@pytest.mark.parametrize("family,extra", [("qwen2", dict(qkv_bias=True)), ("llama", {})])
def test_bf16_sampler_on_the_fused_operand_equals_three_operands(family, extra):
    """In bf16, the sampler with the kernel reading the fused projection's output (and
    adding the bias) gives the same tokens and log-probs, to the bit, as with q, k and
    v split off it after XLA's bias add (the layout before `append_and_attend_qkv`)."""
    # One layer and 6 new tokens: each interpreted kernel step takes tens of ms off a GPU.
    config = ModelConfig(family=family, vocab_size=48, hidden_size=64, intermediate_size=64,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32,
                         initializer_range=0.3, dtype="bfloat16", decode_attention_impl="mosaic",
                         **extra)
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    if config.qkv_bias:
        params = _random_biases(params, jax.random.key(1))
    mask = (np.arange(9)[None] >= 9 - np.array([5, 1, 9, 3])[:, None]).astype(np.int32)
    ids = np.where(mask, np.random.default_rng(0).integers(1, 48, size=(4, 9)), 0)
    sampling = SamplingConfig(max_new_tokens=6, n=2, stop_token_ids=(), pad_token_id=0)
    calls = []

    def three_operands(qkv, bias, *args, num_heads, **kwargs):
        calls.append(num_heads)
        if isinstance(bias, da.KernelBias):  # the sampler makes the kernel's operand ahead
            bias = bias.bias_jh
        biased = qkv if bias is None else qkv + bias.astype(qkv.dtype)
        kv = args[2].shape[1]
        q, k, v = jnp.split(biased, [num_heads, num_heads + kv], axis=1)
        return da.append_and_attend(q, k, v, *args, **kwargs)

    fused = sampler.generate(params, ids, mask, jax.random.key(3), sampling, config=config)
    jax.clear_caches()  # trace the sampler again, through the patch
    try:
        with mock.patch.object(da, "append_and_attend_qkv", three_operands):
            split = sampler.generate(params, ids, mask, jax.random.key(3), sampling,
                                     config=config)
    finally:
        jax.clear_caches()
    assert calls  # the sampler took the fused path
    np.testing.assert_array_equal(fused.responses, split.responses)
    np.testing.assert_array_equal(np.asarray(fused.rollout_log_probs),
                                  np.asarray(split.rollout_log_probs))


_SHARDED_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jrl import sharding
    from jrl.kernels import decode_attention as da

    assert jax.device_count() == 8, jax.devices()
    # The kernels' GPU interpret mode stops under a multi-device CPU mesh (jax 0.10:
    # "Barrier remains allocated" as the shards' programs run), so each kernel here is
    # the XLA path on its shard's operands, and what is tested is the shard_map around
    # it: which rows and heads each shard gets and how the outputs come back together.
    shapes = []

    def fused(qkv, bias, sin, cos, k, v, start, slot, *, num_heads, interpret, tiles):
        shapes.append(("fused", qkv.shape, k.shape))
        return da.append_and_attend_qkv(qkv, bias, sin, cos, k, v, start, slot,
                                        num_heads=num_heads, impl="xla")

    def unfused(q, k, v, start, slot, *, interpret, tiles, block_table=None):
        if block_table is not None:  # pools [K, pages, page, H]: the shard's rows' pages
            shapes.append(("paged", q.shape, k.shape))
            kv, _, page, h = k.shape
            view = lambda pool: jnp.moveaxis(pool[:, block_table], 0, 1).reshape(
                q.shape[0], kv, -1, h)
            ids = jnp.arange(block_table.shape[1] * page)
            mask = (ids >= start[:, None]) & (ids <= slot[:, None])
            return da.grouped_attention(q[:, None], view(k), view(v),
                                        mask[:, None, None])[:, 0]
        shapes.append(("unfused", q.shape, k.shape))
        return da.decode_attention(q, k.astype(q.dtype), v.astype(q.dtype), start, slot + 1)

    da._mosaic_fused, da._mosaic = fused, unfused
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (8, 4, 32))
    k_new = jax.random.normal(keys[1], (8, 2, 32))
    v_new = jax.random.normal(keys[2], (8, 2, 32))
    k = jax.random.normal(keys[3], (8, 2, 64, 32))
    v = jax.random.normal(keys[4], (8, 2, 64, 32))
    angles = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) / 7
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    start = jnp.array([0, 3, 9, 20, 1, 0, 30, 40], jnp.int32)
    want = da.append_and_attend(q, k_new, v_new, sin, cos, k, v, start, 41, impl="xla")

    def max_diff(got, want):
        # NaN-safe: any non-finite output makes the result NaN (Python's max would not).
        diffs = [float(np.max(np.abs(np.asarray(a) - np.asarray(b)), initial=0.0))
                 if np.isfinite(np.asarray(a)).all() else float("nan")
                 for a, b in zip(got, want)]
        return float("nan") if any(np.isnan(diffs)) else max(diffs)

    out = {}
    for name, sizes in (("data", dict(data=8, fsdp=1, tensor=1)),
                        ("data_tensor", dict(data=4, fsdp=1, tensor=2)),
                        ("tensor_uneven", dict(data=2, fsdp=1, tensor=4)),
                        # The rollout's layout under context parallelism: rows over
                        # data x context, heads over tensor.
                        ("rollout_context", dict(data=1, fsdp=1, context=4, tensor=2))):
        sharder = sharding.Sharder(
            sharding.make_mesh(sharding.MeshSettings(**sizes))).for_rollout()
        for tiles in (da.MOSAIC_TILES, da.MosaicTiles(0, 2, compact=True)):
            def fn(q, k_new, v_new, k, v, start, sharder=sharder, tiles=tiles):
                with sharder.active():
                    return da.append_and_attend(q, k_new, v_new, sin, cos, k, v, start, 41,
                                                impl="mosaic", interpret=True, tiles=tiles)
            shapes.clear()
            got = jax.jit(fn)(q, k_new, v_new, k, v, start)
            kind = "fused" if tiles.fused else "unfused"
            out[f"{name} {kind}"] = [max_diff(got, want), [list(x[1]) for x in shapes],
                                     [x[0] for x in shapes]]
    # The paged cache's kernel: each row at its own slot, its pages spread over one pool
    # (every shard reads the whole pool, its rows' block tables only).
    table = jnp.asarray(np.random.default_rng(0).permutation(8 * 8).reshape(8, 8) + 1,
                        jnp.int32)
    pool = lambda x: jnp.zeros((2, 65, 8, 32)).at[:, table.reshape(-1)].set(
        x.reshape(8, 2, 8, 8, 32).transpose(1, 0, 2, 3, 4).reshape(2, 64, 8, 32))
    slots = jnp.array([41, 3, 63, 20, 5, 0, 30, 50], jnp.int32)
    starts = jnp.minimum(start, slots)
    ids = jnp.arange(64)
    mask = (ids >= starts[:, None]) & (ids <= slots[:, None])
    want = da.grouped_attention(q[:, None], k, v, mask[:, None, None])[:, 0]
    for name, sizes in (("paged_data", dict(data=8, fsdp=1, tensor=1)),
                        ("paged_data_tensor", dict(data=4, fsdp=1, tensor=2))):
        sharder = sharding.Sharder(
            sharding.make_mesh(sharding.MeshSettings(**sizes))).for_rollout()
        def fn(q, k_pool, v_pool, sharder=sharder):
            with sharder.active():
                return da.paged_attention(q, k_pool, v_pool, table, starts, slots,
                                          interpret=True)
        shapes.clear()
        got = jax.jit(fn)(q, pool(k), pool(v))
        out[name] = [max_diff([got], [want]), [list(x[1]) for x in shapes],
                     [x[0] for x in shapes]]
    # The fused operand with its bias (the sampler's Qwen2 layout), over the batch.
    bias = jax.random.normal(jax.random.key(7), (8, 32))
    qkv = jnp.concatenate([q, k_new, v_new], axis=1)
    want = da.append_and_attend_qkv(qkv, bias, sin, cos, k, v, start, 41, num_heads=4,
                                    impl="xla")
    # With the kernel's operand made ahead (`kernel_bias`, as the sampler passes it): the
    # whole pytree goes to every shard.
    made = da.kernel_bias(bias, num_heads=4, num_kv=2, dtype=jnp.bfloat16)
    for name, sizes, shard_bias in (("qkv_data", dict(data=8, fsdp=1, tensor=1), bias),
                                    ("qkv_data_fsdp", dict(data=2, fsdp=4, tensor=1), bias),
                                    ("qkv_data_made", dict(data=8, fsdp=1, tensor=1), made)):
        sharder = sharding.Sharder(sharding.make_mesh(sharding.MeshSettings(**sizes)))
        def fn(qkv, bias, k, v, start, sharder=sharder):
            with sharder.active():
                return da.append_and_attend_qkv(qkv, bias, sin, cos, k, v, start, 41,
                                                num_heads=4, impl="mosaic", interpret=True)
        shapes.clear()
        got = jax.jit(fn)(qkv, shard_bias, k, v, start)
        out[name] = [max_diff(got, want), [list(x[1]) for x in shapes], [x[0] for x in shapes]]
    print(json.dumps(out))
""")


def test_kernel_under_a_mesh_runs_per_shard_and_matches():
    """Under a `Sharder` the kernel (fused or not) runs in a shard_map: over the batch,
    over heads when query and key/value heads both divide over `tensor`, and on
    replicated heads when not; from the fused operand and its bias, over the batch; the
    paged kernel over the batch (and heads), each shard reading the whole pool. The
    shards' outputs and caches make the XLA path's."""
    result = run_script(_SHARDED_SCRIPT)
    # Each shard's rows (over the batch axes) and query heads (over `tensor` where the 4
    # query and 2 key/value heads both divide); the fused operand holds the shard's query,
    # key and value heads.
    rows_heads = {"data": (1, 4), "data_tensor": (2, 2), "tensor_uneven": (4, 4),
                  "rollout_context": (2, 2)}
    want = {}
    for name, (rows, heads) in rows_heads.items():
        want[f"{name} fused"] = [[rows, 2 * heads]]
        want[f"{name} unfused"] = [[rows, heads]]
    want.update(qkv_data=[[1, 8]], qkv_data_fsdp=[[1, 8]], qkv_data_made=[[1, 8]],
                paged_data=[[1, 4]],
                paged_data_tensor=[[2, 2]])
    assert result.keys() == want.keys()
    for name, (diff, shapes, kinds) in result.items():
        assert diff < 1e-5, (name, diff)  # False for NaN
        assert [shape[:2] for shape in shapes] == want[name], (name, shapes)
        kind = "paged" if name.startswith("paged") else (
            "unfused" if name.endswith("unfused") else "fused")
        assert kinds == [kind], (name, kinds)


def test_mosaic_tiles_from_the_benches_spec():
    assert da.MosaicTiles.from_spec("128,2") == da.MosaicTiles(128, 2)
    assert da.MosaicTiles.from_spec("64,3,compact,fused") == da.MosaicTiles(
        64, 3, compact=True, fused=True)
    assert da.MosaicTiles.from_spec("128,2,splits0") == da.MosaicTiles(128, 2, splits=0)
    assert da.MosaicTiles.from_spec("128,2,compact,splits4").splits == 4
    assert da.MosaicTiles.from_spec("128,2,compact,rows4") == da.MosaicTiles(
        128, 2, compact=True, row_group=4)
    for bad in ("128", "128,2,fast", "128,2,splits", "128,2,splits1,splits2", "128,2,rows"):
        with pytest.raises(ValueError, match="BLOCK,STAGES"):
            da.MosaicTiles.from_spec(bad)
    # The fused kernel writes the new token itself: one program per (row, head).
    with pytest.raises(ValueError, match="1 with fused=True"):
        da.MosaicTiles(fused=True, splits=2)
    with pytest.raises(ValueError, match="integer >= 0"):
        da.MosaicTiles(splits=-1)
    for bad in (dict(row_group=0), dict(row_group=2, fused=True), dict(row_group=2, splits=0)):
        with pytest.raises(ValueError, match="row_group"):
            da.MosaicTiles(**bad)


def test_forced_mosaic_needs_its_backend_hopper_and_a_16_bit_cache(monkeypatch):
    """A forced "mosaic" rounds the cache to whole blocks, stops with a ValueError on a
    GPU other than Hopper, with a ConfigError naming the key without the Mosaic GPU
    backend, and with a ValueError on a cache that is not 16-bit (wgmma's operands)."""
    assert da.choose_impl("mosaic", 64) == "mosaic"
    assert da.cache_slots("mosaic", 64, 200) == 256 and da.cache_slots("mosaic", 128, 384) == 384
    monkeypatch.setattr(da.jax, "default_backend", lambda: "gpu")
    assert da.choose_impl("auto", 64) == "xla"  # no cache dtype: not known to be 16-bit
    monkeypatch.setattr(mosaic_backend, "on_hopper", lambda: False)
    with pytest.raises(ValueError, match="'mosaic' needs a Hopper GPU"):
        da.choose_impl("mosaic", 64)
    monkeypatch.undo()
    new, start = jnp.zeros((1, 1, 64)), jnp.zeros((1,), jnp.int32)
    angle = jnp.zeros((1, 32))
    with pytest.raises(ValueError, match="bfloat16 or float16 cache.* got float32"):
        da.append_and_attend(jnp.zeros((1, 2, 64)), new, new, angle, angle,
                             jnp.zeros((1, 1, 64, 64)), jnp.zeros((1, 1, 64, 64)), start, 3,
                             impl="mosaic", interpret=INTERPRET)
    monkeypatch.setattr(mosaic_backend, "plgpu", None)
    with pytest.raises(ConfigError, match="model.decode_attention_impl='mosaic' needs"):
        da.choose_impl("mosaic", 64)
    with pytest.raises(ConfigError, match="decode_attention_impl='mosaic'"):
        ModelConfig(family="qwen2", vocab_size=8, hidden_size=8, intermediate_size=8,
                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
                    decode_attention_impl="mosaic")


def test_auto_takes_the_mosaic_kernel_where_it_applies(monkeypatch):
    """On a Hopper GPU (here mocked) `auto` takes the Mosaic GPU kernel for a
    bfloat16/float16 cache (its wgmma operands) and a power-of-two head_dim from 32 to
    256, rounding the cache to whole blocks, and the model's decode steps run it (their
    mask is each row's first slot); else XLA (a float32 cache, a head_dim it does not
    take, slots that are not whole blocks, another GPU, no Mosaic GPU backend)."""
    from jrl.models import transformer  # noqa: PLC0415
    from jrl.models.cache import init_cache  # noqa: PLC0415

    monkeypatch.setattr(da.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(mosaic_backend, "on_hopper", lambda: True)
    monkeypatch.setattr(mosaic_backend, "plgpu", object())  # a backend that imports
    assert da.choose_impl("auto", 64, 384, jnp.bfloat16) == "mosaic"
    assert da.choose_impl("auto", 128, None, "float16") == "mosaic"
    assert da.cache_slots("auto", 64, 200, "bfloat16") == 256
    assert da.cache_slots("auto", 64, 200, "float32") == 200
    for dtype, kernel in (("bfloat16", True), ("float32", False)):
        config = ModelConfig(family="qwen2", vocab_size=8, hidden_size=16, intermediate_size=8,
                             num_layers=1, num_heads=2, num_kv_heads=1, head_dim=64,
                             dtype=dtype)
        mask = transformer._attention_mask(config, jnp.ones((2, 384), jnp.int32), 1,
                                           init_cache(config, 2, 384), 3)
        assert isinstance(mask, transformer.DecodeStep) == kernel, dtype
    for args in ((64, 384, jnp.float32), (64, 384, None), (16, 384, jnp.bfloat16),
                 (48, 384, jnp.bfloat16), (512, 384, jnp.bfloat16), (64, 100, jnp.bfloat16)):
        assert da.choose_impl("auto", *args) == "xla", args
    monkeypatch.setattr(mosaic_backend, "on_hopper", lambda: False)
    assert da.choose_impl("auto", 64, 384, jnp.bfloat16) == "xla"
    monkeypatch.setattr(mosaic_backend, "on_hopper", lambda: True)
    monkeypatch.setattr(mosaic_backend, "plgpu", None)
    assert da.choose_impl("auto", 64, 384, jnp.bfloat16) == "xla"


@NEEDS_HOPPER_OFF_CPU
@pytest.mark.parametrize("tiles", [da.MosaicTiles(64, 3), da.MosaicTiles(128, 2),
                                   da.MosaicTiles(64, 3, compact=True),
                                   da.MosaicTiles(128, 2, compact=True),
                                   da.MosaicTiles(64, 2, splits=3),
                                   da.MosaicTiles(64, 3, compact=True, splits=8),
                                   da.MosaicTiles(64, 2, row_group=2),
                                   da.MosaicTiles(64, 3, compact=True, row_group=4),
                                   da.MosaicTiles(64, 2, row_group=3),  # 4 rows: one a program
                                   da.MosaicTiles(64, 3, fused=True),
                                   da.MosaicTiles(128, 2, compact=True, fused=True)])
def test_mosaic_streams_many_blocks_through_its_buffers(tiles):
    """A long cache (8 blocks of 64 slots): rows reading more blocks than the kernel has
    buffers (each buffer refilled), a row starting in the slot's block, a row whose
    only token is the new one; the slot mid-block; the query group moved as 64 rows or
    as 8 (compact); the cache written by XLA or by the kernel (fused); each row's blocks
    split over 3 or 8 parts (rows with fewer blocks than parts leave parts empty), or 2 or
    4 rows a program through one pipeline (the rows' blocks from the first). Outputs
    match the XLA path and the updated cache equals it exactly, whatever junk lies outside
    `[start, slot]`."""
    keys = jax.random.split(jax.random.key(4), 6)
    b, n, kv, h, slots, slot = 4, 14, 2, 64, 512, 455
    q = jax.random.normal(keys[0], (b, n, h), jnp.bfloat16)
    k_new, v_new = (jax.random.normal(key, (b, kv, h), jnp.bfloat16) for key in keys[1:3])
    k, v = (jax.random.normal(key, (b, kv, slots, h), jnp.bfloat16) for key in keys[3:5])
    angles = jax.random.uniform(keys[5], (b, h // 2), maxval=300.0)
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    start = jnp.asarray([0, 70, 450, slot], jnp.int32)
    want = da.append_and_attend(q, k_new, v_new, sin, cos, k, v, start, slot, impl="xla")
    junk = lambda x, value: x.at[:, :, slot + 1:].set(value).at[1, :, :70].set(value)
    got = da.append_and_attend(q, k_new, v_new, sin, cos, junk(k, 300.0), junk(v, -300.0),
                               start, slot, impl="mosaic", interpret=INTERPRET, tiles=tiles)
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                               rtol=2e-2, atol=2e-2)
    for got_cache, want_cache, value in zip(got[1:], want[1:], (300.0, -300.0), strict=True):
        np.testing.assert_array_equal(np.asarray(got_cache), np.asarray(junk(want_cache, value)))
    # The row whose only token is the new one attends to its own value alone.
    np.testing.assert_allclose(np.asarray(got[0][3], np.float32),
                               np.repeat(np.asarray(v_new[3], np.float32), n // kv, axis=0),
                               rtol=1e-2, atol=1e-2)


@NEEDS_HOPPER_OFF_CPU
@pytest.mark.parametrize("family,extra", [
    ("qwen2", dict(qkv_bias=True)),   # q/k/v bias: the fused operand and its bias
    ("qwen3", dict(qk_norm=True)),    # q/k norm before RoPE: q, k and v as three operands
    ("llama", dict(rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0,
                                            original_max_position_embeddings=8))),
])
def test_bf16_sampler_through_the_mosaic_kernel_matches_the_xla_path(monkeypatch, family,
                                                                      extra):
    """A bf16 model, ragged left-padded prompts, temperature 1: the same tokens with
    `decode_attention_impl="mosaic"` as with "xla" for the same key, and log-probs within
    bf16 rounding, for the kernel and (with `MOSAIC_TILES` fused) its fused variant, each
    against the one XLA path's rollout (which neither reads). (The kernel takes bf16
    caches only, and bf16 sums in another order differ by a rounding: the weights are
    drawn small enough that such a rounding flips no sample at this key; at 0.3 it
    flips some.)"""
    # One layer and 6 new tokens: each interpreted kernel step takes tens of ms off a GPU.
    config = ModelConfig(family=family, vocab_size=48, hidden_size=64, intermediate_size=64,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32,
                         initializer_range=0.05, dtype="bfloat16", **extra)
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    if config.qkv_bias:
        params = _random_biases(params, jax.random.key(1))
    mask = (np.arange(9)[None] >= 9 - np.array([5, 1, 9, 3])[:, None]).astype(np.int32)
    ids = np.where(mask, np.random.default_rng(0).integers(1, 48, size=(4, 9)), 0)
    sampling = SamplingConfig(max_new_tokens=6, n=2, stop_token_ids=(), pad_token_id=0)

    def generate(impl):
        return sampler.generate(params, ids, mask, jax.random.key(3), sampling,
                                config=dataclasses.replace(config, decode_attention_impl=impl))

    xla = generate("xla")
    assert float(jnp.std(xla.rollout_log_probs)) > 0.3  # not a degenerate model
    for fused in (False, True):
        calls, name = [], "_mosaic_fused" if fused else "_mosaic"
        kernel = getattr(da, name)
        monkeypatch.setattr(da, name, lambda *a, kernel=kernel, calls=calls, **kw:
                            calls.append(1) or kernel(*a, **kw))
        monkeypatch.setattr(da, "MOSAIC_TILES", da.MosaicTiles(fused=fused))
        jax.clear_caches()  # MOSAIC_TILES is read when the sampler is traced
        mosaic = generate("mosaic")
        assert calls, fused  # the decode steps ran the kernel
        np.testing.assert_array_equal(mosaic.responses, xla.responses, err_msg=f"{fused=}")
        chex.assert_trees_all_close(mosaic.rollout_log_probs, xla.rollout_log_probs,
                                    rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("with_bias", [True, False])
def test_mosaic_fused_lowers_to_one_kernel_that_updates_the_cache_in_place(with_bias):
    """For CUDA (lowered without a GPU, the kernel's GPU code through Mosaic GPU's
    lowering): the fused variant is one Mosaic GPU call whose cache outputs alias its
    cache inputs, with no `dynamic_update_slice`; the unfused one writes the cache in
    XLA."""
    n, args = _qkv_operands(with_bias)
    texts = {fused: _lower_for_cuda(lambda *a, fused=fused: da.append_and_attend_qkv(
        *a, num_heads=n, impl="mosaic", tiles=da.MosaicTiles(fused=fused)), args)
        for fused in (False, True)}
    calls = lambda text: [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls(texts[True])) == len(calls(texts[False])) == 1
    assert "output_operand_alias" in calls(texts[True])[0]
    assert "dynamic_update_slice" not in texts[True]
    assert texts[False].count("dynamic_update_slice") == 2
    # The fused kernel reads the projection's output as it is (its rows as one axis, a
    # reshape), with no op between them (bias add, RoPE, padding): it adds the bias and
    # rotates in the kernel.
    operand = re.search(r"call @\S+\((%\w+),", texts[True]).group(1)
    assert f"{operand} = stablehlo.reshape %arg0 " in texts[True]


@pytest.mark.parametrize("n,kv,h,slots", [
    (28, 4, 128, 384),   # Qwen2.5-7B's heads, 64-slot blocks: RoPE in register halves
    (28, 4, 128, 2048),  # 128-slot blocks: the permutation matrix
    (16, 2, 256, 2048),  # head_dim 256 keeps 64-slot blocks (128 would not fit SMEM)
])
def test_mosaic_fused_lowers_at_wide_heads(n, kv, h, slots):
    """Heads of 128 and 256 with the bias, lowered for CUDA (through Mosaic GPU's own
    lowering, which checks shared memory): one Mosaic GPU call on the projection's
    output, the cache aliased, in either rotation."""
    n, args = _qkv_operands(True, n=n, kv=kv, h=h, s=slots)
    text = _lower_for_cuda(lambda *a: da.append_and_attend_qkv(
        *a, num_heads=n, impl="mosaic", tiles=da.MOSAIC_TILES), args)
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 1 and "output_operand_alias" in calls[0]
    operand = re.search(r"call @\S+\((%\w+),", text).group(1)
    assert f"{operand} = stablehlo.reshape %arg0 " in text


def test_block_by_the_caches_length_or_the_single_programs():
    """`MosaicTiles.block` 0: 64-slot blocks below `LONG_CACHE` slots, 128 from it (64 at a
    head_dim above 128); with `split_like`, by the slots of the cache it stands in for
    (a segment's cache runs the single program's blocks); a block that does not divide
    the cache's slots falls back to 64."""
    cache = lambda slots, h=64: jnp.zeros((2, 2, slots, h), jnp.bfloat16)
    block = lambda tiles, k: da._mosaic_layout(14, k, k, tiles).block
    assert block(da.MOSAIC_TILES, cache(1024)) == 64
    assert block(da.MOSAIC_TILES, cache(da.LONG_CACHE)) == 128
    assert block(da.MOSAIC_TILES, cache(da.LONG_CACHE, h=256)) == 64
    assert block(dataclasses.replace(da.MOSAIC_TILES, split_like=(8, 4096)), cache(1024)) == 128
    assert block(dataclasses.replace(da.MOSAIC_TILES, split_like=(8, 1024)), cache(4096)) == 64
    assert block(da.MosaicTiles(128, 2), cache(192)) == 64


def test_fused_rotation_by_head_dim():
    """The permutation matrix where the head fits a key buffer, halves elsewhere; a
    head_dim whose halves are not whole 64-column tiles at that block stops with the
    head_dim and what would do."""
    assert da._swap_matmul(32, 64) and da._swap_matmul(64, 64) and da._swap_matmul(128, 128)
    assert not da._swap_matmul(128, 64) and not da._swap_matmul(256, 128)
    z = jnp.zeros
    with pytest.raises(ValueError, match="head_dim 192 in halves at 64-slot blocks"):
        da._mosaic_fused(z((1, 4, 192), jnp.bfloat16), None, z((1, 96)), z((1, 96)),
                         z((1, 1, 128, 192), jnp.bfloat16), z((1, 1, 128, 192), jnp.bfloat16),
                         z((1,), jnp.int32), jnp.int32(3), num_heads=2, interpret=True,
                         tiles=da.MosaicTiles(64, 2, compact=True, fused=True))


@NEEDS_HOPPER_OFF_CPU
@pytest.mark.parametrize("head_dim", [64, 128])  # the permutation matrix; register halves
def test_mosaic_fused_with_bias_matches_xla(head_dim):
    """The fused Mosaic GPU kernel on a projection's bf16 output and its bias, in both
    rotations: the cache writes equal the XLA path's to the bit, the output within
    bf16 rounding; a row starting at the new token, one mid-block, and a new token on
    a block edge."""
    n, kv, b, slots = 8, 2, 2, 192
    keys = jax.random.split(jax.random.key(5), 5)
    j = n + 2 * kv
    qkv = jax.random.normal(keys[0], (b, j, head_dim), jnp.bfloat16)
    bias = jax.random.normal(keys[1], (j, head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (b, kv, slots, head_dim), jnp.bfloat16)
            for key in keys[2:4])
    angles = jax.random.uniform(keys[4], (b, head_dim // 2), maxval=300.0)
    for slot in (64, 100):
        start = jnp.asarray([slot, 30], jnp.int32)
        got, want = (_attend_qkv(qkv, bias, jnp.sin(angles), jnp.cos(angles), k, v, start,
                                 slot, num_heads=n, **args)
                     for args in (dict(impl="mosaic", interpret=INTERPRET,
                                       tiles=da.MosaicTiles(64, 2, compact=True, fused=True)),
                                  dict(impl="xla")))
        np.testing.assert_allclose(np.asarray(got[0], np.float32),
                                   np.asarray(want[0], np.float32), rtol=2e-2, atol=2e-2)
        for g, w in zip(got[1:], want[1:], strict=True):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@NEEDS_HOPPER_OFF_CPU
@pytest.mark.parametrize("slots, slot, fused", [(2048, 100, True), (3072, 2200, False)])
def test_fused_tiles_leave_few_rows_over_a_long_cache_to_the_split_kernel(slots, slot,
                                                                          fused):
    """Fused tiles with `fused_max_splits` 2: 2 rows of 2 key/value heads over 2,048 slots
    (the unfused kernel would split each pair in 2) run the fused kernel; over 3,072 (in
    3) the bias, RoPE and cache write run in XLA and the unfused kernel splits the
    slots (a row starting at 0 read across all three parts). Either gives the XLA
    path's cache to the bit and its output within bf16 rounding."""
    n, kv, b, h = 8, 2, 2, 64
    rng = np.random.default_rng(6)  # drawn on the host: no programs for the suite's budget
    bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape).astype(jnp.bfloat16))
    qkv, bias = bf16(b, n + 2 * kv, h), bf16(n + 2 * kv, h)
    k, v = bf16(b, kv, slots, h), bf16(b, kv, slots, h)
    angles = rng.uniform(0.0, 300.0, (b, h // 2)).astype(np.float32)
    sin, cos = jnp.asarray(np.sin(angles)), jnp.asarray(np.cos(angles))
    start = jnp.asarray([0, slot - 40], jnp.int32)
    calls = {"fused": 0, "split": []}
    fused_kernel = da._mosaic_fused

    def count_fused(*args, **kwargs):
        calls["fused"] += 1
        return fused_kernel(*args, **kwargs)

    # An H100 SXM's or H200's 132 multiprocessors, whatever device runs the test.
    with (mock.patch.object(da, "slot_splits",
                            functools.partial(da.slot_splits, multiprocessors=132)),
          mock.patch.object(da, "_mosaic_fused", count_fused),
          mock.patch.object(da, "_mosaic", lambda *a, **kw: calls["split"].append(kw["tiles"])
                            or _MOSAIC(*a, **kw))):
        got = _attend_qkv(qkv, bias, sin, cos, k, v, start, slot,
                          num_heads=n, impl="mosaic", interpret=INTERPRET,
                          tiles=da.MosaicTiles.from_spec("0,2,compact,fused,maxsplits2"))
    assert calls["fused"] == int(fused)
    assert [(t.fused, t.splits) for t in calls["split"]] == ([] if fused else [(False, 0)])
    want = _attend_qkv(qkv, bias, sin, cos, k, v, start, slot, num_heads=n, impl="xla")
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                               rtol=2e-2, atol=2e-2)
    for g, w in zip(got[1:], want[1:], strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.parametrize("rows, slots, fused", [
    (256, 384, True),     # 512 pairs fill 132 multiprocessors twice: no split
    (128, 8704, True),    # 256 pairs: the unfused kernel would split each in 2
    (64, 8704, False),    # 128 pairs: in 3 (264 programs / 128)
    (32, 8704, False),    # 64 pairs: in 5
    (32, 2048, True),     # too few slots for more than 2 parts of 1,024
])
def test_default_tiles_take_the_fused_kernel_unless_the_unfused_one_splits_more_than_twice(
        rows, slots, fused):
    """`MOSAIC_TILES` (the sampler's): the fused kernel, except where the unfused kernel
    would split a (row, key/value head) pair's slots into more than 2 parts
    (`slot_splits`: 2 programs a multiprocessor, parts of at least 1,024 slots), the
    natural-length decode's tail of few rows over a long cache. 2 key/value heads, an
    H100's or H200's 132 multiprocessors (whatever device runs the test)."""
    h100 = functools.partial(da.slot_splits, multiprocessors=132)
    with mock.patch.object(da, "slot_splits", h100):
        assert da.MOSAIC_TILES.takes_fused(rows, 2, slots) is fused


def test_mosaic_fused_kernel_lowers_once_for_all_layers():
    """A decode step's layers (three caches of one shape) call one jitted kernel
    function: lowered for CUDA, the program holds one Mosaic GPU call, in a function
    that each layer calls (its Mosaic GPU lowering, ~0.3 s a kernel, runs once)."""
    n, (qkv, bias, sin, cos, k, v, start, slot) = _qkv_operands(True)

    def layers(qkv, bias, sin, cos, start, slot, *caches):
        outs = []
        for k_cache, v_cache in zip(caches[::2], caches[1::2], strict=True):
            out, _, _ = da.append_and_attend_qkv(
                qkv, bias, sin, cos, k_cache, v_cache, start, slot, num_heads=n,
                impl="mosaic", tiles=da.MosaicTiles(64, 2, compact=True, fused=True))
            outs.append(out)
        return outs

    text = _lower_for_cuda(layers, (qkv, bias, sin, cos, start, slot, k, v, k, v, k, v))
    assert text.count("custom_call @mosaic_gpu") == 1
    kernel_fn = re.findall(r"func\.func private @(\S+)\(", text.split(
        "custom_call @mosaic_gpu")[0])[-1]
    assert text.count(f"call @{kernel_fn}(") == 3, kernel_fn


def test_fused_bias_places_each_heads_rows_where_the_kernel_adds_them():
    """The fused kernel's bias `[K, R, H]`: key/value head k's query heads' biases at
    rows [0, group), its key's at row `moved` and its value's at `moved + 8`, every
    other row zero (Qwen2.5-0.5B's 14 query and 2 key/value heads)."""
    n, kv, h, moved = 14, 2, 4, 8
    bias = np.arange((n + 2 * kv) * h, dtype=np.float32).reshape(n + 2 * kv, h) + 1
    got = np.asarray(da.fused_bias(jnp.asarray(bias), num_heads=n, num_kv=kv, moved=moved))
    assert got.shape == (kv, 64, h)
    for k in range(kv):
        want = np.zeros((64, h), np.float32)
        want[:7] = bias[7 * k:7 * k + 7]
        want[8] = bias[14 + k]
        want[16] = bias[16 + k]
        np.testing.assert_array_equal(got[k], want)


def test_kernel_bias_is_the_operand_the_fused_kernel_makes_at_each_step():
    """`kernel_bias` makes, for either plain tile (one part, or RoPE's two halves), the
    operand `_mosaic_fused` would otherwise gather at every step: `fused_bias` in the
    cache's dtype, split into the tile's column parts (Qwen2.5-7B's 28 query and 4
    key/value heads of 128)."""
    n, kv, h = 28, 4, 128
    bias = np.random.default_rng(5).normal(size=(n + 2 * kv, h)).astype(np.float32)
    made, full = jax.jit(lambda bias: (  # one program
        da.kernel_bias(bias, num_heads=n, num_kv=kv, dtype=jnp.bfloat16),
        da.fused_bias(bias.astype(jnp.bfloat16), num_heads=n, num_kv=kv, moved=8)))(bias)
    np.testing.assert_array_equal(made.bias_jh, bias)
    assert sorted(made.by_parts) == [1, 2]
    full = np.asarray(full, np.float32)  # `[K, R, H]`
    for parts, operand in made.by_parts.items():
        assert operand.shape == (kv, parts, 64, h // parts) and operand.dtype == jnp.bfloat16
        operand = np.asarray(operand, np.float32)
        for part in range(parts):
            np.testing.assert_array_equal(
                operand[:, part], full[:, :, part * h // parts:(part + 1) * h // parts])


@NEEDS_HOPPER_OFF_CPU
def test_sampler_makes_the_kernels_bias_once_not_at_every_layer_step():
    """The sampler's per-layer parameters carry the fused kernel's bias operand
    (`transformer.with_kernel_bias`) where the kernel reads it: the decode loop's
    compiled body then has no gather of a layer's bias, which it has without it (XLA
    does not hoist a gather that makes its input larger out of a loop). Without a qkv
    bias, or on XLA's decode attention, the layers carry none."""
    config = ModelConfig(family="qwen2", vocab_size=48, hidden_size=64, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, qkv_bias=True,
                         dtype="bfloat16", decode_attention_impl="mosaic")
    # Shapes only (`jax.eval_shape`): nothing here runs but the two compiles below.
    shapes = lambda config: jax.eval_shape(functools.partial(init_params, config),
                                           jax.random.key(0))
    layers = lambda config: jax.eval_shape(functools.partial(sampler.per_layer, config=config),
                                           shapes(config))["layers"]
    assert all(sorted(layer["attn"][transformer.KERNEL_BIAS]) == ["1", "2"]
               for layer in layers(config))
    for other in (dataclasses.replace(config, decode_attention_impl="xla"),
                  dataclasses.replace(config, qkv_bias=False)):
        assert not any(transformer.KERNEL_BIAS in layer["attn"] for layer in layers(other))
    ids = jax.ShapeDtypeStruct((2, 5), jnp.int32)
    sampling = SamplingConfig(max_new_tokens=3, stop_token_ids=(), pad_token_id=0)

    def bias_gathers_in_the_loop():
        program = jax.jit(functools.partial(sampler.generate_program, sampling=sampling,
                                            config=config))
        text = program.lower(shapes(config), ids, ids,
                             jax.eval_shape(jax.random.key, 1)).compile().as_text()
        return len(re.findall(r"gather\(.*op_name=\"[^\"]*while/body[^\"]*/attn/gather\"",
                              text))

    assert bias_gathers_in_the_loop() == 0
    with mock.patch.object(transformer, "with_kernel_bias", lambda layer, config: layer):
        assert bias_gathers_in_the_loop() == config.num_layers


@pytest.mark.parametrize("swap_matmul", [False, True])
def test_rope_table_rotates_as_rope(swap_matmul):
    """The fused kernel's rotation tables are RoPE (float64 reference), for every row's
    angles: `[cos, sin]`, with halves `a, b` of a head vector rotated to
    `a cos - b sin, b cos + a sin`; for the swap matmul `[cos, cos]` and `[-sin, sin]`,
    with `x * row0 + swap(x) * row1` (`swap` exchanging the halves)."""
    b, m, h = 3, 5, 32
    x = np.asarray(jax.random.normal(jax.random.key(0), (b, m, h)), np.float64)
    angles = np.asarray(jax.random.uniform(jax.random.key(1), (b, h // 2), maxval=40.0))
    table = np.asarray(da.rope_table(jnp.sin(angles), jnp.cos(angles), swap_matmul=swap_matmul),
                       np.float64)
    low, high = x[..., :h // 2], x[..., h // 2:]
    if swap_matmul:
        assert table.shape == (b, 2, h)
        got = x * table[:, None, 0] + np.concatenate([high, low], axis=-1) * table[:, None, 1]
    else:
        assert table.shape == (b, 2, h // 2)
        cos, sin = table[:, None, 0], table[:, None, 1]
        got = np.concatenate([low * cos - high * sin, high * cos + low * sin], axis=-1)
    np.testing.assert_allclose(got, naive_rope(x, angles), rtol=1e-6, atol=1e-6)


def _paged(k_bksh, v_bksh, page, seed):
    """The cache `[B, K, S, H]` as pools `[K, pages, page, H]` of pages of `page` slots in
    a shuffled order (page 0, the trash page, filled with junk that no row may read) and
    the rows' block tables."""
    b, kv, s, h = k_bksh.shape
    per_row = s // page
    table = np.random.default_rng(seed).permutation(b * per_row).reshape(b, per_row) + 1
    pool = lambda x, junk: jnp.full((kv, 1 + b * per_row, page, h), junk, x.dtype).at[
        :, table.reshape(-1)].set(x.reshape(b, kv, per_row, page, h).transpose(
            1, 0, 2, 3, 4).reshape(kv, b * per_row, page, h))
    return pool(k_bksh, 1e3), pool(v_bksh, -1e3), jnp.asarray(table, jnp.int32)


@pytest.mark.parametrize("page,tiles", [
    (16, da.MosaicTiles(64, 2, compact=True)),            # four pages a block
    (8, da.MosaicTiles(128, 3, compact=True, splits=3)),  # 16 pages a block, in 3 parts
    (64, da.MosaicTiles(0, 2, compact=True, splits=0)),   # a page a block, `PAGED_TILES`
], ids=["page16_block64", "page8_splits3", "page64"])
def test_paged_kernel_reads_each_rows_pages_in_place(page, tiles):
    """The paged kernel (`paged_attention`) against a float64 reference over each row's
    slots `[start, slot]`, every row at its own slot, its pages shuffled through the pool:
    rows starting mid-page, on a block edge and at their slot, and a row whose table ends
    in trash pages past its slot."""
    b, n, kv, h, slots = 4, 14, 2, 64, 320
    keys = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(keys[0], (b, n, h), jnp.bfloat16)
    k, v = (jax.random.normal(key, (b, kv, slots, h), jnp.bfloat16) for key in keys[1:])
    k_pool, v_pool, table = _paged(k, v, page, seed=page)
    slot = np.array([slots - 1, 200, 37, 64], np.int32)
    start = np.array([5, 128, 37, 0], np.int32)
    table = table.at[2, 37 // page + 1:].set(0)  # the trash page past row 2's slot
    want = np.stack([naive_attention(q[r:r + 1], k[r:r + 1], v[r:r + 1], start[r:r + 1],
                                     slot[r] + 1)[0] for r in range(b)])
    got = jax.jit(functools.partial(da.paged_attention, interpret=INTERPRET, tiles=tiles))(
        q, k_pool, v_pool, table, jnp.asarray(start), jnp.asarray(slot))
    assert got.shape == q.shape and got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-2, atol=2e-2)


def test_paged_kernel_lowers_for_the_gpu_and_refuses_what_it_cannot_read():
    """The paged kernel's compiled path lowers for CUDA to one Mosaic GPU call (pages of 16
    slots, eight copies a 128-slot block, in parts); pages it cannot copy as whole tiles,
    and a forced kernel with such pages, stop with the keys to change."""
    sds = jax.ShapeDtypeStruct
    shapes = (sds((8, 14, 64), jnp.bfloat16), *[sds((2, 100, 16, 64), jnp.bfloat16)] * 2,
              sds((8, 40), jnp.int32), sds((8,), jnp.int32), sds((8,), jnp.int32))
    tiles = da.MosaicTiles.from_spec("128,2,compact,splits2")
    with mock.patch.object(mosaic_backend, "on_hopper", lambda: True):
        text = _lower_for_cuda(lambda *a: da.paged_attention(*a, tiles=tiles), shapes)
    assert text.count("custom_call @mosaic_gpu") == 1
    assert [da.paged_applies(p, 64) for p in (4, 8, 16, 24, 128, 256)] == [
        False, True, True, False, True, False]
    assert not da.paged_applies(128, 256)
    # A block holds whole pages: a 192-slot block of 128-slot pages is rounded up to two.
    cache = sds((8, 2, 1024, 64), jnp.bfloat16)
    assert da._mosaic_layout(14, cache, cache, da.MosaicTiles(192, 2), page=128).block == 256
    assert da._mosaic_layout(14, cache, cache, da.MosaicTiles(0, 2), page=16).block == 64
    pool = jnp.zeros((1, 4, 4, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match="pages of 8 to 128 slots"):
        da.paged_attention(jnp.zeros((1, 2, 32), jnp.bfloat16), pool, pool,
                           jnp.zeros((1, 2), jnp.int32), jnp.zeros((1,), jnp.int32),
                           jnp.zeros((1,), jnp.int32))
    config = ModelConfig(family="qwen2", vocab_size=48, hidden_size=64, intermediate_size=64,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32,
                         decode_attention_impl="mosaic", dtype="bfloat16")
    sampling = SamplingConfig(max_new_tokens=4, stop_token_ids=(), pad_token_id=0,
                              kv_cache="paged", page_size=4)
    with pytest.raises(ValueError, match=r"rollout.page_size a power of two from 8 to 128, "
                                         r"got 4; set rollout.page_size=16"):
        paged.check_inputs(np.ones((2, 3), np.int32), np.ones((2, 3), np.int32), sampling,
                           config)
    with pytest.raises(ValueError, match=r"rollout.page_size a power of two"):  # the trainer's
        sampler.check_inputs(np.ones((2, 3), np.int32), np.ones((2, 3), np.int32), sampling,
                             config)


@NEEDS_HOPPER_OFF_CPU
@pytest.mark.parametrize("head_dim", [32, 128], ids=["swap_matrix", "register_halves"])
def test_paged_fused_kernel_writes_and_attends_each_rows_pages(head_dim):
    """The fused kernel over a paged cache (`append_and_attend_qkv_paged`), every row at
    its own slot, its pages shuffled through the pools, against the XLA path of the
    contiguous cache row by row: the output within bf16 rounding, and the pools read back
    through each row's table equal to the XLA path's cache to the bit (the new key and
    value at the slot's page). Rows whose new token starts a page, sits on a block edge
    and mid-page, one starting at its new token, one whose table ends in trash pages
    past its slot."""
    n, kv, b, slots, page = 8, 2, 4, 192, 16
    keys = jax.random.split(jax.random.key(6), 5)
    qkv = jax.random.normal(keys[0], (b, n + 2 * kv, head_dim), jnp.bfloat16)
    bias = jax.random.normal(keys[1], (n + 2 * kv, head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (b, kv, slots, head_dim), jnp.bfloat16)
            for key in keys[2:4])
    angles = jax.random.uniform(keys[4], (b, head_dim // 2), maxval=300.0)
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    slot = np.array([64, 100, 16, 191], np.int32)
    start = np.array([64, 30, 0, 5], np.int32)
    k_pool, v_pool, table = _paged(k, v, page, seed=2)
    table = table.at[2, 2:].set(0)  # the trash page past row 2's slot (page 1)
    kernel = jax.jit(functools.partial(
        da.append_and_attend_qkv_paged, num_heads=n, interpret=INTERPRET,
        tiles=da.MosaicTiles(64, 2, compact=True, fused=True)))
    out, k_pool, v_pool = kernel(qkv, bias, sin, cos, k_pool, v_pool, table,
                                 jnp.asarray(start), jnp.asarray(slot))
    assert out.shape == (b, n, head_dim) and out.dtype == qkv.dtype
    for r in range(b):
        want = _attend_qkv(qkv[r:r + 1], bias, sin[r:r + 1], cos[r:r + 1], k[r:r + 1],
                           v[r:r + 1], jnp.asarray(start[r:r + 1]), jnp.asarray(slot[r]),
                           num_heads=n, impl="xla")
        np.testing.assert_allclose(np.asarray(out[r], np.float32),
                                   np.asarray(want[0][0], np.float32), rtol=2e-2, atol=2e-2,
                                   err_msg=f"row {r}")
        held = slots if r != 2 else 2 * page  # row 2's table holds pages 0 and 1
        for pool, cache in ((k_pool, want[1]), (v_pool, want[2])):
            back = pool[:, table[r]].reshape(kv, -1, head_dim)[:, :held]
            np.testing.assert_array_equal(np.asarray(back, np.float32),
                                          np.asarray(cache[0, :, :held], np.float32),
                                          err_msg=f"row {r}")


@pytest.mark.parametrize("n,kv,h", [(14, 2, 64), (28, 4, 128)])
def test_paged_fused_kernel_lowers_for_the_gpu_writing_the_pools_in_place(n, kv, h):
    """For CUDA (through Mosaic GPU's own lowering, which checks shared memory): the
    paged fused kernel is one Mosaic GPU call on the projection's output, its pools
    aliased in and out, with no scatter; it stops on pages it cannot read and under a
    mesh of several devices."""
    sds = jax.ShapeDtypeStruct
    shapes = (sds((8, n + 2 * kv, h), jnp.bfloat16), sds((n + 2 * kv, h), jnp.bfloat16),
              sds((8, h // 2), jnp.float32), sds((8, h // 2), jnp.float32),
              *[sds((kv, 100, 16, h), jnp.bfloat16)] * 2, sds((8, 40), jnp.int32),
              sds((8,), jnp.int32), sds((8,), jnp.int32))
    with mock.patch.object(mosaic_backend, "on_hopper", lambda: True):
        text = _lower_for_cuda(
            lambda *a: da.append_and_attend_qkv_paged(*a, num_heads=n), shapes)
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 1 and "output_operand_alias" in calls[0]
    assert "scatter" not in text
    pool = jnp.zeros((2, 4, 4, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match="pages of 8 to 128 slots"):
        da.append_and_attend_qkv_paged(
            jnp.zeros((1, 8, 32), jnp.bfloat16), None, jnp.zeros((1, 16)), jnp.zeros((1, 16)),
            pool, pool, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1,), jnp.int32),
            jnp.zeros((1,), jnp.int32), num_heads=4)


@pytest.mark.parametrize("rows, slots, fused, fused_by_default", [
    (132, 8192, True, True),    # 264 (row, key/value head) pairs fill 132 multiprocessors twice
    (66, 8192, True, False),    # 132 pairs: the unfused kernel splits each in 2
    (65, 8192, False, False),   # 130 pairs: in 3
    (4, 1000, True, True),      # too few slots to split
    (4, 2048, True, False),     # too few slots for more than 2 parts
    (4, 3072, False, False),    # in 3
])
def test_paged_decode_takes_the_fused_kernel_only_where_the_unfused_one_splits_little(
        rows, slots, fused, fused_by_default):
    """`transformer.paged_fused`: the fused kernel over pages keeps each (row, key/value
    head) pair in one program, so with `PAGED_FUSED` "auto" the paged decode takes it
    only where the unfused kernel would split the pair's slots into at most
    `PAGED_FUSED_TILES.fused_max_splits` parts (`slot_splits`: 2 programs a
    multiprocessor, parts of at least 1,024 slots): `fused` at 2 parts, `fused_by_default`
    at the default (no split); at any rows with "always", never with "off"."""
    config = ModelConfig(family="qwen2", vocab_size=48, hidden_size=64, intermediate_size=64,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32,
                         dtype="bfloat16", decode_attention_impl="mosaic")
    # Host arrays of the shapes the rule reads (a row's pages of 8 slots): no programs.
    pool = (np.zeros((2, 4, 8, 32), jnp.bfloat16),)
    cache = PagedCache(k=pool, v=pool, block_table=np.zeros((rows, -(-slots // 8)), np.int32),
                       shift=np.zeros((rows,), np.int32), num_slots=slots)
    # An H100 SXM's or H200's 132 multiprocessors, whatever device runs the test.
    h100 = functools.partial(da.slot_splits, multiprocessors=132)
    with mock.patch.object(da, "slot_splits", h100):
        with mock.patch.object(da, "PAGED_FUSED", "auto"):
            assert transformer.paged_fused(config, cache) is fused_by_default
        two = dataclasses.replace(da.PAGED_FUSED_TILES, fused_max_splits=2)
        with mock.patch.object(da, "PAGED_FUSED_TILES", two):
            for mode, want in (("auto", fused), ("always", True), ("off", False)):
                with mock.patch.object(da, "PAGED_FUSED", mode):
                    assert transformer.paged_fused(config, cache) is want, mode
        with (mock.patch.object(da, "PAGED_FUSED", True),
              pytest.raises(ValueError, match=r"PAGED_FUSED must be one of \('auto'")):
            transformer.paged_fused(config, cache)


def test_tpu_paged_kernel_reads_each_rows_pages_in_place():
    """Pallas' TPU paged attention (`tpu_paged_attention`, in TPU interpret mode) against a
    float64 reference: each row's physical slots `[0, length)` through its shuffled pages,
    with a scale and Gemma 2's soft-cap; a row whose table ends in trash pages."""
    b, n, kv, h, slots, page = 4, 8, 2, 128, 128, 16
    keys = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(keys[0], (b, n, h), jnp.float32)
    k, v = (jax.random.normal(key, (b, kv, slots, h), jnp.float32) for key in keys[1:])
    k_pool, v_pool, table = _paged(k, v, page, seed=1)
    lengths = np.array([slots, 1, 37, 64], np.int32)
    table = table.at[2, 3:].set(0)  # the trash page past row 2's tokens
    scale, cap = 0.05, 3.0
    logits = np.einsum("bkgh,bksh->bkgs", np.asarray(q, np.float64).reshape(b, kv, n // kv, h),
                       np.asarray(k, np.float64)) * scale
    logits = cap * np.tanh(logits / cap)
    logits = np.where(np.arange(slots) < lengths[:, None, None, None], logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("bkgs,bksh->bkgh", weights / weights.sum(-1, keepdims=True),
                     np.asarray(v, np.float64)).reshape(b, n, h)
    with pltpu.force_tpu_interpret_mode():
        got = jax.jit(functools.partial(da.tpu_paged_attention, scale=scale, softcap=cap))(
            q, k_pool, v_pool, table, jnp.asarray(lengths))
    # (The kernel's matmuls run at the default precision: bfloat16 operands.)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-2, atol=1e-2)


def test_bf16_paged_sampler_through_each_kernel_matches_the_xla_path():
    """The paged sampler with its decode steps on a kernel that reads the pages in place
    (the Mosaic GPU kernel, `paged_attention`, and Pallas' TPU paged attention, each in
    its interpret mode), through refill, preemption and drain: the tokens of its XLA
    path (gathered pages) and of the contiguous sampler for the same key, log-probs
    within bf16 rounding; and on a short run, the fused kernel over pages
    (`PAGED_FUSED`) against the XLA path."""
    config = ModelConfig(family="qwen2", vocab_size=48, hidden_size=64, intermediate_size=64,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32,
                         initializer_range=0.05, dtype="bfloat16", qkv_bias=True)
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    mask = (np.arange(9)[None] >= 9 - np.array([5, 1, 9, 3])[:, None]).astype(np.int32)
    ids = np.where(mask, np.random.default_rng(0).integers(1, 48, size=(4, 9)), 0)
    # Four slots for eight rows, pages of 8 slots, a pool of 4 pages beside the trash page:
    # rows refill two at a time and some are preempted.
    sampling = SamplingConfig(max_new_tokens=14, n=2, stop_token_ids=(3,), pad_token_id=0,
                              kv_cache="paged", page_size=8, max_num_seqs=4, refill_rows=2,
                              num_pages=5)
    run = lambda impl: paged.generate(params, ids, mask, jax.random.key(3), sampling,
                                      config=dataclasses.replace(config,
                                                                 decode_attention_impl=impl))
    xla = run("xla")
    contiguous = sampler.generate(params, ids, mask, jax.random.key(3),
                                  dataclasses.replace(sampling, kv_cache="contiguous"),
                                  config=config)
    lengths = np.asarray(xla.response_lengths)
    assert np.asarray(xla.preemptions).sum() > 0 and lengths.min() < lengths.max()
    np.testing.assert_array_equal(xla.responses, contiguous.responses)
    calls = []
    with (mock.patch.object(da, "PAGED_FUSED", "off"),
          mock.patch.object(da, "_mosaic", lambda *a, **kw: calls.append(kw) or _MOSAIC(*a, **kw))):
        mosaic = run("mosaic")
    assert calls and all(kw["block_table"] is not None for kw in calls)
    # The fused kernel (`PAGED_FUSED`, read when the program is traced), on a short run
    # (interpreted, it is the test's slowest): the left-padded rows' pages written and
    # read at their physical slots.
    short = dataclasses.replace(sampling, max_new_tokens=4, max_num_seqs=0, num_pages=0)
    fused_calls, fused_kernel = [], da._mosaic_fused
    with (mock.patch.object(da, "PAGED_FUSED", "always"),
          mock.patch.object(da, "_mosaic_fused",
                            lambda *a, **kw: fused_calls.append(kw) or fused_kernel(*a, **kw))):
        fused = paged.generate(params, ids, mask, jax.random.key(3), short,
                               config=dataclasses.replace(config, decode_attention_impl="mosaic"))
    assert fused_calls and all(kw["block_table"] is not None for kw in fused_calls)
    unfused = paged.generate(params, ids, mask, jax.random.key(3), short,
                             config=dataclasses.replace(config, decode_attention_impl="xla"))
    np.testing.assert_array_equal(fused.responses, unfused.responses)
    chex.assert_trees_all_close(fused.rollout_log_probs, unfused.rollout_log_probs,
                                rtol=2e-2, atol=2e-2)
    tpu_calls, tpu_kernel = [], da.tpu_paged_attention
    with (mock.patch.object(da, "on_tpu", lambda: True),
          mock.patch.object(da, "tpu_paged_attention",
                            lambda *a, **kw: tpu_calls.append(1) or tpu_kernel(*a, **kw)),
          pltpu.force_tpu_interpret_mode()):
        tpu = run("auto")
    assert tpu_calls
    for name, out in (("mosaic", mosaic), ("tpu", tpu)):
        np.testing.assert_array_equal(out.responses, xla.responses, err_msg=name)
        np.testing.assert_array_equal(out.preemptions, xla.preemptions, err_msg=name)
        chex.assert_trees_all_close(out.rollout_log_probs, xla.rollout_log_probs,
                                    rtol=2e-2, atol=2e-2)
