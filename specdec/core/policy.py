"""The policy layer: every online cost model that decides how much to speculate (docs/design.md,
"The policy").

A guess is worth verifying when it raises expected committed tokens per unit of time,

    value(j) = (1 + a_1 + a_1 a_2 + ... + a_1...a_j) / (1 + c j + r j),

with a_i the acceptance at draft position i, c the drafting cost and r the verification cost
of a guess, both in plain steps. Everything here measures these quantities online with
exponentially decayed counts and fits, and probes a declined choice every `PROBE_EVERY` steps
(or lookups) so that it notices when speculating pays again. `generate` (engine.py) and the
server's batcher both call this module:

- `best_prefix`: how many of a proposal's guesses (or a tree's nodes) to verify, given their
  expected acceptance, c and r (prompt lookup's cut, auto's tree trim);
- `LengthPolicy`: acceptance per match length and draft position, and prompt lookup's cut;
- `NodeOdds`: how often a tree node of a given path probability holds;
- `ProbeSchedule`: when a declined choice is probed, at growing intervals (a draft model or an
  EAGLE tree beside prompt lookup, speculation where the batch guard declined it);
- `BatchGuard`: in a batch, speculate only while it measures faster than plain decoding
  (the engine and the server);
- `StepModel`: the one step-time fit, t = a + r A + b A K per batch-size band: what a plain
  step costs and what a guess adds to it. Prompt lookup's cut (and through it auto's tree trim)
  and `LoadPolicy` read it; under the scheduler both read its one instance;
- `LoadPolicy`: the scheduler's per-step cap and choice of source (lookup, tree, draft model,
  any drafter run through the protocol) that maximise the batch's committed tokens per second,
  in `generate` and `serve` alike;
- `DecayedLine`: decayed least squares, the fit behind the server's drafting times.

Each part can hand what it learnt to a later run (`learned()` / `relearn`, see learned.py).
This module knows nothing about models; it sees only counts and seconds.
"""

from __future__ import annotations

import bisect
import math

from ..learned import nonneg

CARRIED_COUNTS = 8.0  # observations' worth of an acceptance rate that a later run starts from (learned.py)
#: every policy that can decline to speculate probes the declined choice once in this many steps
#: (or lookups of one match length), so a choice that stopped speculating notices when it pays again
PROBE_EVERY = 16
#: a probe (a declined choice tried anyway, or a second source's first catch-up) waits until at
#: least this many tokens of the request may still come: a short answer never earns one back
PROBE_ROOM = 32
#: decay of acceptance counts per draft position and of the step-time fits (per step):
#: about the last 50 steps count
FIT_DECAY = 0.98


def ema(old: float | None, new: float, keep: float) -> float:
    """An exponential moving average that keeps `keep` of the old value (the new value itself
    when there is none yet): the drafters' times, gains and tree sizes, the guard's rates."""
    return new if old is None else keep * old + (1.0 - keep) * new


def band(rows: int) -> int:
    """The batch-size band a step of `rows` rows belongs to: 1 row, 2, 3-4, 5-8, ... (the cost of
    a guess changes with the load, so the guard and the step-time fit keep one estimate per band)."""
    return max(1, rows - 1).bit_length() if rows > 1 else 0


def carried(acc: float, seen: float, most: float = CARRIED_COUNTS) -> tuple[float, float]:
    """Decayed counts (accepted, seen) scaled so that seen is at most `most`: the same rate,
    which a later run's own observations soon outweigh (learned.py)."""
    f = min(1.0, most / seen) if seen > 0 else 1.0
    return f * acc, f * seen


def counts_ok(acc: float, seen: float) -> bool:
    """Whether saved counts can be decayed counts of a rate: 0 <= accepted <= seen, 0 < seen < inf."""
    return 0.0 <= acc <= seen < math.inf and seen > 0


