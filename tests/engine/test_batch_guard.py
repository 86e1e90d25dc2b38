"""The engine's BatchGuard: in batches it lets drafters propose only while speculative steps
commit more tokens per second than plain ones. Unit checks of its choices on synthetic
rates, and the engine with steps alternating between speculative and plain (drafters sit
steps out and catch up): greedy output still equals plain decoding (transformers' greedy as
the oracle), for every drafter that can sit steps out (prompt lookup, a draft model, lookup +
draft model, Medusa, the EAGLE tree, lookup + tree), and sampled batches still follow the
target's exact distribution. The server's batcher behind the same guard stays exact too."""

from __future__ import annotations

import pytest
import torch

import helpers
from helpers import V, prompts, target, target_dir
from specdec.engine import Engine
from specdec.policy import BatchGuard, band
from specdec.types import SamplingParams

from oracle import hf_greedy

pytestmark = pytest.mark.real_guard


def test_single_rows_always_speculate():
    g = BatchGuard()
    assert all(g.speculate(1) for _ in range(50))
    assert g.decisions == {True: 0, False: 0}


def run(g: BatchGuard, rows: int, spec_rate: float, plain_rate: float, steps: int) -> list[bool]:
    out = []
    for _ in range(steps):
        s = g.speculate(rows)
        g.observe(rows, s, int(spec_rate if s else plain_rate), 1.0)
        out.append(s)
    return out


class EveryProbeEvery(BatchGuard):
    """The rule the guard had: while plain decoding wins, a speculative probe every
    `probe_every` steps, whatever the probes found (the broken rule of the test below)."""

    def speculate(self, rows: int) -> bool:
        b = band(rows)
        n = self.steps.get(b, 0)
        spec, plain = self.rate.get((b, True)), self.rate.get((b, False))
        if plain is None or spec is None or spec >= plain:
            return super().speculate(rows)
        self.steps[b] = n + 1
        choice = n % self.probe_every == 0
        self.decisions[choice] += 1
        return choice


@pytest.mark.parametrize("rule", ["schedule", "every 16th step"])
def test_guard_falls_back_to_plain_probing_ever_more_rarely_and_returns_when_it_wins(rule):
    """Where speculation loses, the guard decodes plainly and probes speculation after 16, 32,
    64, 128 plain steps (a probe pays the drafter's catch-up on what it sat out): 4 probes in
    400 steps, where a probe every 16th step (the old rule) makes ~24 and fails. When the text
    turns repetitive the next probe sees it, and the guard speculates again, with a plain step
    every 16 to keep plain decoding measured."""
    g = BatchGuard(probe_every=16) if rule == "schedule" else EveryProbeEvery(probe_every=16)
    first = run(g, 4, spec_rate=80, plain_rate=100, steps=400)
    # speculate first (the drafter's warm-up, not counted), measure a plain step, then a speculative one
    assert first[:3] == [True, False, True]
    probes = [i for i, s in enumerate(first) if s and i >= 3]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    if rule == "every 16th step":
        assert len(probes) > 20
        return
    assert len(probes) == 4 and gaps == [32, 64, 128], (probes, gaps)
    # the text turns repetitive: speculation now commits more per second
    later = run(g, 4, spec_rate=200, plain_rate=100, steps=400)
    back = later.index(True)
    assert back <= 256  # the next probe, on the schedule
    tail = later[back:]
    assert sum(tail) >= len(tail) * 14 // 16 and not all(tail)  # speculating, a plain step every 16


def test_a_probe_that_only_caught_the_drafter_up_is_repeated_without_lengthening_the_gap():
    """A speculative probe whose step was a catch-up (not steady: the drafter first caught up
    on the tokens it sat out) measures nothing: the next step probes again, and the gap after
    that is the one the probe would have started."""
    g = BatchGuard(probe_every=16)
    run(g, 4, spec_rate=80, plain_rate=100, steps=40)  # plain wins; probes after 16 and 32 plain steps
    steps = []
    for _ in range(200):
        s = g.speculate(4)
        g.observe(4, s, 80 if s else 100, 1.0, steady=not (s and not any(steps[-1:])))
        steps.append(s)
    probes = [i for i, s in enumerate(steps) if s]
    # each probe is a pair: a catch-up step, then the measured one on the next step
    assert len(probes) >= 2 and probes[1] == probes[0] + 1, probes
    # the gap after the pair: 64 (the catch-up did not lengthen it to 128)
    assert probes[2] - probes[1] == 64, probes


