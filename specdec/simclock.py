"""A simulated machine for the cost model: a clock that only modelled costs advance.

Every choice the cost model makes rests on measured times (`time.perf_counter` around steps and
proposals), so on a real machine it depends on the machine and on whatever else runs there.
With `time.perf_counter` replaced by a `SimClock` and each model's forward charged by a cost
profile (`charge`), the same decoding makes the choices it would make on a machine with that
profile, every run alike: what `benchmarks/policy_sim.py` measures and tests hold to (on a
machine where verification is dear, speculation must not cost throughput).
"""

from __future__ import annotations

import time
from bisect import bisect_right
from contextlib import contextmanager

#: t(T) / t(1) at T tokens scored in one forward (rows x new tokens), measured or made up; linear
#: between points and along the last segment beyond them
PROFILES = {
    # the default model on 8-bit activations on an Intel Xeon (Sapphire Rapids), one thread
    # (`benchmarks/forward_costs.py --threads 1 --prefill 10 --context 100`, shared machine)
    "xeon-vnni": [(1, 1.0), (2, 1.24), (3, 1.26), (4, 1.12), (5, 1.16), (8, 1.8), (9, 2.22), (17, 3.28)],
    # the default model on a 2-core AMD EPYC Zen 2 (docs/benchmarks.md, "What a forward costs")
    "zen2-avx2": [(1, 1.0), (2, 1.19), (3, 1.40), (5, 2.14), (9, 3.68)],
    # verification dearer than on any CPU measured: 0.3 of a step a token
    "dear": [(1, 1.0), (2, 1.3)],
    # a GPU-like machine: a token more is nearly free
    "cheap": [(1, 1.0), (2, 1.01)],
}


class SimClock:
    """A clock that only `advance` moves (seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def curve(points: list[tuple[int, float]]):
    """t(T) in plain steps from a profile's points (PROFILES)."""
    xs = [x for x, _ in points]

    def at(tokens: int) -> float:
        if tokens <= xs[0]:
            return points[0][1] * tokens / xs[0]
        i = min(max(bisect_right(xs, tokens) - 1, 0), len(points) - 2)
        (x0, y0), (x1, y1) = points[i], points[i + 1]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
    return at


def charge(module, clock: SimClock, cost) -> None:
    """Every forward of `module` (a model instance whose first argument is the token ids) advances
    the clock by cost(rows x new tokens)."""
    forward = module.forward

    def charged(ids, *args, **kwargs):
        out = forward(ids, *args, **kwargs)
        clock.advance(cost(int(ids.numel())))
        return out
    module.forward = charged


@contextmanager
def simulated(clock: SimClock):
    """`time.perf_counter` reads `clock` inside the block (every module that calls it through
    `time`, as specdec's do)."""
    real = time.perf_counter
    time.perf_counter = clock
    try:
        yield clock
    finally:
        time.perf_counter = real