class ProbeSchedule:
    """When a gate that declined a choice tries it anyway: after `every` declined steps, then
    after twice as many each time a probe finds the choice still declined (up to `most` times
    `every`), back to `every` once the gate takes it again. A probe that cannot pay for itself
    (`room` False: too little of the answer left to earn back what the probe costs) waits.
    Knows nothing about models."""

    def __init__(self, every: int = PROBE_EVERY, most: int = 32) -> None:
        """most: the longest gap, in `every`s. A probe of a second source costs its catch-up on
        the context (an EAGLE head's on ~90 tokens: ~4 plain steps of the default model), so
        while the source does not pay, probes every 512 steps cost under 1% (every 128: ~3%,
        measured in the server at one client)."""
        self.every, self.most = every, most
        self.gap = every  # declined steps before the next probe
        self.last_gap = every  # the gap before the last probe lengthened it
        self.skipped = 0  # declined steps since the last probe

    def due(self, room: bool = True, share: float = 1.0) -> bool:
        """The gate declined this step: whether to probe anyway (the gap doubles with each probe).
        share: what this step counts towards the gap (a probe of A rows costs A rows' drafting, so
        the server counts a step of A rows as 1/A)."""
        self.skipped += share
        if self.skipped < self.gap or not room:
            return False
        self.skipped = 0
        self.last_gap, self.gap = self.gap, min(2 * self.gap, self.most * self.every)
        return True

    def taken(self) -> None:
        """The gate took the choice: the next probe comes `every` declined steps after it stops."""
        self.gap, self.skipped = self.every, 0

    def again(self, measured: bool = True) -> None:
        """The next declined step probes again: the last probe looked promising (one probe is
        one observation, too few to turn a gate), or it measured nothing (`measured` False: it
        only caught the drafter up, so it does not lengthen the gap either)."""
        if not measured:
            self.gap = self.last_gap
        self.skipped = self.gap


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
    Used for drafting times against the number of rows that draft (the server's `LoadPolicy`)."""

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
    """

    def __init__(self, min_rows: int = 2, probe_every: int = PROBE_EVERY, decay: float = 0.8) -> None:
        self.min_rows, self.probe_every, self.decay = min_rows, probe_every, decay
        self.rate: dict[tuple[int, bool], float] = {}  # (band, speculative) -> decayed tokens/s
        self.steps: dict[int, int] = {}  # steps seen per band
        self.decisions = {True: 0, False: 0}  # guarded steps that speculated / decoded plainly
        self.probes: dict[int, ProbeSchedule] = {}  # per band: when speculation is probed while plain wins
        self._probed: int | None = None  # the band whose last step was such a probe
        self._warm: set[tuple[int, bool]] = set()

    def begin(self) -> None:
        """New prompts arrive (a batch starts): its first speculative step per band is a warm-up again."""
        self._warm.clear()

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
        self.decisions[choice] += 1
        return choice

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

    def observe(self, rows: int, speculated: bool, tokens: int, seconds: float, steady: bool = True) -> None:
        """One step of `rows` rows committed `tokens` tokens in `seconds` (drafting included).
        steady False: the drafter first caught up on tokens it sat out (a one-off per request or
        per stretch of plain steps, not what speculating costs): not counted, and a probe that
        did only that is repeated on the next step."""
        if rows < self.min_rows or seconds <= 0:
            return
        key = (band(rows), speculated)
        if not steady:
            if speculated and self._probed == key[0]:
                self._schedule(key[0]).again(measured=False)
            return
        if speculated and key not in self._warm:
            self._warm.add(key)  # a band's first speculative step may catch a drafter up on whole prompts
            return
        self.rate[key] = ema(self.rate.get(key), tokens / seconds, self.decay)


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """x with m x = v for a small dense system (Gaussian elimination with partial pivoting, in
    floats: a step's cost model is solved up to nine times a step, and torch's per-call overhead
    made that a tenth of a two-row step); None if m is singular."""
    n = len(v)
    a = [list(row) + [v[i]] for i, row in enumerate(m)]
    for c in range(n):
        p = max(range(c, n), key=lambda i: abs(a[i][c]))
        if a[p][c] == 0.0:
            return None
        a[c], a[p] = a[p], a[c]
        for i in range(c + 1, n):
            f = a[i][c] / a[c][c]
            if f:
                for j in range(c, n + 1):
                    a[i][j] -= f * a[c][j]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (a[i][n] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / a[i][i]
    return x


class _Fit:
    """t ~ a + r * A + b * A * K by exponentially decayed least squares (recent steps count most).
    A draft length whose decayed count falls to `forget` no longer counts towards the two that
    b needs; while fewer than two do (every recent step verified as many guesses: a source that
    is not drafted, a text without lookups), the last coefficients solved stand (else a fit
    that stopped choosing guesses would forget what they cost, and price them from scratch)."""

    def __init__(self, decay: float, forget: float = 0.05) -> None:
        self.decay, self.forget = decay, forget
        self.m = [[0.0] * 3 for _ in range(3)]  # decayed sums of f f^T, f = (1, A, A*K)
        self.v = [0.0] * 3  # decayed sums of f * t
        self.weight = 0.0
        self.ks: dict[int, float] = {}  # decayed count of steps per draft length
        self._coef: tuple[float, float, float] | None | bool = False  # solved coefficients (False: not yet)
        self._last: tuple[float, float, float] | None = None  # the last coefficients solved

    def observe(self, rows: int, k: int, seconds: float) -> None:
        d = self.decay
        f = (1.0, float(rows), float(rows * k))
        m, v = self.m, self.v  # updated in place: this runs once a decoding step
        for i in range(3):
            row, fi = m[i], f[i]
            for j in range(3):
                row[j] = d * row[j] + fi * f[j]
            v[i] = d * v[i] + fi * seconds
        self.weight = d * self.weight + 1
        ks = self.ks
        for kk in [kk for kk, w in ks.items() if w <= self.forget]:
            del ks[kk]
        for kk in ks:
            ks[kk] *= d
        ks[k] = ks.get(k, 0.0) + 1
        self._coef = False

    def state(self, max_weight: float) -> dict:
        """The decayed sums scaled to weigh at most `max_weight` steps (the same fit): what a later
        run starts from (learned.py), so that its own steps soon outweigh them."""
        f = min(1.0, max_weight / self.weight) if self.weight > 0 else 1.0
        return {"m": [[f * x for x in row] for row in self.m], "v": [f * x for x in self.v],
                "weight": f * self.weight, "ks": {str(k): f * w for k, w in self.ks.items()}}

    def restore(self, state: dict) -> None:
        m = [[float(x) for x in row] for row in state["m"]]
        v, weight = [float(x) for x in state["v"]], float(state["weight"])
        ks = {int(k): float(w) for k, w in state["ks"].items()}
        if len(m) != 3 or any(len(row) != 3 for row in m) or len(v) != 3:
            raise ValueError("learned step-time fit of another shape")
        if not all(math.isfinite(x) for x in [*sum(m, []), *v, weight, *ks.values()]) or weight < 0:
            raise ValueError("learned step-time fit out of range")
        self.m, self.v, self.weight, self.ks, self._coef = m, v, weight, ks, False

    def coefficients(self) -> tuple[float, float, float] | None:
        """(a, r, b), or None until there are 4 steps and two draft lengths to tell b."""
        if self._coef is False:
            self._coef = self._solve() or self._last
            self._last = self._coef
        return self._coef

    def _solve(self) -> tuple[float, float, float] | None:
        if self.weight < 4 or len(self.ks) < 2:
            return None
        ridge = 1e-9 * max(self.m[i][i] for i in range(3))
        m = [[self.m[i][j] + (ridge if i == j else 0.0) for j in range(3)] for i in range(3)]
        x = _solve(m, self.v)
        if x is None:
            return None
        a, r, b = x
        if a < 0 or r < 0:  # one batch size only (or noise): a and r cannot be told apart
            keep = (0, 2)
            x = _solve([[m[i][j] for j in keep] for i in keep], [self.v[i] for i in keep])
            if x is None:
                return None
            (a, b), r = x, 0.0
        return max(a, 1e-6), max(r, 0.0), max(b, 0.0)


class StepModel:
    """Step time t(A, K) = a + r * A + b * A * K for A rows with K guess slots each: a fixed cost,
    a cost per row (its own token, reading its KV cache) and a cost per guessed token. The cost
    of a guess depends on the load: while a step is bound by reading the weights an extra token
    is nearly free, once the batch makes it compute-bound it costs its full matmul share. So the
    coefficients are fitted per batch-size band (1, 2, 3-4, 5-8, ...), each by decayed least
    squares over its own steps, with a fit over all steps for bands not measured yet. (One line
    over all steps learnt the steep cost of a full batch and then, back at one row, priced
    guesses at it and stopped guessing.)"""

    def __init__(self, decay: float = FIT_DECAY, forget: float = 0.05) -> None:
        """forget: the decayed count below which a draft length stops counting towards telling b
        (the default: the server's, which tries a guess more every 16th step, so its lengths
        keep varying; prompt lookup passes a tiny one, since it may verify no guess for
        hundreds of steps and must keep the cost it measured before)."""
        self.decay, self.forget = decay, forget
        self.all = _Fit(decay, forget)
        self.bands: dict[int, _Fit] = {}
        self.version = 0  # counts changes, so a reader may keep what it priced until the next one

    def observe(self, rows: int, k: int, seconds: float) -> None:
        self.all.observe(rows, k, seconds)
        fit = self.bands.get(band(rows))
        if fit is None:
            fit = self.bands[band(rows)] = _Fit(self.decay, self.forget)
        fit.observe(rows, k, seconds)
        self.version += 1

    def coefficients(self, rows: int | None = None) -> tuple[float, float, float] | None:
        fit = self.bands.get(band(rows)) if rows is not None else None
        c = fit.coefficients() if fit is not None else None
        return c if c is not None else self.all.coefficients()

    def weight(self, rows: int) -> float:
        """How many (decayed) steps the fit used for `rows` rows rests on: its band's, else all."""
        fit = self.bands.get(band(rows))
        return fit.weight if fit is not None and fit.coefficients() is not None else self.all.weight

    def mean(self, rows: int) -> float | None:
        """The decayed mean seconds of the steps seen of `rows` rows' band (else of all); None
        before any: what a step costs before the fit can tell guesses apart."""
        fit = self.bands.get(band(rows))
        fit = fit if fit is not None and fit.weight > 0 else self.all
        return fit.v[0] / fit.m[0][0] if fit.weight > 0 else None

    def plain_step(self, rows: int) -> float | None:
        """Seconds of a step of `rows` rows that verifies no guesses (None until fitted)."""
        c = self.coefficients(rows)
        return None if c is None else c[0] + c[1] * rows

    def plain_or_mean(self, rows: int) -> float | None:
        """A plain step's seconds at `rows` rows from the fit, else the mean step seen (None
        before any)."""
        return self.plain_step(rows) or self.mean(rows)

    def guess_cost(self, rows: int) -> float | None:
        """r: what one more guess slot for each of `rows` rows adds to a step, in plain steps of
        those rows (None until fitted)."""
        c = self.coefficients(rows)
        if c is None:
            return None
        a, r, b = c
        return b * rows / (a + r * rows)

    def learned(self, max_weight: float) -> dict:
        """Every fit, scaled to at most `max_weight` steps (learned.py)."""
        return {"all": self.all.state(max_weight), "bands": {str(b): f.state(max_weight) for b, f in self.bands.items()}}

    def relearn(self, state: dict) -> None:
        """Start from `learned()`'s output; ValueError (nothing changed) if it does not fit."""
        fits = _Fit(self.decay, self.forget), {}
        fits[0].restore(state["all"])
        for b, fit_state in state["bands"].items():
            fit = fits[1][int(b)] = _Fit(self.decay, self.forget)
            fit.restore(fit_state)
        self.all, self.bands = fits
        self.version += 1

    def predict(self, rows: int, k: int) -> float | None:
        c = self.coefficients(rows)
        if c is None:
            return None
        a, r, b = c
        return a + r * rows + b * rows * k


class LengthPolicy:
    """Per (match length, draft position) acceptance and the cost of a verified token;
    chooses how many of a lookup's tokens to propose. Knows nothing about models."""

    def __init__(self, max_n: int, max_k: int, decay: float = FIT_DECAY, r_prior: float = 0.08,
                 clock: bool = True, probe_every: int = PROBE_EVERY, prior: float = 0.5) -> None:
        """clock=False: price a guess at r_prior always, never at a measured cost (lengths that
        follow from the text alone, as tests need them). probe_every: propose one guess after
        this many lookups of a match length declined in a row (0: never). prior: the acceptance
        at every position before any is seen, worth two observations."""
        self.decay = decay
        self.clock = clock
        self.probe_every = probe_every
        self.declined = [0] * (max_n + 1)  # per match length: lookups declined since the last guess
        self.acc = [[2.0 * prior] * max_k for _ in range(max_n + 1)]
        self.seen = [[2.0] * max_k for _ in range(max_n + 1)]
        self.r_prior = r_prior
        # step seconds vs rows and guesses verified (core.policy.StepModel, the step-time fit the
        # server's load policy uses too: its scheduler hands the lookup its own, `share_times`)
        self.times = StepModel(forget=1e-9)
        self.observes_times = True  # False: the fit is fed by its owner (the server's scheduler)
        self.rows = 1  # the batch size of the step whose guesses are priced (set by the drafter)
        self._price_key: tuple | None = None  # (rows, fit, its version) that `_price` was read for
        self._price: tuple[float | None, float | None] = (None, None)

    def share_times(self, times: StepModel) -> None:
        """Read step costs from `times`, which its owner feeds (one fit instead of two)."""
        self.times, self.observes_times = times, False

    def _priced(self) -> tuple[float | None, float | None]:
        """(seconds of a plain step, r) at this batch size from the fit, both None until it rests
        on 8 steps; read once per change of the fit or the batch size (several gates ask each step)."""
        key = (self.rows, self.times, self.times.version)
        if self._price_key != key:
            times, rows = self.times, self.rows
            fitted = times.weight(rows) >= 8 and times.coefficients(rows) is not None
            self._price = (times.plain_step(rows), times.guess_cost(rows)) if fitted else (None, None)
            self._price_key = key
        return self._price

    @property
    def r(self) -> float:
        """What one more verified guess costs, in plain steps (`r_prior` until measured)."""
        r = self._priced()[1]
        return self.r_prior if r is None else min(max(r, 0.005), 1.0)

    def step_seconds(self) -> float | None:
        """Seconds of a step that verifies no guesses, from the fit (None until measured)."""
        return self._priced()[0]

    def held(self, n: int, k: int) -> list[float]:
        """P(the first j guesses of a match-length-n continuation all hold), j = 1 .. min(k,
        positions tracked): the expected accepted tokens each guess adds."""
        n = min(n, len(self.acc) - 1)
        out, p = [], 1.0
        for i in range(min(k, len(self.acc[n]))):
            p *= self.acc[n][i] / self.seen[n][i]
            out.append(p)
        return out

    def expected(self, n: int, k: int) -> list[float]:
        """[E(0), .., E(k')]: expected committed tokens (1 + accepted guesses) when j of a
        match-length-n continuation are proposed, j = 0 .. k' = min(k, positions tracked)."""
        out = [1.0]
        for p in self.held(n, k):
            out.append(out[-1] + p)
        return out

    def choose(self, n: int, available: int, may_probe: bool = True) -> int:
        """How many of a match-length-n lookup's `available` guesses to propose: the prefix of
        most expected tokens per unit of step time (core.policy.best_prefix), or a probe (one
        guess after `probe_every` declined lookups of this match length; not while `may_probe` is
        False: then the count waits). Acceptance is learnt from the text whether or not a lookup
        is proposed (NgramDrafter), so a probe serves the step-time fit: it keeps r measured."""
        r = self.r if self.clock else self.r_prior
        best_j = best_prefix(self.held(n, available), 0.0, r)
        n = min(n, len(self.declined) - 1)
        if best_j == 0 and available > 0 and self.probe_every and may_probe:
            self.declined[n] += 1
            if self.declined[n] >= self.probe_every:
                best_j = 1  # a probe (module docstring)
        if best_j:
            self.declined[n] = 0
        return best_j

    def observe(self, n: int, proposed: int, accepted: int) -> None:
        self.observe_rows(n, [(proposed, accepted)])

    def observe_rows(self, n: int, rows: list[tuple[int, int]]) -> None:
        """One step's (proposed, accepted) of each row that drafted with a match of length n: the
        counts decay once a step, not once a row, so a batch of many rows does not forget faster."""
        n = min(n, len(self.acc) - 1)
        acc, seen, d = self.acc[n], self.seen[n], self.decay
        for i in range(min(len(acc), max((min(p, a + 1) for p, a in rows), default=0))):
            held = tried = 0
            for proposed, accepted in rows:
                if i < min(proposed, accepted + 1):  # the positions whose predecessors all held
                    tried += 1
                    held += i < accepted
            acc[i] = d * acc[i] + held
            seen[i] = d * seen[i] + tried

    def observe_time(self, j: int, seconds: float, rows: int = 1) -> None:
        """A step of `rows` rows that verified up to `j` guesses a row took `seconds`."""
        if self.observes_times:
            self.times.observe(rows, j, seconds)

    def learned(self, max_seen: float = CARRIED_COUNTS, max_times: float = 16.0) -> dict:
        """What this policy has learned, for a later run to start from (learned.py): acceptance
        counts capped at max_seen per (match length, position) and the step-time fit at
        max_times points, so that a new text soon outweighs an old one."""
        acc, seen = [], []
        for a_row, s_row in zip(self.acc, self.seen):
            cells = [carried(a, s, max_seen) for a, s in zip(a_row, s_row)]
            acc.append([a for a, _ in cells])
            seen.append([s for _, s in cells])
        return {"acc": acc, "seen": seen, "times": self.times.learned(max_times)}

    def relearn(self, state: dict) -> None:
        """Start from `learned()`'s output of an earlier run. ValueError if its shape does not fit
        this policy (another max_n or max_k): nothing is changed then."""
        acc, seen, times = state["acc"], state["seen"], state["times"]
        shape = [len(r) for r in self.acc]
        if [len(r) for r in acc] != shape or [len(r) for r in seen] != shape:
            raise ValueError("learned acceptance tables of another shape")
        acc = [[float(v) for v in r] for r in acc]
        seen = [[float(v) for v in r] for r in seen]
        if not all(counts_ok(a, s) for ar, sr in zip(acc, seen) for a, s in zip(ar, sr)):
            raise ValueError("learned acceptance counts out of range")
        fit = StepModel(self.times.decay, self.times.forget)
        fit.relearn(times)  # ValueError (nothing changed) if out of range
        self.acc, self.seen = acc, seen
        if self.observes_times:
            self.times = fit


def _line_at(line: DecayedLine, x: float, fallback: float) -> float:
    """A decayed line's prediction at x once it has 4 points' weight and a non-negative slope;
    `fallback` before that."""
    slope = line.slope()
    if slope is None or slope < 0 or line.weight < 4:
        return fallback
    return max(line.intercept(slope) + slope * x, 0.0)


class LoadPolicy:
    """The scheduler's load-aware choice, per step, in `serve` and `generate` alike: the cap K in
    0..k_max on each row's guesses and which rows take a second source (an EAGLE tree, or a draft
    model's guesses) instead of their prompt lookup, or, for a drafter run through the protocol
    (Medusa, an EAGLE head alone, your own), how far it drafts, maximising the batch's expected
    committed tokens per second,

        sum over rows of (1 + expected accepted guesses under K) / (t(A, K) + drafting time),

    with t from `StepModel` (fed every step by `observe_step`), a row's lookup from its learnt
    per-position acceptance (`Drafter.expected_tokens`), a tree beside the lookup from the tree
    drafter's measured gain, a draft model or a protocol drafter from its measured acceptance per
    position (`draft_odds`; a protocol tree's by depth). Drafting times are lines in the number of
    rows that draft (`head_time`, `draft_time`). K = 0 is plain decoding. Probes:
    every PROBE_EVERY-th step allows one guess more than the best cap (so the cost of guesses
    stays measured at this batch size even while the best cap is 0) while some row may still
    take PROBE_ROOM tokens, and in batches of A <= TREE_PROBE_MAX_ROWS rows, rows that may take
    the declined source and have room for PROBE_ROOM more tokens do so if none chose it, on a
    `ProbeSchedule` (`_probe`: after PROBE_EVERY * A declined steps, the gap doubling while probes
    find the source still declined). Before the step-time fit rests on data, a row's guess is
    priced at R_PRIOR of its share of a plain step; a tree whose head nothing has timed is drafted
    only as such a probe (`eager`: priced as free instead, for a warm-up that must run the head).
    `step` is the caller's count of decode steps, which sets the probes' phase."""

    TREE_PROBE_MAX_ROWS = 4  # forced second-source probes only in batches this small
    TREE_MARGIN = 1.05  # trees must promise this much more than the best lookup-only choice
    DRAFT_PRIOR = 0.6  # a draft model's guess holds with 0.6 once those before it held, until measured
    R_PRIOR = 0.08  # a verified guess's cost in plain steps until the step-time fit tells it (LengthPolicy's prior)

    def __init__(self, k_max: int, adaptive: bool = True) -> None:
        self.k_max, self.adaptive = k_max, adaptive
        self.steps = StepModel()
        self.head_time = DecayedLine(FIT_DECAY)  # the head's drafting seconds vs rows it drafts for
        self.draft_time = DecayedLine(FIT_DECAY)  # a draft model's seconds per drafted token vs rows
        # a draft model's (or a protocol drafter's) acceptance per position, learnt from the rows
        # that took its guesses: a LengthPolicy of one match length
        self.draft_odds = self._new_draft_odds()
        self.probes = ProbeSchedule(PROBE_EVERY)  # when rows that declined the second source try it (`_probe`)
        # price a tree the head has not been timed on as free (the scheduler's warm-up, which
        # must run the head); False: only a probe drafts the first tree, once a row has room
        self.eager = False
        self.probe_room = PROBE_ROOM  # the fewest tokens a row may still take for a probe to try it
        self.t_catch: float | None = None  # a draft model's seconds to read one token it had not seen
        self._probing = False  # the last choice forced the draft model on rows as a probe
        self.draft_depth: int | None = None  # the deepest guess a row took from the draft source (last step)

    def _new_draft_odds(self) -> LengthPolicy:
        """A draft model's acceptance per position, nothing learnt: a LengthPolicy of one match
        length at DRAFT_PRIOR."""
        return LengthPolicy(0, self.k_max, clock=False, probe_every=0, prior=self.DRAFT_PRIOR)

    # -- what was measured --------------------------------------------------------------
    def observe_step(self, rows: int, k: int, seconds: float) -> None:
        """A step of `rows` rows with `k` guess slots took `seconds` (drafting excluded)."""
        self.steps.observe(rows, k, seconds)

    def observe_head(self, rows: int, seconds: float, steady: bool) -> None:
        """An EAGLE head beside the lookup drafted trees for `rows` rows in `seconds`; a draft that
        first caught the head up on a context (not `steady`) is not its cost, and if nothing has
        timed the head yet, the next step probes again (in steady state, so that it times it)."""
        if steady:
            self.head_time.observe(rows, seconds)
        elif self.head_cost(rows) is None:
            self.probes.again(measured=False)

    def observe_draft_time(self, rows: int, seconds_per_token: float) -> None:
        """A draft model drafted for `rows` rows at `seconds_per_token` (steady state only)."""
        self.draft_time.observe(rows, seconds_per_token)

    def observe_catch_up(self, seconds: float, behind: int, drafted: int) -> None:
        """A draft-model proposal that first read `behind` tokens it had not seen, then drafted
        `drafted` guesses, took `seconds`: its time per token read (the guesses after the first
        priced at its steady time per token)."""
        per_guess = self.draft_cost(1)
        self.t_catch = ema(self.t_catch, max(seconds - (drafted - 1) * per_guess, 0.0) / max(behind, 1), 0.8)

    def observe_draft(self, caps: list[int], accepted: list[int]) -> None:
        """Per row: its cap allowed `caps[b]` draft-model guesses and `accepted[b]` held (rows
        with cap 0 did not take the draft model). A probe whose guess held is repeated at once
        (one observation is too few to turn the choice, and the next catch-up is short)."""
        self.draft_odds.observe_rows(0, [(cap, held) for cap, held in zip(caps, accepted) if cap > 0])
        self.draft_depth = max(caps, default=0) or self.draft_depth
        if self._probing and any(cap > 0 and held > 0 for cap, held in zip(caps, accepted)):
            self.probes.again()

    def learned(self) -> dict:
        """The step-time fit, the drafting-time lines (each at most 16 steps' weight) and the
        draft model's acceptance (capped, `carried`), for a later run to start from (learned.py)."""
        return {"steps": self.steps.learned(16.0), "head_time": self.head_time.scaled(16.0),
                "draft_time": self.draft_time.scaled(16.0), "draft_odds": self.draft_odds.learned(),
                "t_catch": self.t_catch}

    def relearn(self, state: dict) -> None:
        """Start from `learned()`'s output; ValueError (nothing changed) if it does not fit."""
        steps = StepModel(self.steps.decay, self.steps.forget)
        steps.relearn(state["steps"])
        lines = []
        for name in ("head_time", "draft_time"):
            sums = [nonneg(v, name) for v in state[name]]  # (rows and seconds: every sum is >= 0)
            if len(sums) != 5 or None in sums:
                raise ValueError(f"learned {name} is not a line's five sums")
            line = DecayedLine(FIT_DECAY)
            line.s = sums
            lines.append(line)
        odds = self._new_draft_odds()
        odds.relearn(state["draft_odds"])
        t_catch = nonneg(state.get("t_catch"), "t_catch")
        # the lookup reads this fit (`share_times`): it is updated in place, not replaced
        self.steps.all, self.steps.bands = steps.all, steps.bands
        self.steps.version += 1
        self.head_time, self.draft_time = lines
        self.draft_odds, self.t_catch = odds, t_catch

    # -- what it predicts ---------------------------------------------------------------
    def draft_cost(self, A: int) -> float:
        """Predicted seconds a draft model takes per drafted token for A rows (0 until measured)."""
        line = self.draft_time
        if line.weight < 1e-9:
            return 0.0
        return _line_at(line, A, line.s[2] / line.weight)

    def catch_up_cost(self, behind: int) -> float:
        """Seconds a draft model takes to read `behind` tokens it has not seen: its measured time
        per token read on catch-ups; before one, its drafting time per token (more than a token
        read in a longer forward costs)."""
        return (self.t_catch if self.t_catch is not None else self.draft_cost(1)) * behind

    def head_cost(self, A: int) -> float | None:
        """Predicted seconds the head drafts a tree for each of A rows: a line over the numbers
        of tree rows seen; from one number only, its cost per row times A (pessimistic above
        it, so many trees are not started on a cost timed for few); None while nothing has timed
        the head (then only a probe drafts a tree, `eager` aside)."""
        h = self.head_time
        if h.weight < 1e-9:
            return None
        return _line_at(h, A, h.s[2] / max(h.s[1], 1e-9) * A)

    def head_steps(self, tree_rows: int, A: int) -> float:
        """c of a step of A rows whose `tree_rows` rows draft a tree: the head's predicted drafting
        time in plain steps (what a tree's cut weighs its nodes against, LookupEagleDrafter's
        `assemble`); 0 until the head is timed and a step is seen."""
        head = self.head_cost(tree_rows) if tree_rows else None
        plain = self.steps.plain_or_mean(A)
        return head / plain if head is not None and plain else 0.0

    # -- what it chooses ----------------------------------------------------------------
    def _search(self, A: int, gains: list[list[float]], second, fit: tuple[float, float, float] | None = None,
                top: int | None = None):
        """{False: best (rate, k, use) with lookups only, True: best with the second source}, or
        None while t(A, K) is not fitted yet. second(k, looks, t) -> (rate, use) or None. fit:
        (a, r, b) to price steps with instead of the step-time fit's. top: the largest cap worth
        pricing (a cap beyond every row's guesses only adds slots: None, k_max)."""
        best = {False: (None, 0, [False] * A), True: (None, 0, [False] * A)}
        fit = fit or self.steps.coefficients(A)  # (read once: `predict` for every k, without its lookups)
        if fit is None:
            return None
        a, r, b = fit
        top = self.k_max if top is None else min(top, self.k_max)
        for k in range(0, top + 1):
            t = a + r * A + b * A * k
            looks = [e[min(k, len(e) - 1)] for e in gains]
            options = [(False, sum(looks) / t, [False] * A)]
            extra = second(k, looks, t) if second is not None else None
            if extra is not None:
                options.append((True, *extra))
            for kind, rate, use in options:
                if best[kind][0] is None or rate > best[kind][0] * 1.0001:
                    best[kind] = (rate, k, use)
        return best

    def _roomy(self, room: list[int] | None) -> bool:
        """Whether some row may still take `probe_room` tokens (None: unknown, yes): a probe on a
        short answer's last steps measures what no later step of it can use."""
        return room is None or max(room, default=0) >= self.probe_room

    def _probe(self, A: int, best_use: list[bool], ok: list[bool], room: list[int] | None,
               cheap: list[bool] | None = None) -> list[bool] | None:
        """The rows this step forces the second source on, or None. Probes follow one
        `ProbeSchedule` (generate's auto uses the same rule): only while no row chose the second
        source, in batches of A <= TREE_PROBE_MAX_ROWS rows, a step of A rows counting 1/A
        towards the gap, which doubles each time a probe finds the source still declined; and
        only on rows that may still take PROBE_ROOM tokens (room; None: unknown), since a short
        answer never earns back a probe's catch-up on its context; and (cheap) on rows whose probe
        costs little enough."""
        if any(best_use):
            self.probes.taken()
            return None
        if not any(ok) or A > self.TREE_PROBE_MAX_ROWS:
            return None
        roomy = list(ok) if room is None else [o and r >= self.probe_room for o, r in zip(ok, room)]
        if cheap is not None:
            roomy = [o and c for o, c in zip(roomy, cheap)]
        return roomy if self.probes.due(any(roomy), share=1.0 / A) else None

    def choose_k(self, guesses: list[list[int]], gains: list[list[float]] | None, step: int,
                 tree_ok: list[bool] | None = None, tree=None, room: list[int] | None = None) -> tuple[int, list[bool]]:
        """Prompt lookup, with an EAGLE tree beside it when `tree` (the auto drafter) is given:
        (the cap, which rows draft a tree). gains: per row, expected committed tokens with its
        first j guesses (None: no estimates, every step drafts: --fixed-k). room: the tokens each
        row may still generate (probes wait for it)."""
        A = len(guesses)
        tree_ok = tree_ok or [False] * A
        if not self.adaptive or gains is None:
            if tree is None:
                return self.k_max, list(tree_ok)
            # --fixed-k: every step drafts; each row's source as `generate --method auto` picks it
            return self.k_max, [ok and not p for ok, p in zip(tree_ok, tree.prefer_lookup(guesses))]

        head_costs: dict[int, float | None] = {}  # per number of tree rows (the same for most k)
        may_tree = tree is not None and any(tree_ok)

        def trees(k, looks, t):
            if not may_tree or k == 0:
                return None
            value = tree.tree_tokens(k)  # a tree of the head's usual size, cut to k nodes
            use = [ok and value > lk for ok, lk in zip(tree_ok, looks)]
            n = sum(use)
            if not n:
                return None
            if n not in head_costs:
                head_costs[n] = self.head_cost(n)
            head = head_costs[n]
            if head is None:
                if not self.eager:
                    return None  # an untimed tree is not priced: the probes below draft the first one
                head = 0.0
            tokens = sum(value if u else lk for u, lk in zip(use, looks))
            return tokens / (t + head), use

        # caps beyond the longest lookup and a whole tree add only slots to price
        top = max(len(e) - 1 for e in gains) if gains else 0
        if may_tree:
            top = max(top, tree.usual_nodes + 1)
        best = self._search(A, gains, trees, top=top)
        if best is None and self.eager:  # nothing fitted yet: measure both ends, trees included
            k0 = self.k_max if step % 2 else 0
            return k0, [ok and k0 > 0 for ok in tree_ok]
        if best is None:
            # nothing fitted yet: a row's verified guess priced at R_PRIOR of its share of a plain
            # step (as the lookup's own length choice prices it), trees only by probe
            best = self._search(A, gains, None, fit=(1.0, 0.0, self.R_PRIOR / A), top=top)
            best_k, best_use = best[False][1:]
        else:
            # trees only by a clear margin: their cost model is coarser than the lookup's, and a
            # marginal tree step that misjudges its cost loses throughput
            with_trees, without = best[True], best[False]
            better = with_trees[0] is not None and with_trees[0] > self.TREE_MARGIN * without[0]
            _, best_k, best_use = with_trees if better else without
        if step % PROBE_EVERY == 0 and best_k < self.k_max and self._roomy(room):
            return best_k + 1, best_use
        probe = self._probe(A, best_use, tree_ok, room) if tree is not None else None
        if probe is not None:
            return max(best_k, min(self.k_max, tree.usual_nodes)), probe
        return best_k, best_use

    def choose_draft(self, guesses: list[list[int]], gains: list[list[float]] | None, step: int,
                     draft_ok: list[bool], room: list[int] | None = None,
                     behind: list[int] | None = None) -> tuple[int, list[bool]]:
        """A draft model (method draft), with prompt lookup beside it when `gains` is given (auto
        with a draft model): (the cap, which rows take the draft model's guesses). A row's
        draft-model guesses are worth 1 + the per-position gains up to K, and cost K times the
        draft's time per token; a row whose lookup under K is worth more takes it instead, and a
        step in which every row does so skips the draft model. behind: per row, the tokens the
        draft model has not read, which it reads before drafting (a catch-up): a row far behind
        takes it only while what may still come repays the catch-up (`_repaid`). Probes: a guess
        more every PROBE_EVERY-th step for the sources in use; a draft model declined on every row
        is tried on the `ProbeSchedule` (`_probe`), only while the catch-up is cheap next to the
        probes' gap and some acceptance could make it pay (`_could_pay`)."""
        A = len(guesses)
        self._probing = False
        if not self.adaptive:
            # --fixed-k: every step drafts; a lookup of 2+ guesses wins over the draft model (as
            # `generate --method auto`'s hybrid drafter does before it has measured anything)
            return self.k_max, [ok and len(g) < 2 for ok, g in zip(draft_ok, guesses)]
        per_tok = self.draft_cost(A)
        # expected extra tokens of a row allowed k draft-model guesses, k = 0 .. k_max
        cum = [tokens - 1.0 for tokens in self.draft_odds.expected(0, self.k_max)]
        behind = behind or [0] * A
        may = self._repaid(A, draft_ok, behind, room, per_tok, cum)

        def drafts(k, looks, t):
            if k == 0 or not any(may):
                return None
            use = [ok and 1.0 + cum[k] > lk for ok, lk in zip(may, looks)]
            if not any(use):
                return None
            tokens = sum(1.0 + cum[k] if u else lk for u, lk in zip(use, looks))
            return tokens / (t + k * per_tok), use

        looks = gains if gains is not None else [[1.0]] * A
        fit = self._fit_or_prior(A)
        if fit is None:  # before any step: a plain one
            return 0, [False] * A
        best = self._search(A, looks, drafts, fit=fit)
        with_draft, without = best[True], best[False]
        _, best_k, best_use = with_draft if with_draft[0] is not None and with_draft[0] > without[0] else without
        if step % PROBE_EVERY == 0 and best_k < self.k_max and self._roomy(room) and (any(best_use) or gains):
            return best_k + 1, best_use  # a guess more for the sources in use
        # the draft model declined on every row: probed on the schedule, where it is cheap enough
        cheap = None  # (a row took it: `_probe` restarts the schedule, nothing to price)
        if not any(best_use):
            plain = self.steps.plain_or_mean(A) or 0.0
            could = self._could_pay(A, per_tok)
            cheap = [could and self.catch_up_cost(b) <= plain * self.probes.gap / PROBE_EVERY for b in behind]
        probe = self._probe(A, best_use, draft_ok, room, cheap)
        if probe is not None:
            self._probing = True
            return max(best_k, 1), probe
        return best_k, best_use

    def _fit_or_prior(self, A: int) -> tuple[float, float, float] | None:
        """(a, r, b) of the step-time fit at A rows; before it is fitted, a step priced at the
        mean step seen and a guess at R_PRIOR of a row's share of it (as choose_k prices
        lookups); None before any step."""
        fit = self.steps.coefficients(A)
        if fit is not None:
            return fit
        mean = self.steps.mean(A)
        return None if mean is None else (mean, 0.0, self.R_PRIOR * mean / A)

    def _could_pay(self, A: int, per_tok: float, slots: int = 1, depth: int = 1) -> bool:
        """Whether any acceptance could make the draft source pay at A rows: `slots` guesses a
        row (a tree's nodes), `depth` of them held, multiply the tokens of a step by 1 + depth
        for their verification and drafting time."""
        plain, drafted = self.steps.predict(A, 0), self.steps.predict(A, slots)
        return plain is None or drafted is None or drafted + slots * per_tok < (1.0 + depth) * plain

    def choose_tree(self, step: int, tree_ok: list[bool], room: list[int] | None, nodes: int) -> tuple[int, list[bool]]:
        """A tree drafter run through the protocol (Medusa, an EAGLE head alone): (the cap, which
        rows draft its tree) this step. Its tree of up to `nodes` nodes a row is worth 1 + the
        expected accepted depth (`draft_odds` by depth, as deep as the last trees, `draft_depth`)
        and costs t(A, nodes) plus its drafting time (a line per node in the rows); it is drafted
        for every row that may while that beats plain decoding, 1 / t(A, 0) a row. Before a tree
        was seen, or with nothing to measure against (not adaptive), every row drafts. While the
        step-time fit cannot tell a guess's cost yet, every PROBE_EVERY-th tree step decodes
        plainly so that it can. Declined: probed on the `ProbeSchedule` (`_probe`) while some
        acceptance could pay."""
        A = len(tree_ok)
        self._probing = False
        if not self.adaptive or self.draft_depth is None or not any(tree_ok):
            return self.k_max, list(tree_ok)
        fit = self._fit_or_prior(A)
        if fit is None:
            return self.k_max, list(tree_ok)
        a, r, b = fit
        per_node = self.draft_cost(A)
        plain = a + r * A
        tokens = self.draft_odds.expected(0, self.draft_depth)[-1]
        drafting = sum(tree_ok)
        rate = (drafting * tokens + A - drafting) / (plain + b * A * nodes + nodes * per_node)
        if rate > A / plain:
            self.probes.taken()
            if self.steps.coefficients(A) is None and step % PROBE_EVERY == 0:
                return 0, [False] * A  # a plain step: the fit's second draft length
            return self.k_max, list(tree_ok)
        could = self._could_pay(A, per_node, nodes, self.draft_depth)
        probe = self._probe(A, [False] * A, tree_ok, room, [could] * A)
        if probe is not None:
            self._probing = True
            return self.k_max, probe
        return 0, [False] * A

    def _repaid(self, A: int, draft_ok: list[bool], behind: list[int], room: list[int] | None, per_tok: float,
                cum: list[float]) -> list[bool]:
        """The rows that may take the draft model this step: those it has nearly caught up on, and
        those whose catch-up what may still come repays, room * (1 - 1 / v) plain steps' time saved
        (v the best rate of a row drafting over plain decoding); before the step-time fit, those
        with room for PROBE_ROOM tokens."""
        fit = self.steps.coefficients(A)
        gain = None
        if fit is not None and any(ok and late > self.k_max + 2 for ok, late in zip(draft_ok, behind)):
            a, r, b = fit
            plain = a + r * A
            gain = max((1.0 + cum[k]) * plain / (plain + b * A * k + k * per_tok) for k in range(1, self.k_max + 1))
        out = []
        for ok, late, left in zip(draft_ok, behind, room or [None] * A):
            if not ok or late <= self.k_max + 2 or left is None:
                out.append(ok)
            elif gain is None:
                out.append(left >= self.probe_room)
            else:
                out.append(gain > 1.0 and left * plain * (1.0 - 1.0 / gain) >= self.catch_up_cost(late))
        return out
