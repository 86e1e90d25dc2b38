"""The server's load-aware draft length, without a model: the fitted step-time model, and
the choice of cap (speculate when steps are weight-bound, stop when they are compute-bound)."""

from __future__ import annotations

import pytest
import torch

from specdec.core.policy import FIT_DECAY, DecayedLine, LoadPolicy, StepModel
from specdec.drafters.base import DraftContext
from specdec.drafters.ngram import LengthPolicy, NgramDrafter
from specdec.types import SamplingParams
import specdec.core.step as step_mod
from specdec.core.scheduler import ContinuousBatcher


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


def test_step_model_predicts_a_single_batch_size_and_follows_new_steps():
    """One batch size only: the fixed and per-row costs cannot be told apart, but the
    prediction at that size must still be right; and a cached fit must follow new steps."""
    m = StepModel()
    for K in (0, 2, 4, 0, 2, 4):
        m.observe(4, K, 0.010 + 0.002 * 4 + 0.0005 * 4 * K)
    for K in (0, 3, 8):
        assert abs(m.predict(4, K) - (0.018 + 0.002 * K)) < 1e-6
    for _ in range(400):  # the machine got slower: every step now takes twice as long
        for K in (0, 2, 4):
            m.observe(4, K, 2 * (0.018 + 0.002 * K))
    assert abs(m.predict(4, 3) - 2 * (0.018 + 0.006)) < 1e-4


def test_one_row_speculates_again_after_a_full_batch():
    """The stuck case of a single line through A*(K+1): a full batch teaches a steep slope
    (rows are expensive), and one row then priced its guesses at that slope and never guessed."""
    b = _chooser(step_a=0.0, step_b=0.0)
    pol = LengthPolicy(max_n=4, max_k=16)
    for i in range(400):  # after 1-gram matches one guess in 20 holds: worth it only if a guess is cheap
        pol.observe(1, 8, 8 if i % 20 == 0 else 0)
    b.lookup = pol
    b.steps = StepModel()
    truth = lambda A, K: 0.020 + 0.002 * A + 0.0005 * A * (K + 1)  # noqa: E731
    for _ in range(200):  # a long high-load period, mostly without guesses
        b.steps.observe(16, 0, truth(16, 0))
    for K in (1, 2):
        b.steps.observe(16, K, truth(16, K))
    for _ in range(30):  # back to one row, plain steps only
        b.steps.observe(1, 0, truth(1, 0))
    assert b.choose([[1] * 8], [1])[0] > 0


def test_exploration_step_tries_one_guess_more():
    busy = _chooser(step_a=0.015, step_b=0.004)
    rows = [[1] * 8] * 32
    assert busy.choose(rows, [3] * 32)[0] == 0
    busy.step = 16 * 7
    assert busy.choose(rows, [3] * 32)[0] == 1


class _Chooser(LoadPolicy):
    """A LoadPolicy with a lookup's length policy beside it, asked as the batcher asks it."""

    step = 100  # not a probing step

    def choose(self, guesses, matches, tree_ok=None, tree=None):
        gains = [self.lookup.expected(n, len(g)) for g, n in zip(guesses, matches)]
        return self.choose_k(guesses, gains, self.step, tree_ok, tree)


def _chooser(step_a: float, step_b: float):
    b = _Chooser(k_max=8)
    for A in (1, 4, 16, 32):
        for K in (0, 4, 8):
            b.steps.observe(A, K, step_a + step_b * A * (K + 1))
    pol = LengthPolicy(max_n=4, max_k=16)
    for _ in range(300):  # after 3-gram matches: half the time all 8 guesses hold, half the time none
        pol.observe(3, 8, 8)
        pol.observe(3, 8, 0)
    b.lookup = pol
    return b


def test_speculates_when_weight_bound_and_backs_off_when_compute_bound():
    b = _chooser(step_a=0.015, step_b=0.0002)  # reading weights dominates: guesses are nearly free
    assert b.choose([[1] * 8], [3])[0] == 8
    busy = _chooser(step_a=0.015, step_b=0.004)  # 32 rows: every scored token costs compute
    rows = [[1] * 8] * 32
    assert busy.choose(rows, [3] * 32)[0] == 0
    b.adaptive = False
    assert b.choose(rows, [3] * 32)[0] == 8  # --fixed-k


