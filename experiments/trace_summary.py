"""Where a traced program's device time goes: the GPU kernels of a `jax.profiler` trace.

    python experiments/trace_summary.py TRACE_DIR [--top 25]

Reads the trace-viewer file (`*.trace.json.gz`) that `jax.profiler.trace(dir)`
writes, keeps the events of the GPU devices, and prints
the device time by kernel, by XLA op, by XLA module and by the jitted program
each kernel ran in (total milliseconds, calls, share). The benchmark scripts
take `--trace_dir` to write such a trace of one extra run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import gzip
import json
import os
import re


@contextlib.contextmanager
def maybe_trace(trace_dir: str | None):
    """`jax.profiler.trace(trace_dir)`, or nothing when None."""
    if not trace_dir:
        yield
        return
    import jax

    with jax.profiler.trace(trace_dir):
        yield


def _gpu_threads(events) -> dict:
    """{(pid, tid): thread name} of the threads of the trace's GPU devices."""
    pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and re.search(r"/device:GPU|GPU:\d", str(e.get("args", {}).get("name", "")))}
    return {(e["pid"], e["tid"]): str(e.get("args", {}).get("name", ""))
            for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
            and e["pid"] in pids}


def _load(trace_dir: str) -> tuple[str, list, dict]:
    """(path, events, GPU threads) of the newest trace-viewer file under `trace_dir`."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}")
    with gzip.open(files[-1], "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return files[-1], events, _gpu_threads(events)


def _table(title: str, totals: dict, top: int) -> list:
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    total = sum(ms for ms, _ in totals.values())
    print(f"\n{title}: {total:.1f} ms in {sum(c for _, c in totals.values())} events")
    print("| name | ms | calls | share |\n|---|---|---|---|")
    for name, (ms, calls) in ranked[:top]:
        print(f"| {name[:70]} | {ms:.2f} | {calls} | {100 * ms / max(total, 1e-9):.1f}% |")
    return [(name, ms, calls) for name, (ms, calls) in ranked]


def summarize(trace_dir: str, top: int = 25, show_args: int = 0,
              program: str | None = None) -> dict:
    """Prints and returns the device time by kernel, by XLA op and by XLA module.

    A GPU device's trace has one thread per CUDA stream (the kernels, named as
    compiled) and the lines "XLA Ops" and "XLA Modules" (the same time, attributed
    to HLO instructions and to programs); the kernels' time is also summed by the
    HLO op each ran for. `program` (a regex) keeps only the kernels of the jitted
    programs it matches (not applied to `sequence`)."""
    path, events, threads = _load(trace_dir)
    examples = {}
    kinds = {"kernels": collections.defaultdict(lambda: [0.0, 0]),
             "XLA Ops": collections.defaultdict(lambda: [0.0, 0]),
             "XLA Modules": collections.defaultdict(lambda: [0.0, 0]),
             "kernels by program": collections.defaultdict(lambda: [0.0, 0]),
             "kernels by HLO op": collections.defaultdict(lambda: [0.0, 0])}
    for e in events:
        thread = threads.get((e.get("pid"), e.get("tid")))
        if e.get("ph") != "X" or thread is None:
            continue
        kind = thread if thread in kinds else ("kernels" if thread.startswith("Stream") else None)
        if kind is None:
            continue
        module = e.get("args", {}).get("hlo_module", "?")
        if program and not (kind == "kernels" and re.search(program, module)):
            continue
        entry = kinds[kind][e.get("name", "?")]
        entry[0] += float(e.get("dur", 0.0)) / 1e3
        entry[1] += 1
        if kind == "kernels":  # the jitted program each kernel ran in
            for table, key in (("kernels by program", module),
                               ("kernels by HLO op", e.get("args", {}).get("hlo_op", "?"))):
                entry = kinds[table][key]
                entry[0] += float(e.get("dur", 0.0)) / 1e3
                entry[1] += 1
        examples.setdefault(e.get("name", "?"), e.get("args", {}))
    print(f"trace {path}; GPU threads: {sorted(set(threads.values()))[:12]}")
    tables = {kind: _table(kind, totals, 8 if kind == "kernels by program" else top)
              for kind, totals in kinds.items() if totals}
    if show_args:
        print("\nan event of each of the top kernels, with the trace's arguments:")
        for name, _, _ in tables.get("kernels", [])[:show_args]:
            print(f"- {name[:60]}: {json.dumps(examples[name])[:900]}")
    return tables


def _kernels(events, threads) -> list:
    """The trace's GPU kernels (the events on its devices' CUDA streams), by start time."""
    return sorted((e for e in events if e.get("ph") == "X"
                   and threads.get((e.get("pid"), e.get("tid")), "").startswith("Stream")),
                  key=lambda e: float(e.get("ts", 0.0)))


def sequence(trace_dir: str, anchor: str, skip: int = 100, count: int = 2) -> list:
    """Prints the kernels that ran, in order, from the `skip`-th kernel named `anchor`
    through `count` more of them (e.g. one decode step's layers between two calls of
    the attention kernel), with each kernel's duration and HLO op."""
    kernels = _kernels(*_load(trace_dir)[1:])
    hits = [i for i, e in enumerate(kernels) if e.get("name") == anchor]
    if len(hits) <= skip + count:
        raise ValueError(f"{len(hits)} kernels named {anchor!r}; need more than {skip + count}")
    rows = []
    print(f"\nkernels from {anchor!r} #{skip} to #{skip + count}:")
    print("| # | kernel | us | hlo op |\n|---|---|---|---|")
    for n, e in enumerate(kernels[hits[skip]:hits[skip + count]]):
        args = e.get("args", {})
        op = args.get("hlo_op", args.get("long_name", ""))
        rows.append((e.get("name"), float(e.get("dur", 0.0)), op))
        name, us = e.get("name", "?")[:60], float(e.get("dur", 0.0))
        print(f"| {n} | {name} | {us:.1f} | {str(op)[:50]} |")
    print(f"total {sum(r[1] for r in rows):.1f} us")
    return rows


