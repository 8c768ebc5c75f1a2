"""What cuDNN's packed attention costs against its padded causal call, by the bound on
segments a row (`packing.MAX_SEGMENTS`) and the segments the rows really hold.

    python experiments/bench_packed_attention.py [--out results.json]

For each layout (rows x slots, the segment lengths of every row) it times one layer's
attention at the Qwen2.5-0.5B heads (14 query, 2 key/value, 64 wide, bf16), forward
alone and forward with backward (`value_and_grad` of the summed output), as
`packed_attention.attend(..., "cudnn")` runs it with a bound M of segments a row, and,
where every segment has one length, as cuDNN's padded causal call on the same tokens
(`jax.nn.dot_product_attention(is_causal=True)`, one sequence a row): what the
same tokens cost unpacked. Times are wall-clock medians, so dispatch weighs on the
smallest rows. TFLOP/s counts the causal half of each segment's QK^T and PV.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import results_json  # this folder is on the path when a script here runs

from jrl.kernels import packed_attention

N, K, H = 14, 2, 64


def timed(fn, *args, reps=10) -> float:
    """Median wall-clock milliseconds of `reps` calls of `fn(*args)` after one warm-up."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def layout(rows: int, length: int, lengths: list[list[int]]) -> jax.Array:
    """Segment ids, int `[rows, length]`: 1, 2, ... for each row's segments of
    `lengths[row]` tokens, 0 in the slots after them."""
    seg = np.zeros((rows, length), np.int32)
    for r in range(rows):
        at, sid = 0, 1
        for n in lengths[r]:
            seg[r, at:at + n] = sid
            at, sid = at + n, sid + 1
    return jnp.asarray(seg)


def flops(rows: int, lengths: list[int], backward: bool) -> float:
    fwd = rows * sum(4 * n * n / 2 * N * H for n in lengths)
    return fwd * (3.5 if backward else 1.0)


def measure(rows, length, lengths, bounds, reps):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(rows, length, N, H)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(rows, length, K, H)), jnp.bfloat16)
            for _ in range(2))
    seg = layout(rows, length, [lengths] * rows)
    out = []

    def both(name, attention):
        fwd = jax.jit(attention)
        loss = lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32))
        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        f_ms, g_ms = timed(fwd, q, k, v, reps=reps), timed(grad, q, k, v, reps=reps)
        row = {"rows": rows, "length": length, "segments": lengths, "call": name,
               "fwd_ms": f_ms, "fwd_bwd_ms": g_ms,
               "fwd_tflops": flops(rows, lengths, False) / f_ms / 1e9,
               "fwd_bwd_tflops": flops(rows, lengths, True) / g_ms / 1e9}
        print(f"{rows:>3} x {length:<6} {str(lengths):<28} {name:<14} fwd {f_ms:7.3f} ms "
              f"({row['fwd_tflops']:5.0f} TFLOP/s)  fwd+bwd {g_ms:7.3f} ms "
              f"({row['fwd_bwd_tflops']:5.0f})", flush=True)
        out.append(row)

    for m in bounds:
        segments = packed_attention.segments(seg, m)
        both(f"packed M={m}",
             lambda q, k, v, s=segments: packed_attention.attend(q, k, v, s, "cudnn"))
    if len(set(lengths)) == 1:
        n = lengths[0]
        as_rows = lambda x: x[:, :n * len(lengths)].reshape(rows * len(lengths), n,
                                                             *x.shape[2:])
        both("padded causal", lambda q, k, v: jax.nn.dot_product_attention(
            as_rows(q), as_rows(k), as_rows(v), is_causal=True, implementation="cudnn"))
    return out


LAYOUTS = [  # (rows, slots, segment lengths of each row, bounds M)
    (1, 8704, [8704], (1, 2, 4, 8)),
    (2, 8704, [8704], (1, 8)),
    (1, 8704, [4352, 4352], (2, 4, 8)),
    (2, 8704, [4352, 4352], (2, 8)),
    (1, 17408, [4352] * 4, (4, 8, 16)),
    (1, 8704, [2176] * 4, (4, 8)),
    (1, 8704, [5000, 2000, 1000, 704], (4, 8)),
    (4, 384, [384], (1, 8)),
    (4, 384, [128, 128, 128], (3, 8)),
]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    print(jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    results = []
    for rows, length, lengths, bounds in LAYOUTS:
        results += measure(rows, length, lengths, bounds, args.reps)
    results_json.write(args.out, results=results)


if __name__ == "__main__":
    main()
