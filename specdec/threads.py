"""How many CPU threads decoding uses: the cores other processes leave free, re-checked while decoding.

A decode step is a few hundred small parallel regions (one per matrix), each ending in a
barrier. When another process wants a core, the OpenMP thread that waits at the barrier spins
while the thread it waits for is descheduled, and a step that took 10 ms takes hundreds (on a
2-core machine beside two busy loops, plain decoding fell from ~100 to under 1 token/s). The
spin is long: libgomp's 300000 PAUSE instructions take ~10 ms on a Sapphire Rapids Xeon, so a
thread sharing its core even part of the time stalls the step far more than the time it loses.
One thread less than the busy cores avoids the barrier stalls entirely; the cost is the idle
speed-up of the extra threads, which only pays while their cores are free.

So unless the user fixed the count (`--threads`, or OMP_NUM_THREADS), `ThreadGovernor` sets
torch's thread count from the CPU time other processes used on this process's allowed cores
(/proc/stat minus this process's own time) over the last interval: at start-up (the interval
spent importing and loading) and again every `interval` seconds of decoding (`tick`, which the
decode loop calls once per step; it costs a clock read between checks). A core counts as free
only while others use less than FREE_BELOW of it. Thread count does not change results on
specdec's kernels (each output row is summed by one thread), so switching between steps is safe.

The row-stable kernels run on their own pool instead (rowstable.cpp, KernelPool), whose caller
never waits for a thread the OS has not run: beside busy processes every thread works when it
runs, so while the governor runs they take every allowed core (`use_kernel_pool`; 2 cores beside
two busy loops, plain decoding of the default model: 91 tokens/s on two such threads, 73 on one,
35 on two OpenMP threads), and the governor's count is torch's own OpenMP work's.

Knows nothing about models.
"""

from __future__ import annotations

import os
import time
from typing import Callable

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
#: a core counts as free for a decoding thread while other processes use less than this share of
#: it. Two threads beat one beside others' share c only while (1 - c) x the 2-thread speed-up
#: (1.6x on the default model, Zen 4: benchmarks.md) exceeds 1, c < ~0.38 even without the stalls
#: above, which make a shared core cost far more than its lost time (was 0.5: a core half used by
#: others counted as free)
FREE_BELOW = 0.25


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def read_cpu_jiffies(cpus: list[int], text: str | None = None) -> tuple[int, int] | None:
    """(busy, total) clock ticks summed over `cpus` from /proc/stat (iowait counts as idle);
    None where /proc/stat is not readable (not Linux)."""
    if text is None:
        try:
            with open("/proc/stat") as f:
                text = f.read()
        except OSError:
            return None
    want = {f"cpu{c}" for c in cpus}
    busy = total = 0
    for line in text.splitlines():
        parts = line.split()
        if not parts or parts[0] not in want:
            continue
        vals = [int(v) for v in parts[1:9]]  # user nice system idle iowait irq softirq steal
        total += sum(vals)
        busy += sum(vals) - vals[3] - vals[4]
    return (busy, total) if total else None


def own_cpu_seconds() -> float:
    """CPU seconds this process used so far (all its threads)."""
    t = os.times()
    return t.user + t.system


def others_busy_cores(before: tuple[int, int], after: tuple[int, int], own_s: float, ncpus: int) -> float | None:
    """How many cores other processes kept busy between two /proc/stat readings, on average:
    (busy ticks - this process's own CPU time) / elapsed. None if too little time passed to tell
    (under 5 ticks a CPU)."""
    busy, total = after[0] - before[0], after[1] - before[1]
    if total < 5 * ncpus:
        return None
    wall_s = total / ncpus / CLOCK_TICKS
    return max(0.0, (busy / CLOCK_TICKS - own_s) / wall_s)


def choose_threads(cores: int, others: float) -> int:
    """Threads for `cores` allowed cores when other processes keep `others` cores busy: the cores
    they leave free, a core counting as free while they use less than FREE_BELOW of it; at least 1."""
    return max(1, min(cores, int(cores - others + FREE_BELOW)))


class ThreadGovernor:
    """Keeps torch's thread count at the free cores (`choose_threads`), re-measured every `interval`
    seconds at most (see the module docstring). `set_threads` is torch.set_num_threads unless a test
    passes its own; `sample` reads (busy, total) ticks and `own` this process's CPU seconds."""

    def __init__(self, interval: float = 0.5, set_threads=None, sample=None, own=own_cpu_seconds,
                 cpus: list[int] | None = None, clock=time.monotonic) -> None:
        self.cpus = cpus if cpus is not None else allowed_cpus()
        self.interval, self.clock, self.own = interval, clock, own
        self.sample = sample if sample is not None else (lambda: read_cpu_jiffies(self.cpus))
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self.set_threads = set_threads
        self.threads: int | None = None  # last count set
        self.changes = 0
        self._mark()

    def _mark(self) -> None:
        self._t, self._stat, self._own = self.clock(), self.sample(), self.own()

    def adjust(self) -> int | None:
        """Measure the interval since the last mark, set the thread count, start a new interval.
        Returns the count set (None when nothing could be measured)."""
        stat, own = self.sample(), self.own()
        if stat is None or self._stat is None:
            return None
        others = others_busy_cores(self._stat, stat, own - self._own, len(self.cpus))
        if others is None:
            return None  # too short to tell: keep measuring from the same mark
        n = choose_threads(len(self.cpus), others)
        if n != self.threads:
            self.set_threads(n)
            self.changes += self.threads is not None
            self.threads = n
        self._mark()
        return n

    def tick(self) -> None:
        """Once per decode step: re-measure when `interval` seconds have passed."""
        if self.clock() - self._t >= self.interval:
            self.adjust()


_governor: ThreadGovernor | None = None
#: sets the threads of the kernels' own pool (0: torch's count); registered when they load
_kernel_threads: Callable[[int], None] | None = None


def _pool_threads() -> None:
    """The kernels' pool takes every allowed core while the governor runs, else torch's count
    (--threads or OMP_NUM_THREADS: the user's)."""
    if _kernel_threads is not None:
        _kernel_threads(len(_governor.cpus) if _governor is not None else 0)


def use_kernel_pool(set_threads: Callable[[int], None]) -> None:
    """The kernels loaded with their own pool: `set_threads(n)` sets how many threads its calls take."""
    global _kernel_threads
    _kernel_threads = set_threads
    _pool_threads()


def start(fixed: int | None) -> ThreadGovernor | None:
    """At start-up, before the work that should be measured (imports, loading): with `fixed`
    (--threads) or OMP_NUM_THREADS in the environment, use that count and nothing adapts;
    otherwise install the governor that `settle` and `tick` drive."""
    global _governor
    import torch

    if fixed:
        torch.set_num_threads(fixed)
        _governor = None
    elif os.environ.get("OMP_NUM_THREADS"):
        _governor = None  # the user's choice; torch read it already
    else:
        _governor = ThreadGovernor()
    _pool_threads()
    return _governor


def settle() -> None:
    """Just before decoding starts: set the count from what other processes used since `start`."""
    if _governor is not None:
        _governor.adjust()


def tick() -> None:
    """Called once per decode step; a no-op unless `start` installed the governor."""
    if _governor is not None:
        _governor.tick()


def stop() -> None:
    """Uninstall the governor (the thread count stays where it is)."""
    global _governor
    _governor = None
