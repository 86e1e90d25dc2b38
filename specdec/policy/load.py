"""The load policy: per step, how far to speculate and which source each row verifies
(docs/design.md, "The policy").

A guess is worth verifying when it raises the batch's expected committed tokens per second,

    sum over rows of E(committed tokens | its source, cap K) / (t(A, K) + drafting time),

with t from the step-time fit (`StepModel`, t = a + r A + b A K), a row's value under each
source from what the policy learnt of that source (`SourceStats`: acceptance per key and
position for chains, node odds by score for known trees, accepted tokens per step for trees drafted
on demand) and drafting time from each source's measured line in the rows it drafts for. K = 0 is
plain decoding. Every source is priced by this one chooser (`LoadPolicy.choose`): known sources
(their guesses are in hand before pricing and cost nothing to make: prompt lookup, a request's
prediction, a suffix cache, a grammar's forced tokens) and sources that draft on demand (a draft
model, an EAGLE or Medusa head, your own), which a row takes only where they promise more than
its best known offer. Probes follow `probing.ProbeSchedule` (see `choose`).
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass, field

from ..learned import nonneg
from .acceptance import Acceptance, NodeOdds, outcome, path_chances
from .fits import FIT_DECAY, DecayedLine, StepModel, batch_end, ema
from .probing import PROBE_EVERY, PROBE_ROOM, PROBE_SHARE, ProbeSchedule

#: the keys and draft positions a source's acceptance is learnt over (a lookup's match lengths)
KEYS, POSITIONS = 8, 16
#: the longest chain a known source with `Drafter.long_chains` may verify in one step (a
#: prediction or a prompt copy that has been holding), beyond k_max: on a CPU a step of 17 tokens
#: costs ~3.3 plain steps and one of 9 ~2.5, so a chain that holds pays more the longer it runs
LONG_MAX = 32
#: observations' worth of a known tree's own scores before its nodes' odds are learnt (a suffix
#: cache read from one prompt scores a continuation seen once at 1.0; on chat such nodes hold ~30%
#: of the time, and a prior worth two observations kept a fresh request verifying them ~10 steps)
KNOWN_TREE_PRIOR = 0.5
#: a tree drafted on demand is expected to gain this many tokens a step until one is seen: a tree
#: pays at once only where verifying its nodes is cheap (a CPU rarely), and learns fast (0.9 a step)
TREE_PRIOR = 0.5
#: the plain steps right after an on-demand source drafted whose time beyond a plain step is charged
#: to that drafting (`LoadPolicy.observe_step`), not to plain decoding
AFTER_STEPS = 4
#: how many recent plain steps (outside those stretches) `LoadPolicy._plain_step` takes the median of
FAR_PLAIN = 16
#: plain steps an engine times (outside settling and a drafting step's aftermath) before an
#: on-demand source may draft: the price of plain decoding that drafting is weighed against
PLAIN_FIRST = 4
#: the steps after a prefill that are not fitted while every row of the step is that young
SETTLE_STEPS = 8


def expected_path(odds: list[float], parents: list[int]) -> float:
    """A tree's expected accepted nodes under sample and compare: the sum over nodes of the chance
    that the path to it holds (`acceptance.path_chances`)."""
    return sum(path_chances(odds, parents))


class SourceStats:
    """What the policy learnt of one draft source (`name`): the acceptance of its chains per key
    and position (`prior` until seen), the odds of its known trees' nodes by their scores, an
    on-demand tree's accepted tokens and nodes per row-step, its drafting time (seconds per guess
    for a chain, per proposal for a tree) as a line in the rows it drafts for, and its time per
    token read on a catch-up."""

    def __init__(self, name: str, known: bool, tree: bool, prior: float, k_max: int, holds_on: bool = False) -> None:
        """holds_on: unseen draft positions take the rate of the one before (`Drafter.holds_on`)."""
        self.name, self.known, self.tree = name, known, tree
        self.acceptance = Acceptance(KEYS, max(POSITIONS, k_max), prior, inherit=holds_on)
        self.odds = NodeOdds(prior=KNOWN_TREE_PRIOR, calibrated=True)
        self.gain = TREE_PRIOR  # on-demand trees: accepted tokens per row-step that drafted one
        self.nodes: float | None = None  # and the nodes such a tree held
        self.time = DecayedLine(FIT_DECAY)
        self.t_catch: float | None = None
        # seconds a drafting step adds to the plain steps after it (its forwards take the target's
        # weights out of the caches): decayed, signed (noise averages out), priced at least 0
        self.aftermath = 0.0
        self.probes = ProbeSchedule(PROBE_EVERY)
        self.probing = False  # the last choice forced this source on rows as a probe

    @property
    def timed(self) -> bool:
        return self.time.weight > 1e-9

    @property
    def tried(self) -> bool:
        """Whether any of its guesses was verified yet (in this process or a learnt earlier run)."""
        return self.nodes is not None if self.tree else self.acceptance.observed(0)

    def draft_seconds(self, rows: int) -> float:
        """Predicted drafting seconds per unit (a guess of a chain, a tree) for `rows` rows: the
        line once it rests on 4 points, else its mean pro rata in the rows (0 until timed)."""
        line = self.time
        if not self.timed:
            return 0.0
        return line.at(rows, line.s[2] / max(line.s[1], 1e-9) * rows)

    def catch_up(self, behind: int) -> float:
        """Seconds to read `behind` tokens the source has not seen: the measured time per token
        read on catch-ups; before one, its drafting time per unit at one row."""
        return (self.t_catch if self.t_catch is not None else self.draft_seconds(1)) * behind

    def value(self, k: int, k_max: int) -> float:
        """Expected committed tokens of a row that verifies this on-demand source's guesses under
        a cap of k: a tree's measured accepted tokens pro rata below its usual size; a chain's
        acceptance per position."""
        if self.tree:
            return 1.0 + self.gain * min(1.0, k / max(self.nodes or 1.0, 1.0))
        return self.acceptance.expected(0, k_max)[min(k, k_max)]

    def learned(self) -> dict:
        return {"acceptance": self.acceptance.learned(), "odds": self.odds.learned(), "gain": self.gain,
                "nodes": self.nodes, "time": self.time.scaled(16.0), "t_catch": self.t_catch,
                "aftermath": self.aftermath}

    def relearn(self, state: dict) -> None:
        """Start from `learned()`'s output; ValueError if it does not fit (parts may be restored)."""
        sums = [nonneg(v, "time") for v in state["time"]]
        if len(sums) != 5 or None in sums:
            raise ValueError("learned drafting time is not a line's five sums")
        gain, nodes, t_catch = (nonneg(state.get(n), n) for n in ("gain", "nodes", "t_catch"))
        self.acceptance.relearn(state["acceptance"])
        self.odds.relearn(state["odds"])
        self.time.s = sums
        self.gain = self.gain if gain is None else gain
        self.nodes, self.t_catch = nodes or None, t_catch
        aftermath = state.get("aftermath", 0.0)
        if not isinstance(aftermath, (int, float)) or not math.isfinite(aftermath):
            raise ValueError("learned aftermath is not a number")
        self.aftermath = float(aftermath)


