"""A request's predicted output as a draft source (OpenAI's Predicted Outputs: the client sends
the text it expects, e.g. the file it asks to edit).

A known source: per row with a prediction it keeps where in the prediction the answer is, and
offers the prediction's next tokens from there. While the answer follows the prediction the
position advances with it; where it departs (an edit inserts, deletes or changes text) the source
looks for the answer's last tokens in the prediction and re-aligns after them, preferring the
nearest occurrence ahead of where it was (an edit moves forward through a file), and offers
nothing until they occur. An offer's key is how long the prediction has been holding (0, 1, 2-3,
4-7, ... tokens since the last departure, the run it re-aligned on included), so the cost model learns that a prediction that has
been holding keeps holding and drafts it long, and one that has just departed is worth less.
Greedy output does not depend on the prediction (verification keeps the target's tokens only).
"""

from __future__ import annotations

from .base import Draft, DraftContext, Drafter, Offer, RowInfo

#: the longest and shortest runs of answer tokens looked up in the prediction to re-align after a
#: departure (a single token is too common to say where an edit ended)
ALIGN_MAX, ALIGN_MIN = 8, 2


class _Row:
    """One row's prediction and where the answer is in it."""

    def __init__(self, prediction: list[int], start: int) -> None:
        self.pred = prediction
        self.start = start  # where the answer starts in the row's tokens (after its prompt)
        self.seen = 0  # answer tokens already followed
        self.pos: int | None = 0  # the prediction token the next answer token should be (None: lost)
        self.last = 0  # where it was last aligned (what "ahead" means while lost)
        self.run = 0  # answer tokens that followed the prediction since the last departure
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> end positions in the prediction
        for n in range(ALIGN_MIN, ALIGN_MAX + 1):
            for end in range(n, len(prediction) + 1):
                self.ends.setdefault(tuple(prediction[end - n: end]), []).append(end)

    def follow(self, answer: list[int]) -> None:
        """Advance over the answer tokens not followed yet."""
        for i in range(self.seen, len(answer)):
            if self.pos is not None and self.pos < len(self.pred) and self.pred[self.pos] == answer[i]:
                self.pos += 1
                self.run += 1
            else:
                self.pos, self.run = self._realign(answer[: i + 1])
            if self.pos is not None:
                self.last = self.pos
        self.seen = len(answer)

    def _realign(self, answer: list[int]) -> tuple[int | None, int]:
        """(the prediction position after the longest run of the answer's last tokens found in it,
        the nearest ahead of where the answer was, else the last before it; that run's length),
        or (None, 0) if none."""
        here = self.last
        for n in range(min(ALIGN_MAX, len(answer)), ALIGN_MIN - 1, -1):
            ends = self.ends.get(tuple(answer[-n:]))
            if ends:
                ahead = [e for e in ends if e >= here]
                return (min(ahead) if ahead else max(ends)), n
        return None, 0


class PredictionDrafter(Drafter):
    """Each request's predicted output (`RowInfo.prediction`), re-aligned after departures (module
    docstring). Rows without a prediction offer nothing."""

    name = "prediction"
    known = True
    long_chains = True
    holds_on = True
    prior = 0.5

    def __init__(self) -> None:
        self.rows: list[_Row | None] = []

    def begin(self, prompts, params, max_len) -> None:
        self.rows = []

    def join(self, row: RowInfo) -> None:
        self.rows.append(_Row(list(row.prediction), len(row.prompt)) if row.prediction else None)

    def add_row(self, max_len: int, prompt: list[int] | None = None) -> None:
        self.rows.append(None)  # (a row joined without its request: no prediction)

    def keep_rows(self, rows) -> None:
        self.rows = [self.rows[r] for r in rows]

    def offer(self, ctx: DraftContext, max_tokens: int) -> list[Offer | None]:
        out = []
        for tokens, row in zip(ctx.tokens, self.rows):
            if row is None:
                out.append(None)
                continue
            row.follow(tokens[row.start:])
            if row.pos is None or row.pos >= len(row.pred):
                out.append(None)
                continue
            out.append(Offer(row.pred[row.pos: row.pos + max_tokens], key=row.run.bit_length()))
        return out

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        return Draft.chains([o.tokens if o is not None else [] for o in self.offer(ctx, max_tokens)])

    def commit(self, num_accepted, paths=None) -> None:
        """Nothing to do: the next offer follows the committed answer."""
