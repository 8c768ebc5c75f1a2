"""A decode step's matmuls on Mosaic GPU: `x [M, K] @ W [K, N]` for the few rows a decode
step has (M <= 256), against XLA's (cuBLAS) dot. A prototype to decide whether the
decode layer's matmuls, at 24% of the HBM bandwidth in the sampler (docs/performance.md,
"Long responses", "Where the time goes"), can stream their weights faster in a kernel
of jrl's own.

    python experiments/skinny_matmul_mgpu.py [--rows 64 128 256] [--out results.json]
    python experiments/bench_rollout.py --batch-sizes 64 256 512 --no-hf --gemm cublas mosaic \
        [--mosaic_gemm "896x1152=64,1,64,4;4864x896=64,4,64,4"]

Each program of the grid `(N / tn, splits)` multiplies its `[M, tn]` block over its
`K / splits` slice of K: TMA copies of `[M, tk]` tiles of x and `[tk, tn]` tiles of W
into swizzled shared memory, `stages` deep, each step a wgmma into a float32
accumulator in registers. With one split it writes the block in x's dtype; with more,
float32 partial sums `[splits, M, N]` that XLA adds (as cuBLAS' split-K does with its
reduce kernel). Off a GPU it runs in Pallas' GPU interpret mode (the CPU checks below:
the kernel against XLA, and a small model's rollout with its decode projections on it).
`on_decode_projections` puts the model's decode-step projections on it while a program
is traced; `bench_rollout.py --gemm mosaic` times the sampler so.
Times are GPU kernel time (CUPTI; a split-K run's reduce included), the median of
`--reps` calls of `--layers` matmuls, each with weights of its own, per matmul (48
layers: 77 MB of the smallest weights, the output projection's, against the H200's 50
MB of L2, so most reads come from HBM). Wall-clock timing does not do here: a call of these kernels
is launch-bound (~20 us a matmul for XLA and the kernel alike, call 15d).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import types

import jax
import jax.numpy as jnp
import numpy as np
import results_json  # this folder is on the path when a script here runs
from jax.experimental import pallas as pl

from jrl.kernels import mosaic_backend
from jrl.rollout import sampler


def matmul(x, w, *, tn: int, splits: int = 1, tk: int = 64, stages: int = 4,
           interpret: bool | None = None):
    """`x @ w` (`[M, K] @ [K, N]`, 16-bit, M a multiple of 64) on Mosaic GPU."""
    mgpu = mosaic_backend.plgpu
    m, k = x.shape
    n = w.shape[1]
    if m % 64 or n % tn or k % (tk * splits):
        raise ValueError(f"M {m} (multiple of 64), N {n} (of tn {tn}), K {k} (of tk x "
                         f"splits = {tk * splits}) do not tile")
    k_steps = k // (tk * splits)
    out_dtype = x.dtype if splits == 1 else jnp.float32
    # As deep as shared memory holds (227 KiB on Hopper, less the output tile).
    per_stage = (m * tk + tk * tn) * jnp.dtype(x.dtype).itemsize
    stages = max(1, min(stages, (220 * 1024 - m * tn * jnp.dtype(out_dtype).itemsize)
                        // per_stage))
    itemsize = jnp.dtype(x.dtype).itemsize
    swizzle = mgpu.find_swizzle(tk * itemsize * 8)
    tiled = (mgpu.TilingTransform((8, swizzle // itemsize)), mgpu.SwizzleTransform(swizzle))
    out_item = jnp.dtype(out_dtype).itemsize
    out_swizzle = mgpu.find_swizzle(min(tn, 128 // out_item) * out_item * 8)
    out_tiled = (mgpu.TilingTransform((8, out_swizzle // out_item)),
                 mgpu.SwizzleTransform(out_swizzle))
    mode = mosaic_backend.interpret(force=bool(interpret))

    def kernel(x_gmem, w_gmem, out_gmem, out_smem):
        j, s = jax.lax.axis_index("n"), jax.lax.axis_index("s")
        k0 = s * (k_steps * tk)
        x_part = x_gmem.at[:, pl.ds(k0, k_steps * tk)]
        w_part = w_gmem.at[pl.ds(k0, k_steps * tk), pl.ds(j * tn, tn)]
        delay = int(k_steps > 1)
        specs = [mgpu.BlockSpec((m, tk), lambda i: (0, i), transforms=tiled,
                                delay_release=delay),
                 mgpu.BlockSpec((tk, tn), lambda i: (i, 0), transforms=tiled,
                                delay_release=delay)]

        def compute(acc_ref):
            def step(_, x_smem, w_smem):
                mgpu.wgmma(acc_ref, x_smem, w_smem)
                mgpu.wgmma_wait(delay)
            mgpu.emit_pipeline(step, grid=(k_steps,), in_specs=specs,
                               max_concurrent_steps=stages)(x_part, w_part)
            return acc_ref[...]

        acc = pl.run_scoped(compute, mgpu.ACC((m, tn), jnp.float32))
        out_smem[...] = acc.astype(out_dtype)
        mgpu.commit_smem()
        target = (out_gmem.at[:, pl.ds(j * tn, tn)] if splits == 1
                  else out_gmem.at[s, :, pl.ds(j * tn, tn)])
        mgpu.copy_smem_to_gmem(out_smem, target)
        mgpu.wait_smem_to_gmem(0)

    out_shape = (m, n) if splits == 1 else (splits, m, n)
    operands = jax.lax.optimization_barrier((x, w))
    out = mgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=(n // tn, splits), grid_names=("n", "s"),
        scratch_types=[mgpu.SMEM((m, tn), out_dtype, transforms=out_tiled)],
        compiler_params=mgpu.CompilerParams(approx_math=True), interpret=mode,
    )(*operands)
    return out if splits == 1 else jnp.sum(out, axis=0).astype(x.dtype)


def default_config(k: int, n: int) -> tuple[int, int, int, int]:
    """`(tn, splits, tk, stages)` for a `[K, N]` weight: 64-wide blocks of N, and K split
    (up to 4 ways) until there are a GPU's worth of programs."""
    tk, tn = 64, 64
    programs = n // tn
    splits = 1
    for s in (2, 4):
        if programs * splits >= 132 or (k // tk) % s:
            break
        splits = s
    return tn, splits, tk, 4


def _dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                 *, configs, max_rows):
    """`lax.dot_general` as a flax projection calls it, on `matmul` where it is a decode
    step's: no batch dimensions, the kernel's leading dimensions contracted with the
    input's trailing ones, at most `max_rows` rows, 16-bit operands, blocks that tile."""
    (lc, rc), (lb, rb) = dimension_numbers
    fallback = lambda: jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                           preferred_element_type=preferred_element_type)
    nc = len(lc)
    if (lb or rb or tuple(rc) != tuple(range(nc))
            or tuple(lc) != tuple(range(lhs.ndim - nc, lhs.ndim))
            or lhs.dtype != rhs.dtype or jnp.dtype(lhs.dtype).itemsize != 2):
        return fallback()
    rows = int(np.prod(lhs.shape[:lhs.ndim - nc]))
    k = int(np.prod(lhs.shape[lhs.ndim - nc:]))
    n = int(np.prod(rhs.shape[nc:]))
    tn, splits, tk, stages = configs.get((k, n)) or default_config(k, n)
    if rows > max_rows or n % tn or k % (tk * splits):
        return fallback()
    padded = -(-rows // 64) * 64
    x = jnp.pad(lhs.reshape(rows, k), ((0, padded - rows), (0, 0)))
    out = _jitted_matmul(tn, splits, tk, stages)(x, rhs.reshape(k, n))
    return out[:rows].reshape(*lhs.shape[:lhs.ndim - nc], *rhs.shape[nc:])


@functools.cache
def _jitted_matmul(tn, splits, tk, stages):
    """One jitted `matmul` a block configuration: the call sites of a program that share
    a shape lower (and run ptxas on) its kernel once."""
    return jax.jit(functools.partial(matmul, tn=tn, splits=splits, tk=tk, stages=stages))


@contextlib.contextmanager
def on_decode_projections(configs: dict | None = None, max_rows: int = 256):
    """While active, the projections jrl's model builds (`transformer._dense`) run their
    decode steps' matmuls (at most `max_rows` rows) on `matmul`: `configs` maps a
    weight's `(K, N)` to `(tn, splits, tk, stages)` (else `default_config`). Trace the
    program inside the context. For the benchmark only: it swaps the `nn` the transformer
    module sees for one whose `DenseGeneral` takes this dot."""
    from jrl.models import transformer

    dot = functools.partial(_dot_general, configs=dict(configs or {}), max_rows=max_rows)
    linen = transformer.nn
    patched = types.SimpleNamespace(**{name: getattr(linen, name) for name in dir(linen)
                                       if not name.startswith("__")})
    patched.DenseGeneral = functools.partial(linen.DenseGeneral, dot_general=dot)
    transformer.nn = patched
    try:
        yield
    finally:
        transformer.nn = linen


# The 0.5B decode layer's four matmuls (fused qkv and gate/up, as the sampler runs them).
SHAPES = {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728), "down": (4864, 896)}
CONFIGS = {  # (tn, splits, tk, stages) tried a shape; stages capped by shared memory
    "qkv": [(64, 1, 64, 4), (64, 2, 64, 4), (64, 7, 64, 4), (128, 1, 64, 4),
            (64, 1, 128, 4)],
    "o": [(64, 1, 64, 4), (64, 2, 64, 4), (64, 7, 64, 4), (64, 1, 128, 4)],
    "gate_up": [(128, 1, 64, 4), (64, 1, 64, 6), (128, 1, 64, 6), (256, 1, 64, 4)],
    "down": [(64, 2, 64, 4), (64, 4, 64, 4), (64, 19, 64, 4), (128, 4, 64, 4),
             (64, 2, 128, 4), (128, 2, 64, 6)],
}


