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

Where other processes hold cores, the row-stable kernels' parallel calls move to their own pool
(rowstable.cpp, KernelPool), whose caller never waits for a thread the OS has not run, on every
allowed core (or the fixed count): beside busy processes every such thread works when it runs.
Idle, they stay on OpenMP's team, whose spinning threads join each call a little sooner (the pool
took 2-5% more per step there). `use_kernel_pool` registers the switch when the kernels load; the
governor also runs with a fixed count, then only to switch the pool (a server pinned to
`--threads 2` beside busy processes otherwise stalls as above). SPECDEC_KERNEL_POOL=1 / 0 keeps the
pool on / off whatever the load.

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
    seconds at most (see the module docstring), unless `fixed` gives the count; either way the
    kernels' pool (`set_pool(on, threads)`, where given) is on while some core is shared.
    `set_threads` is torch.set_num_threads unless a test passes its own; `sample` reads (busy,
    total) ticks and `own` this process's CPU seconds."""

    def __init__(self, interval: float = 0.5, set_threads=None, sample=None, own=own_cpu_seconds,
                 cpus: list[int] | None = None, clock=time.monotonic, fixed: int | None = None,
                 set_pool: Callable[[bool, int], None] | None = None) -> None:
        self.cpus = cpus if cpus is not None else allowed_cpus()
        self.interval, self.clock, self.own, self.fixed = interval, clock, own, fixed
        self.sample = sample if sample is not None else (lambda: read_cpu_jiffies(self.cpus))
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self.set_threads, self.set_pool = set_threads, set_pool
        self.threads: int | None = None  # last count set
        self.pool: bool | None = None  # whether the kernels' pool was last switched on
        self.changes = 0
        self._mark()

    def _mark(self) -> None:
        self._t, self._stat, self._own = self.clock(), self.sample(), self.own()

    def adjust(self) -> int | None:
        """Measure the interval since the last mark, set the thread count (and the pool), start a
        new interval. Returns the count chosen (None when nothing could be measured)."""
        stat, own = self.sample(), self.own()
        if stat is None or self._stat is None:
            return None
        others = others_busy_cores(self._stat, stat, own - self._own, len(self.cpus))
        if others is None:
            return None  # too short to tell: keep measuring from the same mark
        n = choose_threads(len(self.cpus), others)
        if self.fixed is None and n != self.threads:
            self.set_threads(n)
            self.changes += self.threads is not None
            self.threads = n
        self.switch_pool(n < len(self.cpus))
        self._mark()
        return n

    def switch_pool(self, shared: bool) -> None:
        """The kernels' pool on while a core is shared, on every allowed core (or the fixed count)."""
        if self.set_pool is not None and shared != self.pool:
            self.set_pool(shared, self.fixed or len(self.cpus))
            self.pool = shared

    def tick(self) -> None:
        """Once per decode step: re-measure when `interval` seconds have passed."""
        if self.clock() - self._t >= self.interval:
            self.adjust()


_governor: ThreadGovernor | None = None
#: switches the kernels' own pool (on, threads); registered when they load (`use_kernel_pool`)
_kernel_pool: Callable[[bool, int], None] | None = None


def use_kernel_pool(set_pool: Callable[[bool, int], None]) -> None:
    """The kernels loaded: `set_pool(on, threads)` switches their calls between OpenMP's team and
    their own pool. Left alone where SPECDEC_KERNEL_POOL fixes it."""
    global _kernel_pool
    if os.environ.get("SPECDEC_KERNEL_POOL") in ("0", "1"):
        return
    _kernel_pool = set_pool
    if _governor is not None:
        _governor.set_pool, _governor.pool = set_pool, None  # (switched at the next settle or tick)


def start(fixed: int | None) -> ThreadGovernor:
    """At start-up, before the work that should be measured (imports, loading): with `fixed`
    (--threads) or OMP_NUM_THREADS in the environment, that count, and the governor only switches
    the kernels' pool; otherwise the governor also sets the count. `settle` and `tick` drive it."""
    global _governor
    import torch

    if fixed:
        torch.set_num_threads(fixed)
    elif os.environ.get("OMP_NUM_THREADS"):
        fixed = torch.get_num_threads()  # the user's choice; torch read it already
    _governor = ThreadGovernor(fixed=fixed, set_pool=_kernel_pool)
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