def test_bands_are_measured_apart():
    g = BatchGuard()
    run(g, 8, spec_rate=50, plain_rate=100, steps=40)  # a full batch: plain wins
    two = run(g, 2, spec_rate=150, plain_rate=100, steps=40)  # two rows: speculation wins
    assert sum(two[8:]) >= 28


def run_with_cost_model(g: BatchGuard, rows: int, declines, steps: int) -> list[bool]:
    """Steps where the guard asks, and on a step it lets through the cost model declines every
    guess while `declines(step)` holds (the step then decodes plainly, priced for nothing).
    Returns per step whether the cost model was asked."""
    asked = []
    for i in range(steps):
        s = g.speculate(rows)
        spec = s and not declines(i)
        g.observe(rows, spec, 120 if spec else 100, 1.0, declined=s and not spec)
        asked.append(s)
    return asked


class AlwaysAsk(BatchGuard):
    """The guard as it was: a step it lets through is priced whatever the cost model did on the
    band's last steps (the broken rule of the test below)."""

    def observe(self, rows, speculated, tokens, seconds, steady=True, declined=False):
        super().observe(rows, speculated, tokens, seconds, steady)


@pytest.mark.parametrize("rule", ["back off", "always ask"])
def test_where_the_cost_model_keeps_declining_the_guard_asks_it_ever_more_rarely(rule):
    """A band whose priced steps the cost model declines (a 32-row batch where no guess pays:
    each such step still paid for the offers and the pricing, ~10% of it) is priced again after
    2, 4, then every 8 steps, not on every step; once a priced step speculates, every step is
    priced again. The band never measured a speculative step, so the rates alone would let
    every step through."""
    g = BatchGuard() if rule == "back off" else AlwaysAsk()
    asked = run_with_cost_model(g, 32, lambda i: True, 200)
    if rule == "always ask":
        assert sum(asked) > 150
        return
    assert 20 <= sum(asked) <= 35, sum(asked)  # ~1 in 8 once the gap is at its longest
    gaps = [b - a for a, b in zip(*[[i for i, s in enumerate(asked) if s][j:] for j in (0, 1)])]
    assert max(gaps) <= 9 and gaps[-1] == 8, gaps  # an offer that would pay waits 8 steps at most
    # the text turns: the cost model takes the next priced step, and the guard asks every step again
    # (but the plain step every 16 that keeps plain decoding measured)
    later = run_with_cost_model(g, 32, lambda i: False, 40)
    first = later.index(True)
    assert first <= 8 and sum(later[first:]) >= len(later[first:]) - 2, later
    # another band is not held back by this one's declines
    g2 = BatchGuard()
    run_with_cost_model(g2, 32, lambda i: True, 50)
    assert all(run_with_cost_model(g2, 4, lambda i: False, 10)[2:])


@pytest.mark.parametrize("rule", ["back off", "always ask"])
def test_a_single_row_the_cost_model_keeps_declining_is_priced_ever_more_rarely(rule):
    """A single row (which the guard lets through unmeasured) whose steps the cost model declines
    is priced after 2, 4, then every 8 steps (`priced`), until a priced step speculates."""
    g = BatchGuard() if rule == "back off" else AlwaysAsk()
    asked = []
    for _ in range(200):
        assert g.speculate(1)
        ask = g.priced(1)
        g.observe(1, False, 100, 1.0, declined=True)  # declined, priced or not
        asked.append(ask)
    if rule == "always ask":
        assert all(asked)
        return
    assert 20 <= sum(asked) <= 35, sum(asked)
    g.observe(1, True, 130, 1.0)  # a priced step speculated: every step is priced again
    assert all(g.priced(1) for _ in range(10))


class Alternate(BatchGuard):
    """Speculate on every other step (a stand-in for the measured choice)."""

    def speculate(self, rows: int) -> bool:
        self.n = getattr(self, "n", 0) + 1
        choice = rows < self.min_rows or self.n % 2 == 0
        self.decisions[choice] += 1
        return choice


def make(kind, kw):
    """Sources for the tiny target: prompt lookup, a draft model (a second, differently seeded tiny
    model), lookup + draft model (auto with a draft), Medusa heads, the EAGLE tree or lookup + tree."""
    if kind == "ngram":
        return helpers.lookup()
    if kind == "draft":
        return helpers.draft_model(1)
    if kind == "hybrid":
        return helpers.auto_draft()
    if kind == "medusa":
        return helpers.medusa()
    if kind == "lookup":
        return helpers.auto(**kw)
    return helpers.eagle(True, **kw)


