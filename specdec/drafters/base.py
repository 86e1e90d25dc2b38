"""The drafter interface (docs/design.md, "The drafter protocol") and the registry of drafting methods.

A drafter guesses up to `max_tokens` next tokens per row; the engine verifies them and
tells the drafter how many were accepted. The engine calls only `propose` and `commit`
(plus `begin` at the start of a request batch and `keep_rows` when finished rows leave).
Drafters know nothing about tokenizers or text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from ..types import SamplingParams


@dataclass
class DraftContext:
    tokens: list[list[int]]  # per row: prompt + committed output, pending token last
    params: SamplingParams
    generator: torch.Generator | None
    hidden: torch.Tensor | None = None  # target hidden states, for head-based drafters


@dataclass
class Draft:
    tokens: torch.Tensor  # [B, N] long (padding past counts[b] is ignored)
    counts: torch.Tensor  # [B] long, 0 = nothing proposed for that row
    probs: torch.Tensor | None = None  # [B, N, V] warped draft probabilities; None = deterministic guesses
    parents: torch.Tensor | None = None  # [B, N] tree parents; None = a chain

    @staticmethod
    def empty(batch: int) -> "Draft":
        return Draft(torch.zeros(batch, 0, dtype=torch.long), torch.zeros(batch, dtype=torch.long))


class Drafter(Protocol):
    #: relative cost of one proposed token vs one target forward, if known a priori
    cost_hint: float

    def begin(self, prompts: list[list[int]], params: SamplingParams, max_len: int) -> None: ...
    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft: ...
    def commit(self, num_accepted: list[int]) -> None: ...
    def keep_rows(self, rows: list[int]) -> None: ...
    # optional: `skip()`, the engine decodes this step without asking for a proposal (batches
    # where speculation does not pay, adaptive.BatchGuard); the next `propose` sees the context
    # and features committed meanwhile. Drafters without it are never skipped.


def timing_free(params) -> bool:
    """A seeded sampled request. How many guesses a step verifies decides which random numbers
    the stochastic verification draws, so for the same seed to give the same sample, drafting
    for it must not depend on measured times (or on other requests): adaptive lengths, gates and
    load-aware caps stand aside, and lookups are proposed whole up to k."""
    return params is not None and params.seed is not None and not params.greedy


#: method name -> factory(target LoadedModel-like object, draft spec, options) -> Drafter
REGISTRY: dict[str, Callable[..., Drafter]] = {}


def register(name: str):
    def deco(factory):
        REGISTRY[name] = factory
        return factory

    return deco