# -- the batcher with an EAGLE head (method auto), on tiny random models ------------------


def _run(batcher, jobs, timeout: float = 120.0):
    """Submit (prompt, params) jobs at once (rows join and leave the batch as they
    finish); returns each job's tokens. A batcher without a worker thread is run here, until
    every job is done (every job queued before the first step: the rows join in a fixed order)."""
    import threading

    from specdec.core.scheduler import Request

    out, done, reqs = [None] * len(jobs), threading.Semaphore(0), []
    for i, (prompt, params) in enumerate(jobs):
        def on_done(reason, stats, i=i):
            out[i] = reason
            done.release()

        r = Request(list(prompt), params, lambda new: None, on_done)
        reqs.append(r)
        batcher.submit(r)
    if batcher.thread is None:
        batcher.run(until=lambda: all(o is not None for o in out))
    for _ in jobs:
        assert done.acquire(timeout=timeout), "a request did not finish"
    assert all(o in ("eos", "length") for o in out), out
    return [r.tokens for r in reqs]


def _auto_batcher(adaptive: bool, max_batch: int = 3, seed: int = 0, vocab: int | None = None, thread: bool = True,
                  **kw):
    from test_eagle import V, drafter, target

    vocab = vocab or V
    d = drafter("lookup", seed, vocab, depth=3, width=2, nodes=5, **kw)
    return ContinuousBatcher(target(seed, vocab).model, (), method="auto", k_max=6, max_batch=max_batch,
                             max_context=96, max_queue=2048, adaptive=adaptive, drafter=d, thread=thread)


def _steady_clock(monkeypatch):
    """time.perf_counter advancing 1 ms a call: every measured time, so every load-aware choice
    (cost model, batch guard, the drafters' gates), is the same on every run, however loaded
    the machine."""
    import itertools
    import time

    ticks = itertools.count()
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks) * 1e-3)


def run_join_leave(b) -> tuple[list, list]:
    """5 requests of different lengths over the batcher's rows (they join and leave mid-run):
    (each answer, transformers' plain greedy answer for it). Closes the batcher."""
    from transformers import AutoModelForCausalLM

    from oracle import hf_greedy, one_thread
    from specdec.types import SamplingParams
    from test_eagle import prompts, target_dir

    with one_thread():
        hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
        hf.generation_config.pad_token_id = 0
        ps = prompts() + [prompts()[0][:3], prompts()[1][2:]]
        lengths = [14, 9, 20, 6, 17]
        want = [hf_greedy(hf, p, n) for p, n in zip(ps, lengths)]
        try:
            got = _run(b, [(p, SamplingParams(max_new_tokens=n)) for p, n in zip(ps, lengths)])
        finally:
            b.close()
    return got, want


@pytest.mark.parametrize("adaptive", [False, True])
def test_auto_batcher_greedy_equals_transformers(adaptive, monkeypatch):
    """Lookup chains and EAGLE trees in one batch, rows joining and leaving mid-run (5 requests
    over 3 rows, different lengths): every answer equals plain greedy decoding, and trees ran.
    Load-aware choices follow measured times: the batcher runs in this thread on a steady clock,
    so which rows draft trees is the same on every run."""
    _steady_clock(monkeypatch)
    b = _auto_batcher(adaptive, thread=False)
    b.policy.eager = True  # trees before the head is timed (else only a probe, which answers this short never earn)
    got, want = run_join_leave(b)
    s = b.stats()
    assert got == want
    assert s["tree_rows"] > 0 and b.drafter.rows_drafted["eagle"] > 0
    assert b.drafter.rows_drafted["graft"] > 0  # a tree row's lookup grafted onto its tree
    assert s["proposed"] > 0 and s["batch"] == 0


def test_the_lookup_and_the_load_policy_read_one_step_time_fit(monkeypatch):
    """In the server, the lookup's cut and auto's tree gate and trim price guesses on the fit the
    scheduler feeds (one fit, observed once a step), not on a second fit of their own."""
    _steady_clock(monkeypatch)
    b = _auto_batcher(True, thread=False)
    lookup = b.drafter.ngram.policy
    assert lookup.times is b.policy.steps and not lookup.observes_times
    got, want = run_join_leave(b)
    assert got == want
    assert b.policy.steps.all.weight == pytest.approx(sum(0.98 ** i for i in range(b.stats()["steps"])))