@pytest.mark.parametrize("kind,kw", [("ngram", {}), ("draft", {}), ("hybrid", {}), ("medusa", {}),
                                     (True, dict(depth=3, width=2, nodes=5)),
                                     ("lookup", dict(depth=3, width=2, nodes=5))])
def test_steps_alternating_plain_and_speculative_stay_exact(monkeypatch, kind, kw):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
    ps = prompts()
    ps = [p + p[:5] for p in ps]  # some repetition, so prompt lookup finds matches
    want = [hf_greedy(hf, p, 16) for p in ps]
    d = make(kind, kw)
    eng = Engine(target().model, d, k=4)
    helpers.always_drafting(monkeypatch, eng.policy)  # (every row drafts: the guard decides)
    eng.guard = Alternate()
    res = eng.generate(ps, SamplingParams(max_new_tokens=16))
    assert [r.tokens for r in res] == want
    assert eng.guard.decisions[True] > 0 and eng.guard.decisions[False] > 0
    assert sum(r.stats.proposed for r in res) > 0


def test_seeded_samples_of_sampled_guesses_take_deterministic_ones_under_the_cost_model(monkeypatch):
    """A seeded sampled batch with a drafter whose guesses are drawn from a q (an EAGLE chain):
    under the cost model it asks for deterministic guesses, so the seeded text is plain
    sampling's whatever timing decided, and the guard is asked as for greedy batches. At a fixed
    k it draws its guesses from q on every step, and no guard is asked (timing must not decide
    its random numbers)."""
    calls = []
    monkeypatch.setattr(BatchGuard, "speculate", lambda self, rows: calls.append(rows) or True)
    seeded = SamplingParams(max_new_tokens=8, temperature=0.8, seed=3)
    plain = [r.tokens for r in Engine(target().model, None).generate(prompts(), seeded)]
    for fixed_k in (False, True):
        chain, asked = helpers.eagle(False), []
        propose = chain.propose
        chain.propose = lambda ctx, k: asked.append(ctx.params.greedy) or propose(ctx, k)
        calls.clear()
        engine = Engine(target().model, chain, k=3, fixed_k=fixed_k)
        helpers.always_drafting(monkeypatch, engine.policy)  # whatever this machine's timing
        res = engine.generate(prompts(), seeded)
        assert asked and sum(r.stats.proposed for r in res) > 0
        if fixed_k:
            assert calls == [] and not any(asked)  # drawn from q, every step
        else:
            assert calls and all(asked) and [r.tokens for r in res] == plain


def test_server_batcher_with_steps_turned_plain_stays_exact():
    """The server's batcher behind the same guard: with steps alternately turned plain (rows
    joining and leaving), every answer still equals plain greedy decoding and trees still ran."""
    b = helpers.batcher(helpers.auto(depth=3, width=2, nodes=5))
    b.policy.eager = True  # trees on these short answers, every other step
    b.guard = Alternate()
    got, want = helpers.run_join_leave(b)
    assert got == want
    assert b.guard.decisions[True] > 0 and b.guard.decisions[False] > 0
    assert b.stats().source_rows.get("eagle", 0) > 0


@pytest.mark.parametrize("broken", [False, True])
def test_sampling_with_steps_alternating_plain_and_speculative_follows_the_target(monkeypatch, broken):
    """Sampled batches whose steps alternate between plain and speculative (auto's lookup +
    tree) still follow the target's exact distribution (chi-square over the first 3 tokens,
    transformers' probabilities as the oracle). A broken plain step (the most likely token
    instead of a sample) must be caught by the same check."""
    from transformers import AutoModelForCausalLM

    from helpers import CTX, SV
    from oracle import chi2_against

    import specdec.core.step as step_mod

    if broken:  # plain steps take the most likely token instead of sampling it
        orig_verify = step_mod.verify_stochastic

        def verify(probs, tokens, q, counts, gen, *draws):
            if int(counts.sum()) == 0:
                return torch.zeros_like(counts), probs[:, 0].argmax(-1)
            return orig_verify(probs, tokens, q, counts, gen, *draws)

        monkeypatch.setattr(step_mod, "verify_stochastic", verify)
    params = dict(temperature=0.9)
    tg = target(3, SV)
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(3, SV)), dtype=torch.float32).eval()
    rows = [list(CTX[i % 2]) for i in range(800)]
    out = {c: [] for c in CTX}
    guard = Alternate()
    for s in range(5):
        d = helpers.auto(3, SV, depth=2, width=3, nodes=6)
        eng = Engine(tg.model, d, k=2)
        eng.policy.eager = True  # speculate on these 4-token answers, every other step
        eng.guard = guard
        res = eng.generate(rows, SamplingParams(max_new_tokens=4, seed=900 + s, **params))
        for p, r in zip(rows, res):
            out[tuple(p)].append(r.tokens[:3])
    assert guard.decisions[True] > 0 and guard.decisions[False] > 0
    results = chi2_against(hf, out, params)
    rejected = [label for label, r in results if r.rejected]
    assert bool(rejected) == broken, (broken, results)


