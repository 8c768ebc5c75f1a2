"""The decode step's Mosaic GPU kernel (`impl="mosaic"`) on a Hopper GPU: its errors
and speed next to the Triton kernel (`impl="pallas"`) and the XLA path.

    python experiments/check_mosaic_decode.py --out mosaic_decode.json
    python experiments/check_mosaic_decode.py --smoke   # toy sizes, interpret mode, CPU

For each shape (Qwen2.5-0.5B's heads at 64, 256 and 512 rows of 384 slots and 128
and 32 rows of 8,704; Qwen2.5-7B's at 64 rows of 384): random bf16 queries, new keys and
values and caches, rows starting at random slots below 128, the new token 37 slots
before the end. Each variant (the Mosaic GPU kernel at a few block sizes and buffer
depths, the Triton kernel at its default tiles, XLA) runs in try/except (a variant
that does not compile prints its error's first lines, and the next runs), then:

- errors: the largest difference of its attention output from the float32 XLA path
  (`err_f32`) and from the bf16 XLA path (`err_xla`), and of its updated key and
  value caches from the XLA path's (`cache_diff`, 0 when the new token is written
  as XLA writes it); non-finite outputs are counted (`nonfinite`);
- time: one jitted program runs the step on `--layers` cache pairs (each donated,
  so updated in place, the output feeding the next layer's queries, as a decode
  step's layers do); the median of `--repeats` timed calls after a warm-up, divided
  by the layers, is `us` per layer-step (XLA's small RoPE and cache-write fusions
  of the "mosaic" and "xla" variants included);
- bandwidth: `gbps` = bytes of the cache blocks the variant reads (the blocks
  holding each row's `[start, slot]`, at the variant's block size; XLA reads all
  slots) plus the new keys and values written, over `us`; `valid_gbps` counts the
  slots `[start, slot]` alone (the same bytes for every variant).

The Mosaic GPU variants include the fused one (`MosaicTiles.fused`: the cache written
by the kernel, one XLA fusion before it; " f" in the table) and one split over slots as
`slot_splits` chooses (`MosaicTiles.splits=0`, " s") or with 4 or 8 rows a program
(`MosaicTiles.row_group`, " r4", " r8"). Then the first compact
and the first padded Mosaic GPU variants (`MosaicTiles`), unfused and fused, run
again at the 0.5B shape with the new token at the cache's edges (slots 0, 63, 64, 65,
127 and the last) for their errors alone. A table is printed and everything written
to `--out` as JSON.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import results_json  # this folder is on the path when a script here runs

from jrl.kernels import decode_attention as da

SHAPES = {  # name: (B, N, K, H, S)
    "0.5B b64": (64, 14, 2, 64, 384),
    "0.5B b256": (256, 14, 2, 64, 384),
    "0.5B b512": (512, 14, 2, 64, 384),
    "0.5B b128 long": (128, 14, 2, 64, 8704),
    "0.5B b32 long": (32, 14, 2, 64, 8704),
    "7B b64": (64, 28, 4, 128, 384),
}
SMOKE_SHAPES = {"toy g7": (2, 14, 2, 64, 256), "toy 7B": (2, 8, 2, 128, 128)}
MOSAIC_TILES = [da.MosaicTiles(128, 2, compact=True), da.MosaicTiles(128, 3, compact=True),
                da.MosaicTiles(64, 3, compact=True),
                # Split over slots as the Triton kernel chooses (`slot_splits`; one part
                # at short caches and many rows).
                da.MosaicTiles(128, 2, compact=True, splits=0),
                # Several rows a program through one pipeline (short caches).
                da.MosaicTiles(128, 2, compact=True, row_group=4),
                da.MosaicTiles(128, 3, compact=True, row_group=8), da.MosaicTiles(128, 2)]
# The fused variant (`MosaicTiles.fused`: one XLA fusion before the kernel, the cache
# written by the kernel; 36 KiB more shared memory at H = 128 than the unfused one: a
# 128/3 would need 244 KiB there, past Hopper's 227).
FUSED_TILES = [da.MosaicTiles(128, 2, compact=True, fused=True),
               da.MosaicTiles(128, 2, fused=True)]


def variants(smoke: bool, specs=None, impls=("mosaic", "pallas", "xla")) -> dict:
    """name: (impl, tiles, block of cache slots read, None for all); `specs`: the Mosaic
    GPU tiles as `MosaicTiles.from_spec` strings instead of the lists above; `impls`:
    the implementations to keep."""
    if specs:
        tiles = [da.MosaicTiles.from_spec(spec) for spec in specs]
    else:
        tiles = (MOSAIC_TILES[:1] + MOSAIC_TILES[-2:] + FUSED_TILES[:1] + FUSED_TILES[-1:]
                 if smoke else MOSAIC_TILES + FUSED_TILES)
    out = {f"mosaic {t.block}/{t.stages}{' c' if t.compact else ''}{' f' if t.fused else ''}"
           f"{' s' if t.splits != 1 else ''}{f' r{t.row_group}' if t.row_group > 1 else ''}":
           ("mosaic", t, t.block) for t in tiles}
    out["pallas (default)"] = ("pallas", da.TILES, da.TILES.block)
    out["xla"] = ("xla", da.TILES, None)
    return {name: v for name, v in out.items() if v[0] in impls}


def inputs(b, n, k, h, s, slot, seed=0):
    keys = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(keys[0], (b, n, h), jnp.bfloat16)
    k_new, v_new = (jax.random.normal(key, (b, k, h), jnp.bfloat16) for key in keys[1:3])
    cache = [jax.random.normal(key, (b, k, s, h), jnp.bfloat16) for key in keys[3:5]]
    angles = jax.random.uniform(keys[5], (b, h // 2), maxval=1000.0)
    start = np.random.default_rng(seed).integers(0, min(128, slot + 1), b).astype(np.int32)
    return dict(q=q, k_new=k_new, v_new=v_new, sin=jnp.sin(angles), cos=jnp.cos(angles),
                k=cache[0], v=cache[1], start=jnp.asarray(start), slot=slot)


def call(x, impl, tiles, interpret, **overrides):
    x = {**x, **overrides}
    return da.append_and_attend(x["q"], x["k_new"], x["v_new"], x["sin"], x["cos"], x["k"],
                                x["v"], x["start"], jnp.int32(x["slot"]), impl=impl,
                                interpret=interpret, tiles=tiles)


def references(x):
    """The bf16 and the float32 XLA paths' results."""
    xla = jax.jit(functools.partial(call, impl="xla", tiles=da.TILES, interpret=False))
    f32 = {name: x[name].astype(jnp.float32) for name in ("q", "k_new", "v_new", "k", "v")}
    return xla(x), xla(x, **f32)