def test_auto_batcher_seeded_sample_does_not_depend_on_the_load():
    """A seeded sampled request gives the same tokens alone and sharing the batch with greedy
    rows that draft trees (it may draft them too)."""
    alone, shared, _, stats = _seeded_alone_and_shared(_auto_batcher(adaptive=False))
    assert stats["tree_rows"] > 0
    assert shared[1] == alone[0]


def _seeded_alone_and_shared(b):
    """A seeded sampled request run alone, then between two greedy ones, through batcher `b`
    (closed after): (tokens alone, the three answers shared, stats after alone, stats after).
    Alone it must give plain sampling's text for its seed (`Engine` without a drafter: the
    guesses are deterministic, verify.py "sample and compare"). The greedy neighbours (verified
    together, apart from the sampled row) must equal transformers' plain greedy output of the
    target (test_eagle's tiny model 0)."""
    from transformers import AutoModelForCausalLM

    from oracle import hf_greedy, one_thread
    from specdec.engine import Engine
    from specdec.types import SamplingParams
    from test_eagle import prompts, target, target_dir

    seeded = SamplingParams(max_new_tokens=16, temperature=0.9, seed=11)
    with one_thread():
        try:
            alone = _run(b, [(prompts()[0], seeded)])
            after_alone = b.stats()
            shared = _run(b, [(prompts()[1], SamplingParams(max_new_tokens=12)), (prompts()[0], seeded),
                              (prompts()[2], SamplingParams(max_new_tokens=20))])
            stats = b.stats()
        finally:
            b.close()
        hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
        hf.generation_config.pad_token_id = 0
        assert shared[0] == hf_greedy(hf, prompts()[1], 12)
        assert shared[2] == hf_greedy(hf, prompts()[2], 20)
        assert alone[0] == Engine(target().model).generate([prompts()[0]], seeded)[0].tokens
    return alone, shared, after_alone, stats


@pytest.mark.parametrize("broken", [False, True])
def test_auto_batcher_sampling_matches_exact_distribution(monkeypatch, broken):
    """Sampled rows verify trees inside the batcher: over many seeded requests (fixed caps, every
    row drafts a tree with its lookup grafted on) the first three tokens follow the target's
    exact distribution (chi-square); with a broken tree rule (no residual) the same check fails."""
    import test_tree
    from specdec.drafters.hybrid import LookupEagleDrafter
    from test_eagle import SV

    monkeypatch.setattr(LookupEagleDrafter, "prefer_lookup", lambda self, looked: [False] * len(looked))
    if broken:
        monkeypatch.setattr(step_mod, "verify_tree_stochastic", test_tree.broken_tree_verify)
    s, b = _chi2_through_batcher(
        monkeypatch, lambda: _auto_batcher(adaptive=False, max_batch=8, seed=3, vocab=SV, min_lookup=1, min_n=1),
        broken, "auto")
    assert s["tree_rows"] > 0 and 0 < s["accepted"] < s["proposed"] and b.drafter.rows_drafted["graft"] > 0


