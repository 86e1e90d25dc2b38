"""`--method auto`'s fall-back to plain decoding through the engine, counted in head calls and
verified nodes (not wall time): a tree that is never accepted ends up drafted only as rare probes,
greedy and seeded-sampled alike; a short answer pays for no probe at all; a seeded sample's text
does not depend on the clock. Tiny random target and head. (The cost model alone, on synthetic
timings: test_policy.py.)"""

from __future__ import annotations

import random

import pytest
import torch

from helpers import V, auto, prompts, target
from specdec.drafters import ngram
from specdec.engine import Engine
from specdec.policy import SETTLE_STEPS, LoadPolicy, ProbeSchedule, SourceStats
from specdec.types import SamplingParams

SEEDED = dict(temperature=0.8, seed=3)


def plain(ps, params):
    return [r.tokens for r in Engine(target().model).generate(ps, params)]


def drafter():
    return auto(depth=3, width=2, nodes=5)


def never_accepted(sources, bad: int) -> list[int]:
    """Make the head's every tree node the token `bad`; returns a list that grows by one per tree
    call (its context length)."""
    head = sources[1]
    calls, propose = [], head.propose

    def wrong(ctx, k):
        tree = propose(ctx, k)
        tree.tokens = torch.full_like(tree.tokens, bad)
        if ctx.want is not None:  # (a proposal for the scheduler's rows, not the head timed alone)
            calls.append(len(ctx.tokens[0]))
        return tree

    head.propose = wrong
    return calls


def unused_token(outputs) -> int:
    seen = {t for out in outputs for t in out}
    return next(t for t in range(V - 1, -1, -1) if t not in seen)


