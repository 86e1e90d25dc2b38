"""How often guesses hold, learnt online (docs/design.md, "The policy").

- `best_prefix`: how many of a proposal's guesses (or a tree's nodes) to verify, given their
  expected acceptance, c and r;
- `Acceptance`: P(guess i holds | the guesses before it held), per key (a lookup's match length;
  0 for a source without keys) and draft position, as exponentially decayed counts;
- `NodeOdds`: how often a tree node holds, by the source's own probability of its path;
- `Hindsight`: scores a known source's offers against the text that followed, verified or not,
  so a declined offer teaches as much as a verified one;
- `carried` / `counts_ok`: counts as a later run starts from them (learned.py).

Pure: counts in, estimates out; nothing here knows about models.
"""

from __future__ import annotations

import bisect
import math

from .fits import FIT_DECAY

CARRIED_COUNTS = 8.0  # observations' worth of an acceptance rate that a later run starts from (learned.py)


def carried(acc: float, seen: float, most: float = CARRIED_COUNTS) -> tuple[float, float]:
    """Decayed counts (accepted, seen) scaled so that seen is at most `most`: the same rate,
    which a later run's own observations soon outweigh (learned.py)."""
    f = min(1.0, most / seen) if seen > 0 else 1.0
    return f * acc, f * seen


def counts_ok(acc: float, seen: float) -> bool:
    """Whether saved counts can be decayed counts of a rate: 0 <= accepted <= seen, 0 < seen < inf."""
    return 0.0 <= acc <= seen < math.inf and seen > 0


def outcome(proposed: int, accepted: int) -> list[float]:
    """A chain's outcome per position tried when `accepted` of `proposed` guesses held: 1 for each
    that held, 0 for the first that did not (the ones after it were not tried)."""
    return [1.0] * accepted + [0.0] * (accepted < proposed)


def path_chances(odds: list[float], parents: list[int]) -> list[float]:
    """Per node of a tree (node j, 1-based, under parents[j - 1]; 0 is the root), the chance that
    its whole path holds: the product of its ancestors' and its own `odds` (each given its parent
    held)."""
    out: list[float] = []
    for parent, chance in zip(parents, odds):
        out.append((out[parent - 1] if parent else 1.0) * chance)
    return out


def best_prefix(values: list[float], c: float, r: float) -> int:
    """How many of `values` (expected accepted tokens per node, best first) to verify: the m
    that maximises committed tokens per unit of step time, (1 + sum(values[:m])) / (1 + c + r m),
    with c the drafting cost and r the cost of a verified node, in plain steps."""
    best_m, best, total = 0, 1.0 / (1.0 + c), 1.0
    for m, v in enumerate(values, start=1):
        total += v
        rate = total / (1.0 + c + r * m)
        if rate > best:
            best_m, best = m, rate
    return best_m