@dataclass
class Quote:
    """One source's standing this step, as the proposal path hands it to `LoadPolicy.choose`."""
    stats: SourceStats
    ok: list[bool]  # rows that may take it (the request allows it, the row has room)
    offers: list | None = None  # a known source: per row its offer (tokens, key, scores, certain) or None
    lags: list[int] | None = None  # on demand: per row, the committed tokens it must read first
    every_row: bool = True  # on demand: it drafts every row whenever it drafts (its time line's x is A)


@dataclass
class Choice:
    """The step's plan: the cap K on each row's guesses and the source each row verifies (an
    index into the quotes, None: its pending token alone); `reason` says why a step is plain."""
    k: int
    source: list[int | None]
    probe: bool = False
    reason: str = ""
    values: list[list[float]] = field(default_factory=list)  # per known quote, per row: E(j guesses)


class LoadPolicy:
    """The scheduler's per-step choice, in `serve` and `generate` alike (module docstring).

    Probes (`choose`): while the best cap is below k_max, every PROBE_EVERY-th step allows one
    guess more, so what a guess costs at this batch size stays measured (while the fit cannot yet
    tell it and every step drafts the most, that step is plain instead); an on-demand source that
    no row took is tried on rows with room for PROBE_ROOM more tokens, in batches of up to
    PROBE_MAX_ROWS rows, on its `ProbeSchedule`, while some acceptance could make it pay and the
    probe fits the probes' budget (`ProbeSchedule.affordable`); a tree's probe verifies its best
    PROBE_NODES nodes. Before the step-time fit rests on data, a step is priced at the mean step
    seen (a unit step before any) and a row's guess slot at R_PRIOR of a step at one row, up to a
    row's whole share of it in a batch; a source nothing has timed is priced as free until its
    first proposal times it.
    `eager` (a warm-up that must run every source and measure both ends): every other step drafts
    as at a fixed k, the others are plain.
    `closed` (a batch no row joins once it started: `Engine.generate`): a step is worth what it
    brings the batch's end closer, the rows times the fewest tokens expected of a row with the most
    room (`BatchGuard.progress`, the guard's count of the same batches), not every row's tokens."""

    PROBE_MAX_ROWS = 4  # forced probes of a declined source only in batches this small
    #: a forced probe of a declined tree source verifies at most its best this-many nodes: where a
    #: tree does not pay (a CPU verifying 16 nodes at ~3.6 plain steps) a whole tree a probe costs
    #: a request more than the probes could ever learn; a small tree tells whether its guesses hold
    PROBE_NODES = 4
    TREE_MARGIN = 1.05  # an on-demand tree must promise this much more than the best choice without it
    R_PRIOR = 0.08  # a verified guess's cost in plain steps until the step-time fit tells it

    def __init__(self, k_max: int, adaptive: bool = True) -> None:
        self.k_max, self.adaptive = k_max, adaptive
        # a long known chain's cap (LONG_MAX); at a fixed k every step drafts k_max
        self.long_max = max(k_max, LONG_MAX) if adaptive and k_max else k_max
        self.steps = StepModel()
        self.sources: dict[str, SourceStats] = {}
        self.eager = False
        self.closed = False
        self.probe_room = PROBE_ROOM
        # the on-demand source that drafted last, the plain steps since and their time beyond a
        # plain step's (`_plain_step`)
        self._after: tuple[SourceStats, int, float] | None = None
        # per row count, the last FAR_PLAIN plain steps outside any such stretch: what a stretch's
        # steps are measured against (`_plain_step`)
        self._far: dict[int, collections.deque] = {}
        self._plain_timed = 0  # plain steps timed outside any such stretch (and not settling)
        self._saved: dict = {}  # learned state of sources not yet registered (relearn before `source`)

    def source(self, name: str, known: bool, tree: bool, prior: float, nodes: int = 0,
               holds_on: bool = False) -> SourceStats:
        """The stats of source `name` (a tree of up to `nodes` nodes; `holds_on`: see
        `Drafter.holds_on`), made (and restored from learned state) on first use."""
        stats = self.sources.get(name)
        if stats is None:
            stats = self.sources[name] = SourceStats(name, known, tree, prior, self.long_max, holds_on)
            if name in self._saved:
                try:
                    stats.relearn(self._saved.pop(name))
                except (ValueError, KeyError, TypeError):
                    stats = self.sources[name] = SourceStats(name, known, tree, prior, self.long_max, holds_on)
            if tree and stats.nodes is None and nodes:
                stats.nodes = float(nodes)
        return stats

    # -- what was measured --------------------------------------------------------------
    def observe_step(self, rows: int, k: int, seconds: float, drafted: SourceStats | None = None,
                     settling: bool = False) -> None:
        """A step of `rows` rows with `k` guess slots took `seconds` (drafting excluded); `drafted`:
        the on-demand source that drafted for it, if any; `settling`: every row joined within the
        last SETTLE_STEPS steps. Such steps are not fitted: after a prefill the steps run slower
        for a while, plain and speculative alike (the default model on a 2-core Xeon: the first
        ~1.5x a step 10 later), and fitted, they set a fresh engine's plain step that high, which
        its drafting then never measured again.

        A model drafter's forwards take the target's weights out of the caches, so the target's
        next steps run slower (the default model and its draft on a 2-core Xeon: a plain step
        right after a drafted one 1.3x one 9+ steps later, recovering over ~4 steps). Counted as
        plain steps, that time made plain decoding look dear and drafting cheap, so a fresh
        `--method draft` engine drafted half its steps at 0.9x a plain engine. So the first
        AFTER_STEPS plain steps after a drafting step stay out of the step-time fit, and their
        time beyond it is that source's `aftermath`, priced with its drafting. The drafting step's
        own verification counts too, by what it took beyond the price `choose` gave it (the draft
        model's 34 MB forward evicts the target's weights before that step's own forward: a
        one-guess step measured 1.24-1.28 plain steps where the fit priced 1.11-1.12, and a fresh
        engine, its fit still on its prior, drafted at 0.8x plain in those steps)."""
        if settling:
            return
        after = self._after
        if after is not None:
            stats, n, excess = after
            plain = self._plain_step(rows) if k == 0 and drafted is None else None
            if plain is not None:
                n, excess = n + 1, excess + seconds - plain
                if n < AFTER_STEPS:
                    self._after = (stats, n, excess)
                    return
            # the stretch ends (AFTER_STEPS plain steps, or the next drafting step before them);
            # one the next drafting step ended before any plain step is not counted (a source
            # that drafts step after step had its aftermath averaged away: its steps are fitted)
            if n > 0:
                stats.aftermath = ema(stats.aftermath, excess, 0.8)
            self._after = None
            if plain is not None:
                return
        if drafted is not None:  # its excess over its price, before the fit learns from it
            priced = self.steps.mean(rows) is not None  # (before any step, no price to measure by)
            self._after = (drafted, 0, seconds - self._priced(rows, k) if priced else 0.0)
        elif k == 0:
            self._far.setdefault(rows, collections.deque(maxlen=FAR_PLAIN)).append(seconds)
            self._plain_timed += 1
        self.steps.observe(rows, k, seconds)

    def _plain_step(self, rows: int) -> float | None:
        """What a plain step of `rows` rows takes, for the steps after a drafting one to be
        measured against: the median of the last FAR_PLAIN plain steps outside such stretches once
        there are 4, else the step-time fit's. (Against the fit alone, which in a fresh engine's
        first steps moved between 5.4 and 8.1 ms for a 7.1 ms step of the default model, a draft
        model's aftermath averaged ~0 where the 4 steps after it measured ~1.5 ms slower.)"""
        measured = self._measured_plain(rows)
        return measured if measured is not None else self.steps.predict(rows, 0)

    def _measured_plain(self, rows: int) -> float | None:
        """The median of the last FAR_PLAIN plain steps of `rows` rows outside any drafting
        step's aftermath, once there are 4; else None."""
        far = self._far.get(rows)
        return statistics.median(far) if far is not None and len(far) >= 4 else None

    def observe_drafting(self, stats: SourceStats, rows: int, seconds: float, units: int, steady: bool,
                         behind: int = 0) -> None:
        """Source `stats` drafted `units` (guesses of a chain, or 1 tree) for `rows` rows in
        `seconds`. A proposal that first read `behind` committed tokens it had not seen (not
        `steady`) is a catch-up, priced per token read; if nothing has timed the source yet, the
        next step probes it again, in steady state."""
        if steady:
            stats.time.observe(rows, seconds / max(units, 1))
            return
        if behind > 0 and stats.timed:
            drafting = stats.draft_seconds(rows) * (1 if stats.tree else max(units - 1, 0))
            stats.t_catch = ema(stats.t_catch, max(seconds - drafting, 0.0) / behind, 0.8)
        if not stats.timed:
            stats.probes.again(measured=False)

    def observe_outcome(self, stats: SourceStats, reached: list[int], accepted: list[int],
                        odds: list[list[float] | None] | None = None,
                        parents: list[list[int]] | None = None) -> None:
        """Per row that verified this on-demand source's guesses: how deep its proposal reached
        (a chain's guesses, a tree's depth) and how many held; for a sampled row, `odds` (each
        guess's chance of holding given its parent held: `core.step.held_odds`; a tree's
        `parents`) stand for the outcome: their expectation, with less noise than one sample. A
        probe whose guess held is repeated at once (one observation is too few to turn the
        choice)."""
        rows = [b for b, d in enumerate(reached) if d > 0]
        if not rows:
            return
        sampled = [odds[b] if odds is not None else None for b in rows]
        if stats.tree:
            gains = [float(accepted[b]) if o is None else expected_path(o, parents[b]) for b, o in zip(rows, sampled)]
            stats.gain = ema(stats.gain, sum(gains) / len(gains), 0.9)
        else:
            stats.acceptance.observe_held(0, [outcome(reached[b], accepted[b]) if o is None else o[: reached[b]]
                                              for b, o in zip(rows, sampled)])
        if stats.probing and any(accepted[b] > 0 for b in rows):
            stats.probes.again()

    def observe_nodes(self, stats: SourceStats, nodes: list[int]) -> None:
        """The sizes of the trees an on-demand tree source drafted this step (after any cut)."""
        if nodes:
            stats.nodes = ema(stats.nodes, sum(nodes) / len(nodes), 0.9)

    # -- what it predicts ---------------------------------------------------------------
    def guess_steps(self, rows: int) -> float:
        """r: what one more verified guess costs at `rows` rows, in plain steps (R_PRIOR until the
        fit rests on 8 steps)."""
        steps = self.steps
        if steps.weight(rows) < 8:
            return self.R_PRIOR
        r = steps.guess_cost(rows)
        return self.R_PRIOR if r is None else min(max(r, 0.005), 1.0)

    def draft_steps(self, stats: SourceStats, drafting: int, rows: int) -> float:
        """c: source `stats`'s predicted drafting time for `drafting` rows, in plain steps of
        `rows` rows (0 until it is timed and a step is seen)."""
        plain = self.steps.plain_or_mean(rows)
        if not plain or not stats.timed:
            return 0.0
        return stats.draft_seconds(drafting) / plain

    def _fit(self, A: int) -> tuple[float, float, float]:
        """(a, r, b) of the step-time fit at A rows; before it is fitted, a step priced at the mean
        step seen (a unit step before any) and a row's guess slot at min(1, R_PRIOR * A) of a
        row's share of it."""
        fit = self.steps.coefficients(A)
        if fit is not None:
            return fit
        mean = self.steps.mean(A) or 1.0
        # a row's guess slot costs R_PRIOR of a step at one row and up to a whole row's share of it
        # in a batch (a CPU's step turns compute-bound as rows join: 8 rows of 7 tokens cost ~4.7
        # steps of 8 rows on a 2-core Xeon, not the 1.3 that R_PRIOR alone would say)
        return mean, 0.0, min(1.0, self.R_PRIOR * A) * mean / A

    # -- what it chooses ----------------------------------------------------------------
    def choose(self, quotes: list[Quote], step: int, room: list[int], fixed: bool = False) -> Choice:
        """This step's cap and each row's source (module and class docstrings). `step` is the
        caller's count of decode steps (the probes' phase); room: the tokens each row may still
        take beyond its pending one; fixed: draft k_max this step (as when not adaptive)."""
        A = len(room)
        values = [self._known_values(q) if q.stats.known else None for q in quotes]
        for q in quotes:
            q.stats.probing = False
        if fixed or not self.adaptive:
            return self._fixed(quotes, values, A)
        if self.eager:  # a warm-up: every source drafts on every other step, so both ends are measured
            return self._fixed(quotes, values, A) if step % 2 else Choice(0, [None] * A, reason="probe")
        fit = self._fit(A)
        has_fit = self.steps.coefficients(A) is not None
        # before a step-time fit (a fresh engine, not one restored from learned state), an
        # on-demand source waits for PLAIN_FIRST timed plain steps, what it is priced against: one
        # that drafted from the first step after settling never timed one, and the fit took the
        # drafted steps' line at 0 guesses (~1.2 plain steps) for plain decoding
        on_demand = [i for i, q in enumerate(quotes) if not q.stats.known and any(q.ok)]
        offered = any(v for vs in values if vs for v in vs)
        if not has_fit and (self.steps.mean(A) is None or on_demand and self._plain_timed < PLAIN_FIRST):
            if not offered:  # the first steps: nothing to price drafting by
                return Choice(0, [None] * A, reason="warming")
            on_demand = []
        known_top = max((len(v) - 1 for vs in values if vs for v in vs if v), default=0)
        top = self.k_max if on_demand and not all(quotes[i].stats.tree for i in on_demand) else 0
        for i in on_demand:
            if quotes[i].stats.tree:
                top = max(top, round(quotes[i].stats.nodes or self.k_max) + 1)
        # on-demand sources draft up to k_max; a known offer may be longer (Drafter.long_chains)
        top = max(min(top, self.k_max), min(known_top, self.long_max))
        may = {i: self._repaid(quotes[i], fit, A, room) for i in on_demand}
        best = {None: (None, 0, [None] * A)}  # option -> (rate, k, per-row source)
        a, r, b = fit
        per_unit: dict[tuple[int, int], float] = {}  # (source, rows drafted for) -> seconds per unit
        for k in self._caps(top):
            t = self._priced(A, k, fit, has_fit)
            base_val, base_src = self._best_known(values, k, A) if offered else ([1.0] * A, [None] * A)
            self._keep(best, None, self._worth(base_val, room) / t, k, base_src)
            for i in on_demand:
                stats = quotes[i].stats
                if k == 0 or k > self.k_max:
                    continue
                v = stats.value(k, self.k_max)
                use = [m and v > bv for m, bv in zip(may[i], base_val)]
                n = sum(use)
                if not n:
                    continue
                if (i, n) not in per_unit:
                    per_unit[i, n] = self._per_unit(quotes[i], n, A)
                cost = self._drafting(quotes[i], n, A, k, per_unit[i, n])
                tokens = self._worth([v if u else bv for u, bv in zip(use, base_val)], room)
                self._keep(best, i, tokens / (t + cost), k,
                           [i if u else s for u, s in zip(use, base_src)])
        rate0, best_k, best_src = best[None]
        for i in on_demand:
            if i in best and best[i][0] > rate0 * (self.TREE_MARGIN if quotes[i].stats.tree else 1.0):
                rate0, best_k, best_src = best[i]
        return self._probe(quotes, values, step, room, best_k, best_src, has_fit, on_demand)

    def _priced(self, rows: int, k: int, fit: tuple[float, float, float] | None = None,
                has_fit: bool | None = None) -> float:
        """What `choose` prices a step of `rows` rows with `k` guess slots at, in seconds
        (drafting apart): the fit's line and its residual at k, or `_fit`'s stand-in before it (a
        step's mean, guesses at R_PRIOR of it); once fitted, a plain step (k = 0) at what recent
        plain steps measured where there are 4 (`_far`). A line through steps that verified
        guesses misprices the plain step where the curve bends (a draft model's steps, slowed by
        its own forwards, set the fresh default model's line at 1.2 plain steps for 0 guesses),
        and a source drafting step after step times none."""
        if has_fit is None:
            has_fit = self.steps.coefficients(rows) is not None
        measured = self._measured_plain(rows) if k == 0 and has_fit else None
        if measured is not None:
            return measured
        a, r, b = fit if fit is not None else self._fit(rows)
        return a + r * rows + b * rows * k + (self.steps.residual(rows, k) if has_fit else 0.0)

    def _worth(self, tokens: list[float], room: list[int]) -> float:
        """What a step whose rows expect `tokens` each is worth: their sum; in a closed batch of 2+
        rows, what it brings the batch's end closer (`fits.batch_end`)."""
        return batch_end(tokens, room) if self.closed and len(tokens) > 1 else sum(tokens)

    def _caps(self, top: int) -> list[int]:
        """The caps a step is priced at: every one up to k_max, then half as many again each
        (12, 18, 27, then `top`, for k_max 8): a long chain's worth changes little per guess."""
        caps = list(range(min(top, self.k_max) + 1))
        while caps[-1] < top:
            caps.append(min(top, caps[-1] + max(caps[-1] // 2, 1)))
        return caps

    def _probe(self, quotes, values, step, room, best_k, best_src, has_fit, on_demand) -> Choice:
        """The chosen plan, or a probe instead (class docstring)."""
        A = len(room)
        roomy = max(room, default=0) >= self.probe_room
        known = any(q.stats.known for q in quotes)
        in_use = known or any(s is not None for s in best_src)
        if step % PROBE_EVERY == 0 and roomy and in_use:
            if best_k < self.k_max:
                return Choice(best_k + 1, best_src, True, values=values)
            if not has_fit:
                return Choice(0, [None] * A, True, reason="probe", values=values)  # a second draft length to fit
        for i in on_demand:
            q = quotes[i]
            if any(s == i for s in best_src):
                q.stats.probes.taken()
                continue
            if A > self.PROBE_MAX_ROWS:
                continue
            plain = self.steps.plain_or_mean(A) or 0.0
            could = self._could_pay(q, A)
            k = max(min(best_k, self.k_max), min(self.k_max, self.PROBE_NODES, round(q.stats.nodes or self.k_max))
                    if q.stats.tree else 1)
            rows, cost = self._probe_rows(q, k, best_k, A, room, plain) if could else ([False] * A, 0.0)
            if q.stats.probes.due(any(rows), share=1.0 / A):
                q.stats.probing = True
                q.stats.probes.paid(cost)
                return Choice(k, [i if use else s for use, s in zip(rows, best_src)], True, values=values)
        if best_k == 0 or all(s is None for s in best_src):
            offered = on_demand or any(v for vs in values if vs for v in vs)
            return Choice(0, [None] * A, reason="cost" if offered else "nothing", values=values)
        return Choice(best_k, best_src, values=values)

    def _fixed(self, quotes, values, A) -> Choice:
        """Every step drafts k_max: a row takes a known offer of 2+ guesses, else the first
        on-demand source that may draft for it, else whatever known offer it has."""
        src: list[int | None] = []
        for b in range(A):
            known = [(len(vs[b]) - 1, i) for i, vs in enumerate(values) if vs and vs[b]]
            long = [i for n, i in sorted(known, reverse=True) if n >= 2]
            demand = [i for i, q in enumerate(quotes) if not q.stats.known and q.ok[b]]
            pick = long[0] if long else demand[0] if demand else max(known)[1] if known else None
            src.append(pick)
        return Choice(self.k_max if any(s is not None for s in src) else 0, src, values=values,
                      reason="" if any(s is not None for s in src) else "nothing")

    @staticmethod
    def _keep(best: dict, option, rate: float, k: int, src: list) -> None:
        if option not in best or best[option][0] is None or rate > best[option][0] * 1.0001:
            best[option] = (rate, k, src)

    def _known_values(self, q: Quote) -> list[list[float] | None]:
        """Per row, E(committed tokens | its first j guesses verified) of a known source's offer."""
        out = []
        for ok, offer in zip(q.ok, q.offers or []):
            if not ok or offer is None or not offer.tokens:
                out.append(None)
            elif offer.parents is not None and offer.scores is not None:
                out.append(q.stats.odds.tree_expected(offer.scores, offer.parents))
            else:
                out.append(q.stats.acceptance.expected(offer.key, len(offer.tokens), offer.certain))
        return out

    @staticmethod
    def _best_known(values, k: int, A: int) -> tuple[list[float], list[int | None]]:
        """Per row, the most a known offer is worth under cap k, and which source's it is."""
        val, src = [1.0] * A, [None] * A
        for i, vs in enumerate(values):
            if not vs:
                continue
            for b, v in enumerate(vs):
                if v and len(v) > 1:
                    x = v[min(k, len(v) - 1)]
                    if x > val[b]:
                        val[b], src[b] = x, i
        return val, src

    @staticmethod
    def _per_unit(q: Quote, n: int, A: int) -> float:
        """Seconds an on-demand source takes per unit (a chain's guess, a tree) for n of A rows."""
        return q.stats.draft_seconds(A if q.every_row else n)

    def _drafting(self, q: Quote, n: int, A: int, k: int, per_unit: float | None = None) -> float:
        """Seconds an on-demand source takes to draft under cap k for n of A rows (`per_unit`:
        `_per_unit`'s answer where the caller has it)."""
        per_unit = self._per_unit(q, n, A) if per_unit is None else per_unit
        return (per_unit if q.stats.tree else k * per_unit) + max(q.stats.aftermath, 0.0)

    def _probe_rows(self, q: Quote, k: int, best_k: int, A: int, room: list[int], plain: float
                    ) -> tuple[list[bool], float]:
        """The rows a probe of on-demand source q under cap k drafts for, cheapest first while the
        probes' budget holds (`ProbeSchedule.affordable`), and what it costs in plain steps of A
        rows: every row's slots padded from best_k to k (the step verifies A rows of k guesses,
        whichever rows draft them), and each probing row's catch-up on its unread tokens and
        drafting. (Counting a row's own k guesses alone had priced a probe in a batch of 3 at a
        third of its cost: on a machine where verification is dear such probes lost 5% of a
        short level.)"""
        if not plain:
            return [False] * A, 0.0
        a, r, b = self._fit(A)
        cost = b * A * max(0, k - best_k) / plain
        lags = q.lags or [0] * A
        own = sorted((q.stats.catch_up(lag) + self._drafting(q, 1, A, k), i)
                     for i, (ok, left, lag) in enumerate(zip(q.ok, room, lags)) if ok and left >= self.probe_room)
        rows = [False] * A
        for seconds, i in own:
            if not q.stats.probes.affordable(cost + seconds / plain, room[i]):
                break
            rows[i], cost = True, cost + seconds / plain
        return rows, cost

    def _could_pay(self, q: Quote, A: int) -> bool:
        """Whether any acceptance could make an on-demand source pay at A rows: its guesses (a
        tree's nodes) all held multiply the step's tokens by 1 + depth, against their
        verification and drafting."""
        slots = round(q.stats.nodes or self.k_max) if q.stats.tree else 1
        plain, drafted = self.steps.predict(A, 0), self.steps.predict(A, slots)
        if plain is None or drafted is None:
            return True
        return drafted + self._drafting(q, 1, A, slots) < (1.0 + slots) * plain

    def _repaid(self, q: Quote, fit, A: int, room: list[int]) -> list[bool]:
        """The rows that may take on-demand source q: those it has nearly caught up on, and those
        whose catch-up what may still come repays, room * (1 - 1/v) plain steps' time saved (v its
        best rate over plain decoding; before the step-time fit, a step priced at the mean step
        seen), with room for PROBE_ROOM more tokens. A source none of whose guesses was verified
        yet has only its prior for v: on that word alone it catches up on a far row for at most
        PROBE_SHARE of the row's coming steps, else only as a probe (a fresh `--method draft`
        engine had read each 55-token prompt into the draft at its second step, ~3.5 plain steps
        of a 64-token answer, and kept 0.93 of plain decoding's rate)."""
        lags = q.lags or [0] * A
        far = [ok and late > self.k_max + 2 for ok, late in zip(q.ok, lags)]
        if not any(far):
            return list(q.ok)
        a, r, b = fit
        plain = a + r * A
        gain = max(q.stats.value(k, self.k_max) * plain / (plain + b * A * k + self._drafting(q, 1, A, k))
                   for k in range(1, self.k_max + 1))
        out = []
        for ok, f, late, left in zip(q.ok, far, lags, room):
            if not f:
                out.append(ok)
            else:
                catch_up = q.stats.catch_up(late)
                out.append(left >= self.probe_room and gain > 1.0  # (a far row is an ok one)
                           and left * plain * (1.0 - 1.0 / gain) >= catch_up
                           and (q.stats.tried or catch_up <= PROBE_SHARE * left * plain))
        return out

    # -- what a later run starts from ----------------------------------------------------
    def learned(self) -> dict:
        """The step-time fit (at most 16 steps' weight) and every source's stats (learned.py)."""
        saved = dict(self._saved)
        saved.update({name: s.learned() for name, s in self.sources.items()})
        return {"steps": self.steps.learned(16.0), "sources": saved}

    def relearn(self, state: dict) -> None:
        """Start from `learned()`'s output; ValueError (the step fit unchanged) if it does not fit.
        Sources not registered yet are restored when they are (`source`)."""
        steps = StepModel(self.steps.decay, self.steps.forget)
        steps.relearn(state["steps"])
        self.steps.all, self.steps.bands = steps.all, steps.bands
        self.steps.version += 1
        for name, sub in dict(state.get("sources") or {}).items():
            if name in self.sources:
                self.sources[name].relearn(sub)
            else:
                self._saved[name] = sub