def busy(trace_dir: str, program: str | None = None) -> dict:
    """Prints how much of the span of the GPU's kernels (those of the jitted programs
    matching `program`, or all) the kernels fill, and the idle time between
    consecutive kernels by gap length: short gaps are launch latency, long ones the
    host (a while loop's condition read back, a host round trip)."""
    kernels = [(float(e.get("ts", 0.0)), float(e.get("dur", 0.0)))
               for e in _kernels(*_load(trace_dir)[1:])
               if not program or re.search(program, e.get("args", {}).get("hlo_module", ""))]
    if not kernels:
        print(f"\nno GPU kernels of programs matching {program!r} in the trace")
        return {}
    edges = (0.0, 2.0, 5.0, 20.0, 100.0, float("inf"))  # microseconds
    gaps = [[0, 0.0] for _ in edges[1:]]
    end = kernels[0][0]
    for start, dur in kernels:
        gap = start - end
        if gap > 0:
            bucket = next(i for i, hi in enumerate(edges[1:]) if gap < hi)
            gaps[bucket][0] += 1
            gaps[bucket][1] += gap
        end = max(end, start + dur)
    span = end - kernels[0][0]
    filled = sum(d for _, d in kernels)
    print(f"\nkernels {len(kernels)}: span {span / 1e3:.2f} ms, kernel time {filled / 1e3:.2f} "
          f"ms ({100 * filled / max(span, 1e-9):.1f}% of the span)")
    print("| gap, us | gaps | idle ms | of the span |\n|---|---|---|---|")
    for (count, total), lo, hi in zip(gaps, edges, edges[1:], strict=False):
        print(f"| {lo:g}-{hi:g} | {count} | {total / 1e3:.2f} | {100 * total / span:.1f}% |")
    return {"span_ms": span / 1e3, "kernel_ms": filled / 1e3, "kernels": len(kernels),
            "gaps": [(lo, count, total / 1e3)
                     for (count, total), lo in zip(gaps, edges[:-1], strict=True)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace_dir")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--show_args", type=int, default=0,
                        help="print the arguments of an event of the N top kernels")
    parser.add_argument("--program", default=None,
                        help="only the kernels of jitted programs matching this regex")
    parser.add_argument("--anchor", default=None,
                        help="also print the kernels in order between calls of this kernel")
    parser.add_argument("--skip", type=int, default=100, help="start at this --anchor call")
    parser.add_argument("--count", type=int, default=2, help="--anchor calls to span")
    parser.add_argument("--busy", action="store_true",
                        help="also print the share of the kernels' span they fill, and the gaps")
    args = parser.parse_args()
    summarize(args.trace_dir, args.top, args.show_args, args.program)
    if args.busy:
        busy(args.trace_dir, args.program)
    if args.anchor:
        sequence(args.trace_dir, args.anchor, args.skip, args.count)


if __name__ == "__main__":
    main()