def errors(x, impl, tiles, interpret, refs) -> dict:
    """The variant against the float32 and the bf16 XLA paths (`refs`)."""
    run = jax.jit(functools.partial(call, impl=impl, tiles=tiles, interpret=interpret))
    got = jax.block_until_ready(run(x))
    want, exact = refs
    diff = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
    return dict(err_f32=diff(got[0], exact[0]), err_xla=diff(got[0], want[0]),
                cache_diff=max(diff(a, b) for a, b in zip(got[1:], want[1:], strict=True)),
                nonfinite=int(jnp.sum(~jnp.isfinite(got[0].astype(jnp.float32)))))


def timing(x, impl, tiles, interpret, layers, repeats) -> float:
    """Microseconds per layer-step: the median of `repeats` calls of a `layers`-step
    program over donated caches."""
    caches = [(x["k"] + i, x["v"] - i) for i in range(layers)]  # distinct buffers

    def program(caches, q):
        new = []
        for k, v in caches:
            q, k, v = call(x, impl, tiles, interpret, q=q, k=k, v=v)
            new.append((k, v))
        return new, q

    program = jax.jit(program, donate_argnums=0)
    caches, out = program(caches, x["q"])  # compile and warm up
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        caches, out = program(caches, x["q"])
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times) / layers


def bytes_moved(x, block) -> tuple[int, int]:
    """(bytes of the cache blocks read, at `block` slots (None: all) plus the new
    keys and values written; bytes of the valid slots alone plus the same writes)."""
    b, k, s, h = x["k"].shape
    start, slot = np.asarray(x["start"]), x["slot"]
    row = 2 * k * h * x["k"].dtype.itemsize  # one slot's key and value, all heads
    written = b * row
    valid = int(np.sum(slot + 1 - start)) * row + written
    if block is None:
        return b * s * row + written, valid
    blocks = slot // block + 1 - start // block
    return int(np.sum(blocks)) * block * row + written, valid