def _chi2_through_batcher(monkeypatch, make_batcher, broken: bool, label: str):
    """1200 seeded sampled requests (temperature 0.9, seeded rows allowed to draft here) for 3
    tokens after test_eagle's CTX[0], through the batcher `make_batcher()` builds over the tiny
    target of seed 3; the chi-square views of the samples against the target's exact
    distribution must pass, or, when the caller `broken` a rule, some must fail. Returns the
    batcher's stats and the batcher."""
    import functools

    from transformers import AutoModelForCausalLM

    import test_tree
    from oracle import exact_joint, one_thread
    from specdec.core import scheduler as batcher_mod
    from specdec.types import SamplingParams
    from test_eagle import CTX, SV, target_dir
    from test_tree import chi2_views

    # lookup guesses must be verified here, on a random text whose lookups rarely hold: start the
    # lookup at an even prior (a fresh one declines every lookup until one would have held)
    monkeypatch.setattr("specdec.drafters.ngram.LOOKUP_PRIOR", 0.5)
    params = dict(temperature=0.9)
    with one_thread():
        hf = AutoModelForCausalLM.from_pretrained(str(target_dir(3, SV)), dtype=torch.float32).eval()
        b = make_batcher()
        try:
            got = _run(b, [(CTX[0], SamplingParams(max_new_tokens=3, seed=9000 + i, **params)) for i in range(1200)],
                       timeout=600)
            s = b.stats()
        finally:
            b.close()
    monkeypatch.setattr(test_tree, "exact", functools.lru_cache(maxsize=None)(
        lambda c, t, k, p: exact_joint(hf, list(c), 3, t, k, p)))
    results = chi2_views({CTX[0]: torch.tensor(got)}, params)
    if broken:
        assert any(r.rejected for _, r in results), [f"{lb}: {r}" for lb, r in results]
    else:
        for name, res in results:
            assert not res.rejected, f"batcher {label} {params} {name}: {res}"
    return s, b


def test_head_cost_is_fitted_against_the_batch_size():
    """The head drafts trees for the rows that take them: its time is predicted per number of
    tree rows, and from a single count seen it scales per row (pessimistic above it), so many
    trees are not started on a cost measured for one."""
    b = LoadPolicy(k_max=8)
    assert b.head_cost(8) is None  # nothing timed: only a probe drafts a tree
    for _ in range(10):
        b.observe_head(1, 0.004, True)
    assert b.head_cost(1) == pytest.approx(0.004) and b.head_cost(16) == pytest.approx(0.064)
    for _ in range(30):
        b.observe_head(8, 0.004 + 0.0005 * 7, True)
    assert b.head_cost(16) == pytest.approx(0.004 + 0.0005 * 15, rel=0.05)


def test_trees_are_chosen_only_by_a_clear_margin():
    """With an EAGLE head (method auto) a row drafts a tree when the predicted tokens per
    second beat the best lookup-only choice by TREE_MARGIN; a marginal gain keeps plain steps."""
    from specdec.drafters.hybrid import LookupEagleDrafter

    b = _Chooser(k_max=8)
    b.step = 101  # not an exploration step
    for K in (0, 2, 4, 8):
        for _ in range(5):
            b.steps.observe(1, K, 0.015 + 0.0002 * K)
    b.lookup = LengthPolicy(max_n=4, max_k=16)
    d = object.__new__(LookupEagleDrafter)
    d.nodes = 5.0
    b.observe_head(1, 0.004, True)  # the head drafts in 4 ms
    # a 5-node tree: t = 0.016 + 0.004 s for 1 + gain tokens, against 1 token in 0.015 s
    d.gain = 0.37  # ~3% more tokens per second than plain steps: below the margin
    assert b.choose([[]], [0], [True], d) == (0, [False])
    d.gain = 0.6  # ~20% more
    k, use = b.choose([[]], [0], [True], d)
    assert use == [True] and k >= 5
    assert b.choose([[]], [0], [False], d) == (0, [False])  # a row that may not draft trees


@pytest.mark.parametrize("rule", ["schedule", "every 16th step"])
def test_a_tree_that_does_not_pay_is_probed_ever_more_rarely_and_only_with_room(monkeypatch, rule):
    """The server's second-source probes follow generate's ProbeSchedule: at one row a tree
    that never pays is probed after 16, 32, 64, 128, 256 declined steps (4 probes in 400 steps), and
    never for a row with fewer than PROBE_ROOM tokens left. The rule it had (a probe every 16th
    step whatever it found, at any room: ~25 in 400 steps) fails."""
    from specdec.core.policy import PROBE_EVERY, PROBE_ROOM
    from specdec.drafters.hybrid import LookupEagleDrafter

    if rule == "every 16th step":
        def every_16th(self, A, best_use, ok, room):
            self.count = getattr(self, "count", 0) + 1
            return list(ok) if self.count % PROBE_EVERY == 0 and any(ok) and not any(best_use) else None

        monkeypatch.setattr(LoadPolicy, "_probe", every_16th)
    b = _Chooser(k_max=8)
    for K in (0, 2, 4, 8):
        for _ in range(5):
            b.steps.observe(1, K, 0.015 + 0.0002 * K)
    b.lookup = LengthPolicy(max_n=4, max_k=16)
    d = object.__new__(LookupEagleDrafter)
    d.nodes, d.gain = 5.0, 0.1  # a tree that costs more than it gains (its head drafts in 4 ms)
    b.observe_head(1, 0.004, True)

    def probes(room, steps=400):
        return sum(b.choose_k([[]], [[1.0]], b.step, [True], d, [room])[1] == [True] for _ in range(steps))

    many = probes(room=1000)
    if rule == "schedule":
        assert many == 4, many
        assert probes(room=PROBE_ROOM - 1) == 0
    else:
        assert many > 20