def _kernel_ms(fn, *args, reps: int) -> float:
    """Median over `reps` calls of the GPU time of `fn`'s kernels (CUPTI, through Mosaic
    GPU's profiler): launch gaps and the host excluded."""
    from jax.experimental.mosaic.gpu import profiler

    jax.block_until_ready(fn(*args))
    _, times = profiler.measure(fn, iterations=reps)(*args)
    if times is None:
        raise RuntimeError("the profiler saw no kernels")
    return float(np.median(times))


def _over_layers(mm, x, weights):
    """One compiled call of `mm` with each layer's own weights, with the sampler's XLA
    options (cuBLAS for every dot, `sampler.compiler_options`); a `Compiled`, which the
    profiler runs as it is."""
    mm = jax.jit(mm)  # one lowering (and one ptxas run) for every layer's call (a jitted
    # `mm`, as `_jitted_matmul`'s, keeps its own)
    fn = jax.jit(lambda x, *ws: [mm(x, w) for w in ws])
    return fn.lower(x, *weights).compile(sampler.compiler_options(sampler.SamplingConfig()))


def bench(rows, layers: int, reps: int, hbm_gbps: float):
    results = []
    for name, (k, n) in SHAPES.items():
        keys = jax.random.split(jax.random.key(0), layers + 1)
        ws = [(jax.random.normal(key, (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
              for key in keys[1:]]
        for m in rows:
            x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
            ref = jnp.dot(x.astype(jnp.float32), ws[0].astype(jnp.float32))

            floor_us = k * n * 2 / hbm_gbps / 1e3
            xla_us = _kernel_ms(_over_layers(jnp.dot, x, ws), x, *ws, reps=reps) * 1e3 / layers
            row = {"shape": name, "m": m, "k": k, "n": n, "xla_us": xla_us,
                   "floor_us": floor_us, "kernels": {}}
            print(f"{name:8} M {m:4} K {k:5} N {n:5}: XLA {xla_us:7.2f} us "
                  f"({floor_us / xla_us:5.1%} of HBM)", flush=True)
            for tn, splits, tk, stages in CONFIGS[name]:
                label = f"tn{tn} s{splits} tk{tk} st{stages}"
                mm = _jitted_matmul(tn, splits, tk, stages)  # checked and timed: one lowering
                try:
                    got = mm(x, ws[0]).astype(jnp.float32)
                    err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
                    us = _kernel_ms(_over_layers(mm, x, ws), x, *ws, reps=reps) * 1e3 / layers
                except Exception as e:  # a tile that does not fit: report and go on
                    print(f"    {label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    row["kernels"][label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    continue
                row["kernels"][label] = {"us": us, "rel_err": err}
                print(f"    {label}: {us:7.2f} us ({floor_us / us:5.1%} of HBM, "
                      f"{xla_us / us:4.2f}x XLA), max rel err {err:.1e}", flush=True)
            results.append(row)
    return results


def check_interpret():
    """The kernel in Pallas' GPU interpret mode against XLA, on the CPU."""
    rng = np.random.default_rng(0)
    for (m, k, n), (tn, splits, tk, stages) in itertools.product(
            [(64, 256, 128)], [(64, 1, 64, 2), (64, 2, 64, 2), (128, 4, 64, 2)]):
        x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
        w = jnp.asarray(rng.normal(size=(k, n)), jnp.bfloat16)
        got = matmul(x, w, tn=tn, splits=splits, tk=tk, stages=stages, interpret=True)
        ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
        print(f"interpret M {m} K {k} N {n} tn {tn} splits {splits}: max rel err {err:.1e}")
        assert err < 2e-2, err


def check_decode_interpret(new_tokens: int = 3):
    """A small bf16 model's sampled rollout (one key) with its decode projections on
    `matmul` (Pallas' GPU interpret mode) against the same rollout on XLA's dot, on the
    CPU: the same tokens, and their log-probs close."""
    from jrl.models.config import ModelConfig
    from jrl.models.transformer import init_params
    from jrl.rl import step

    config = ModelConfig.preset("tiny", vocab_size=64, hidden_size=128, intermediate_size=256,
                                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                                dtype="bfloat16", param_dtype="bfloat16")
    params = init_params(config, jax.random.key(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 64, (4, 8)), jnp.int32)
    mask = jnp.ones_like(ids)
    sampling = sampler.SamplingConfig(max_new_tokens=new_tokens, ignore_stop=True)

    def run():  # a function of its own each time: jit's cache would reuse the first trace
        def generate(params, ids, mask):
            sampler_config, params = step.sampling_params(params, config)
            out = sampler.generate(params, ids, mask, jax.random.key(1), sampling=sampling,
                                   config=sampler_config)
            return out.responses, out.rollout_log_probs
        return jax.jit(generate)(params, ids, mask)

    want = run()
    with on_decode_projections(max_rows=256):
        got = run()
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    err = float(jnp.max(jnp.abs(got[1] - want[1])))
    print(f"decode on the kernel (interpret): the same {new_tokens} tokens a row, "
          f"log-probs within {err:.1e}")
    assert err < 5e-2, err


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--hbm_gbps", type=float, default=4800.0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        check_interpret()
        check_decode_interpret()
        return
    print(jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    results = bench(args.rows, args.layers, args.reps, args.hbm_gbps)
    results_json.write(args.out, results=results)


if __name__ == "__main__":
    main()
