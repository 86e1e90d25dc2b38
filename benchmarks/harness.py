"""What the benchmark scripts share: variants interleaved over the same items (so a machine that
drifts during a run drifts for every variant alike), repeats with medians, the machine a figure
comes from, a readable table, and one JSON document as the last line of the output.

    from harness import interleaved, median, machine, table, emit

Nothing here knows about specdec; it times callables.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Callable


def interleaved(variants: dict[str, Callable], items: list, repeats: int, progress: bool = True) -> dict:
    """{variant: {item index: [result of each repeat]}}: every variant on every item, `repeats`
    times, the variants' order reversed on every other item and repeat (no variant always runs
    first, on a cold cache, or last, on a hot one)."""
    out: dict = {name: {i: [] for i in range(len(items))} for name in variants}
    names = list(variants)
    total, done, t0 = repeats * len(items) * len(names), 0, time.perf_counter()
    for rep in range(repeats):
        for i, item in enumerate(items):
            order = names if (rep + i) % 2 == 0 else names[::-1]
            for name in order:
                out[name][i].append(variants[name](item))
                done += 1
            if progress:
                left = (time.perf_counter() - t0) / done * (total - done)
                print(f"\r  {done}/{total} runs, ~{left / 60:.1f} min left   ", end="", flush=True,
                      file=__import__("sys").stderr)
    if progress:
        print(file=__import__("sys").stderr)
    return out


def median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def spread(xs) -> float:
    """Half the range of `xs` over its median: how far repeats of one figure stray (the resolution
    a ratio of two such figures has)."""
    xs = list(xs)
    m = median(xs)
    return (max(xs) - min(xs)) / 2 / m if xs and m else float("nan")


def machine(threads: int | None = None) -> dict:
    """The CPU, the threads used and the load when the figures were taken."""
    name = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and name in ("", platform.machine()):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    isa = "avx512_vnni" if "avx512_vnni" in flags else "avx2" if "avx2" in flags else "other"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cpu": name, "isa": isa, "amx": "amx_int8" in flags, "cores": os.cpu_count(), "threads": threads,
            "load": round(load, 2) if load is not None else None}


def table(rows: list[dict], columns: list[str]) -> str:
    """A plain-text table of `rows` (dicts) in `columns` order, floats to 2 decimals."""
    def cell(v):
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    for r in rows:
        lines.append("  ".join(cell(r.get(c, "")).ljust(w) for c, w in zip(columns, widths)))
    return "\n".join(lines)


def emit(result: dict) -> None:
    """The run's JSON document, as the last line of the output."""
    print(json.dumps(result))
