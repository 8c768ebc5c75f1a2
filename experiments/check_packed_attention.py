"""Packed causal attention on a GPU: cuDNN's packed layout against the XLA reference
(outputs and gradients), and its time against the padded layout's dense-mask cuDNN call.

    python experiments/check_packed_attention.py

Prints the relative errors (bf16 inputs, float32 reference) and a timing table.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from jrl.kernels import packed_attention
from jrl.models.cache import attention_mask


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def layout(rows, length, lengths):
    seg = np.zeros((rows, length), np.int32)
    for r in range(rows):
        at, sid = 0, 1
        for n in lengths[r]:
            seg[r, at:at + n] = sid
            at, sid = at + n, sid + 1
    return jnp.asarray(seg)


def check(rows, length, lengths, n=14, k=2, h=64, seed=0):
    seg = layout(rows, length, lengths)
    segments = packed_attention.segments(seg, 8)
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(rows, length, n, h)), jnp.bfloat16)
    kk, v = (jnp.asarray(rng.normal(size=(rows, length, k, h)), jnp.bfloat16) for _ in range(2))
    used = (seg > 0)[:, :, None, None]
    cot = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def loss(impl, q, kk, v):
        out = packed_attention.attend(q, kk, v, segments, impl).astype(jnp.float32)
        return jnp.sum(jnp.where(used, out * cot, 0))

    f32 = lambda *xs: [x.astype(jnp.float32) for x in xs]
    out_ref = packed_attention.attend(*f32(q, kk, v), segments, "xla")
    out = jax.jit(lambda *a: packed_attention.attend(*a, segments, "cudnn"))(q, kk, v)
    g_ref = jax.grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2))(*f32(q, kk, v))
    g = jax.jit(jax.grad(lambda *a: loss("cudnn", *a), argnums=(0, 1, 2)))(q, kk, v)
    mask = np.asarray(used)
    errors = [rel(np.where(mask, out, 0), np.where(mask, out_ref, 0))]
    errors += [rel(a, b) for a, b in zip(g, g_ref, strict=True)]
    print(f"rows {rows} L {length} segments {lengths}: rel err out/dq/dk/dv "
          + " ".join(f"{e:.2e}" for e in errors), flush=True)
    assert max(errors) < 2e-2, errors


def bench(fn, *args, reps=10):
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def _timing_row(rng, b, t, n, k, h):
    """(dense-mask, is_causal, packed) fwd+bwd times of `b` sequences of `t` tokens."""
    q = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.bfloat16)
    kk, v = (jnp.asarray(rng.normal(size=(b, t, k, h)), jnp.bfloat16) for _ in range(2))
    mask = attention_mask(jnp.ones((b, t), jnp.int32), t, None)
    segments = packed_attention.segments(layout(1, b * t, [[t] * b]), 8)

    def grad_of(attention):
        loss = lambda q, kk, v: jnp.sum(attention(q, kk, v).astype(jnp.float32))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    dense = grad_of(lambda q, kk, v: jax.nn.dot_product_attention(
        q, kk, v, mask=mask, implementation="cudnn"))
    causal = grad_of(lambda q, kk, v: jax.nn.dot_product_attention(
        q, kk, v, is_causal=True, implementation="cudnn"))
    one_row = lambda x: x.reshape(1, b * t, *x.shape[2:])
    packed = grad_of(lambda q, kk, v: packed_attention.attend(
        one_row(q), one_row(kk), one_row(v), segments, "cudnn"))
    return tuple(bench(fn, q, kk, v) for fn in (dense, causal, packed))


def timing(n=14, k=2, h=64):
    rng = np.random.default_rng(0)
    # One 8.7k-token sequence per padded row (P512 + R8192), 2 rows = 17.4k tokens,
    # against the same tokens packed into one row of 17,408 slots.
    rows = [(b, t, *_timing_row(rng, b, t, n, k, h)) for b, t in ((2, 8704), (4, 4352))]
    print("fwd+bwd of one layer's attention (ms), Qwen2.5-0.5B heads (14 q, 2 kv, 64):")
    print(f"{'rows x T':>12} {'dense mask':>11} {'is_causal':>10} {'packed':>8}")
    for b, t, d, c, p in rows:
        print(f"{b:>4} x {t:<6} {d:>11.2f} {c:>10.2f} {p:>8.2f}")


if __name__ == "__main__":
    print(jax.devices(), jax.__version__)
    check(1, 256, [[100, 130]])
    check(2, 512, [[200, 1, 311], [512]])
    check(3, 1024, [[1000], [17, 300, 600, 7], [5]])
    timing()
