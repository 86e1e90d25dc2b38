"""Prompt lookup (Saxena 2023; transformers' `prompt_lookup_num_tokens`): a known source.

Match the last n tokens of the context (n from max_n down to min_n) against earlier context
(prompt and generated text) and offer the tokens that followed the most recent earlier match.
Guesses are deterministic (q one-hot) and cost almost nothing to make, so the lookup is a known
source (`Drafter.known`): it offers every row's whole lookup each step, and the scheduler's cost
model (specdec.policy.LoadPolicy) decides how many of its tokens are worth verifying, from the
acceptance it learns per match length (the key of each offer) and draft position. That acceptance
is learnt from every lookup, proposed or not (`policy.Hindsight`), so the cost model starts a fresh
lookup below any guess's cost (LOOKUP_PRIOR) and proposes it once the text shows that it holds.
`propose` alone (without a scheduler) gives every row its whole lookup.
"""

from __future__ import annotations

from .base import Draft, DraftContext, Drafter, Offer

LOOKUP_PRIOR = 0.05  # a fresh lookup's acceptance at every (match length, position): below any r, so declined


def lookup_match(tokens: list[int], max_tokens: int, min_n: int, max_n: int) -> tuple[int, list[int]]:
    """(n, tokens that followed the latest earlier occurrence of the longest matching suffix);
    (0, []) when no suffix of length >= min_n occurs earlier."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n :]
        last = suffix[-1]
        # scan right to left so the most recent match wins; the match must end before L
        for end in range(L - 2, n - 2, -1):
            if tokens[end] == last and tokens[end - n + 1 : end + 1] == suffix:
                follow = tokens[end + 1 : end + 1 + max_tokens]
                if follow:
                    return n, follow
    return 0, []


class SuffixIndex:
    """`lookup_match` for one growing token list in O(max_n) a step instead of a scan of the
    whole context (a 1500-token context: ~0.23 ms of Python a step, 2-3% of a decoding step):
    for every n-gram length it keeps the latest end position of each n-gram seen, and indexes
    only the positions added since the last call. Same answers as `lookup_match` (tested
    against it). A list that is not the indexed one grown (no longer than where the index
    ended, or other tokens just before it) is indexed afresh."""

    CHECK = 8  # tokens compared at the end of the indexed part, to tell another list apart

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._reset()

    def _reset(self) -> None:
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.max_n + 1)]
        self.done = 0  # n-grams ending before this position are indexed
        self.tail: list[int] = []  # the indexed list's tokens just before `done`

    def match(self, tokens: list[int], max_tokens: int) -> tuple[int, list[int]]:
        L = len(tokens)
        if L <= self.done or tokens[max(0, self.done - self.CHECK) : self.done] != self.tail:
            self._reset()
        for e in range(self.done, L - 1):  # matches must end before the last token
            for n in range(self.min_n, min(self.max_n, e + 1) + 1):
                self.ends[n][tuple(tokens[e - n + 1 : e + 1])] = e
        if L - 1 > self.done:
            self.done = L - 1
            self.tail = tokens[max(0, self.done - self.CHECK) : self.done]
        if max_tokens <= 0:
            return 0, []
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            end = self.ends[n].get(tuple(tokens[L - n :]))
            if end is not None:
                return n, tokens[end + 1 : end + 1 + max_tokens]
        return 0, []


def lookup(tokens: list[int], max_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Tokens that followed the latest earlier occurrence of the longest matching suffix."""
    return lookup_match(tokens, max_tokens, min_n, max_n)[1]


class NgramDrafter(Drafter):
    """Prompt lookup as a known source (module docstring)."""

    name = "ngram"
    known = True
    long_chains = True
    prior = LOOKUP_PRIOR

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._index: list[SuffixIndex] = []  # per row: its context's n-grams (lookups without a scan)

    def begin(self, prompts, params, max_len) -> None:
        self._index = []

    def offer(self, ctx: DraftContext, max_tokens: int) -> list[Offer | None]:
        """Per row, the tokens that followed the latest earlier occurrence of its longest matching
        suffix (up to max_tokens), keyed by the match length."""
        while len(self._index) < len(ctx.tokens):  # a row joined (the server) or a new request
            self._index.append(SuffixIndex(self.min_n, self.max_n))
        out = []
        for tokens, index in zip(ctx.tokens, self._index):
            n, guesses = index.match(tokens, max_tokens)
            out.append(Offer(guesses, key=n) if guesses else None)
        return out

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        return Draft.chains([o.tokens if o is not None else [] for o in self.offer(ctx, max_tokens)])

    def commit(self, num_accepted, paths=None) -> None:
        """Nothing to do: what held is learnt by the cost model from the committed text."""

    def keep_rows(self, rows) -> None:
        rows = list(rows)
        self._index = [self._index[r] for r in rows] if all(r < len(self._index) for r in rows) else []