class Acceptance:
    """P(guess i holds | the guesses before it held) per key and draft position i, from
    exponentially decayed counts; before any observation a cell is `prior`, worth two
    observations. With `inherit` (a source that `Drafter.holds_on`: a request's prediction)
    only the first position starts at the prior, and a later position holds as often as the one
    before it: it starts from two observations at that rate when it is first seen. So a
    prediction whose first guesses held is trusted as far as it offers (32 tokens), rather than
    every position it has not reached yet falling back to the prior. A key beyond the last is
    counted as the last (a lookup's longest match)."""

    def __init__(self, keys: int, positions: int, prior: float, decay: float = FIT_DECAY,
                 inherit: bool = False) -> None:
        self.decay = decay
        later = 0.0 if inherit else 1.0  # a later position's prior weight (0: not seen yet)
        self.acc = [[2.0 * prior] + [2.0 * prior * later] * (positions - 1) for _ in range(keys)]
        self.seen = [[2.0] + [2.0 * later] * (positions - 1) for _ in range(keys)]

    def _key(self, key: int) -> int:
        return min(max(key, 0), len(self.acc) - 1)

    @staticmethod
    def _rates(acc: list[float], seen: list[float], n: int) -> list[float]:
        """One key's P(guess i holds | the ones before held), i < n: a position not seen yet at
        the rate of the one before it."""
        out, rate = [], 0.0
        for i in range(min(n, len(acc))):
            rate = acc[i] / seen[i] if seen[i] > 0 else rate
            out.append(rate)
        return out

    def held(self, key: int, k: int, certain: int = 0) -> list[float]:
        """P(the first j guesses all hold), j = 1 .. min(k, positions tracked): the expected
        accepted tokens each guess adds. The first `certain` guesses hold for sure (a grammar
        forces them)."""
        row = self._key(key)
        out, p = [], 1.0
        for i, rate in enumerate(self._rates(self.acc[row], self.seen[row], k)):
            if i >= certain:
                p *= rate
            out.append(p)
        return out

    def expected(self, key: int, k: int, certain: int = 0) -> list[float]:
        """[E(0), .., E(k')]: expected committed tokens (1 + accepted guesses) when j guesses are
        verified, j = 0 .. k' = min(k, positions tracked)."""
        out = [1.0]
        for p in self.held(key, k, certain):
            out.append(out[-1] + p)
        return out

    def observe(self, key: int, proposed: int, accepted: int) -> None:
        self.observe_rows(key, [(proposed, accepted)])

    def observed(self, key: int = 0) -> bool:
        """Whether a guess under `key` was ever verified (its first position counts more than the
        prior's two observations)."""
        return self.seen[self._key(key)][0] > 2.0

    def observe_rows(self, key: int, rows: list[tuple[int, int]]) -> None:
        """One step's (proposed, accepted) of each row that guessed under `key`: each position
        whose predecessors all held was tried, and held or not."""
        self.observe_held(key, [outcome(p, a) for p, a in rows])

    def observe_held(self, key: int, rows: list[list[float]]) -> None:
        """One step's outcome of each row that guessed under `key`: per position tried, whether
        it held (1 or 0) or its chance of holding given that its predecessors held (a sampled
        row's `held_odds`, known for every guess scored). The counts decay once a step, not once a
        row, so a batch of many rows does not forget faster."""
        row = self._key(key)
        acc, seen, d = self.acc[row], self.seen[row], self.decay
        for i in range(min(len(acc), max((len(h) for h in rows), default=0))):
            held = tried = 0.0
            for h in rows:
                if i < len(h):
                    tried += 1.0
                    held += h[i]
            if seen[i] == 0:  # first seen: two observations at the rate of the position before
                acc[i], seen[i] = 2.0 * acc[i - 1] / seen[i - 1], 2.0
            acc[i] = d * acc[i] + held
            seen[i] = d * seen[i] + tried

    def learned(self, max_seen: float = CARRIED_COUNTS) -> dict:
        """The counts, capped at max_seen per cell (`carried`), for a later run (learned.py)."""
        acc, seen = [], []
        for a_row, s_row in zip(self.acc, self.seen):
            cells = [carried(a, s, max_seen) for a, s in zip(a_row, s_row)]
            acc.append([a for a, _ in cells])
            seen.append([s for _, s in cells])
        return {"acc": acc, "seen": seen}

    def relearn(self, state: dict) -> None:
        """Start from `learned()`'s output; ValueError (nothing changed) if its shape or counts do
        not fit."""
        shape = [len(r) for r in self.acc]
        acc = [[float(v) for v in r] for r in state["acc"]]
        seen = [[float(v) for v in r] for r in state["seen"]]
        if [len(r) for r in acc] != shape or [len(r) for r in seen] != shape:
            raise ValueError("learned acceptance tables of another shape")
        if not all(counts_ok(a, s) or (i > 0 and a == s == 0)  # (a later position not seen yet)
                   for ar, sr in zip(acc, seen) for i, (a, s) in enumerate(zip(ar, sr))):
            raise ValueError("learned acceptance counts out of range")
        self.acc, self.seen = acc, seen


