"""A request as the scheduler holds it (`Request`), its counters (`BatcherStats`), and the
log-probabilities it may ask for (`logprobs`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Callable

import torch

from ..types import RequestStats, SamplingParams

# finish reasons of a request that did not end normally: its own row failed; the server shut down
FAILED = ("error", "shutdown")


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    on_tokens: Callable[[list[int]], None]  # newly committed ids (called from the worker thread)
    on_done: Callable[[str, dict], None]  # (finish reason, stats) when the request ends
    stop_fn: Callable[[list[int]], bool] | None = None
    spec_k: int | None = None  # per-request cap on guesses (None: the server's policy; 0: off)
    sources: frozenset[str] | None = None  # the draft sources it may take (their names; None: all)
    prediction: list[int] | None = None  # its predicted output, tokenised: a draft source for this row
    constraint: object | None = None  # its grammar (core.step.constrained reads its `allowed`)
    logprobs: int | None = None  # None: off; N >= 0: each token's log-probability and the N most likely
    prompt_logprobs: int | None = None  # as logprobs, for the prompt's tokens (set in prompt_lps at the prefill)
    score_only: bool = False  # prefill (and prompt_logprobs) only: no token is generated
    id: str = ""  # the caller's request id, for the log
    key: int = 0  # its key for the uniforms its sampled tokens take (sampling.position_uniforms)
    cancelled: bool = False
    prompt_lps: list | None = None  # [None, (lp, alts), ...] per prompt token, when prompt_logprobs was asked
    tokens: list[int] = field(default_factory=list)
    context: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    submitted: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    decode_start: float | None = None  # when its decoding began (after the prefills it joined with)
    stats: RequestStats = field(default_factory=RequestStats)  # counts and times, as generate reports them
    feats: dict = field(default_factory=dict)  # per source that reads them: target features not yet handed over

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class BatcherStats:
    """The scheduler's counters (since it started) and gauges (now); /metrics reads them."""
    requests: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    tokens: int = 0  # tokens generated
    first_tokens: int = 0  # of which the prefills' first tokens
    prompt_tokens: int = 0  # prompt tokens prefilled
    cached_tokens: int = 0  # of which taken from the prefix cache
    proposed: int = 0  # guesses verified
    accepted: int = 0  # guesses that held
    forwards: int = 0  # row-steps (one target forward of one row each)
    steps: int = 0
    source_rows: dict = field(default_factory=dict)  # source name -> row-steps that verified its guesses
    plain_steps: dict = field(default_factory=dict)  # reason -> steps decoded plainly for it
    batch: int = 0  # rows decoding now
    queued: int = 0  # requests waiting to join
    draft_k: int = 0  # guess slots per row in the last step

    @property
    def alpha(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tau(self) -> float:
        return (self.tokens - self.first_tokens) / self.forwards if self.forwards else 0.0

    def copy(self) -> "BatcherStats":
        out = BatcherStats(**{f.name: getattr(self, f.name) for f in fields(self)})
        out.source_rows, out.plain_steps = dict(self.source_rows), dict(self.plain_steps)
        return out


def logprobs(logits: torch.Tensor, ids: list[int], top: int | None) -> list | None:
    """Per token: (its log-probability, [(id, log-probability) of the `top` most likely]) under
    the raw distribution of its logits row; None when not asked for."""
    if top is None:
        return None
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = []
    for row, t in zip(lp, ids):
        alts = []
        if top > 0:
            v, i = row.topk(top)
            alts = list(zip(i.tolist(), v.tolist()))
        out.append((float(row[t]), alts))
    return out
