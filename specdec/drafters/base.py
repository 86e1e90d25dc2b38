"""The drafter protocol (docs/design.md, "The drafter protocol") and the registry of drafting methods.

A drafter guesses up to `max_tokens` next tokens per row; the core (core/step.py, driven by
`Engine` and `ContinuousBatcher`) verifies them and tells the drafter what each row kept.
`Drafter` lists everything the core calls or reads; the core probes nothing else, so a drafter
that subclasses it runs in `generate` and `serve` alike. Drafters know nothing about
tokenizers or text.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from importlib import import_module
from typing import Callable

import torch

from ..types import SamplingParams


@dataclass
class DraftContext:
    tokens: list[list[int]]  # per row: prompt + committed output, pending token last
    params: SamplingParams
    generator: torch.Generator | None
    hidden: torch.Tensor | None = None  # target hidden states, for head-based drafters
    # per row: tokens it may still generate after its pending one (None: not known). A probe,
    # whose cost only later tokens can earn back, waits while too few may come (core.policy.PROBE_ROOM)
    room: list[int] | None = None


@dataclass
class Draft:
    tokens: torch.Tensor  # [B, N] long (padding past counts[b] is ignored)
    counts: torch.Tensor  # [B] long, 0 = nothing proposed for that row
    probs: torch.Tensor | None = None  # [B, N, V] warped draft probabilities; None = deterministic guesses
    parents: torch.Tensor | None = None  # [B, N] tree parents; None = a chain

    @staticmethod
    def empty(batch: int) -> "Draft":
        return Draft(torch.zeros(batch, 0, dtype=torch.long), torch.zeros(batch, dtype=torch.long))


class Drafter(ABC):
    """What the core calls on a drafter. Rows are the batch rows in order; a finished row
    leaves (`keep_rows`), a request joining a running batch adds one at the end (`add_row`).

    Per step the core either asks for a proposal (`propose`, then `commit` with what each row
    kept) or, when speculation does not pay this step, tells the drafter it sits it out (`skip`;
    only drafters with `may_skip`). Guesses must be drawn as `Draft.probs` says (None:
    deterministic guesses, q one-hot), which the core relies on: the server, and `generate` for
    seeded sampled rows under the cost model, ask with greedy params, so every row verifies
    one-hot guesses exactly."""

    #: propose reads `DraftContext.hidden`: the target's final hidden states of the committed
    #: positions not yet handed over (EAGLE, Medusa)
    needs_hidden: bool = False
    #: a tree drafter's node budget per row (the cache keeps room for it); 0 for chains
    max_nodes: int = 0
    #: the core may decode a step without asking for a proposal (`skip`), as the cost model finds
    #: it pays; False: every step proposes (k guesses, as at a fixed k)
    may_skip: bool = True
    #: in sampled decoding its guesses are drawn from a q (`Draft.probs`: a draft model, an EAGLE
    #: chain), so a seeded request's text depends on what was drafted (`timing_free`); False:
    #: deterministic guesses, with which a seeded request commits plain sampling's text
    samples_guesses: bool = False

    def begin(self, prompts: list[list[int]], params: SamplingParams | None, max_len: int) -> None:
        """A batch starts with these rows: the scheduler passes none (rows join with `add_row`) and
        params, the sampling settings every row shares (`generate`), or None (the server: each
        request its own, and guesses are asked for greedily)."""

    @abstractmethod
    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """Guesses for every row: a chain of up to max_tokens, or a tree (`Draft.parents`)."""

    @abstractmethod
    def commit(self, num_accepted: list[int], paths: list[list[int]] | None = None) -> None:
        """After a proposal: per row how many guesses held (and for a tree, which nodes)."""

    def skip(self) -> None:
        """This step decodes without a proposal; the next `propose` sees what was committed meanwhile."""

    def keep_rows(self, rows: list[int]) -> None:
        """Keep (and reorder to) these rows; drafters with per-row state override it."""

    def add_row(self, max_len: int, prompt: list[int] | None = None) -> None:
        """A prompt joins the batch as the last row (its prompt, for drafters that read it ahead;
        its target features come with the next proposal when `needs_hidden`). A drafter with
        per-row state keeps it here and in `keep_rows`."""

    def expected_tokens(self) -> list[list[float]] | None:
        """Per row of the last proposal: the expected committed tokens (1 + expected accepted
        guesses) when its first j guesses are verified, j = 0 .. its count; None: no estimate.
        The server's load-aware policy (core/policy.py) caps guesses by these."""
        return None

    def draft_timing(self) -> tuple[float, bool] | None:
        """(seconds, steady) of the last proposal's own drafting, for a drafter that times it
        itself: the model or head that guessed (0 when none ran) and whether it drafted in
        steady state, with nothing to catch up on first (a prompt that just joined, steps it sat
        out). The cost models learn from steady timings only. None: the core times `propose`
        and counts it steady."""
        return None

    def learned(self) -> dict | None:
        """What adapted while decoding, for a later run to start from (learned.py); None: nothing."""
        return None

    def relearn(self, state: dict) -> None:
        """Start from `learned()`'s output of an earlier run; ValueError if it does not fit."""


def steady(behind: int, max_tokens: int) -> bool:
    """Whether a proposal that first had to read `behind` unseen committed tokens of some row
    drafted in steady state: a few tokens (the last step's commit), not a whole prompt that
    just joined or many steps sat out. One rule for every drafter that catches up lazily."""
    return behind <= max_tokens + 2


def timing_free(params) -> bool:
    """A seeded sampled request, for a drafter that draws its guesses from a q
    (`Drafter.samples_guesses`): with those, how many guesses a step verifies decides which
    random numbers verification draws, so for the same seed to give the same sample, drafting
    for it must not depend on measured times (or on other requests). So the scheduler asks for
    deterministic guesses instead wherever the cost model shapes them, and draws from q only at a
    fixed k; deterministic guesses commit plain sampling's text (verify.py, "sample and
    compare")."""
    return params is not None and params.seed is not None and not params.greedy


#: method name -> module (in specdec.drafters) whose `@register(name)` factory makes it. Registering
#: a drafter is one line here: the module is imported on first use, so importing
#: specdec.drafters does not import every drafter (and what they import).
METHODS = {
    "ngram": "ngram",
    "draft": "draft_model",
    "eagle": "eagle",
    "medusa": "medusa",
    "lookup-eagle": "hybrid",
    "hybrid": "hybrid",
}


class _Registry(dict):
    """Method name -> factory(target LoadedModel-like object, draft spec, options) -> Drafter,
    importing a method's module the first time it is asked for."""

    def _load(self, name: str) -> None:
        if not dict.__contains__(self, name) and name in METHODS:
            import_module(f"{__package__}.{METHODS[name]}")

    def __getitem__(self, name: str):
        self._load(name)
        return dict.__getitem__(self, name)

    def get(self, name, default=None):
        self._load(name)
        return dict.get(self, name, default)

    def __contains__(self, name) -> bool:
        return dict.__contains__(self, name) or name in METHODS

    def keys(self):
        return sorted(set(dict.keys(self)) | set(METHODS))

    def __iter__(self):
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())


REGISTRY: dict[str, Callable[..., Drafter]] = _Registry()


def register(name: str):
    def deco(factory):
        dict.__setitem__(REGISTRY, name, factory)
        return factory

    return deco