class NodeOdds:
    """How often a tree node is accepted, by the source's probability of its path p (the product
    of its probabilities from the root to the node), in bins of p with exponentially decayed
    counts. A bin starts from `prior` observations' worth (decayed with its own) of its middle p
    (a source taken at its word) or, with `calibrated`, of that p times what the source's word
    has been worth over every bin so far (nodes held / the sum of their p, at most 1, starting at
    one node's worth of 1): a source whose scores are overconfident (a suffix tree read from one prompt
    scores a continuation seen once at 1.0; on chat such nodes hold ~30% of the time) is marked
    down in every bin after a few nodes, not bin by bin."""

    EDGES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9)  # bin i holds EDGES[i-1] <= p < EDGES[i]

    def __init__(self, decay: float = 0.995, prior: float = 2.0, calibrated: bool = False) -> None:
        self.decay, self.calibrated = decay, calibrated
        lows, highs = (0.0,) + self.EDGES, self.EDGES + (1.0,)
        self.mids = [(lo + hi) / 2 for lo, hi in zip(lows, highs)]
        self.seen = [0.0] * len(lows)  # the bins' own decayed counts (the prior apart)
        self.acc = [0.0] * len(lows)
        self.weight = [prior] * len(lows)  # the prior's weight in each bin, decayed with its counts
        self.held, self.promised = 1.0, 1.0  # nodes held and the sum of their p, over all bins

    def bin(self, p: float) -> int:
        return bisect.bisect_right(self.EDGES, p)

    def word(self) -> float:
        """What the source's p has been worth: held nodes per unit of p, at most 1 (1 when not
        calibrated): it only marks an overconfident source down (a run of held nodes in its likely
        bins must not lift bins of unlikely nodes that have not been tried)."""
        return min(1.0, self.held / self.promised) if self.calibrated else 1.0

    def odds_of_bin(self, i: int) -> float:
        guess = self.mids[i] * self.word()
        return (self.acc[i] + self.weight[i] * guess) / (self.seen[i] + self.weight[i])

    def __call__(self, p: float) -> float:
        return self.odds_of_bin(self.bin(p))

    def observe(self, p: float, accepted: bool) -> None:
        i, d = self.bin(p), self.decay
        self.acc[i] = d * self.acc[i] + (1.0 if accepted else 0.0)
        self.seen[i] = d * self.seen[i] + 1.0
        self.weight[i] *= d
        self.held = d * self.held + (1.0 if accepted else 0.0)
        self.promised = d * self.promised + p

    def expected(self, scores: list[float]) -> list[float]:
        """[E(0), .., E(n)]: expected committed tokens when the j nodes of highest `scores` are
        verified (the nodes' odds summed, best first)."""
        out = [1.0]
        for p in sorted(scores, reverse=True):
            out.append(out[-1] + self(p))
        return out

    def tree_values(self, scores: list[float], parents: list[int]) -> list[float]:
        """Per node of a tree whose odds are learnt given the parent (`observe_tree`): the chance
        that its whole path holds, the product of its ancestors' and its own odds, each looked up
        by its score relative to its parent's (a suffix chain read from one occurrence scores 1.0
        at every depth; its deep nodes still hold only if every node before them did)."""
        return path_chances([self(relative(scores, parents, j)) for j in range(1, len(parents) + 1)], parents)

    def tree_expected(self, scores: list[float], parents: list[int]) -> list[float]:
        """[E(0), .., E(n)]: expected committed tokens when the j likeliest nodes are verified
        (`tree_values`, best first: a node is never likelier than its parent)."""
        out = [1.0]
        for v in sorted(self.tree_values(scores, parents), reverse=True):
            out.append(out[-1] + v)
        return out

    def observe_tree(self, scores: list[float], parents: list[int], held: set[int]) -> None:
        """A tree was settled and the nodes `held` (1-based) lay on the committed path: each node
        whose parent held (or that hangs from the root) teaches the odds of its relative score."""
        for j, parent in enumerate(parents, start=1):
            if parent == 0 or parent in held:
                self.observe(relative(scores, parents, j), j in held)

    def learned(self) -> dict:
        """The counts per bin with their priors, and the source's word, capped (`carried`), for a
        later run (learned.py), which starts from them as its counts."""
        acc, seen = zip(*(carried(self.acc[i] + w * self.mids[i] * self.word(), self.seen[i] + w)
                          for i, w in enumerate(self.weight)))
        held, promised = carried(self.held, self.promised)
        return {"acc": list(acc), "seen": list(seen), "held": held, "promised": promised}

    def relearn(self, state: dict) -> None:
        acc, seen = [float(v) for v in state["acc"]], [float(v) for v in state["seen"]]
        if len(acc) != len(self.acc) or len(seen) != len(self.seen):
            raise ValueError("learned node odds of another shape")
        if not all(counts_ok(a, s) for a, s in zip(acc, seen)):
            raise ValueError("learned node odds out of range")
        held, promised = float(state.get("held", 1.0)), float(state.get("promised", 1.0))
        if not (0.0 <= held < math.inf and 0.0 < promised < math.inf):
            raise ValueError("learned node odds' calibration out of range")
        self.acc, self.seen, self.held, self.promised = acc, seen, held, promised
        self.weight = [0.0] * len(acc)


