"""The tokens a request's grammar forces, as a draft source (structured output's jump-forward).

A known source: per row with a grammar (`RowInfo.constraint`, see core.step.constrained) it offers
the tokens the grammar allows alone from here (a JSON key after its opening quote, the `": ` that
follows it, closing braces), each certain to hold (`Offer.certain`): verification masks every
other token out, so they cost only their share of the step, never a rejection.
"""

from __future__ import annotations

from .base import Draft, DraftContext, Drafter, Offer, RowInfo


class GrammarDrafter(Drafter):
    """Each request's grammar-forced tokens (module docstring). Rows without a grammar offer nothing."""

    name = "grammar"
    known = True
    prior = 1.0

    def __init__(self) -> None:
        self.rows: list[object | None] = []

    def begin(self, prompts, params, max_len) -> None:
        self.rows = []

    def join(self, row: RowInfo) -> None:
        self.rows.append(row.constraint)

    def add_row(self, max_len: int, prompt: list[int] | None = None) -> None:
        self.rows.append(None)

    def keep_rows(self, rows) -> None:
        self.rows = [self.rows[r] for r in rows]

    def offer(self, ctx: DraftContext, max_tokens: int) -> list[Offer | None]:
        out = []
        for constraint in self.rows:
            forced = list(constraint.forced(max_tokens)) if constraint is not None else []
            out.append(Offer(forced, certain=len(forced)) if forced else None)
        return out

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        return Draft.chains([o.tokens if o is not None else [] for o in self.offer(ctx, max_tokens)])

    def commit(self, num_accepted, paths=None) -> None:
        """Nothing to do: the grammar follows the committed tokens (the scheduler advances it)."""
