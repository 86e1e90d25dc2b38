"""`--method auto`'s fall-back to plain decoding, counted in drafter calls and verified nodes (not
wall time): a tree that is never accepted ends up drafted only as rare probes, greedy and
seeded-sampled alike; a short answer pays for no probe at all; a seeded sample's text does not
depend on the clock. Tiny random target and head (test_eagle's)."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.drafters import ngram
from specdec.core.policy import LoadPolicy, ProbeSchedule
from specdec.drafters.hybrid import LookupEagleDrafter
from specdec.engine import Engine
from specdec.types import SamplingParams

from test_eagle import V, drafter, prompts, target

SEEDED = dict(temperature=0.8, seed=3)


def plain(ps, params):
    return [r.tokens for r in Engine(target().model).generate(ps, params)]


def never_accepted(d: LookupEagleDrafter, bad: int) -> list[int]:
    """Make the head's every tree node the token `bad`; returns a list that grows by one per tree call."""
    calls, propose = [], d.eagle.propose

    def wrong(ctx, k, rows=None, min_logp=None):
        tree = propose(ctx, k, rows=rows, min_logp=min_logp)
        tree.tokens = torch.full_like(tree.tokens, bad)
        calls.append(len(ctx.tokens[0]))
        return tree

    d.eagle.propose = wrong
    return calls


def unused_token(outputs) -> int:
    seen = {t for out in outputs for t in out}
    return next(t for t in range(V - 1, -1, -1) if t not in seen)


