"""The server's load-aware draft length, without a model: the fitted step-time model, and
the choice of cap (speculate when steps are weight-bound, stop when they are compute-bound)."""

from __future__ import annotations

from specdec.drafters.ngram import LengthPolicy
from specdec.server.batcher import ContinuousBatcher, StepModel


def test_step_model_fits_a_plus_b_times_tokens():
    m = StepModel()
    assert m.predict(1, 0) is None
    for A in (1, 2, 4, 8):
        for K in (0, 2, 4):
            m.observe(A, K, 0.010 + 0.002 * A * (K + 1))
    assert abs(m.predict(3, 5) - (0.010 + 0.002 * 18)) < 1e-9


def _chooser(step_a: float, step_b: float):
    b = object.__new__(ContinuousBatcher)  # no model, no worker thread: only the policy is under test
    b.adaptive, b.k_max = True, 8
    b.totals = {"steps": 100}
    b.steps = StepModel()
    for A in (1, 4, 16, 32):
        for K in (0, 4, 8):
            b.steps.observe(A, K, step_a + step_b * A * (K + 1))
    pol = LengthPolicy(max_n=4, max_k=16)
    for _ in range(300):  # after 3-gram matches: half the time all 8 guesses hold, half the time none
        pol.observe(3, 8, 8)
        pol.observe(3, 8, 0)
    b.drafter = type("D", (), {"policy": pol})()
    return b


def test_speculates_when_weight_bound_and_backs_off_when_compute_bound():
    b = _chooser(step_a=0.015, step_b=0.0002)  # reading weights dominates: guesses are nearly free
    assert b._choose_k([[1] * 8], [3]) == 8
    busy = _chooser(step_a=0.015, step_b=0.004)  # 32 rows: every scored token costs compute
    rows = [[1] * 8] * 32
    assert busy._choose_k(rows, [3] * 32) == 0
    b.adaptive = False
    assert b._choose_k(rows, [3] * 32) == 8  # --fixed-k
