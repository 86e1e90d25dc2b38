"""`Engine.generate`: a batch of prompts decoded to the end, plain or speculative.

Every prompt joins the scheduler (`core.scheduler.ContinuousBatcher`, the one `serve` runs) at
the start: each is prefilled alone, then every step proposes, scores the rows' pending tokens
and guesses in one target forward, verifies, commits or rolls back the caches, records, and
finished rows leave at once; the batch ends when the last row does. Every drafter is priced
per step by the scheduler's cost model (core.policy.LoadPolicy), as the server prices it:
prompt lookup, alone or beside an EAGLE tree or a draft model (`ngram`, `auto`), and a draft
model alone (`draft`) under their own scheduler methods (`priced_method`); any other drafter
(Medusa, an EAGLE head alone, your own) through the protocol (`drafters.Drafter`): a chain (up
to k tokens in a row) or a tree (Draft.parents, see tree.py), with the batch's own sampling
settings. In batches of two or more rows a guard (core.policy.BatchGuard) lets the drafter
propose only while speculative steps commit more tokens per second than plain ones (a few rows
already make a CPU step compute-bound). With `fixed_k`, or a drafter that may not sit a step
out, every step drafts k. The cost model and the guard live in the engine, so what they learn
carries from one call to the next (`learned`).

Rows share one generator; each samples with its prompt's index as its key
(`sampling.position_uniforms`), so a seeded row's text does not depend on its batch.

The engine yields token ids through a callback and knows nothing about tokenization,
text, files or HTTP. Stop strings are the caller's business (`stop_fn`).
"""

from __future__ import annotations

from typing import Callable

from .core.policy import BatchGuard, LoadPolicy
from .drafters.base import Drafter
from .sampling import make_generator
from .core.scheduler import ContinuousBatcher, Request
from .types import MAX_GUESSES, GenerationResult, SamplingParams, SpecdecError

OnTokens = Callable[[int, list[int]], None]  # (row, newly committed ids)
StopFn = Callable[[int, list[int]], bool]  # (row, all generated ids) -> stop now?