# -- the batcher with a draft model (method draft), on tiny random models -------------------

def _draft_batcher(adaptive: bool, draft_seed: int = 0, max_batch: int = 3, seed: int = 0, vocab: int | None = None,
                   confidence: float = 0.0, method: str = "draft"):
    """Target: test_eagle's tiny model `seed`; draft: the tiny model `draft_seed` (the target
    itself when equal: every guess holds, so long accepted runs and early finishes happen).
    method "auto": prompt lookup beside the draft model."""
    from specdec.drafters.draft_model import DraftModelDrafter
    from test_eagle import V, target

    vocab = vocab or V
    d = DraftModelDrafter(target(draft_seed, vocab).model, vocab_size=vocab, confidence=confidence)
    return ContinuousBatcher(target(seed, vocab).model, (), method=method, k_max=5, max_batch=max_batch,
                             max_context=96, max_queue=2048, adaptive=adaptive, drafter=d)


def _free_at_first(b) -> None:
    """Price the batcher's draft model nearly free until it drafts in use: timed alone, a tiny
    draft model costs about a tiny target's step, so on a busy machine the cost model may rightly
    never draft it, and a test of what drafting does would see none."""
    b.policy.draft_time = DecayedLine(FIT_DECAY)
    b.policy.observe_draft_time(1, 1e-6)


@pytest.mark.parametrize("adaptive,draft_seed,confidence", [(False, 0, 0.0), (True, 0, 0.0), (False, 1, 0.3)])
def test_draft_batcher_greedy_equals_transformers(adaptive, draft_seed, confidence):
    """Draft-model guesses in the server's batcher, rows joining and leaving mid-run (5 requests
    over 3 rows, different lengths; the draft's cache gets each prompt on joining and follows
    the rows as they move): every answer equals plain greedy decoding."""
    b = _draft_batcher(adaptive, draft_seed, confidence=confidence)
    if adaptive:
        _free_at_first(b)
    got, want = run_join_leave(b)
    s = b.stats()
    assert got == want
    assert s["proposed"] > 0 and s["batch"] == 0
    if draft_seed == 0:  # the target drafting for itself: its guesses hold
        assert s["accepted"] > s["proposed"] // 2
    assert b.drafter.cache.batch_size == 0 and b.drafter.fed == []  # every row left the draft's cache too


def test_draft_batcher_seeded_sample_does_not_depend_on_the_load():
    """A seeded sampled request gives the same tokens alone and next to greedy rows that take
    draft-model guesses (it takes them too: the server's draft guesses are the draft's argmax)."""
    alone, shared, after_alone, stats = _seeded_alone_and_shared(_draft_batcher(adaptive=False))
    assert after_alone["proposed"] > 0
    assert stats["accepted"] > 0
    assert shared[1] == alone[0]


@pytest.mark.parametrize("broken", [False, True])
def test_draft_batcher_sampling_matches_exact_distribution(monkeypatch, broken):
    """Sampled rows verify the draft model's argmax guesses (one-hot q) by the chain rule inside
    the batcher: over many seeded requests (fixed caps) the first three tokens follow the target's exact distribution (chi-square); with a
    broken rule (the recovered token drawn from p, not the residual) the same check fails."""
    import oracle
    from test_eagle import SV

    if broken:
        monkeypatch.setattr(step_mod, "verify_stochastic", oracle.broken_verify_stochastic)
    s, _ = _chi2_through_batcher(
        monkeypatch, lambda: _draft_batcher(adaptive=False, draft_seed=4, max_batch=8, seed=3, vocab=SV), broken, "draft")
    assert 0 < s["accepted"] < s["proposed"]


