"""Adaptive draft length (`--method auto`).

Each step picks the k in 0..k_max that maximises expected committed tokens per second,

    E(k) / time(k),   E(k) = 1 + a + a^2 + ... + a^k,   time(k) = t_fwd(k) + k * t_draft,

the speedup formula of docs/design.md ((1 + a + ... + a^k) / (1 + c k)) with the target's own
cost growing with k measured rather than assumed flat. a is the running acceptance rate
(exponentially decayed counts, so it follows the text); t_draft and t_fwd(k) are measured
step times. When k = 0 wins (acceptance near zero, or drafting too dear) the policy still
probes k = 1 every `probe_every` steps so that it notices when drafting starts to pay.

Also here, on the same footing: `NodeOdds` and `best_prefix` (how many of a tree's nodes are
worth verifying, from the learnt odds of a node by its draft probability), `DecayedLine`
(decayed least squares for step times) and `BatchGuard` (speculate in a batch only while it
beats plain decoding). Each can hand what it learnt to a later run (`learned()` / `relearn`,
see learned.py).

This module knows nothing about models; it sees only counts and seconds.
"""

from __future__ import annotations

import bisect
import math

from .learned import nonneg

CARRIED_COUNTS = 8.0  # observations' worth of an acceptance rate that a later run starts from (learned.py)


def carried(acc: float, seen: float, most: float = CARRIED_COUNTS) -> tuple[float, float]:
    """Decayed counts (accepted, seen) scaled so that seen is at most `most`: the same rate,
    which a later run's own observations soon outweigh (learned.py)."""
    f = min(1.0, most / seen) if seen > 0 else 1.0
    return f * acc, f * seen


def counts_ok(acc: float, seen: float) -> bool:
    """Whether saved counts can be decayed counts of a rate: 0 <= accepted <= seen, 0 < seen < inf."""
    return 0.0 <= acc <= seen < math.inf and seen > 0


class AdaptiveK:
    def __init__(self, cost_hint: float | None = None, decay: float = 0.9, probe_every: int = 16) -> None:
        self.decay = decay
        self.probe_every = probe_every
        self.acc, self.prop = 1.0, 2.0  # prior: a = 0.5 until measured
        self.t_draft = None if cost_hint is None else 0.0  # seconds per drafted token (0 for free drafters)
        self.t_fwd: dict[int, float] = {}  # draft length -> EMA seconds of one target step
        self.steps_at_zero = 0
        self.last_k = None

    @property
    def alpha(self) -> float:
        return self.acc / self.prop if self.prop > 0 else 0.0

    def _fwd_time(self, k: int) -> float:
        if k in self.t_fwd:
            return self.t_fwd[k]
        ks = sorted(self.t_fwd)
        if len(ks) == 1:
            return self.t_fwd[ks[0]]
        lo, hi = ks[0], ks[-1]
        slope = max(0.0, (self.t_fwd[hi] - self.t_fwd[lo]) / (hi - lo))
        return self.t_fwd[lo] + slope * (k - lo)

    def expected_rate(self, k: int) -> float:
        """Expected committed tokens per second with draft length k (needs measurements)."""
        a = min(self.alpha, 0.999)
        tokens = sum(a**i for i in range(k + 1))
        return tokens / (self._fwd_time(k) + k * (self.t_draft or 0.0))

    def choose_k(self, k_max: int) -> int:
        if not self.t_fwd or self.t_draft is None:
            k = k_max if self.t_draft is not None else 1  # measure the drafter first, cheaply
        else:
            k = max(range(k_max + 1), key=self.expected_rate)
            if k == 0:
                self.steps_at_zero += 1
                if self.steps_at_zero % self.probe_every == 0:
                    k = 1
            else:
                self.steps_at_zero = 0
        self.last_k = k
        return k

    def observe(self, k: int, counts: list[int], accepted: list[int], draft_s: float, verify_s: float) -> None:
        proposed = sum(counts)
        if proposed:
            self.acc = self.decay * self.acc + sum(accepted)
            self.prop = self.decay * self.prop + proposed
        kk = max(counts) if counts else 0
        if kk:
            per_token = draft_s / kk
            self.t_draft = per_token if not self.t_draft else 0.8 * self.t_draft + 0.2 * per_token
        prev = self.t_fwd.get(kk)
        self.t_fwd[kk] = verify_s if prev is None else 0.8 * prev + 0.2 * verify_s

    def learned(self) -> dict:
        """Acceptance (capped, `carried`) and times, for a later run (learned.py)."""
        acc, prop = carried(self.acc, self.prop)
        return {"acc": acc, "prop": prop, "t_draft": self.t_draft, "t_fwd": {str(k): v for k, v in self.t_fwd.items()}}

    def relearn(self, state: dict) -> None:
        acc, prop, t_draft = float(state["acc"]), float(state["prop"]), nonneg(state["t_draft"], "draft time")
        t_fwd = {int(k): nonneg(float(v), "step time") for k, v in state["t_fwd"].items()}
        if not counts_ok(acc, prop) or min(t_fwd, default=0) < 0:
            raise ValueError("learned draft-length policy out of range")
        self.acc, self.prop, self.t_draft, self.t_fwd = acc, prop, t_draft, t_fwd


