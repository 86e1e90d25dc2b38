"""Side-by-side benchmark of decoders on task sets (`specdec bench`).

Every runner (specdec with each method, and the peers of `peers.py`) runs on the same
prompts and settings in one process, interleaved per prompt (prompt 1: none, ngram, ...,
hf, llamacpp; prompt 2: ...), so machine drift hits all of them alike. Each (prompt,
runner) pair runs `repeats` times; per category a runner's speed is total new tokens /
total wall seconds (prefill + decode, one `generate` call each) per repeat, and the median
over repeats is reported. For specdec runners the decode-only speed (prefill excluded, which
is the same work for every method and, on a CPU with long prompts, a large share of the
wall time) is reported too.

Also per runner: whether its greedy outputs equal specdec `none` token for token (share
of prompts), acceptance figures (specdec runners only: peers do not report them), and
memory: the process's peak resident memory while the runner ran, and the most it grew
above its level just before a call (the runner's working memory: KV cache, activations).
specdec's runners live in this process, so their peak includes every model it loaded; a peer
runs in a process of its own (peers.py) and reports that process's peak.

A runner that cannot be built is reported as skipped with the reason; one that raises is
reported as failed with the error and not called again; the rest of the benchmark goes on.
This module does the running and the arithmetic; `report.py` writes tables and plots.
"""

from __future__ import annotations

import os
import platform
import statistics
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch

from ..metrics import summarize
from .tasks import Task


def category_speedups(categories: list[str], times: dict[str, dict[int, list[float]]], base: str,
                      variants: list[str]) -> dict[str, dict[str, float]]:
    """Per category of the prompts (categories[i]: prompt i's) and for "all": the base variant's
    time over each variant's, each prompt's time the median of its repeats, summed over the
    category's prompts (times[variant][i]: seconds of prompt i's runs). For the benchmarks that
    time whole `generate` calls of several drafter variants against plain decoding."""
    table = {}
    for c in sorted(set(categories)) + ["all"]:
        idx = [i for i, ci in enumerate(categories) if c == "all" or ci == c]
        total = sum(statistics.median(times[base][i]) for i in idx)
        table[c] = {v: round(total / sum(statistics.median(times[v][i]) for i in idx), 3) for v in variants}
    return table


@dataclass
class Runner:
    name: str
    kind: str  # "specdec" or "peer"
    call: Callable | None  # (ids, params) -> (new token ids, GenerationResult or None)
    error: str | None = None  # set: skipped with this reason
    # () -> (peak resident bytes, growth) of the last call, for a runner in its own process (a peer)
    memory: Callable | None = None


def machine_info(threads: int) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": threads, "torch": torch.__version__,
            "python": platform.python_version()}