# -- method auto with a draft model: prompt lookup beside the draft model --------------------

@pytest.mark.parametrize("adaptive", [False, True])
def test_lookup_and_draft_batcher_greedy_equals_transformers(adaptive):
    """Rows take their prompt lookup or the draft model's guesses, per step (rows joining and
    leaving mid-run, the draft's cache catching up on rows that took lookups): every answer
    equals plain greedy decoding, and both sources drafted."""
    b = _draft_batcher(adaptive, draft_seed=1, method="auto")
    assert b.drafting and not b.trees and b.lookup is not None
    b.policy.probe_room = 0  # (answers this short would not start the draft model on its prompts)
    if adaptive:
        _free_at_first(b)
    got, want = run_join_leave(b)
    s = b.stats()
    assert got == want
    assert s["draft_rows"] > 0 and s["lookup_rows"] > 0 and s["batch"] == 0
    assert b.drafter.cache.batch_size == 0 and b.drafter.fed == []


def test_lookup_and_draft_choice_follows_expected_tokens():
    """The load-aware choice per row: a row whose lookup promises more tokens than the draft
    model takes the lookup, the others the draft model; a step in which the draft model would
    pay for no row leaves it out (lookups only)."""
    b = LoadPolicy(k_max=4)
    lookup = NgramDrafter(choose_length=False)
    pol = lookup.policy
    for _ in range(200):  # 4-token matches hold; 1-token matches never do
        pol.observe(4, 4, 4)
        pol.observe(1, 4, 0)
    # the lookup's estimates for its proposal: a 4-token match and a 1-token match
    lookup.propose(DraftContext([[5, 6, 7, 8, 1, 5, 6, 7, 8], [3, 9, 4, 4, 4, 4, 1, 2, 9]], SamplingParams(), None), 4)
    assert lookup.matches == [4, 1]
    guesses, gains = [[1, 5, 6, 7], [4, 4, 4, 4]], lookup.expected_tokens()
    assert gains == [pol.expected(4, 4), pol.expected(1, 4)]
    for n in range(100):  # the draft model's j-th guess held in 90, 80, 70, 60 of 100 rows
        b.observe_draft([4], [4 if n < 60 else 3 if n < 70 else 2 if n < 80 else 1 if n < 90 else 0])

    class Steps(StepModel):  # t(A, K) = 0.030 + 0.001 A K
        def coefficients(self, rows=None):
            return 0.030, 0.0, 0.001

    b.steps = Steps()
    for _ in range(8):
        b.observe_draft_time(2, 0.0005)
    k, use = b.choose_draft(guesses, gains, 1, [True, True])
    assert k > 0 and use == [False, True]  # the long match keeps its lookup, the other drafts
    k, use = b.choose_draft(guesses, gains, 1, [True, False])  # the second may not draft
    assert k > 0 and use == [False, False]
    b.draft_time = DecayedLine(0.98)
    for _ in range(8):
        b.observe_draft_time(2, 0.5)  # a draft model far dearer than it gains
    k, use = b.choose_draft(guesses, gains, 1, [True, True])
    assert not any(use) and k == 4


def test_lookup_and_draft_batcher_seeded_sample_does_not_depend_on_the_load():
    """With lookup beside the draft model, a seeded sampled request gives the same tokens alone
    and next to greedy rows that draft."""
    alone, shared, _, stats = _seeded_alone_and_shared(_draft_batcher(adaptive=False, draft_seed=1, method="auto"))
    assert stats["draft_rows"] > 0
    assert shared[1] == alone[0]


def test_lookup_and_draft_batcher_sampling_matches_exact_distribution(monkeypatch):
    """Sampled rows verify lookup chains and draft-model chains (one-hot q) side by side in the
    batcher: over many seeded requests the first three tokens follow the
    target's exact distribution (chi-square; the broken-rule counterpart is the draft-model test
    above, same check, same verification call)."""
    from test_eagle import SV

    s, _ = _chi2_through_batcher(
        monkeypatch, lambda: _draft_batcher(adaptive=False, draft_seed=4, max_batch=8, seed=3, vocab=SV,
                                            method="auto"), False, "auto+draft")
    assert s["draft_rows"] > 0 and s["lookup_rows"] > 0 and 0 < s["accepted"] < s["proposed"]