@pytest.fixture
def no_lookups(monkeypatch):
    """Every step would draft the tree: the gate alone decides."""
    monkeypatch.setattr(ngram.SuffixIndex, "match", lambda *a, **k: (0, []))


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_tree_never_accepted_ends_up_as_rare_probes(no_lookups, sampling):
    n = 300
    params = SamplingParams(max_new_tokens=n, **(SEEDED if sampling == "seeded" else {}))
    p = prompts()[1]
    want = plain([p], params)
    d = drafter("lookup", depth=3, width=2, nodes=5)
    trees = never_accepted(d, unused_token(want) if sampling == "greedy" else V - 1)
    [res] = Engine(target().model, d, k=3).generate([p], params)
    assert [res.tokens] == want  # sampled too: the seed's text, whatever was drafted (verify.py)
    steps = res.stats.target_forwards
    late = [c for c in trees if c - len(p) > n // 2]  # tree calls in the second half
    # probes after 16, 32, 64, 128 declined steps once a tree has failed: a handful in 300 steps
    assert 1 <= len(trees) <= 12 and len(late) <= 3, (len(trees), steps)
    # and verified little beyond the pending token: at most the probes' nodes
    assert res.stats.proposed <= 5 * len(trees) * 4


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_short_answer_pays_for_no_probe(no_lookups, sampling):
    """A fresh drafter: nothing measured, 40 tokens to go, so probing (the head catching up on
    the whole prompt) could not pay back; the head is never run."""
    params = SamplingParams(max_new_tokens=40, **(SEEDED if sampling == "seeded" else {}))
    p = prompts()[1]
    d = drafter("lookup", depth=3, width=2, nodes=5)
    trees = never_accepted(d, 0)
    [res] = Engine(target().model, d, k=3).generate([p], params)
    assert trees == [] and res.stats.proposed == 0
    assert [res.tokens] == plain([p], params)


def test_the_probes_wait_for_room_a_broken_rule_would_probe(no_lookups):
    """The room rule can fail: without it the same short answer probes at step 16."""
    d = drafter("lookup", depth=3, width=2, nodes=5)
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
        d = drafter("lookup", depth=3, width=2, nodes=5)
        if noisy:
            noise = random.Random(7)
            d.gain = 5.0  # a learnt state that says the tree pays
            # the head's price, in the cost model's choice and in the tree's cut, at random each step
            monkeypatch.setattr(LoadPolicy, "head_cost", lambda self, A: noise.choice([0.0, 1.0]) * A)
            monkeypatch.setattr(LoadPolicy, "head_steps", lambda self, tree_rows, A: noise.uniform(0, 3))
        return [r.tokens for r in Engine(target().model, d, k=3).generate(ps, params)], d.rows_drafted["eagle"]

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


def fit_steps(policy: LoadPolicy, r: float, rows: int = 1) -> None:
    """Steps of `rows` rows whose time is 1 + r * guesses plain steps, at every cap: the step-time
    fit prices a plain step at 1 and a guess at r."""
    for _ in range(8):
        for k in range(policy.k_max + 1):
            policy.observe_step(rows, k, 1.0 + r * k)


def test_a_draft_model_pays_only_above_its_drafting_and_verification_cost():
    """The cost model (auto with a draft model) lets a row take the draft model's guesses while a
    guess's acceptance exceeds c (its drafting time in plain steps) plus r (verifying it): a draft
    whose first guess holds 30% of the time at c = 0.2 drafts one guess where verifying is cheap
    (r 0.05) and none where it is dear (r 0.15); its second guess, which never holds, is never
    drafted."""
    for r, want in ((0.05, (1, [True])), (0.15, (0, [False]))):
        policy = LoadPolicy(4)
        policy.draft_odds.acc[0][:2], policy.draft_odds.seen[0][:2] = [3.0, 0.0], [10.0, 10.0]
        policy.observe_draft_time(1, 0.2)
        fit_steps(policy, r)
        assert policy.choose_draft([[]], [[1.0]], 1, [True], [100], [1]) == want, r


def priced_run(c: float, r: float, holds: list[float], steps: int = 300, k: int = 4, room: int = 10_000,
               catch_up: float = 0.25, later: tuple[int, list[float]] | None = None, timed_alone: bool = True,
               rule: str = "priced"):
    """Drive the scheduler's cost model for auto with a draft model (`LoadPolicy.choose_draft`,
    one row, a text that never repeats: no lookups) over `steps` steps on a clock in plain
    steps, as the scheduler feeds it: drafting costs `c` per guess plus `catch_up` per token the
    draft model has not read (a 40-token prompt at first, then every step it sat out), a step
    verifying j guesses 1 + r j; the i-th guess holds with probability holds[i-1] given that the
    ones before it held (a fixed seed; from step later[0] on, later[1] instead). timed_alone:
    the scheduler timed the draft model alone first (else it is priced free until it drafts).
    rule: "priced" (the cost model), "always" (--fixed-k: every step drafts k), "free probes"
    (probes that ignore their catch-up's cost and whether the draft model could pay), "no room"
    (a first catch-up before the step-time fit waits for no room). Returns (the
    steps that drafted, their lengths, committed tokens per plain step's time: plain decoding's
    rate is 1)."""
    policy = LoadPolicy(k, adaptive=rule != "always")
    if timed_alone:
        policy.observe_draft_time(1, c)
        policy.t_catch = catch_up
    if rule == "free probes":
        policy.catch_up_cost = lambda behind: 0.0
        policy._could_pay = lambda rows, per_token: True
    if rule == "no room":
        policy.probe_room = 0
    rng = random.Random(0)
    behind, committed, clock = 40, 0, 0.0
    at, lengths = [], []
    for step in range(steps):
        left = room - committed - 2
        if left < 0:
            break
        cap, use = policy.choose_draft([[]], [[1.0]], step, [True], [left], [behind])
        j = min(cap, left) if use[0] else 0
        if j:
            seconds = c * j + catch_up * (behind - 1)  # (the pending token: read in the first forward)
            if behind <= j + 2:
                policy.observe_draft_time(1, seconds / j)
            else:
                policy.observe_catch_up(seconds, behind, j)
            clock += seconds
            at.append(step)
            lengths.append(j)
        clock += 1.0 + r * j
        policy.observe_step(1, j, 1.0 + r * j)
        if later is not None and step == later[0]:
            holds = later[1]
        held = 0
        while held < j and rng.random() < holds[min(held, len(holds) - 1)]:
            held += 1
        policy.observe_draft([j], [held])
        committed += held + 1
        behind = 1 if j else behind + held + 1
    return at, lengths, committed / clock


@pytest.mark.parametrize("rule", ["priced", "always", "free probes"])
def test_a_draft_that_cannot_pay_is_dropped_after_timing_it(rule):
    """A draft whose guesses nearly always hold (90%) but whose cost alone rules it out (c 0.5 +
    r 0.6 per guess, more than the one token a guess can gain): after the first steps that
    fit the step time it never drafts again, not even as a probe (each probe would pay a
    catch-up on the steps it sat out), and decodes at plain decoding's rate or near it. Drafting
    every step, or probing without pricing the probe, fails here."""
    at, _, rate = priced_run(c=0.5, r=0.6, holds=[0.9], rule=rule)
    ok = len(at) <= 6 and max(at, default=0) < 50 and rate > 0.9
    assert ok == (rule == "priced"), (at, rate)


@pytest.mark.parametrize("rule", ["priced", "always"])
def test_a_draft_that_is_seldom_right_is_dropped_within_a_few_steps(rule):
    """A cheap draft (c 0.3, r 0.1) whose guesses hold 20% of the time: it costs more than it
    gains, so the cost model drops it within a few steps and, its catch-up being dear (0.25 steps
    a token sat out), does not probe it: a handful of proposals in 300 steps, at least 0.95 of
    plain decoding's rate. Drafting every step fails both."""
    at, _, rate = priced_run(c=0.3, r=0.1, holds=[0.2], rule=rule)
    ok = len(at) <= 10 and rate > 0.95
    assert ok == (rule == "priced"), (at, rate)


@pytest.mark.parametrize("rule", ["priced", "always"])
def test_a_draft_that_pays_for_its_first_guess_keeps_drafting_one(rule):
    """A cheap draft (c 0.3, r 0.1) whose first guess holds 95% of the time and later ones 10%:
    one guess a step pays (1.95 tokens for 1.4 steps), more do not. The cost model drafts
    nearly every step, one guess (two on its probes), at 1.3x plain decoding's rate or more;
    4 guesses every step is slower than plain decoding."""
    at, lengths, rate = priced_run(c=0.3, r=0.1, holds=[0.95, 0.1], rule=rule)
    ok = len(at) >= 280 and rate > 1.3 and sum(n == 1 for n in lengths[-100:]) >= 90
    assert ok == (rule == "priced"), (len(at), rate, lengths[-20:])


def test_a_draft_that_pays_at_every_position_drafts_them_all():
    """A cheap draft (c 0.2, r 0.05) whose guesses hold 90% of the time at every position drafts
    every step, soon the full 4 guesses nearly always, at 1.8x plain decoding's rate or more."""
    at, lengths, rate = priced_run(c=0.2, r=0.05, holds=[0.9])
    assert len(at) >= 290 and sum(n == 4 for n in lengths[-100:]) >= 90 and rate > 1.8, (len(at), rate)


@pytest.mark.parametrize("catch_up", [0.01, 0.25])
def test_a_draft_that_starts_to_pay_is_noticed_where_probes_are_cheap(catch_up):
    """A draft seldom right for 100 steps (20%), then right 90% of the time (c 0.3, r 0.1): with a
    cheap catch-up (0.01 steps a token) the probes (after 16, 32, 64 declined steps) notice and
    it drafts most of the last 100 steps; with a dear one (0.25) it is not probed, and never
    drafts after its first few steps."""
    at, _, rate = priced_run(c=0.3, r=0.1, holds=[0.2], catch_up=catch_up, later=(100, [0.9]))
    late = sum(step >= 200 for step in at)
    if catch_up < 0.1:
        assert late >= 90, (at, rate)
    else:
        assert late == 0 and len(at) <= 10, (at, rate)


@pytest.mark.parametrize("rule", ["priced", "no room"])
def test_a_short_answer_does_not_start_the_draft_model(rule):
    """With 24 tokens to go, the draft model's catch-up on a 40-token prompt (10 plain steps)
    could not pay back even for a draft that pays once caught up: it never runs. Without the
    room rule the first steps, which measure the step time with and without guesses, pay it."""
    at, _, rate = priced_run(c=0.2, r=0.05, holds=[0.9], steps=20, room=24, rule=rule)
    assert (at == [] and rate == 1.0) == (rule == "priced"), (at, rate)


def probe_steps(schedule, declined: int, measured=lambda step: True) -> list[int]:
    """The declined steps (of `declined` in a row) at which `schedule` probes; measured(step)
    False marks a probe that only caught the drafter up (`again(measured=False)`)."""
    out = []
    for step in range(declined):
        if schedule.due():
            out.append(step)
            if not measured(step):
                schedule.again(measured=False)
    return out


def test_probes_back_off_to_their_longest_gap():
    """After every, 2x every, 4x ... up to `most` times every declined steps: a gate that keeps
    declining costs a vanishing share of probes."""
    steps = probe_steps(ProbeSchedule(every=4, most=8), 200)
    assert [b - a for a, b in zip([-1] + steps, steps)] == [4, 8, 16, 32, 32, 32, 32, 32][: len(steps)]


def test_a_probe_that_only_caught_up_is_followed_at_once_and_does_not_back_off():
    """The tree's first probe catches the head up (it measures nothing): the next declined step
    probes again, and the gap after that is still the first one."""
    steps = probe_steps(ProbeSchedule(every=4), 60, measured=lambda step: step != 3)
    assert steps[:3] == [3, 4, 12]


def test_taking_the_choice_restarts_the_gap_and_room_defers_a_probe():
    schedule = ProbeSchedule(every=4)
    assert probe_steps(schedule, 20) == [3, 11]
    schedule.taken()
    assert [schedule.due(room=step >= 5) for step in range(7)] == [False, False, False, False, False, True, False]


def protocol_run(c: float, r: float, holds: list[float], steps: int = 240, k: int = 4, rows=lambda step: 1,
                 tree: tuple[int, int] | None = None, rule: str = "priced") -> tuple[list[int], float]:
    """Drive the cost model as the scheduler drives it for a drafter run through the protocol
    (Medusa, an EAGLE head alone, your own), with no catch-up: a chain (`choose_draft`, no
    lookup), or with tree = (nodes, depth) a tree (`choose_tree`), over `steps` steps of
    rows(step) rows on a clock in plain steps. Drafting costs `c` a guess (a tree: a node); a step
    verifying j guesses a row (a tree: its nodes) costs 1 + r j at one row and 2 + 16 r j at more
    (a batch turns compute-bound: each row's guess costs 4 r); the i-th guess (a tree: depth i) holds with probability
    holds[i-1] given that the ones before it held (a fixed seed). rule: "priced" (the cost model),
    "always" (a fixed k). Returns the length drafted each step (a tree: its depth or 0) and
    committed tokens per plain step's time per row (plain decoding's rate is 1)."""
    policy = LoadPolicy(k, adaptive=rule != "always")
    rng = random.Random(0)
    lengths, committed, clock = [], 0, 0.0
    for step in range(steps):
        A = rows(step)
        if tree is None:
            cap, use = policy.choose_draft([[]] * A, None, step, [True] * A, [10_000] * A)
            slots = depth = cap if use[0] else 0
        else:
            cap, use = policy.choose_tree(step, [True] * A, [10_000] * A, tree[0])
            slots, depth = tree if cap and use[0] else (0, 0)
        plain = 1.0 if A == 1 else 2.0
        seconds = plain + (r if A == 1 else 16 * r) * slots
        if slots:
            policy.observe_draft_time(A, c)
            clock += c * slots
        clock += seconds
        policy.observe_step(A, slots, seconds)
        held = []
        for _ in range(A):
            n = 0
            while n < depth and rng.random() < holds[min(n, len(holds) - 1)]:
                n += 1
            held.append(n)
        policy.observe_draft([depth] * A, held)
        committed += (sum(held) + A) / A * plain
        lengths.append(depth)
    return lengths, committed / clock


def test_a_protocol_chain_drafts_the_guesses_that_pay():
    """A chain whose first guess holds half the time and whose later ones never do, at c 0.2 +
    r 0.1 a guess: one guess pays (1.5 tokens for 1.3 steps' time), so it drafts one (two every
    16th step, to keep the next position measured). (A first guess that holds 40% of the time,
    1.08x at best, is dropped after a few unlucky steps: acceptance is learnt only from what is
    drafted, and the probes back off.)"""
    lengths, rate = protocol_run(c=0.2, r=0.1, holds=[0.5, 0.0])
    late = lengths[120:]
    assert late.count(1) >= 0.85 * len(late) and set(late) <= {1, 2} and rate > 1.08, (late, rate)


@pytest.mark.parametrize("rule", ["per position", "mean"])
def test_the_draft_odds_weigh_each_position_on_its_own(monkeypatch, rule):
    """The first guess held 5 times in 10, the next three never (each seen 10 times), at c 0.2 +
    r 0.1 a guess: the first guess pays (1.5 tokens for 1.3 steps' time). One mean acceptance
    over all drafted positions (a broken rule here, the one a former length policy had) lets the
    bad tail stop it (0.125: 1.125 tokens for 1.3)."""
    from specdec.core.policy import LengthPolicy

    if rule == "mean":
        def mean_held(self, n, k):
            k = min(k, len(self.acc[n]))
            a = sum(self.acc[n][:k]) / sum(self.seen[n][:k])
            return [a ** (i + 1) for i in range(k)]

        monkeypatch.setattr(LengthPolicy, "held", mean_held)
    policy = LoadPolicy(4)
    policy.draft_odds.acc[0][:4], policy.draft_odds.seen[0][:4] = [5.0, 0.0, 0.0, 0.0], [10.0] * 4
    policy.observe_draft_time(1, 0.2)
    fit_steps(policy, 0.1)
    assert policy.choose_draft([[]], None, 1, [True], [100])[0] == (1 if rule == "per position" else 0)


def test_a_protocol_chain_is_priced_at_its_batch_size():
    """In a batch a guess costs more (the step turns compute-bound): a chain whose first guess
    holds 60% of the time (c 0.2) pays at one row (r 0.1: 1.6 tokens for 1.3 steps' time), and
    drafts; from step 120 on, steps of 4 rows cost 2 + 16 r a guess slot, where it no longer pays
    (1.6 tokens for 0.95 of a 4-row plain step's time a row, against 1 for 0.5): the cost model
    then drafts at most its probes."""
    lengths, _ = protocol_run(c=0.2, r=0.1, holds=[0.6, 0.0], steps=360, rows=lambda step: 1 if step < 120 else 4)
    early, late = lengths[60:120], lengths[240:]
    assert early.count(0) <= 0.1 * len(early) and late.count(0) >= 0.9 * len(late), (early, late)


@pytest.mark.parametrize("rule", ["once a step", "once a row"])
def test_a_batch_step_decays_the_draft_odds_once(monkeypatch, rule):
    """The cost model learns a draft source's acceptance from every row that drafted, but decays
    its counts once a step: a step of 32 rows that held, then one of 32 that failed, leave about
    even odds at the first position. Decayed once a row (a broken rule here), the older step
    weighs half as much: odds ~0.34."""
    from specdec.core.policy import LengthPolicy

    if rule == "once a row":
        observe_rows = LengthPolicy.observe_rows
        monkeypatch.setattr(LengthPolicy, "observe_rows",
                            lambda self, n, rows: [observe_rows(self, n, [row]) for row in rows])
    policy = LoadPolicy(4)
    policy.observe_draft([1] * 32, [1] * 32)
    policy.observe_draft([1] * 32, [0] * 32)
    odds = policy.draft_odds.held(0, 1)[0]
    if rule == "once a step":
        assert 0.45 < odds < 0.55, odds
    else:
        assert odds < 0.4, odds


def test_a_protocol_chain_that_cannot_pay_stops_and_is_not_probed():
    """A chain that costs twice a plain step a guess cannot pay whatever holds: once timed it
    drafts nothing, and no probe is spent on it."""
    lengths, rate = protocol_run(c=2.0, r=0.1, holds=[0.9])
    assert set(lengths[8:]) == {0} and rate > 0.9, (lengths[:40], rate)


@pytest.mark.parametrize("rule", ["priced", "always"])
def test_a_protocol_tree_that_pays_drafts_nearly_every_step(rule):
    """A tree of 6 nodes, 4 deep, whose depths hold 90%, 70%, 60%, 50% (c 0.02 a node, r 0.05): it
    is drafted on nearly every step (a plain one now and then until the step-time fit can tell
    what a node costs), at 1.9x plain decoding's rate or more; the fixed rule drafts it always."""
    lengths, rate = protocol_run(c=0.02, r=0.05, holds=[0.9, 0.7, 0.6, 0.5], tree=(6, 4), rule=rule)
    assert sum(n > 0 for n in lengths) >= 0.9 * len(lengths) and rate > 1.9, (lengths[:40], rate)


@pytest.mark.parametrize("rule", ["priced", "always"])
def test_a_protocol_tree_that_is_never_right_ends_as_rare_probes(rule):
    """A tree of 6 nodes whose guesses never hold (c 0.03 a node, r 0.05): after its first steps it
    is drafted only as probes, ever more rarely, at 0.95 of plain decoding's rate or more.
    Drafting it every step (the fixed rule) costs 0.48 steps' time a step and fails."""
    lengths, rate = protocol_run(c=0.03, r=0.05, holds=[0.0], tree=(6, 4), rule=rule)
    ok = sum(n > 0 for n in lengths[20:]) <= 6 and rate > 0.95
    assert ok == (rule == "priced"), (lengths[:40], rate)


@pytest.mark.parametrize("timing", ["alone", "in use"])
def test_a_fresh_scheduler_prices_the_draft_model_alone(timing):
    """With nothing learnt, the scheduler times the draft model alone (a few forwards on a scratch
    cache) instead of drafting for the first request to time it, whose first proposal catches it
    up on the whole prompt (40 tokens here, 10 plain steps' time). A draft slower than a plain
    step a guess (c 1.2) then never drafts, and a 64-token answer decodes at 0.97 of plain
    decoding's rate or more; timed in use, it pays the catch-up and does not. A draft that pays
    (c 0.2, r 0.05, 90% held) still drafts nearly every step."""
    alone = timing == "alone"
    at, _, rate = priced_run(c=1.2, r=0.1, holds=[0.9], steps=64, room=64, timed_alone=alone)
    assert (at == [] and rate >= 0.97) == alone, (at, rate)
    at, _, rate = priced_run(c=0.2, r=0.05, holds=[0.9], timed_alone=alone)
    assert len(at) >= 290 and rate > 1.7, (len(at), rate)


def test_the_scheduler_times_a_fresh_draft_model_alone():
    """A scheduler running a draft model the cost model has not timed times it alone before any
    request: its drafting time per guess and its time per token read, from forwards on a
    scratch cache of its own."""
    from specdec.core.scheduler import ContinuousBatcher
    from specdec.drafters.draft_model import DraftModelDrafter

    policy = LoadPolicy(4)
    ContinuousBatcher(target().model, method="draft", k_max=4, drafter=DraftModelDrafter(target().model),
                      thread=False, policy=policy)
    assert policy.draft_time.weight > 0 and policy.draft_cost(1) > 0 and policy.t_catch > 0
    assert policy.steps.all.weight == 0  # (no step ran)