def rss_bytes() -> int:
    """Resident memory of this process (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _hwm_bytes() -> int:
    """The kernel's high-water mark of this process's resident memory (Linux VmHWM; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _reset_hwm() -> bool:
    """Restart the high-water mark at the current resident memory (Linux: /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _hwm_bytes() > 0
    except OSError:
        return False


class PeakMemory:
    """Peak resident memory while active: `with pm: ...` then pm.peak. On Linux the kernel's own
    high-water mark (reset on entry), so nothing runs beside the measured code; elsewhere a thread
    samples RSS every `interval` seconds (which costs the measured code a little: on two cores a
    thread waking every 5 ms slowed decoding steps)."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = None
        self._kernel = False

    def __enter__(self):
        self.peak = rss_bytes()
        self._kernel = _reset_hwm()
        if not self._kernel:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def _loop(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        if self._kernel:
            self.peak = max(self.peak, _hwm_bytes())
        else:
            self._stop.set()
            self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def run(runners: list[Runner], tasks: list[Task], encoded: list[list[int]], params, repeats: int,
        quiet: bool = False) -> dict:
    """Returns per-runner, per-category results (see the module docstring)."""
    from tqdm import tqdm

    from ..drafters.suffix import forget_shared

    names = [r.name for r in runners]
    status = {r.name: ("skipped: " + r.error) if r.error else "ok" for r in runners}
    live = [r for r in runners if not r.error]
    # per runner, category, repeat: [new tokens, wall seconds, decode seconds (specdec only)]
    totals = {n: defaultdict(lambda: [[0, 0.0, 0.0] for _ in range(repeats)]) for n in names}
    stats = {n: defaultdict(list) for n in names}
    outputs: dict[str, dict[int, list[int]]] = {n: {} for n in names}
    peak = {n: 0 for n in names}
    grow = {n: 0 for n in names}
    bar = tqdm(total=repeats * len(tasks) * len(live), desc="bench", unit="run", disable=quiet, dynamic_ncols=True)
    pm = PeakMemory()
    for rep in range(repeats):
        for i, (task, ids) in enumerate(zip(tasks, encoded)):
            for r in live:
                if status[r.name] != "ok":
                    bar.update(1)
                    continue
                forget_shared()  # timed as a newcomer: no suffix drafts from this prompt's earlier answers
                before = rss_bytes()
                try:
                    with pm:
                        t0 = time.perf_counter()
                        tokens, res = r.call(ids, params)
                        dt = time.perf_counter() - t0
                except Exception as e:  # a failing runner is marked, the others go on
                    status[r.name] = f"failed on {task.task_id}: {type(e).__name__}: {e}"
                    bar.update(1)
                    continue
                call_peak, call_grow = r.memory() if r.memory is not None else (pm.peak, pm.peak - before)
                peak[r.name] = max(peak[r.name], call_peak)
                grow[r.name] = max(grow[r.name], call_grow)
                acc = totals[r.name][task.category][rep]
                acc[0] += len(tokens)
                acc[1] += dt
                if res is not None:
                    acc[2] += res.stats.decode_s
                if rep == 0:
                    outputs[r.name][i] = tokens
                    if res is not None:
                        stats[r.name][task.category].append(res)
                bar.update(1)
    bar.close()

    cats = sorted({t.category for t in tasks})
    table: dict[str, dict] = {}
    ref = outputs.get("none", {})
    for r in runners:
        n = r.name
        table[n] = {}
        for c in cats + ["all"]:
            idx = [i for i, t in enumerate(tasks) if c == "all" or t.category == c]
            row = {"prompts": len(idx), "status": status[n]}
            table[n][c] = row
            if status[n] != "ok":
                continue
            per_rep, dec_rep = [], []
            for rep in range(repeats):
                keys = cats if c == "all" else [c]
                tok = sum(totals[n][k][rep][0] for k in keys)
                sec = sum(totals[n][k][rep][1] for k in keys)
                dec = sum(totals[n][k][rep][2] for k in keys)
                per_rep.append(tok / sec if sec else 0.0)
                dec_rep.append((tok - len(idx)) / dec if dec else 0.0)  # the prefill's token excluded
            row["tokens_per_s"] = statistics.median(per_rep)
            if r.kind == "specdec":
                row["decode_tokens_per_s"] = statistics.median(dec_rep)
            row["new_tokens"] = sum(len(outputs[n][i]) for i in idx)
            if ref:
                row["equal_to_none"] = f"{sum(outputs[n][i] == ref.get(i) for i in idx)}/{len(idx)}"
            row["peak_rss_mb"] = peak[n] / 2**20
            row["working_mb"] = grow[n] / 2**20
            if r.kind == "specdec":
                s = summarize([x for k in cats for x in stats[n][k]] if c == "all" else stats[n][c])
                for key in ("alpha", "tau", "acceptance_by_pos", "draft_s", "verify_s", "draft_cost"):
                    row[key] = s[key]
    for base_name, field, key in (("none", "tokens_per_s", "speedup_vs_none"), ("hf", "tokens_per_s", "speedup_vs_hf"),
                                  ("none", "decode_tokens_per_s", "decode_speedup_vs_none")):
        if base_name not in table or status[base_name] != "ok":
            continue
        for n in names:
            for c, row in table[n].items():
                base = table[base_name][c].get(field)
                if field in row and base:
                    row[key] = row[field] / base
    return {"runners": names, "kinds": {r.name: r.kind for r in runners}, "status": status,
            "categories": cats + ["all"], "table": table}
