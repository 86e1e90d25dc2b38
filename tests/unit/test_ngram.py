"""Prompt lookup: the match itself, the incremental index, and the source's offers (how many of
an offer's tokens are verified is the cost model's: test_policy.py)."""

from __future__ import annotations


from specdec.drafters.base import DraftContext
from specdec.drafters.ngram import NgramDrafter, SuffixIndex, lookup, lookup_match
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
    d = NgramDrafter(1, 3)
    d.begin([[1], [2], [3]], SamplingParams(), 64)
    rows = [[1, 2, 3, 1, 2], [7, 8, 9, 7, 8], [4, 5, 4]]

    def proposed(rows):
        out = d.propose(DraftContext([list(r) for r in rows], SamplingParams(), None), 3)
        return [out.tokens[b, : int(out.counts[b])].tolist() for b in range(len(rows))]

    assert proposed(rows) == [lookup(r, 3, 1, 3) for r in rows]
    d.keep_rows([2, 0])
    rows = [rows[2] + [5], rows[0] + [3], [6, 6, 6]]  # rows 2 and 0 grew; a new row joined
    assert proposed(rows) == [lookup(r, 3, 1, 3) for r in rows]


def test_offers_carry_the_match_length_as_their_key():
    d = NgramDrafter(1, 3)
    offers = d.offer(DraftContext([[1, 2, 3, 9, 1, 2, 3], [5, 6]], SamplingParams(), None), 2)
    assert (offers[0].tokens, offers[0].key, offers[0].parents) == ([9, 1], 3, None)
    assert offers[1] is None
