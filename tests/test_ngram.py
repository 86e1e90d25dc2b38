"""Prompt lookup: the match itself, and the adaptive length rule (how many of a match's
tokens to propose from measured acceptance and measured verification cost)."""

from __future__ import annotations

import pytest

from specdec.drafters.base import DraftContext
from specdec.drafters.ngram import LengthPolicy, NgramDrafter, SuffixIndex, lookup, lookup_match
from specdec.types import SamplingParams


def test_lookup_prefers_the_longest_and_most_recent_match():
    toks = [1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3]
    assert lookup_match(toks, 4, 1, 3) == (3, [9, 2, 3, 7])  # [1 2 3] occurred at the start
    assert lookup([5, 2, 3, 6, 4, 3], 2, 1, 3) == [6, 4]  # only the 1-gram [3] matches
    assert lookup([1, 2, 3, 4], 3, 1, 3) == []
    assert lookup([4, 4], 3, 2, 3) == []  # min_n respected
    assert lookup([7, 1, 7, 2, 7], 1, 1, 1) == [2]  # the most recent earlier match wins


def test_suffix_index_answers_as_the_scan_does_on_growing_and_replaced_lists():
    """The incremental index against `lookup_match` (the scan, the oracle here) after every
    token of random lists over small vocabularies (many repeats), with several tokens added
    at once, and when handed another list (a row replaced), a shrunk one or an equal one."""
    import random

    rng = random.Random(0)
    for trial in range(40):
        vocab, min_n, max_n = rng.choice([2, 3, 5, 20]), rng.choice([1, 1, 2]), rng.choice([2, 3, 4])
        idx = SuffixIndex(min_n, max_n)
        toks = [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
        checked = 0
        while len(toks) < 120:
            k = rng.choice([1, 3, 8])
            assert idx.match(toks, k) == lookup_match(toks, k, min_n, max_n), (trial, toks)
            assert idx.match(toks, k) == lookup_match(toks, k, min_n, max_n)  # asked twice: same
            checked += 1
            if rng.random() < 0.05:  # another row's list in this slot
                toks = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
            elif rng.random() < 0.05:  # shrunk (a list that is not this one grown)
                toks = toks[: rng.randrange(1, len(toks) + 1)]
            else:
                toks = toks + [rng.randrange(vocab) for _ in range(rng.randrange(1, 5))]
        assert checked > 20
    idx = SuffixIndex(1, 3)
    assert idx.match([1, 2, 3, 1, 2], 4) == (2, [3, 1, 2])
    assert idx.match([1, 2, 3, 1], 4) == (1, [2, 3, 1])  # shrunk by one: its own last token must not match
    assert idx.match([1, 2, 3, 1, 2], 4) == (2, [3, 1, 2])
    assert idx.match([5, 2, 3, 1, 2], 4) == (1, [3, 1, 2])  # same length, another start: indexed afresh
    assert idx.match([1, 2], 0) == (0, [])


def test_drafter_lookups_follow_rows_that_leave_and_join():
    """keep_rows drops a leaving row's index, a joining row gets its own, and each row's
    proposal is its own context's lookup."""
    d = NgramDrafter(1, 3, adaptive=False)
    d.begin([[1], [2], [3]], SamplingParams(), 64)
    rows = [[1, 2, 3, 1, 2], [7, 8, 9, 7, 8], [4, 5, 4]]

    def proposed(rows):
        out = d.propose(DraftContext([list(r) for r in rows], SamplingParams(), None), 3)
        return [out.tokens[b, : int(out.counts[b])].tolist() for b in range(len(rows))]

    assert proposed(rows) == [lookup(r, 3, 1, 3) for r in rows]
    d.keep_rows([2, 0])
    rows = [rows[2] + [5], rows[0] + [3], [6, 6, 6]]  # rows 2 and 0 grew; a new row joined
    assert proposed(rows) == [lookup(r, 3, 1, 3) for r in rows]


def test_length_policy_learns_to_stop_and_to_go_long():
    pol = LengthPolicy(max_n=3, max_k=8)
    for _ in range(200):  # 1-gram matches never hold
        pol.observe(1, 4, 0)
    for _ in range(200):  # 3-gram matches hold for 6 tokens
        pol.observe(3, 8, 6)
    assert pol.choose(1, 8) == 0
    assert pol.choose(3, 8) >= 6
    assert pol.choose(3, 2) == 2  # never more than the continuation has


def test_length_policy_measures_the_cost_of_a_verified_token():
    pol = LengthPolicy(max_n=2, max_k=8)
    assert pol.r == pol.r_prior
    for i in range(100):
        j = i % 5
        pol.observe_time(j, 0.010 * (1 + 0.25 * j))
    assert abs(pol.r - 0.25) < 1e-6
    # at that cost a guess that holds half the time is worth one token but not many
    for _ in range(300):
        pol.observe(2, 1, 0)
        pol.observe(2, 1, 1)
    assert pol.choose(2, 8) <= 2


def test_length_policy_prices_a_guess_at_its_own_batch_size():
    """One row: a guess is nearly free (the step reads the weights); eight rows: each guess slot
    costs its full share. The lookup's fit keeps a band per batch size, so the same policy cuts
    one row's lookups long and eight rows' short; one line over all steps (the broken rule)
    would price both alike."""
    pol = LengthPolicy(max_n=2, max_k=8)
    for i in range(200):
        j = i % 5
        rows = 1 if i % 2 else 8
        per_slot = 0.02 if rows == 1 else 0.5
        pol.observe_time(j, 0.010 * rows ** 0.5 * (1 + per_slot * j), rows)
    pol.rows = 1
    assert pol.r == pytest.approx(0.02, rel=1e-3) and pol.step_seconds() == pytest.approx(0.010)
    pol.rows = 8
    assert pol.r == pytest.approx(0.5, rel=1e-3)
    for _ in range(300):  # a guess that holds 60% of the time
        pol.observe(2, 3, 0)
        pol.observe(2, 3, 1)
        pol.observe(2, 3, 3)
    pol.rows = 1
    long_cut = pol.choose(2, 8)
    pol.rows = 8
    assert long_cut >= 3 and pol.choose(2, 8) <= 1


def test_length_policy_probes_after_declining_and_recovers_when_guesses_start_to_hold():
    """A policy that stopped guessing (its acceptance estimate, or a cost measured in a slow spell,
    says guesses do not pay) proposes one guess after probe_every declined lookups of a match
    length, so it learns again: once the text copies, its probes hold and it proposes in full."""
    pol = LengthPolicy(max_n=2, max_k=8, clock=False)
    for _ in range(300):
        pol.observe(2, 4, 0)  # 2-gram matches never hold
    picks = [pol.choose(2, 6) for _ in range(64)]
    assert picks.count(1) == 64 // pol.probe_every and set(picks) == {0, 1}
    assert [i for i, p in enumerate(picks) if p] == [i for i in range(64) if (i + 1) % pol.probe_every == 0]
    lengths = []
    for _ in range(400):  # the text starts to copy: every guess proposed now holds
        j = pol.choose(2, 6)
        lengths.append(j)
        if j:
            pol.observe(2, j, j)
    assert max(lengths[:15]) == 0 and max(lengths[-20:]) >= 4, lengths
    never = LengthPolicy(max_n=2, max_k=8, clock=False, probe_every=0)
    for _ in range(300):
        never.observe(2, 4, 0)
    assert all(never.choose(2, 6) == 0 for _ in range(64))


def _steps_where_lookups_fail(d: NgramDrafter, params, steps: int, k: int = 4) -> list[int]:
    """Propose on a text that ends in the 2-gram [3 4] at every proposal, whose lookup (what
    followed the last [3 4]) never holds: each step commits a new token and [3 4] again.
    Returns the guess counts proposed."""
    ctx, counts = [3, 4, 5, 3, 4], []
    for i in range(steps):
        counts += d.propose(DraftContext([ctx], params, None), k).counts.tolist()
        d.commit([0])
        ctx = ctx + [100 + i, 3, 4]
    return counts


def test_adaptive_drafter_proposes_nothing_where_guesses_fail():
    d = NgramDrafter(max_n=2)
    d.begin(None, SamplingParams(), 0)
    # a guess is priced at the prior r: the cost this loop's wall clock would measure between
    # proposals depends on the machine's load (a loaded machine once made two guesses look cheap)
    d.policy.clock = False
    first = _steps_where_lookups_fail(d, SamplingParams(), 1)
    assert first == [0]  # a fresh policy declines (its prior), until the text shows what holds
    _steps_where_lookups_fail(d, SamplingParams(), 100)
    # then nothing, but for a probe of one guess after every probe_every lookups declined in a row
    every = d.policy.probe_every
    counts = _steps_where_lookups_fail(d, SamplingParams(), 3 * every)
    assert counts.count(1) == 3 and sum(counts) == 3  # the probes: one guess each
    probes = [i for i, c in enumerate(counts) if c]
    assert probes[1] - probes[0] == probes[2] - probes[1] == every
    fixed = NgramDrafter(max_n=2, adaptive=False)
    assert fixed.propose(DraftContext([[3, 4, 5, 3, 4]], SamplingParams(), None), 4).tokens.tolist() == [[5, 3, 4]]


def test_a_fresh_lookup_proposes_once_the_text_copies():
    """A fresh policy declines every lookup (its prior), and learns from the declined ones: in a
    text that repeats itself it proposes whole lookups after the first one that would have held."""
    d = NgramDrafter(max_n=2)
    d.begin(None, SamplingParams(), 0)
    d.policy.clock = False
    ctx, counts = [3, 4, 5, 6, 7, 8, 3, 4], []
    for _ in range(4):  # the text after [3 4] is always [5 6 7 8 3 4]
        counts += d.propose(DraftContext([ctx], SamplingParams(), None), 4).counts.tolist()
        d.commit([0])
        ctx = ctx + [5, 6, 7, 8, 3, 4]
    assert counts[0] == 0 and counts[-1] == 4, counts


@pytest.mark.parametrize("rule", ["room", "broken"])
def test_a_lookup_probe_waits_for_room(monkeypatch, rule):
    """A probe costs a verified guess that mostly fails; a short answer never earns back what it
    tells, so with fewer than PROBE_ROOM tokens left (DraftContext.room) the declined lookups
    wait. A rule that ignores the room probes there."""
    from specdec.core import policy

    if rule == "broken":
        choose = policy.LengthPolicy.choose
        monkeypatch.setattr(policy.LengthPolicy, "choose", lambda self, n, a, may_probe=True: choose(self, n, a))
    d = NgramDrafter(max_n=2)
    d.begin(None, SamplingParams(), 0)
    d.policy.clock = False
    _steps_where_lookups_fail(d, SamplingParams(), 100)  # learnt to decline (probing as it went)
    every = d.policy.probe_every

    def run(room: int) -> list[int]:
        ctx, counts = [3, 4, 5, 3, 4], []
        for i in range(2 * every):
            counts += d.propose(DraftContext([ctx], SamplingParams(), None, room=[room]), 4).counts.tolist()
            d.commit([0])
            ctx = ctx + [100 + i, 3, 4]
        return counts

    short = run(policy.PROBE_ROOM - 1)
    assert sum(run(policy.PROBE_ROOM)) == 2  # room enough: a probe per probe_every declined lookups
    if rule == "room":
        assert sum(short) == 0
    else:
        assert sum(short) == 2


def test_declined_lookups_are_learnt_from_the_text_that_followed():
    """A lookup that was not proposed is scored against the committed text as if it had been:
    a policy that declines every lookup (and never probes) starts proposing again within a few
    steps once the text copies what its lookups predict."""
    d = NgramDrafter(max_n=2)
    d.begin(None, SamplingParams(), 0)
    d.policy.clock, d.policy.probe_every = False, 0
    assert sum(_steps_where_lookups_fail(d, SamplingParams(), 60)[-20:]) == 0  # learnt to decline
    ctx, counts = [3, 4, 5, 6, 3, 4], []
    for _ in range(12):  # now the text after [3 4] is always [5 6 3 4]
        counts += d.propose(DraftContext([ctx], SamplingParams(), None), 4).counts.tolist()
        d.commit([0])  # (nothing was verified: the proposals were empty or are ignored here)
        ctx = ctx + [5, 6, 3, 4]
    assert counts[0] == 0 and counts[-1] == 4, counts  # it proposes the whole lookup again


def test_seeded_sample_lookups_are_cut_by_the_shared_policy():
    """A seeded sampled request's lookups are cut by the drafter's one policy, which learns from
    it as from any request (its text does not depend on the cut: test_exactness_sampling)."""
    seeded = SamplingParams(temperature=0.8, seed=3)
    d = NgramDrafter(max_n=2)
    d.begin(None, seeded, 0)
    d.policy.clock = False
    before = d.policy.seen[2][0]
    assert _steps_where_lookups_fail(d, seeded, 1) == [0]  # (declined at the prior)
    _steps_where_lookups_fail(d, seeded, 100)
    assert d.policy.seen[2][0] > before
    assert sum(_steps_where_lookups_fail(d, seeded, 16)) == 1  # learnt to decline: one probe per 16



def test_a_step_of_many_rows_decays_the_counts_once():
    """A batch's step teaches the acceptance of each row that drafted, but the counts decay once a
    step: 32 rows that held, then 32 that failed, leave about even odds (decayed once a row, the
    older step would weigh half as much as the newer one: ~0.34)."""
    pol = LengthPolicy(max_n=0, max_k=4)
    pol.observe_rows(0, [(1, 1)] * 32)
    pol.observe_rows(0, [(1, 0)] * 32)
    assert 0.45 < pol.held(0, 1)[0] < 0.55
    one = LengthPolicy(max_n=0, max_k=4)  # one row a step: the same counts as `observe`
    two = LengthPolicy(max_n=0, max_k=4)
    for proposed, accepted in [(3, 1), (2, 2), (4, 0)]:
        one.observe(0, proposed, accepted)
        two.observe_rows(0, [(proposed, accepted)])
    assert one.acc == two.acc and one.seen == two.seen
