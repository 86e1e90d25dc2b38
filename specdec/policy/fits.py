"""Decayed fits of what a step and a draft cost (docs/design.md, "The policy").

- `ema`: a running mean keeping a share of the old value;
- `band`: the batch-size band a step belongs to (1, 2, 3-4, 5-8, ...);
- `DecayedLine`: y ~ a + b x by decayed least squares (a source's drafting time against the rows
  it drafts for);
- `StepModel`: the one step-time fit, t = a + r A + b A K per batch-size band: what a plain step
  costs and what a guess slot adds.

Pure: counts and seconds in, predictions out; nothing here knows about models.
"""

from __future__ import annotations

import math

#: decay of acceptance counts per draft position and of the step-time fits (per step): about the
#: last 50 steps count
FIT_DECAY = 0.98


#: the step-time residuals per draft length keep this much of their sums a step of that length
RESIDUAL_DECAY = 0.8
#: a draft length's residual corrects the line once this many (decayed) steps of it were seen
RESIDUAL_SEEN = 2.0


def ema(old: float | None, new: float, keep: float) -> float:
    """An exponential moving average that keeps `keep` of the old value (the new value itself
    when there is none yet)."""
    return new if old is None else keep * old + (1.0 - keep) * new


def band(rows: int) -> int:
    """The batch-size band a step of `rows` rows belongs to: 1 row, 2, 3-4, 5-8, ... (the cost of
    a guess changes with the load, so the guard and the step-time fit keep one estimate per band)."""
    return max(1, rows - 1).bit_length() if rows > 1 else 0


def batch_end(tokens: list[float], room: list[int]) -> float:
    """What a step of a closed batch (no row joins it once it started) brings its end closer, in
    tokens: the rows times the fewest tokens (committed or expected) of a row with the most room
    left, the rows the batch waits for. `BatchGuard.progress` and `LoadPolicy` count by it."""
    most = max(room)
    return len(tokens) * min(v for v, left in zip(tokens, room) if left == most)


class DecayedLine:
    """y ~ a + b x, fitted by exponentially decayed least squares (recent points count most).
    A source's drafting time against the number of rows it drafts for (`LoadPolicy`)."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.s = [0.0] * 5  # decayed sums: w, x, y, xx, xy (replaced, never changed in place)
        self._slope: tuple[list[float], float | None] | None = None  # (the sums it was solved from, b)

    def observe(self, x: float, y: float) -> None:
        d = self.decay
        w, sx, sy, sxx, sxy = self.s
        self.s = [d * w + 1, d * sx + x, d * sy + y, d * sxx + x * x, d * sxy + x * y]

    @property
    def weight(self) -> float:
        return self.s[0]

    def slope(self) -> float | None:
        """b, or None while the x values do not vary enough to tell it (solved once per sums: the
        chooser asks for it at every cap it prices)."""
        if self._slope is not None and self._slope[0] is self.s:
            return self._slope[1]
        w, sx, sy, sxx, sxy = self.s
        var = w * sxx - sx * sx
        b = None if var <= 1e-9 * max(w * w, 1.0) else (w * sxy - sx * sy) / var
        self._slope = (self.s, b)
        return b

    def intercept(self, slope: float) -> float:
        w, sx, sy, _, _ = self.s
        return (sy - slope * sx) / w

    def scaled(self, max_weight: float) -> list[float]:
        """The sums scaled so that they weigh at most max_weight points (same fitted line): what a
        later run starts from (learned.py), so that its own points soon outweigh them."""
        f = min(1.0, max_weight / self.s[0]) if self.s[0] > 0 else 1.0
        return [f * v for v in self.s]

    def at(self, x: float, fallback: float) -> float:
        """The prediction at x once the line has 4 points' weight and a non-negative slope;
        `fallback` before that."""
        slope = self.slope()
        if slope is None or slope < 0 or self.weight < 4:
            return fallback
        return max(self.intercept(slope) + slope * x, 0.0)


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
        # per (band, draft length): decayed [sum of (measured - the line's) seconds, count]
        self.residuals: dict[tuple[int, int], list[float]] = {}
        self.version = 0  # counts changes, so a reader may keep what it priced until the next one

    def observe(self, rows: int, k: int, seconds: float) -> None:
        line = self.line(rows, k)
        if line is not None:
            cell = self.residuals.setdefault((band(rows), k), [0.0, 0.0])
            cell[0] = RESIDUAL_DECAY * cell[0] + (seconds - line)
            cell[1] = RESIDUAL_DECAY * cell[1] + 1.0
        self.all.observe(rows, k, seconds)
        fit = self.bands.get(band(rows))
        if fit is None:
            fit = self.bands[band(rows)] = _Fit(self.decay, self.forget)
        fit.observe(rows, k, seconds)
        self.version += 1

    def residual(self, rows: int, k: int) -> float:
        """How far steps of `rows` rows with `k` guess slots measured above (or below) the line,
        seconds; 0 until RESIDUAL_SEEN such steps. A kernel's cost is seldom a line in the tokens
        it scores (a row-padded tile makes 2 tokens cost what 4 do; a 1-row path is cheaper than
        any multi-row one), and a line through the lengths a source drafts misprices the others."""
        cell = self.residuals.get((band(rows), k))
        return cell[0] / cell[1] if cell is not None and cell[1] >= RESIDUAL_SEEN else 0.0

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

    def line(self, rows: int, k: int) -> float | None:
        """The fitted line's seconds for a step of `rows` rows with `k` guess slots (None until fitted)."""
        c = self.coefficients(rows)
        if c is None:
            return None
        a, r, b = c
        return a + r * rows + b * rows * k

    def predict(self, rows: int, k: int) -> float | None:
        """A step's seconds: the line, corrected by what steps of this length measured (`residual`)."""
        line = self.line(rows, k)
        return None if line is None else max(line + self.residual(rows, k), 1e-6)