def short_error(e: Exception) -> str:
    lines = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()
    return " | ".join(lines[:6])[:1200]


def run_shape(name, shape, impls, args, interpret) -> list[dict]:
    b, n, k, h, s = shape
    x = inputs(b, n, k, h, s, slot=s - 37)
    refs = references(x)
    rows = []
    for variant, (impl, tiles, block) in impls.items():
        row = dict(shape=name, dims=dict(B=b, N=n, K=k, H=h, S=s), variant=variant,
                   slot=x["slot"])
        try:
            row |= errors(x, impl, tiles, interpret, refs)
            row["us"] = timing(x, impl, tiles, interpret, args.layers, args.repeats)
            moved, valid = bytes_moved(x, block)
            row["gbps"], row["valid_gbps"] = moved / row["us"] / 1e3, valid / row["us"] / 1e3
        except Exception as e:  # noqa: BLE001 (a variant that does not compile or run)
            row["error"] = short_error(e)
        rows.append(row)
        print_row(row)
    return rows


def print_row(row):
    if "error" in row:
        print(f"{row['shape']:15s} {row['variant']:17s} ERROR {row['error']}", flush=True)
        return
    print(f"{row['shape']:15s} {row['variant']:17s} {row.get('us', math.nan):9.2f} "
          f"{row.get('gbps', math.nan):8.1f} {row.get('valid_gbps', math.nan):8.1f} "
          f"{row['err_f32']:9.2e} {row['err_xla']:9.2e} {row['cache_diff']:9.2e} "
          f"{row['nonfinite']:4d}", flush=True)


def edges(impls, interpret, smoke) -> list[dict]:
    """The new token at the cache's edges, for the first compact and the first padded
    Mosaic GPU variants, unfused and fused."""
    b, n, k, h, s = (2, 14, 2, 64, 256) if smoke else SHAPES["0.5B b64"]
    chosen = {}
    for variant, (impl, tiles, _) in impls.items():
        if impl == "mosaic":
            chosen.setdefault((tiles.compact, tiles.fused), (variant, tiles))
    rows = []
    for variant, tiles in chosen.values():
        for slot in (0, 63, 64, 65, 127, s - 1):
            x = inputs(b, n, k, h, s, slot=slot, seed=slot)
            row = dict(shape=f"edge slot {slot}", variant=variant, slot=slot)
            try:
                row |= errors(x, "mosaic", tiles, interpret, references(x))
            except Exception as e:  # noqa: BLE001
                row["error"] = short_error(e)
            rows.append(row)
            print_row(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="toy sizes in interpret mode (runs on CPU)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--only", nargs="*", default=None, help="shape names to run")
    parser.add_argument("--tiles", nargs="*", default=None,
                        help="Mosaic GPU tiles to run instead of the default list, as "
                             "MosaicTiles.from_spec strings (e.g. 64,2,compact)")
    parser.add_argument("--impls", nargs="*", default=["mosaic", "pallas", "xla"],
                        choices=["mosaic", "pallas", "xla"])
    parser.add_argument("--no_edges", action="store_true",
                        help="skip the runs with the new token at the cache's edges")
    parser.add_argument("--out", default="mosaic_decode.json")
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.repeats = 2, 2
    interpret = args.smoke or jax.default_backend() != "gpu"
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    shapes = {k: v for k, v in shapes.items() if args.only is None or k in args.only}
    impls = variants(args.smoke, args.tiles, args.impls)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, interpret={interpret}")
    print(f"{'shape':15s} {'variant':17s} {'us/layer':>9s} {'GB/s':>8s} {'valid':>8s} "
          f"{'err_f32':>9s} {'err_xla':>9s} {'cache':>9s} {'nan':>4s}")
    rows = []
    for name, shape in shapes.items():
        rows += run_shape(name, shape, impls, args, interpret)
    if not args.no_edges:
        rows += edges(impls, interpret, args.smoke)
    results_json.write(args.out, args=vars(args), rows=rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