def relative(scores: list[float], parents: list[int], j: int) -> float:
    """Node j's (1-based) path score over its parent's: its own odds given that the parent held."""
    parent = parents[j - 1]
    above = scores[parent - 1] if parent else 1.0
    return min(1.0, scores[j - 1] / above) if above > 0 else 0.0


class Hindsight:
    """A known source's offers for one row, scored against the text that followed them, whether
    or not they were verified: a guess "holds" if the committed token at its position equals it,
    given that the guesses before it held. For a verified guess that is its verification's
    outcome; for one that was not, the outcome verifying it would have had (greedy: the committed
    text is the target's argmax chain; sampled: every committed token is distributed as the
    target's, so the chance that it equals a one-hot guess is the chance the guess would have
    been accepted). So acceptance is learnt as fast from declined offers as from verified ones,
    and a text that starts to repeat is noticed without probing."""

    def __init__(self) -> None:
        # (position of the first guess in the row's tokens, key, tokens, parents, scores)
        self.open: list[tuple[int, int, list[int], list[int] | None, list[float] | None]] = []

    def add(self, start: int, key: int, tokens: list[int], parents: list[int] | None,
            scores: list[float] | None) -> None:
        self.open.append((start, key, tokens, parents, scores))

    def score(self, text: list[int], acceptance: Acceptance, odds: NodeOdds) -> None:
        """Score the open offers that `text` (the row's committed tokens) settles, teaching
        `acceptance` (chains) and `odds` (trees, by their scores); the others wait for more text."""
        waiting = []
        for offer in self.open:
            start, key, tokens, parents, scores = offer
            if parents is None:
                known = text[start : start + len(tokens)]
                held = 0
                while held < len(known) and known[held] == tokens[held]:
                    held += 1
                if held < len(known):  # guess `held` differs from the text: the ones before it held
                    acceptance.observe(key, held + 1, held)
                elif held == len(tokens):
                    acceptance.observe(key, held, held)
                else:
                    waiting.append(offer)
            else:
                path = _tree_path(tokens, parents, text[start:])
                if path is None:
                    waiting.append(offer)
                elif scores is not None:
                    odds.observe_tree(scores, parents, set(path))
        self.open = waiting


def _tree_path(tokens: list[int], parents: list[int], text: list[int]) -> list[int] | None:
    """The nodes (1-based) of a tree that `text` follows from the root, or None while the text
    ends before the path could go on (a child of the last node reached may still hold)."""
    path, node, depth = [], 0, 0
    while True:
        children = [j for j in range(1, len(tokens) + 1) if parents[j - 1] == node]
        if not children:
            return path
        if depth >= len(text):
            return None
        nxt = next((j for j in children if tokens[j - 1] == text[depth]), None)
        if nxt is None:
            return path
        path.append(nxt)
        node, depth = nxt, depth + 1