class NodeOdds:
    """How often a drafted tree node is accepted, by the drafter's probability of its path p
    (the product of the head's probabilities from the root to the node), in bins of p with
    exponentially decayed counts; before any observation a bin's odds are its middle p (a head
    taken at its word). Knows nothing about models."""

    EDGES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9)  # bin i holds EDGES[i-1] <= p < EDGES[i]

    def __init__(self, decay: float = 0.995, prior: float = 2.0) -> None:
        self.decay = decay
        lows, highs = (0.0,) + self.EDGES, self.EDGES + (1.0,)
        self.seen = [prior] * len(lows)
        self.acc = [prior * (lo + hi) / 2 for lo, hi in zip(lows, highs)]

    def bin(self, p: float) -> int:
        return bisect.bisect_right(self.EDGES, p)

    def __call__(self, p: float) -> float:
        i = self.bin(p)
        return self.acc[i] / self.seen[i]

    def observe(self, p: float, accepted: bool) -> None:
        i = self.bin(p)
        self.acc[i] = self.decay * self.acc[i] + (1.0 if accepted else 0.0)
        self.seen[i] = self.decay * self.seen[i] + 1.0

    def learned(self) -> dict:
        """The counts per bin, capped (`carried`), for a later run (learned.py)."""
        acc, seen = zip(*(carried(a, s) for a, s in zip(self.acc, self.seen)))
        return {"acc": list(acc), "seen": list(seen)}

    def relearn(self, state: dict) -> None:
        acc, seen = [float(v) for v in state["acc"]], [float(v) for v in state["seen"]]
        if len(acc) != len(self.acc) or len(seen) != len(self.seen):
            raise ValueError("learned node odds of another shape")
        if not all(counts_ok(a, s) for a, s in zip(acc, seen)):
            raise ValueError("learned node odds out of range")
        self.acc, self.seen = acc, seen


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


