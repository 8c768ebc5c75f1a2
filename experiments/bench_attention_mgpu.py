"""Is a Mosaic GPU flash attention worth writing for training? JAX's own Hopper
kernel (`jax.experimental.pallas.ops.gpu.attention_mgpu`: float16 only, no segment ids,
its backward not causal) against cuDNN on the same tokens, one layer's heads.

    python experiments/bench_attention_mgpu.py [--out results.json]

Shapes: rows x tokens at the Qwen2.5-0.5B heads (14 query, 2 key/value, 64 wide) and
the 7B heads (28, 4, 128), float16. Causal: cuDNN forward alone and forward with
backward, the Mosaic GPU kernel forward alone over a few of its tunings. Not causal
(where the Mosaic GPU kernel has a backward): both forward with backward, timed only.
The kernel applies no softmax scale, so it gets q scaled by 1/sqrt(head_dim); its causal
output is compared with cuDNN's. TFLOP/s counts the causal half of QK^T and PV when causal (a
backward as 2.5 forwards more). Times are wall-clock medians of 10 calls.
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import results_json  # this folder is on the path when a script here runs
from bench_packed_attention import timed  # this folder is on the path


def causal_flops(rows, t, heads, hd):
    return rows * 4 * t * t / 2 * heads * hd


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu

    shapes = [(1, 8704, 14, 2, 64), (2, 8704, 14, 2, 64), (4, 4352, 14, 2, 64),
              (1, 16384, 14, 2, 64), (1, 8704, 28, 4, 128)]
    tunings = [(bq, bkv, st) for bq, bkv, st in itertools.product((64, 128), (64, 128), (2, 4))]
    rows_out = []
    for rows, t, n, k, h in shapes:
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.normal(size=(rows, t, n, h)), jnp.float16)
        kk, v = (jnp.asarray(rng.normal(size=(rows, t, k, h)), jnp.float16) for _ in range(2))
        qs = (q * h ** -0.5).astype(q.dtype)  # JAX's kernel applies no softmax scale
        fl = causal_flops(rows, t, n, h)
        cudnn = jax.jit(lambda q, kk, v: jax.nn.dot_product_attention(
            q, kk, v, is_causal=True, implementation="cudnn"))
        loss = lambda q, kk, v: jnp.sum(jax.nn.dot_product_attention(
            q, kk, v, is_causal=True, implementation="cudnn").astype(jnp.float32))
        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        c_ms, g_ms = timed(cudnn, q, kk, v), timed(grad, q, kk, v)
        ref = np.asarray(cudnn(q, kk, v), np.float32)
        row = {"rows": rows, "tokens": t, "heads": [n, k, h], "cudnn_fwd_ms": c_ms,
               "cudnn_fwd_tflops": fl / c_ms / 1e9, "cudnn_fwd_bwd_ms": g_ms,
               "cudnn_fwd_bwd_tflops": 3.5 * fl / g_ms / 1e9, "mgpu": []}
        print(f"{rows} x {t} heads {n}/{k}/{h}: cuDNN fwd {c_ms:.3f} ms "
              f"({row['cudnn_fwd_tflops']:.0f} TFLOP/s), fwd+bwd {g_ms:.3f} ms "
              f"({row['cudnn_fwd_bwd_tflops']:.0f})", flush=True)
        for bq, bkv, st in tunings:
            config = mgpu.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=st,
                                       causal=True)
            fn = jax.jit(lambda q, kk, v, c=config: mgpu.attention(q, kk, v, c))
            try:
                m_ms = timed(fn, qs, kk, v)
                err = float(np.max(np.abs(np.asarray(fn(qs, kk, v), np.float32) - ref)))
            except Exception as e:  # a tuning that does not fit or lower
                print(f"   mgpu {bq}/{bkv}/{st}: {type(e).__name__}: {str(e)[:160]}")
                continue
            row["mgpu"].append({"block_q": bq, "block_kv": bkv, "stages": st, "ms": m_ms,
                                "tflops": fl / m_ms / 1e9, "max_abs_diff": err})
            print(f"   mgpu {bq}/{bkv}/{st}: {m_ms:.3f} ms ({fl / m_ms / 1e9:.0f} TFLOP/s, "
                  f"x{c_ms / m_ms:.2f} of cuDNN's fwd), max |diff| {err:.3g}", flush=True)
        fl2 = 2 * fl * 3.5  # not causal, forward and backward
        dense = lambda q, kk, v: jnp.sum(jax.nn.dot_product_attention(
            q, kk, v, implementation="cudnn").astype(jnp.float32))
        d_ms = timed(jax.jit(jax.value_and_grad(dense, argnums=(0, 1, 2))), q, kk, v)
        row["cudnn_dense_fwd_bwd_ms"] = d_ms
        print(f"   not causal, fwd+bwd: cuDNN {d_ms:.3f} ms ({fl2 / d_ms / 1e9:.0f} TFLOP/s)")
        row["mgpu_dense"] = []
        for bq, bkv in ((64, 64), (64, 128), (128, 64)):
            config = mgpu.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=2,
                                       block_q_dkv=bq, block_kv_dkv=bkv, block_q_dq=bq,
                                       block_kv_dq=bkv)
            loss = lambda q, kk, v, c=config: jnp.sum(
                mgpu.attention(q, kk, v, c).astype(jnp.float32))
            try:
                m_ms = timed(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), qs, kk, v)
            except Exception as e:
                print(f"   mgpu dense {bq}/{bkv}: {type(e).__name__}: {str(e)[:160]}")
                continue
            row["mgpu_dense"].append({"block_q": bq, "block_kv": bkv, "fwd_bwd_ms": m_ms})
            print(f"   mgpu dense {bq}/{bkv}: fwd+bwd {m_ms:.3f} ms "
                  f"({fl2 / m_ms / 1e9:.0f} TFLOP/s, x{d_ms / m_ms:.2f} of cuDNN's)", flush=True)
        rows_out.append(row)
    results_json.write(args.out, shapes=rows_out)


if __name__ == "__main__":
    main()