@pytest.fixture
def no_lookups(monkeypatch):
    """Every step would draft the tree: the gate alone decides."""
    monkeypatch.setattr(ngram.SuffixIndex, "match", lambda *a, **k: (0, []))


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_tree_never_accepted_ends_up_as_rare_probes(monkeypatch, no_lookups, sampling):
    """The probes' schedule (their budget aside: test_policy.py): after 16, 32, 64, 128 declined
    steps, a handful in 300."""
    import helpers

    helpers.pinned_timing(monkeypatch)  # (measured prices on a loaded machine let the cost model take trees outright)
    monkeypatch.setattr(ProbeSchedule, "affordable", lambda self, cost, left: True)
    n = 300
    params = SamplingParams(max_new_tokens=n, **(SEEDED if sampling == "seeded" else {}))
    p = prompts()[1]
    want = plain([p], params)
    d = drafter()
    trees = never_accepted(d, unused_token(want) if sampling == "greedy" else V - 1)
    [res] = Engine(target().model, d, k=3).generate([p], params)
    assert [res.tokens] == want  # sampled too: the seed's text, whatever was drafted (verify.py)
    steps = res.stats.target_forwards
    late = [c for c in trees if c - len(p) > n // 2]  # tree calls in the second half
    # probes after 16, 32, 64, 128 declined steps once a tree has failed: a handful in 300 steps
    # (3 here, after 18, 52 and 120 steps; a probe every 16 steps makes 12, from 18 to 205)
    assert 1 <= len(trees) <= 4 and len(late) <= 1, (len(trees), steps)
    # and verified little beyond the pending token: at most the probes' nodes
    assert res.stats.proposed <= 5 * len(trees) * 4


@pytest.mark.parametrize("rule", ["back off", "price every step"])
def test_one_row_whose_head_keeps_losing_is_priced_ever_more_rarely(monkeypatch, no_lookups, rule):
    """One row, nothing known on offer, a head the cost model keeps declining: its steps are priced
    after 2, 4, then every 8 declined steps (BatchGuard.priced), not on every step (pricing cost
    ~0.1-0.15 ms of a ~4 ms step of the default model), while the head's probes still come on
    their own schedule; the text is plain decoding's. The broken rule prices every step."""
    import helpers
    from specdec.policy import BatchGuard

    helpers.pinned_timing(monkeypatch)
    monkeypatch.setattr(ProbeSchedule, "affordable", lambda self, cost, left: True)
    if rule == "price every step":
        monkeypatch.setattr(BatchGuard, "priced", lambda self, rows: True)
    priced, choose = [], LoadPolicy.choose
    monkeypatch.setattr(LoadPolicy, "choose", lambda self, *a, **k: priced.append(1) or choose(self, *a, **k))
    params = SamplingParams(max_new_tokens=300)
    p = prompts()[1]
    want = plain([p], params)
    d = drafter()
    trees = never_accepted(d, unused_token(want))
    [res] = Engine(target().model, d, k=3).generate([p], params)
    assert [res.tokens] == want
    steps = res.stats.target_forwards
    if rule == "price every step":
        assert len(priced) >= steps - 1, (len(priced), steps)
        return
    # ~1 in 8 once the gap is at its longest, after the first SETTLE_STEPS, which the chooser
    # answers at once (nothing fitted yet: `warming`)
    assert len(priced) <= SETTLE_STEPS + steps // 5, (len(priced), steps)
    assert 1 <= len(trees) <= 4, trees  # the probes: as test_a_tree_never_accepted_ends_up_as_rare_probes


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_short_answer_pays_for_no_probe(monkeypatch, no_lookups, sampling):
    """A fresh drafter: nothing measured, 40 tokens to go, so probing (the head catching up on
    the whole prompt) could not pay back; the head is never run. (A steady clock: the same
    prices on any machine.)"""
    import helpers

    helpers.steady_clock(monkeypatch)
    params = SamplingParams(max_new_tokens=40, **(SEEDED if sampling == "seeded" else {}))
    p = prompts()[1]
    d = drafter()
    trees = never_accepted(d, 0)
    [res] = Engine(target().model, d, k=3).generate([p], params)
    assert trees == [] and res.stats.proposed == 0
    assert [res.tokens] == plain([p], params)


def test_the_probes_wait_for_room_a_broken_rule_would_probe(monkeypatch, no_lookups):
    """The room rule and the probes' budget can fail: without them the same short answer probes
    at step 16."""
    import helpers

    helpers.steady_clock(monkeypatch)
    monkeypatch.setattr(ProbeSchedule, "affordable", lambda self, cost, left: True)
    d = drafter()
    trees = never_accepted(d, 0)
    engine = Engine(target().model, d, k=3)
    engine.policy.probe_room = 0
    engine.generate([prompts()[1]], SamplingParams(max_new_tokens=40))
    assert len(trees) >= 1


def test_seeded_text_ignores_timing(monkeypatch):
    """A seeded sample's text does not depend on what was drafted: noise in every measured time
    and a learnt state from elsewhere (which change the trees drafted) change nothing."""
    ps = prompts()
    params = SamplingParams(max_new_tokens=90, **SEEDED)

    def run(noisy: bool):
        engine = Engine(target().model, drafter(), k=3)
        if noisy:
            noise = random.Random(7)
            engine.policy.source("eagle", False, True, 0.6, 5).gain = 5.0  # a learnt state: the tree pays
            # the head's price, in the cost model's choice and in the tree's cut, at random each step
            monkeypatch.setattr(SourceStats, "draft_seconds", lambda self, rows: noise.choice([0.0, 1.0]) * rows)
            monkeypatch.setattr(LoadPolicy, "draft_steps", lambda self, stats, drafting, rows: noise.uniform(0, 3))
        res = engine.generate(ps, params)
        return [r.tokens for r in res], sum(r.stats.sources.get("eagle", [0])[0] for r in res)

    first, _ = run(False)
    again, trees = run(True)
    assert again == first and trees > 0
    monkeypatch.undo()
    assert run(False)[0] == first


def test_learned_key_tells_greedy_from_sampled():
    from specdec.config import SpecConfig
    from specdec.flags import build_parser

    class Target:
        path, weights = "m.gguf", "fp32"

    keys = {SpecConfig.from_args(build_parser().parse_args(["generate", "x", *flags])).learned_key(Target())
            for flags in ([], ["--temperature", "0.7"], ["--temperature", "0.7", "--seed", "1"])}
    assert len(keys) == 2  # greedy, sampled (seeded or not)


def test_the_scheduler_times_a_fresh_draft_model_alone():
    """A scheduler running a draft model the cost model has not timed times it alone before any
    request: its drafting time per guess and its time per token read, from forwards on a
    scratch cache of its own."""
    from helpers import draft_model
    from specdec.core.scheduler import ContinuousBatcher

    policy = LoadPolicy(4)
    ContinuousBatcher(target().model, (), [draft_model(0)], method="draft", k_max=4, thread=False, policy=policy)
    stats = policy.sources["draft"]
    assert stats.timed and stats.draft_seconds(1) > 0 and stats.t_catch > 0
    assert policy.steps.all.weight == 0  # (no step ran)


@pytest.mark.parametrize("rule", ["priced", "fixed k"])
def test_on_a_machine_where_verification_is_dear_auto_keeps_plain_decodings_rate(rule):
    """On a simulated machine where each scored token costs 0.3 of a step (specdec.simclock: the
    clock moves only by the forwards' modelled costs, every run alike), a fresh auto engine (a
    random head, random prompts) decodes one row and a batch of 6 at 0.97 of plain decoding's
    rate or better, greedy, with the same text; drafting every step (a fixed k: a broken rule for
    this) loses. (On the Xeon's profile the batch of 6 comes to 0.969: its probes of a guess more
    break even, and the rows they help end early, leaving the last row in smaller batches.)"""
    profile = "dear"
    from specdec.simclock import PROFILES, SimClock, charge, curve, simulated

    clock, cost = SimClock(), curve(PROFILES[profile])
    tg = target()
    g = torch.Generator().manual_seed(9)
    ps = [torch.randint(0, V, (n,), generator=g).tolist() for n in (12, 30, 7, 21, 16, 9)]
    params = SamplingParams(max_new_tokens=48)
    rates = {}
    with simulated(clock):
        charge(tg.model, clock, lambda tokens: 0.01 * cost(tokens))
        try:
            for name in ("none", "auto"):
                for batch in (ps[:1], ps):
                    engine = Engine(tg.model) if name == "none" else Engine(tg.model, auto(depth=3, width=2, nodes=6), k=4,
                                                                            fixed_k=rule != "priced")
                    results = engine.generate(batch, params)
                    if name == "auto":
                        assert [r.tokens for r in results] == plain(batch, params)
                    rates[name, len(batch)] = sum(r.stats.new_tokens for r in results) / \
                        max(r.stats.decode_s for r in results)
        finally:
            del tg.model.forward  # the instance's charged forward; the class's is back
    ratios = [rates["auto", n] / rates["none", n] for n in (1, len(ps))]
    assert all(r >= 0.97 for r in ratios) == (rule == "priced"), ratios


@pytest.mark.parametrize("rule", ["priced", "fixed k"])
def test_the_servers_scheduler_keeps_plain_decodings_rate_where_verification_is_dear(rule):
    """The server's path (a long-lived ContinuousBatcher, each request its own sampling settings,
    requests arriving together) on the simulated machine where a scored token costs 0.3 of a step:
    levels of 1, 3 and 6 concurrent requests each finish at 0.97 of plain decoding's rate or
    better with plain's text; drafting every step (a fixed k) loses at some level."""
    from specdec.core.request import Request
    from specdec.core.scheduler import ContinuousBatcher
    from specdec.simclock import PROFILES, SimClock, charge, curve, simulated

    clock, cost = SimClock(), curve(PROFILES["dear"])
    tg = target()
    g = torch.Generator().manual_seed(11)
    levels = [[torch.randint(0, V, (n,), generator=g).tolist() for n in sizes]
              for sizes in ((14,), (9, 25, 12), (12, 30, 7, 21, 16, 9))]
    params = SamplingParams(max_new_tokens=40)
    took: dict[str, list[float]] = {}
    with simulated(clock):
        charge(tg.model, clock, lambda tokens: 0.01 * cost(tokens))
        try:
            for name in ("none", "auto"):
                sources = auto(depth=3, width=2, nodes=6) if name == "auto" else []
                batcher = ContinuousBatcher(tg.model, (), sources, method=name, k_max=4 if sources else 0,
                                            max_batch=8, thread=False, adaptive=rule == "priced")
                for ps in levels:
                    done = []
                    reqs = [Request(list(p), params, lambda ids: None, lambda reason, stats: done.append(1))
                            for p in ps]
                    for req in reqs:
                        batcher.submit(req)
                    t0 = clock()
                    batcher.run(until=lambda: len(done) == len(ps))
                    took.setdefault(name, []).append(clock() - t0)
                    if name == "auto":
                        assert [r.tokens for r in reqs] == plain(ps, params)
        finally:
            del tg.model.forward  # the instance's charged forward; the class's is back
    ratios = [none / spec for none, spec in zip(took["none"], took["auto"])]
    assert all(r >= 0.97 for r in ratios) == (rule == "priced"), ratios


def test_a_fresh_engine_does_not_fit_the_steps_right_after_its_prefill():
    """The steps right after a prefill run slower for a while (on a 2-core Xeon the first ~1.5x a
    step ten later), plain and speculative alike; while every row of a step joined within
    SETTLE_STEPS steps the step is not fitted, so a fresh engine prices a plain step from the
    steps after them (fitted, they had set its plain step that high, and a draft model that
    drafted on never measured it again)."""
    from specdec.policy.fits import FIT_DECAY

    engine = Engine(target().model, [ngram.NgramDrafter()], k=3)
    res = engine.generate([prompts()[1]], SamplingParams(max_new_tokens=24))
    steps = res[0].stats.target_forwards
    assert steps > SETTLE_STEPS
    fitted = sum(FIT_DECAY ** i for i in range(steps - SETTLE_STEPS))
    assert engine.policy.steps.all.weight == pytest.approx(fitted)
