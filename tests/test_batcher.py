"""The server's load-aware draft length, without a model: the fitted step-time model, and
the choice of cap (speculate when steps are weight-bound, stop when they are compute-bound)."""

from __future__ import annotations

from specdec.drafters.ngram import LengthPolicy
from specdec.server.batcher import ContinuousBatcher, StepModel


def test_step_model_fits_a_fixed_a_per_row_and_a_per_token_cost():
    m = StepModel()
    assert m.predict(1, 0) is None
    for A in (1, 2, 4, 8):
        m.observe(A, 0, 0.010 + 0.003 * A)
    assert m.predict(3, 5) is None  # one draft length seen: the token cost is unknown
    for A in (1, 2, 4, 8):
        for K in (2, 4):
            m.observe(A, K, 0.010 + 0.003 * A + 0.0005 * A * K)
    assert abs(m.predict(3, 5) - (0.010 + 0.009 + 0.0005 * 15)) < 1e-6


def test_one_row_speculates_again_after_a_full_batch():
    """The stuck case of a single line through A*(K+1): a full batch teaches a steep slope
    (rows are expensive), and one row then priced its guesses at that slope and never guessed."""
    b = _chooser(step_a=0.0, step_b=0.0)
    pol = LengthPolicy(max_n=4, max_k=16)
    for i in range(400):  # after 1-gram matches one guess in 20 holds: worth it only if a guess is cheap
        pol.observe(1, 8, 8 if i % 20 == 0 else 0)
    b.drafter = type("D", (), {"policy": pol})()
    b.steps = StepModel()
    truth = lambda A, K: 0.020 + 0.002 * A + 0.0005 * A * (K + 1)  # noqa: E731
    for _ in range(200):  # a long high-load period, mostly without guesses
        b.steps.observe(16, 0, truth(16, 0))
    for K in (1, 2):
        b.steps.observe(16, K, truth(16, K))
    for _ in range(30):  # back to one row, plain steps only
        b.steps.observe(1, 0, truth(1, 0))
    assert b._choose_k([[1] * 8], [1]) > 0


def test_exploration_step_tries_one_guess_more():
    busy = _chooser(step_a=0.015, step_b=0.004)
    rows = [[1] * 8] * 32
    assert busy._choose_k(rows, [3] * 32) == 0
    busy.totals["steps"] = 16 * 7
    assert busy._choose_k(rows, [3] * 32) == 1


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