@pytest.mark.default_model
def test_full_batch_on_the_default_model_answers_as_each_prompt_decoded_alone(default_model):
    """The server's batcher under load on the default model (on the row-stable kernels): 8 chat
    prompts at once over 8 rows, every step drafting up to 8 guesses a row (lookup chains and
    EAGLE trees, --fixed-k), so steps score up to 72 row-tokens; each answer equals
    plain greedy decoding of its prompt alone, as `specdec generate` gives it. (A mismatch needs a
    near-tie, so these prompts passed before the 2026-12-02 fix too; the bit-for-bit guarantee
    behind this is tested in test_rowstable and test_gguf_native, batched steps of any size.)"""
    from specdec.drafters.hybrid import lookup_eagle_for
    from specdec.engine import Engine
    from specdec.text import encode_prompt
    from specdec.types import SamplingParams

    lm = default_model
    questions = ["Name three colours.", "Summarize: the cat sat on the mat. The cat sat on the mat again.",
                 "Write a haiku about rain.", "What is 12 times 13?", "Translate to French: good morning",
                 "List the days of the week.", "Explain what a compiler does in one sentence.",
                 "Repeat after me: red, green, blue, red, green, blue."]
    prompts = [encode_prompt(lm.tokenizer, q, True) for q in questions]
    params = SamplingParams(max_new_tokens=24)
    plain = Engine(lm.model, None, eos_ids=lm.eos_ids)
    want = [plain.generate([p], params)[0].tokens for p in prompts]
    b = ContinuousBatcher(lm.model, lm.eos_ids, method="auto", k_max=8, max_batch=8, max_context=512,
                          adaptive=False, drafter=lookup_eagle_for(lm))
    try:
        got = _run(b, [(p, params) for p in prompts])
    finally:
        b.close()
    assert got == want
    s = b.stats()
    assert s["proposed"] > 0 and s["tree_rows"] > 0


@pytest.mark.parametrize("eager", [False, True])
def test_before_any_fit_lookups_are_priced_at_the_prior_and_trees_wait_for_a_probe(eager):
    """A fresh LoadPolicy (no step timed): a lookup expected to hold is verified and one expected
    to fail is not, on every step (a guess priced at R_PRIOR plain steps), and no tree is drafted
    before its first probe. `eager` (the warm-up's rule) instead measures both ends, trees
    included, so it fails the first two checks: the fresh rule is what makes them hold."""
    from test_eagle import _Tree

    def choose(gains, step):
        policy = LoadPolicy(k_max=4)
        policy.eager = eager
        return policy.choose_k([[5, 6, 7]], [gains], step, [True], _Tree(3.0), room=[100])

    good, bad = [1.0, 1.9, 2.7, 3.4], [1.0, 1.01, 1.02, 1.03]
    results = [(choose(good, step), choose(bad, step)) for step in (1, 2, 3)]
    fresh_rule = all(g == (3, [False]) and b == (0, [False]) for g, b in results)
    assert fresh_rule != eager, results


def test_the_guess_probe_waits_for_room():
    """Every 16th step allows a guess more than the best cap, so the cost of guesses stays
    measured, but only while some row may still take PROBE_ROOM tokens: on a short answer's
    steps it would verify a guess that nothing later can use (the probing rule of design.md)."""
    from test_eagle import _fitted_policy

    bad = [[1.0, 1.01, 1.02]]  # a lookup that will not hold: the best cap is 0
    policy = _fitted_policy()
    assert policy.choose_k([[5, 6]], bad, 17, room=[100])[0] == 0  # not a probe step
    assert policy.choose_k([[5, 6]], bad, 16, room=[100])[0] == 1  # a probe step, room to use it
    assert policy.choose_k([[5, 6]], bad, 16, room=[10])[0] == 0  # a probe step near the end
    policy.probe_room = 0  # the rule without room: the last probe verifies its guess
    assert policy.choose_k([[5, 6]], bad, 16, room=[10])[0] == 1
