"""Prompt-lookup drafting (Saxena 2023; transformers' `prompt_lookup_num_tokens`).

Match the last n tokens of the context (n from max_n down to min_n) against earlier
context (prompt and generated text); propose the tokens that followed the most recent
earlier match. Guesses are deterministic (q one-hot), and cost almost nothing to make.

They are not free to verify, though: each guessed token adds to the target forward (on
this project's CPU ~6-11% of a one-token step, more with long contexts). So the drafter
learns how far its guesses tend to hold, per match length n and draft position i
(exponentially decayed counts: P(guess i accepted | guesses before it accepted)), and
proposes the prefix of the continuation that maximises expected tokens per unit of
time,

    (1 + a_1 + a_1 a_2 + ... + a_1...a_j) / (1 + r j),

where r is the measured cost of one more verified token relative to a plain step (timed
between successive `propose` calls and fitted by decayed least squares; 0.08 until
measured). A 1-token match that rarely holds is then not proposed at all, while a long
match in copied text is proposed in full.

Acceptance is learnt from every lookup, proposed or not: each step's whole lookup is scored
against the text that was then committed (guess i "holds" if the committed token at its
position equals it, given that the guesses before it held). For a guess that was verified
this is its verification's outcome; for one that was not, it is the outcome verifying it
would have had: in greedy decoding the committed text is the target's argmax chain, and in
sampled decoding every committed token is distributed as the target's (the point of the
rejection rule), so the chance that it equals a one-hot guess is the chance that the guess
would have been accepted. The policy therefore learns as fast from declined lookups as from
proposed ones, and needs no exploration to notice a text that starts to copy. What declined
lookups cannot measure is the cost of a verified guess: after `probe_every` lookups of one
match length declined in a row the policy proposes one guess anyway, so a cost misjudged in a
slow spell (a high r stops every guess, and only guessed steps can measure it again) is
noticed within a few probes (one guess in 16 declined steps: ~0.5% of a step). A probe waits
while fewer than `core.policy.PROBE_ROOM` tokens of its row may still come (`DraftContext.room`):
in a short answer it costs more than what it tells can earn back.
`adaptive=False` gives the classic fixed rule.
Sampled requests, seeded or not, are cut by the same policy: lookups are deterministic
guesses, and with those a seeded request commits the text plain sampling commits with its seed
however many guesses each step verifies (verify.py, "sample and compare"), so measured times
may decide its lengths.
`choose_length=False` leaves the cut to the caller (the server's batcher).
"""

from __future__ import annotations

import time

import torch

from ..core.policy import PROBE_ROOM, LengthPolicy
from .base import Draft, DraftContext, Drafter, register