class DecayedLine:
    """y ~ a + b x, fitted by exponentially decayed least squares (recent points count most).
    Used for step times: per guessed token (prompt lookup) and per scored token (the server)."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.s = [0.0] * 5  # decayed sums: w, x, y, xx, xy

    def observe(self, x: float, y: float) -> None:
        d = self.decay
        w, sx, sy, sxx, sxy = self.s
        self.s = [d * w + 1, d * sx + x, d * sy + y, d * sxx + x * x, d * sxy + x * y]

    @property
    def weight(self) -> float:
        return self.s[0]

    def slope(self) -> float | None:
        """b, or None while the x values do not vary enough to tell it."""
        w, sx, sy, sxx, sxy = self.s
        var = w * sxx - sx * sx
        if var <= 1e-9 * max(w * w, 1.0):
            return None
        return (w * sxy - sx * sy) / var

    def intercept(self, slope: float) -> float:
        w, sx, sy, _, _ = self.s
        return (sy - slope * sx) / w

    def scaled(self, max_weight: float) -> list[float]:
        """The sums scaled so that they weigh at most max_weight points (same fitted line): what a
        later run starts from (learned.py), so that its own points soon outweigh them."""
        f = min(1.0, max_weight / self.s[0]) if self.s[0] > 0 else 1.0
        return [f * v for v in self.s]


class BatchGuard:
    """Speculate in a batch only while it commits more tokens per second than plain decoding.

    Verifying guesses is nearly free while a step is bound by reading the weights; on a
    CPU a batch of a few rows already makes the step compute-bound, and then every guessed
    token (padded to the longest draft in the batch) costs its full share while the
    drafters' per-row cost models still see a gain. So for batches of `min_rows` rows or more
    the engine (and, behind its cost model, the server's batcher) asks this guard before
    drafting: per batch-size band (2, 3-4, 5-8, ...; a single row is a band of its own when
    `min_rows` is 1, as the engine sets it for drafters that do not price their own guesses: a
    draft model, Medusa heads, an EAGLE head alone) it keeps
    decayed means of committed tokens per second of speculative steps and of plain steps,
    speculates while the speculative mean is at least the plain one, and probes the other
    mode once every `probe_every` steps (plain first, on the band's second step), so both
    stay measured as the text and the batch change. Never used for seeded sampled requests
    (their drafting must not depend on timing). Knows nothing about models.
    """

    def __init__(self, min_rows: int = 2, probe_every: int = 16, decay: float = 0.8) -> None:
        self.min_rows, self.probe_every, self.decay = min_rows, probe_every, decay
        self.rate: dict[tuple[int, bool], float] = {}  # (band, speculative) -> decayed tokens/s
        self.steps: dict[int, int] = {}  # steps seen per band
        self.decisions = {True: 0, False: 0}  # guarded steps that speculated / decoded plainly
        self._warm: set[tuple[int, bool]] = set()

    @staticmethod
    def band(rows: int) -> int:
        return 0 if rows == 1 else max(1, rows - 1).bit_length()

    def begin(self) -> None:
        """New prompts arrive (a batch starts): its first speculative step per band is a warm-up again."""
        self._warm.clear()

    def speculate(self, rows: int) -> bool:
        """Whether this step (of `rows` active rows) should draft."""
        if rows < self.min_rows:
            return True
        b = self.band(rows)
        n = self.steps.get(b, 0)
        self.steps[b] = n + 1
        spec, plain = self.rate.get((b, True)), self.rate.get((b, False))
        if plain is None:
            choice = n != 1  # the band's second step measures plain decoding
        elif spec is None:
            choice = True
        else:
            choice = spec >= plain
            if n % self.probe_every == 0:
                choice = not choice  # keep the other mode measured
        self.decisions[choice] += 1
        return choice

    def learned(self) -> dict:
        """The measured rates per band and mode, for a later run (learned.py); None before any."""
        return {"rate": [[b, s, r] for (b, s), r in self.rate.items()]} if self.rate else None

    def relearn(self, state: dict) -> None:
        rate = {}
        for b, s, r in state["rate"]:
            if not (isinstance(b, int) and isinstance(s, bool) and math.isfinite(float(r)) and float(r) > 0):
                raise ValueError("learned guard rate out of range")
            rate[(b, s)] = float(r)
        self.rate = rate

    def observe(self, rows: int, speculated: bool, tokens: int, seconds: float) -> None:
        """One step of `rows` rows committed `tokens` tokens in `seconds` (drafting included)."""
        if rows < self.min_rows or seconds <= 0:
            return
        key = (self.band(rows), speculated)
        if speculated and key not in self._warm:
            self._warm.add(key)  # a band's first speculative step may catch a drafter up on whole prompts
            return
        r = tokens / seconds
        old = self.rate.get(key)
        self.rate[key] = r if old is None else self.decay * old + (1 - self.decay) * r