class Engine:
    def __init__(self, model, drafter=None, k: int = 4, eos_ids=(), fixed_k: bool = False) -> None:
        """model: follows the forward contract (native or adapter); drafter: a Drafter or
        None; k: the most guesses a step drafts; fixed_k: the drafter drafts every step, k
        guesses (as `serve --fixed-k`), instead of as the cost model prices them."""
        if not 0 <= k <= MAX_GUESSES:
            raise SpecdecError(f"-k must be between 0 and {MAX_GUESSES} (longer steps are not verified bit for bit "
                               f"as plain decoding computes them), got {k}")
        if drafter is not None and not isinstance(drafter, Drafter):
            raise SpecdecError(f"a drafter must subclass specdec.drafters.Drafter (got {type(drafter).__name__})")
        self.model = model
        self.drafter = drafter
        self.k = k if drafter is not None else 0
        self.eos_ids = set(int(e) for e in eos_ids)
        self._batches = 0
        # how the scheduler runs the drafter (its method), priced per step and row by the
        # scheduler's cost model (LoadPolicy), as the server prices it; the engine keeps that model
        # so that what it learns carries between calls. An auto drafter built not to be priced
        # (`gate` False) and one that may not sit a step out draft every step
        self.method = "none" if drafter is None else priced_method(drafter)
        self.policy = None
        if drafter is not None:
            adaptive = not fixed_k and drafter.may_skip and (self.method != "auto" or drafter.gate)
            self.policy = LoadPolicy(self.k, adaptive=adaptive)
        # speculate in batches of 2+ rows only while it beats plain decoding, measured
        # (core.policy.BatchGuard), as the server guards them; kept here so that what it measured
        # carries from one generate call to the next
        self.guard = BatchGuard(min_rows=2) if self.policy is not None and self.policy.adaptive else None

    def learned(self) -> dict:
        """What the drafter, the guard and the cost model learned while decoding, for a later run
        to start from (learned.py); {} when nothing adapts."""
        out = {}
        for name, part in self._learners():
            state = part.learned()
            if state:
                out[name] = state
        return out

    def relearn(self, state: dict) -> None:
        """Start from `learned()`'s output of an earlier run of the same method on the same
        machine and model. ValueError (and possibly a part restored) if it does not fit."""
        for name, part in self._learners():
            if state.get(name):
                part.relearn(state[name])

    def _learners(self):
        """(name, part) of the parts that adapt: the drafter, the guard, the cost model."""
        return [(n, p) for n, p in (("drafter", self.drafter), ("guard", self.guard), ("policy", self.policy))
                if p is not None]

    # ------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        on_tokens: OnTokens | None = None,
        stop_fn: StopFn | None = None,
        predictions: list[list[int] | None] | None = None,
        constraints: list | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (one batch: every row joins the scheduler at the start).
        Returns one result per prompt, in order. `predictions` (per prompt, token ids or None):
        the text each answer is expected to repeat, a draft source; `constraints` (per prompt, a
        specdec.grammar.Constraint or None): the grammar each answer must follow. Both ride on the
        scheduler's Request."""
        if not prompts:
            return []
        for i, p in enumerate(prompts, 1):  # numbered from 1, as the CLI numbers prompts
            where = f"prompt {i}" if len(prompts) > 1 else "the prompt"
            if not p:
                raise SpecdecError(f"{where} is empty (no tokens)")
            if len(p) >= self.model.max_context:
                raise SpecdecError(
                    f"{where} has {len(p)} tokens but the model's context is {self.model.max_context}; shorten it"
                )
        scheduler = self._scheduler(prompts, params)
        # the transformers adapter keeps one row per cache: its rows run one after another, each a batch
        native = getattr(self.model, "native", False)
        results, done, requests = [GenerationResult() for _ in prompts], [], []
        generator = make_generator(params.seed)  # one for the batch: each row draws with its index as its key
        for i, prompt in enumerate(prompts):
            results[i].stats.batch = self._batches + (1 if native else i + 1)
            requests.append(Request(
                list(prompt), params,
                on_tokens=(lambda ids, i=i: on_tokens(i, ids)) if on_tokens is not None else (lambda ids: None),
                on_done=lambda reason, _stats: done.append(reason),
                stop_fn=(lambda ids, i=i: stop_fn(i, ids)) if stop_fn is not None else None,
                key=i, stats=results[i].stats, generator=generator,
                prediction=predictions[i] if predictions else None,
                constraint=constraints[i] if constraints else None))
            scheduler.submit(requests[-1])
        self._batches += 1 if native else len(prompts)
        scheduler.run(until=lambda: len(done) == len(prompts))
        for result, req in zip(results, requests):
            result.tokens = req.tokens
        return results

    def _scheduler(self, prompts, params: SamplingParams) -> ContinuousBatcher:
        """The scheduler for one batch: room for its longest prompt, its tokens and the longest
        draft (k tokens, or a tree drafter's node budget); the drafter with the engine's cost
        model and guard and the batch's sampling settings."""
        width = max(self.k, self.drafter.max_nodes) if self.drafter is not None else 0
        max_len = min(self.model.max_context, max(len(p) for p in prompts) + params.max_new_tokens + width + 2)
        native = getattr(self.model, "native", False)
        scheduler = ContinuousBatcher(
            self.model, self.eos_ids, method=self.method, k_max=self.k, policy=self.policy,
            adaptive=self.policy.adaptive if self.policy is not None else True,
            max_batch=len(prompts) if native else 1, max_queue=len(prompts), max_context=max_len,
            drafter=self.drafter, thread=False, shared=params, fill_context=True, raise_errors=True)
        if scheduler.guard is not None:  # (None: no drafter, or a fixed k)
            scheduler.guard = self.guard  # (None: the caller turned the engine's guard off)
            if self.guard is not None:
                self.guard.begin()
        return scheduler


def priced_method(drafter) -> str:
    """The scheduler method that runs `drafter` under the scheduler's cost model: "auto" for
    prompt lookup beside an EAGLE tree or a draft model, "ngram" for adaptive prompt lookup,
    "draft" for a draft model alone; "protocol" for any other drafter (Medusa, an EAGLE head
    alone, your own, a draft model the native loader does not run), which runs through the
    drafter protocol."""
    from .drafters.draft_model import DraftModelDrafter
    from .drafters.hybrid import HybridDrafter, LookupEagleDrafter
    from .drafters.ngram import NgramDrafter

    def native(d) -> bool:
        return isinstance(d, DraftModelDrafter) and getattr(d.model, "native", False)

    if isinstance(drafter, LookupEagleDrafter) or (isinstance(drafter, HybridDrafter) and native(drafter.draft)):
        return "auto"
    if isinstance(drafter, NgramDrafter) and drafter.policy is not None:
        return "ngram"
    if native(drafter):
        return "draft"
    return "protocol"