LOOKUP_PRIOR = 0.05  # a fresh policy's acceptance at every (match length, position): below any r, so declined


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

    def __init__(self, min_n: int = 1, max_n: int = 4, adaptive: bool = True, max_k: int = 16,
                 choose_length: bool = True) -> None:
        """adaptive: learn acceptance per (match length, position); choose_length: also cut each
        lookup to the length that pays (False: propose whole lookups and let the caller cap them,
        as the server's batcher does with its own cost model)."""
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        # a fresh policy declines every lookup (prior acceptance 0.05) until the text shows what holds:
        # declined lookups are scored too, so one that would have held is learnt at once, and a
        # fresh process does not verify a short answer's chance matches at an optimistic prior
        self.policy = LengthPolicy(max_n, max_k, prior=LOOKUP_PRIOR) if adaptive else None
        self.max_k = max_k
        self.choose_length = choose_length
        self._last: list[tuple[int, int]] | None = None  # per row (n, proposed) of the last proposal
        self._t_end: float | None = None  # when the last proposal was handed over
        self._index: list[SuffixIndex] = []  # per row: its context's n-grams (lookups without a scan)
        # per row: lookups not yet scored against the text that followed them (module docstring):
        # (position of the first guess in the row's tokens, match length, the whole lookup)
        self._open: list[list[tuple[int, int, list[int]]]] = []
        self.step_tokens = 0  # guesses the target verifies this step (a wrapping drafter may raise it)

    def begin(self, prompts, params, max_len) -> None:
        self._last = None
        self._index = []
        self._open = []
        self._t_end = None  # a new request's prefill must not count as a step

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        guesses = self.lookups(ctx, max_tokens)
        B, N = len(guesses), max((len(g) for g in guesses), default=0)
        tokens = torch.tensor([list(g) + [0] * (N - len(g)) for g in guesses], dtype=torch.long).reshape(B, N)
        self._t_end = time.perf_counter()
        return Draft(tokens, torch.tensor([len(g) for g in guesses], dtype=torch.long))

    def lookups(self, ctx: DraftContext, max_tokens: int) -> list[list[int]]:
        """`propose`'s guesses as a list per row, for a drafter that builds its own proposal from
        them (auto's): the step is timed from `handed_over`, which that drafter calls."""
        now = time.perf_counter()
        if self.policy is not None and self._t_end is not None and self._last is not None:
            self.policy.observe_time(self.step_tokens, now - self._t_end, len(self._last))
        guesses, last = [], []
        pol = self.policy
        if pol is not None:
            pol.rows = len(ctx.tokens)  # this step's guesses are priced at its own batch size
        cut = pol is not None and self.choose_length
        while len(self._index) < len(ctx.tokens):  # a row joined (the server) or a new request
            self._index.append(SuffixIndex(self.min_n, self.max_n))
            self._open.append([])
        rooms = ctx.room or [PROBE_ROOM] * len(ctx.tokens)
        for t, index, open_, room in zip(ctx.tokens, self._index, self._open, rooms):
            n, g = index.match(t, max_tokens)
            if pol is not None:
                self._score(open_, t)
                if g:
                    open_.append((len(t), n, g))
            if g and cut:
                g = g[: pol.choose(n, len(g), may_probe=room >= PROBE_ROOM)]
            guesses.append(g)
            last.append((n, len(g)))
        self._last = last
        self.step_tokens = max((p for _, p in last), default=0)
        return guesses

    def _score(self, open_: list[tuple[int, int, list[int]]], tokens: list[int]) -> None:
        """Score a row's open lookups against its committed `tokens` (module docstring): each
        lookup whose outcome the text settles (a guess that differs, or all of them matched)
        teaches the policy and is dropped; the others wait for more text."""
        waiting = []
        for start, n, guesses in open_:
            known = tokens[start : start + len(guesses)]
            held = 0
            while held < len(known) and known[held] == guesses[held]:
                held += 1
            if held < len(known):  # guess `held` differs from the text: the ones before it held
                self.policy.observe(n, held + 1, held)
            elif held == len(guesses):
                self.policy.observe(n, held, held)
            elif start <= len(tokens):
                waiting.append((start, n, guesses))
        open_[:] = waiting

    def skip(self) -> None:
        """The engine decodes a step without drafting: do not time across it."""
        self._t_end = None
        self._last = None

    def handed_over(self) -> None:
        """The proposal leaves for verification now (a wrapping drafter that did more work after
        `propose` calls this, so that work is not timed as part of the target's step)."""
        self._t_end = time.perf_counter()

    @property
    def matches(self) -> list[int]:
        """Per row, the length of the match behind the last proposal (0: none)."""
        return [n for n, _ in self._last or []]

    def expected_tokens(self) -> list[list[float]] | None:
        """Per row of the last proposal, expected committed tokens with its first j guesses,
        j = 0 .. all it proposed (`LengthPolicy.expected`); None without a learning policy."""
        if self.policy is None:
            return None
        return [self.policy.expected(n, p) for n, p in self._last or []]

    def commit(self, num_accepted, paths=None) -> None:
        """Nothing to do: acceptance is learnt from the committed text at the next proposal
        (`_score`), for verified and unverified guesses alike."""

    def keep_rows(self, rows) -> None:
        rows = list(rows)
        if self._last is not None:  # a row that joined since the last proposal has none: that step is over
            self._last = [self._last[r] for r in rows] if all(r < len(self._last) for r in rows) else None
        self._index = [self._index[r] for r in rows] if all(r < len(self._index) for r in rows) else []
        self._open = [self._open[r] for r in rows] if all(r < len(self._open) for r in rows) else []

    def learned(self) -> dict | None:
        """What the length policy learned (None without one), for a later run (learned.py)."""
        return None if self.policy is None else {"policy": self.policy.learned()}

    def relearn(self, state: dict) -> None:
        if self.policy is not None and state.get("policy") is not None:
            self.policy.relearn(state["policy"])


@register("ngram")
def _make(target=None, draft=None, min_n: int = 1, max_n: int = 4, **_):
    return NgramDrafter(min_n=min_n, max_n=max_n)
