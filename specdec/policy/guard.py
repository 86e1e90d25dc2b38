"""The batch guard: in a batch, speculate only while it measures faster than plain decoding
(docs/design.md, "The policy"). A backstop behind the load policy's cost model, for loads the
model misjudges. Pure: rows, tokens and seconds in, a yes or no out."""

from __future__ import annotations

import math

from .fits import band, batch_end, ema
from .probing import PROBE_EVERY, ProbeSchedule


class BatchGuard:
    """Speculate in a batch only while it commits more tokens per second than plain decoding.

    Verifying guesses is nearly free while a step is bound by reading the weights; on a
    CPU a batch of a few rows already makes the step compute-bound, and then every guessed
    token (padded to the longest draft in the batch) costs its full share while the
    drafters' per-row cost models still see a gain. So for batches of `min_rows` rows or more
    (2: a single row is priced by the cost model alone) the scheduler asks this guard, behind
    its cost model, before drafting: per batch-size band (2, 3-4, 5-8, ...; a single row is a
    band of its own when `min_rows` is 1) it keeps
    decayed means of committed tokens per second of speculative steps and of plain steps,
    speculates while the speculative mean is at least the plain one, and probes the other
    mode so both stay measured as the text and the batch change (plain first, on the band's
    second step): while speculation wins, a plain step every `probe_every` steps (it costs one
    step's guesses); while plain decoding wins, a speculative step on the band's
    `ProbeSchedule` (after `probe_every` plain steps, the gap doubling while probes find
    speculation still slower), since a probe pays the drafter's catch-up on every token it sat
    out. A probe step that only caught the drafter up (not steady) measures nothing: the next
    step probes again. Never used where drafting must not depend on timing (a fixed k: a
    seeded sampled request with guesses drawn from a q). Knows nothing about models.

    A step the guard lets through may still be declined by the cost model: it decodes plainly,
    so the guard never measures speculation there, yet it paid for every source's offers and
    the pricing (~10% of a 32-row step of the default model: the offers, their hindsight and the
    chooser run per row, single-threaded). So after the cost model declined a band's step, the
    band's next steps stay plain unpriced on a `ProbeSchedule` of their own (every
    `COST_EVERY` steps, the gap doubling up to `COST_MOST` while the cost model keeps
    declining), until a priced step speculates again. A step of fewer than `min_rows` rows, which
    the guard lets through unmeasured, keeps the same back-off for its on-demand sources (a draft
    model, an EAGLE or Medusa head) where no known source offers anything (`priced`): their worth
    changes only with what their own drafting measures, and pricing them cost ~0.1-0.15 ms of a
    ~4 ms one-row step of the default model (~2-3.5%) that `--method eagle` or `medusa` paid on
    every step they declined.

    A closed batch (`closed`: no request joins it once it started, as in `Engine.generate`)
    ends with its last row, so its time is that of the row with the most left to write, and a
    guess another row gains only shortens a row that would have left early anyway (it then frees
    its marginal share of a step, ~1 ms of a 15 ms six-row step of the default model, not a sixth
    of it). There a step counts as the rows times the fewest tokens any row with the most room
    committed (`progress`): speculating pays only where it moves the rows that decide the end.
    """

    #: after the cost model declined a band's step, it is asked again this many steps later ...
    COST_EVERY = 2
    #: ... the gap doubling each time it declines again, up to this many times COST_EVERY (8
    #: steps: an offer that would pay waits at most that long)
    COST_MOST = 4

    def __init__(self, min_rows: int = 2, probe_every: int = PROBE_EVERY, decay: float = 0.8,
                 closed: bool = False) -> None:
        self.min_rows, self.probe_every, self.decay, self.closed = min_rows, probe_every, decay, closed
        self.rate: dict[tuple[int, bool], float] = {}  # (band, speculative) -> decayed tokens/s
        self.steps: dict[int, int] = {}  # steps seen per band
        self.decisions = {True: 0, False: 0}  # guarded steps that speculated / decoded plainly
        self.probes: dict[int, ProbeSchedule] = {}  # per band: when speculation is probed while plain wins
        # per band whose last priced step the cost model declined: when it is priced again
        self.declined: dict[int, ProbeSchedule] = {}
        self._probed: int | None = None  # the band whose last step was such a probe
        self._warm: set[tuple[int, bool]] = set()

    def begin(self) -> None:
        """New prompts arrive (a batch starts): its first speculative step per band is a warm-up again,
        and the cost model is asked afresh."""
        self._warm.clear()
        self.declined.clear()

    def speculate(self, rows: int) -> bool:
        """Whether this step (of `rows` active rows) should draft."""
        if rows < self.min_rows:
            return True
        b = band(rows)
        n = self.steps.get(b, 0)
        self.steps[b] = n + 1
        spec, plain = self.rate.get((b, True)), self.rate.get((b, False))
        self._probed = None
        if plain is None:
            choice = n != 1  # the band's second step measures plain decoding
        elif spec is None:
            choice = True
        elif spec >= plain:
            self._schedule(b).taken()
            choice = n % self.probe_every != 0  # a plain step now and then keeps plain decoding measured
        else:
            choice = self._schedule(b).due()  # speculation probed ever more rarely while it keeps losing
            if choice:
                self._probed = b
        if choice and self._probed != b:
            choice = self.priced(rows)  # the cost model declined here lately: ask it now and then
        self.decisions[choice] += 1
        return choice

    def priced(self, rows: int) -> bool:
        """Whether the cost model prices a step of `rows` rows now, or the step stays plain unpriced
        because the cost model declined the band lately (the back-off above): asked by `speculate`
        for a batch it lets through, and by the proposal path for a step of fewer than `min_rows`
        rows in which no known source offers anything."""
        schedule = self.declined.get(band(rows))
        return schedule is None or schedule.due()

    def _schedule(self, b: int) -> ProbeSchedule:
        if b not in self.probes:
            self.probes[b] = ProbeSchedule(self.probe_every)
        return self.probes[b]

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

    def progress(self, room: list[int], accepted: list[int]) -> int:
        """The tokens a step counts as committed, given each row's room before it (the tokens it
        could still take beyond its pending one) and its accepted guesses: every row's tokens; in a
        closed batch, the rows times the fewest any row with the most room committed (the rows the
        batch waits for; all of them while none has got ahead)."""
        if not self.closed or not room:
            return sum(accepted) + len(accepted)
        return int(batch_end([1 + a for a in accepted], room))

    def observe(self, rows: int, speculated: bool, tokens: int, seconds: float, steady: bool = True,
                declined: bool = False) -> None:
        """One step of `rows` rows committed `tokens` tokens in `seconds` (drafting included).
        steady False: the drafter first caught up on tokens it sat out (a one-off per request or
        per stretch of plain steps, not what speculating costs): not counted, and a probe that
        did only that is repeated on the next step. declined: the guard let the step through and
        the cost model declined every guess (it counts as a plain step)."""
        b = band(rows)
        if declined:
            self.declined.setdefault(b, ProbeSchedule(self.COST_EVERY, self.COST_MOST))
        elif speculated:
            self.declined.pop(b, None)
        if rows < self.min_rows or seconds <= 0:
            return  # (a single row's rates are not the guard's to measure: the cost model's alone)
        key = (b, speculated)
        if not steady:
            if speculated and self._probed == key[0]:
                self._schedule(key[0]).again(measured=False)
            return
        if speculated and key not in self._warm:
            self._warm.add(key)  # a band's first speculative step may catch a drafter up on whole prompts
            return
        self.rate[key] = ema(self.rate.get(key), tokens / seconds, self.decay)
