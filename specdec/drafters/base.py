"""The draft-source protocol (docs/design.md, "Draft sources").

A draft source guesses the next tokens of the rows in a batch; the scheduler (core/) prices its
guesses against every other source's with one cost model (specdec.policy.LoadPolicy), verifies
the chosen ones and tells each source what held. `Drafter` lists everything the scheduler calls
or reads on a source, and the scheduler never asks which class a source is. Two kinds:

- *known* sources (`known = True`: prompt lookup, a request's prediction, a suffix cache, a
  grammar's forced tokens) have their guesses in hand before the step is priced and make them for
  free: they answer `offer` with a chain or a tree per row;
- *on-demand* sources (a draft model, EAGLE and Medusa heads, your own) draft when a row takes
  them: `propose` with the rows and the cap the cost model chose.

Sources know nothing about tokenizers or text.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..types import SamplingParams


@dataclass
class RowInfo:
    """A row as it joins the batch: what a source may read about its request."""
    prompt: list[int]
    params: SamplingParams
    max_len: int  # the row's room in the cache
    prediction: list[int] | None = None  # the request's predicted output, tokenised (OpenAI `prediction`)
    constraint: object | None = None  # the request's grammar (core.step reads its `allowed`), if any


@dataclass
class Offer:
    """What a known source could verify for one row this step, before the step is priced."""
    tokens: list[int]
    parents: list[int] | None = None  # a tree: node j (tokens[j-1]) hangs under parents[j-1] in 0..j-1
    # (0: the pending token); None: a chain
    key: int = 0  # what the source's acceptance is learnt per (a lookup's match length)
    scores: list[float] | None = None  # a tree's nodes: the source's probability of each node's path
    certain: int = 0  # the first `certain` guesses cannot fail (a grammar forces them)


@dataclass
class DraftContext:
    tokens: list[list[int]]  # per row: prompt + committed output, pending token last
    params: SamplingParams
    generator: torch.Generator | None
    hidden: torch.Tensor | None = None  # target hidden states, for head-based drafters
    # per row: tokens it may still generate after its pending one (None: not known); a source need
    # not start what a short answer cannot repay
    room: list[int] | None = None
    want: list[bool] | None = None  # the rows this proposal is for (None: all); others may be left empty
    draft_cost: float = 0.0  # c: this proposal's drafting time in plain steps, as the cost model prices it
    guess_cost: float = 0.08  # r: what one more verified guess costs, in plain steps


@dataclass
class Draft:
    tokens: torch.Tensor  # [B, N] long (padding past counts[b] is ignored)
    counts: torch.Tensor  # [B] long, 0 = nothing proposed for that row
    probs: torch.Tensor | None = None  # [B, N, V] warped draft probabilities; None = deterministic guesses
    parents: torch.Tensor | None = None  # [B, N] tree parents; None = a chain

    @staticmethod
    def empty(batch: int) -> "Draft":
        return Draft(torch.zeros(batch, 0, dtype=torch.long), torch.zeros(batch, dtype=torch.long))

    @staticmethod
    def chains(guesses: list[list[int]]) -> "Draft":
        """Deterministic chains, one list of guessed ids per row (a known source's `propose`:
        `Draft.chains([o.tokens if o else [] for o in self.offer(ctx, k)])`)."""
        B, N = len(guesses), max((len(g) for g in guesses), default=0)
        tokens = torch.tensor([list(g) + [0] * (N - len(g)) for g in guesses], dtype=torch.long).reshape(B, N)
        return Draft(tokens, torch.tensor([len(g) for g in guesses], dtype=torch.long))


class Drafter(ABC):
    """A draft source. Rows are the batch rows in order: a request joins as the last row (`join`),
    a finished one ends (`finish_row`) and leaves (`keep_rows`). Per step the scheduler asks a
    known source for its offers (`offer`), an on-demand source for a proposal when some row takes
    it (`propose`, then `commit` with what each row kept), or tells it the step went on without
    its guesses (`skip`). Guesses must be drawn as `Draft.probs` says (None: deterministic, q
    one-hot): the server, and `generate` for seeded sampled rows under the cost model, ask with
    greedy params, so every row verifies one-hot guesses exactly. Only `propose` and `commit` are
    required."""

    #: the source's name in stats and in what the cost model learns (the class name by default)
    name: str = ""
    #: guesses in hand before pricing, free to make: `offer` answers (lookup, prediction, suffix)
    known: bool = False
    #: acceptance of a guess before any is seen (the cost model learns the rest)
    prior: float = 0.6
    #: a known source whose chains may run past the step's cap k_max, up to the cost model's
    #: `LoadPolicy.long_max`, where they have been holding (a prediction, a copy of the prompt):
    #: verifying 17-33 tokens costs ~3.3-5 plain steps on a CPU, 9 tokens ~2.5
    long_chains: bool = False
    #: a source whose guesses, once they held, go on holding as far as it offers (a request's own
    #: prediction): a draft position it has not reached yet is trusted at the rate of the one
    #: before it (`policy.Acceptance(inherit=True)`), not sent back to `prior`. Not prompt lookup:
    #: on chat a lookup that held 12 tokens once then offered 20 that failed (2.8 plain steps
    #: lost; fresh `ngram` 0.98 -> 0.95 of plain decoding on a simulated Xeon)
    holds_on: bool = False
    #: propose reads `DraftContext.hidden`: the target's final hidden states of the committed
    #: positions not yet handed over (EAGLE, Medusa)
    needs_hidden: bool = False
    #: a tree drafter's node budget per row (the cache keeps room for it); 0 for chains
    max_nodes: int = 0
    #: the scheduler may decode a step without its guesses (`skip`), as the cost model finds it
    #: pays; False: every step proposes (k guesses, as at a fixed k)
    may_skip: bool = True
    #: in sampled decoding its guesses are drawn from a q (`Draft.probs`), so a seeded request's
    #: text depends on what was drafted (`timing_free`); False: deterministic guesses
    samples_guesses: bool = False
    #: drafts only the rows `DraftContext.want` names (its cost grows with them); False: every row
    partial_rows: bool = False

    @property
    def label(self) -> str:
        return self.name or type(self).__name__.lower()

    def begin(self, prompts: list[list[int]], params: SamplingParams | None, max_len: int) -> None:
        """A batch starts with these rows (the scheduler passes none: rows join with `join`) and
        params, the sampling settings every row shares (`generate`), or None (the server)."""

    def join(self, row: RowInfo) -> None:
        """A request joins as the last row. By default `add_row(row.max_len, row.prompt)`."""
        self.add_row(row.max_len, row.prompt)

    def add_row(self, max_len: int, prompt: list[int] | None = None) -> None:
        """A prompt joins the batch as the last row (its features come with the next proposal
        when `needs_hidden`). A source with per-row state keeps it here and in `keep_rows`."""

    def finish_row(self, row: int, tokens: list[int]) -> None:
        """Row `row` ends with `tokens` (its prompt and output as committed), before it leaves."""

    def keep_rows(self, rows: list[int]) -> None:
        """Keep (and reorder to) these rows; sources with per-row state override it."""

    def offer(self, ctx: DraftContext, max_tokens: int) -> list[Offer | None]:
        """A known source: per row, up to `max_tokens` guesses it could verify now (None: none)."""
        raise NotImplementedError(f"{type(self).__name__} is not a known source (known = False)")

    @abstractmethod
    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """Guesses for the rows (`ctx.want`, default all): a chain of up to max_tokens, or a tree."""

    @abstractmethod
    def commit(self, num_accepted: list[int], paths: list[list[int]] | None = None) -> None:
        """After a proposal: per row how many guesses held (and for a tree, which nodes)."""

    def skip(self) -> None:
        """This step decodes without its proposal; the next one sees what was committed meanwhile."""

    def lags(self, tokens: list[list[int]]) -> list[int]:
        """Per row, the committed tokens it has not read yet, which its next proposal first reads
        (a catch-up, priced by the cost model); 0 for a source that reads as it goes."""
        return [0] * len(tokens)

    def time_alone(self) -> tuple[float, float] | None:
        """(seconds per drafted unit: a guess of a chain, a tree; seconds per token read in a
        catch-up), measured on scratch state of its own, so the cost model can price the source
        before its first proposal; None: not known (it is priced as free until it is timed)."""
        return None

    def draft_timing(self) -> tuple[float, bool] | None:
        """(seconds, steady) of the last proposal's own drafting, for a source that times it
        itself, and whether it drafted in steady state (not first catching up on a prompt or steps
        it sat out); the cost model learns drafting times from steady proposals only. None: the
        scheduler times `propose`."""
        return None

    def learned(self) -> dict | None:
        """What adapted while decoding, for a later run to start from (learned.py); None: nothing."""
        return None

    def relearn(self, state: dict) -> None:
        """Start from `learned()`'s output of an earlier run; ValueError if it does not fit."""


def fastest(call, calls: int = 2) -> float:
    """Seconds of the fastest of `calls` runs of `call`, after one untimed run (a first call pays
    one-off costs: the weights' pages, buffers): how a drafter times itself alone (`time_alone`)."""
    call()
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return best


def steady(behind: int, max_tokens: int) -> bool:
    """Whether a proposal that first had to read `behind` unseen committed tokens of some row
    drafted in steady state: a few tokens (the last step's commit), not a whole prompt that
    just joined or many steps sat out. One rule for every drafter that catches up lazily."""
    return behind <= max_tokens + 2


def timing_free(params) -> bool:
    """A seeded sampled request, for a source that draws its guesses from a q
    (`Drafter.samples_guesses`): with those, how many guesses a step verifies decides which
    random numbers verification draws, so for the same seed to give the same sample, drafting
    for it must not depend on measured times (or on other requests). So the scheduler asks for
    deterministic guesses instead wherever the cost model shapes them, and draws from q only at a
    fixed k; deterministic guesses commit plain sampling's text (verify.py, "sample and
    compare")."""
    return params is not None and params.seed is not None and not params.greedy