@pytest.mark.parametrize("closed", [True, False])
def test_a_closed_batch_speculates_only_where_it_moves_the_rows_it_waits_for(closed):
    """A closed batch (Engine.generate: no row joins later) ends with its row that has the most
    left to write. Four rows of 40 tokens: speculating costs 1.3 plain steps and row 0 alone
    accepts 3 guesses a step (the others none). Counted by every row's tokens (the server's rule,
    where a finished row's slot goes to the next request) speculation wins, 7 tokens a step
    against 4, while row 0 lasts, yet the batch still takes 40 steps, each speculative one
    dearer; counted by the rows the batch waits for, it loses, and the guard falls back to plain
    steps (the batch's time within its probes of plain decoding's 40)."""
    g = BatchGuard(probe_every=16, closed=closed)
    left, spec_steps, steps, seconds = {0: 40, 1: 40, 2: 40, 3: 40}, 0, 0, 0.0  # row -> its room
    while left:
        s = g.speculate(len(left))
        accepted = {r: min(3, n - 1) if s and r == 0 else 0 for r, n in left.items()}
        g.observe(len(left), s, g.progress(list(left.values()), list(accepted.values())), 1.3 if s else 1.0)
        spec_steps, steps, seconds = spec_steps + s, steps + 1, seconds + (1.3 if s else 1.0)
        left = {r: n - 1 - accepted[r] for r, n in left.items() if n - 1 - accepted[r] > 0}  # finished rows leave
    assert steps == 40  # rows 1-3 take one token a step either way
    if not closed:
        assert spec_steps >= 8 and seconds > 42  # speculating while row 0 lasts: the batch ends later
        return
    assert spec_steps <= 4 and seconds <= 41.2, (spec_steps, seconds)
    assert g.progress([10, 10, 10], [3, 0, 1]) == 3  # the fewest any row with the most room took, x 3
    assert g.progress([6, 10, 10], [3, 1, 2]) == 6  # row 0, already ahead, is not waited for
    assert BatchGuard().progress([6, 10, 10], [3, 1, 2]) == 9  # an open batch: every row's tokens


def test_a_single_row_has_a_band_of_its_own_when_guarded():
    """min_rows=1: one row falls back to plain decoding where speculation loses, measured apart
    from batches of two."""
    g = BatchGuard(min_rows=1, probe_every=16)
    one = run(g, 1, spec_rate=60, plain_rate=100, steps=64)
    assert sum(one[16:]) <= 4 and any(one[16:])
    two = run(g, 2, spec_rate=150, plain_rate=100, steps=40)
    assert sum(two[8:]) >= 28


def test_engine_guards_batches_of_every_priced_drafter_and_none_at_a_fixed_k():
    """Every drafter the cost model prices (prompt lookup, a draft model, a drafter run through
    the protocol) is guarded in batches of 2+ rows, as the server guards them (a single row is
    priced by the cost model alone); at a fixed k, or for a drafter that may not sit a step out,
    every step drafts: no guard."""
    from oracle import RandomGuessDrafter

    model = target(0).model
    draft = helpers.draft_model(1)
    assert Engine(model, draft, k=4).guard.min_rows == 2
    assert Engine(model, draft, k=4, fixed_k=True).guard is None
    assert Engine(model, helpers.lookup(), k=4).guard.min_rows == 2
    protocol = RandomGuessDrafter(V)
    assert Engine(model, protocol, k=4).guard is None and not Engine(model, protocol, k=4).policy.adaptive
    protocol.may_skip = True
    engine = Engine(model, protocol, k=4)
    assert engine.policy.adaptive and engine.guard.min_rows == 2
    assert Engine(model, None).guard is None
    # generate's rows start together: its guard and cost model count what the batch waits for
    assert engine.guard.closed and engine.policy.closed
