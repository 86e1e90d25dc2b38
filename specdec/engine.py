"""`Engine.generate`: a batch of prompts decoded to the end, plain or speculative.

Every prompt joins the scheduler (`core.scheduler.ContinuousBatcher`, the one `serve` runs) at
the start and the batch ends when its last row does. The engine's draft sources (built by
specdec.methods' table, or any `drafters.Drafter` of your own) are priced per step and row by the
scheduler's cost model (policy.LoadPolicy), as the server prices them, and in batches of two or
more rows a guard (policy.BatchGuard) lets them propose only while speculative steps commit more
tokens per second than plain ones. With `fixed_k`, or a source that may not sit a step out, every
step drafts k. The cost model and the guard live in the engine, so what they learn carries from
one call to the next (`learned`).

Rows share one generator; each samples with its prompt's index as its key
(`sampling.position_uniforms`), so a seeded row's text does not depend on its batch.

The engine yields token ids through a callback and knows nothing about tokenization, text, files
or HTTP. Stop strings are the caller's business (`stop_fn`).
"""

from __future__ import annotations

import itertools
from typing import Callable

from .core.scheduler import ContinuousBatcher, Request
from .drafters.base import Drafter
from .policy import BatchGuard, LoadPolicy
from .sampling import make_generator
from .types import MAX_GUESSES, GenerationResult, SamplingParams, SpecdecError

#: batch numbers (RequestStats.batch), unique in the process: results of several engines summarized
#: together (metrics.summarize) must not share a number, or their times would be taken as one batch's
_BATCH_NUMBERS = itertools.count(1)

OnTokens = Callable[[int, list[int]], None]  # (row, newly committed ids)
StopFn = Callable[[int, list[int]], bool]  # (row, all generated ids) -> stop now?


class Engine:
    def __init__(self, model, drafter: Drafter | list[Drafter] | None = None, k: int = 4, eos_ids=(),
                 fixed_k: bool = False, method: str = "", prefix_cache=None) -> None:
        """model: follows the forward contract (native or adapter); drafter: a draft source, a
        list of them, or None; k: the most guesses a step drafts; fixed_k: every step drafts k
        guesses (as `serve --fixed-k`), instead of as the cost model prices them; method: the
        name shown in stats (default: the sources' names); prefix_cache: a `prefix_cache.PrefixCache`
        kept across generate calls, from which prompts take the prefixes computed before (None: none;
        `config.build_engine` makes one of `--prefix-cache-mb`)."""
        if not 0 <= k <= MAX_GUESSES:
            raise SpecdecError(f"-k must be between 0 and {MAX_GUESSES} (longer steps are not verified bit for bit "
                               f"as plain decoding computes them), got {k}")
        sources = [] if drafter is None else list(drafter) if isinstance(drafter, (list, tuple)) else [drafter]
        for d in sources:
            if not isinstance(d, Drafter):
                raise SpecdecError(f"a drafter must subclass specdec.drafters.Drafter (got {type(d).__name__})")
        self.model = model
        self.sources = sources
        # a tree source's node budget is the cap too: a step verifies its whole tree
        self.k = max([k] + [d.max_nodes for d in sources]) if sources and k else 0
        self.eos_ids = set(int(e) for e in eos_ids)
        self.method = method or ("none" if not sources else "+".join(d.label for d in sources))
        self.prefix_cache = prefix_cache
        # the cost model that prices every source per step and row, as the server's does; the
        # engine keeps it so that what it learns carries between calls
        adaptive = not fixed_k and all(d.may_skip for d in sources)
        self.policy = LoadPolicy(self.k, adaptive=adaptive) if sources else None
        if self.policy is not None:
            self.policy.closed = True  # a generate call's rows start together; none joins later
        # speculate in batches of 2+ rows only while it beats plain decoding, measured
        # (policy.BatchGuard), as the server guards them, but by when the batch ends (closed: a
        # generate call's rows all start together and none joins later); kept here so that what
        # it measured carries from one generate call to the next
        self.guard = BatchGuard(min_rows=2, closed=True) if self.policy is not None and adaptive else None

    def learned(self) -> dict:
        """What the sources, the guard and the cost model learned while decoding, for a later run
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
        """(name, part) of the parts that adapt: each source, the guard, the cost model."""
        parts = [(f"source:{d.label}", d) for d in self.sources]
        return parts + [(n, p) for n, p in (("guard", self.guard), ("policy", self.policy)) if p is not None]

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
        predictions: per prompt, the answer expected (token ids; a draft source, see
        drafters.prediction) or None; constraints: per prompt, a grammar (core.step.constrained)
        or None. Returns one result per prompt, in order."""
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
        shared = next(_BATCH_NUMBERS)
        for i, prompt in enumerate(prompts):
            results[i].stats.batch = shared if native or i == 0 else next(_BATCH_NUMBERS)
            requests.append(Request(
                list(prompt), params,
                on_tokens=(lambda ids, i=i: on_tokens(i, ids)) if on_tokens is not None else (lambda ids: None),
                on_done=lambda reason, _stats: done.append(reason),
                stop_fn=(lambda ids, i=i: stop_fn(i, ids)) if stop_fn is not None else None,
                prediction=predictions[i] if predictions else None, constraint=constraints[i] if constraints else None,
                key=i, stats=results[i].stats, generator=generator))
            scheduler.submit(requests[-1])
        scheduler.run(until=lambda: len(done) == len(prompts))
        for result, req in zip(results, requests):
            result.tokens = req.tokens
        return results

    def _scheduler(self, prompts, params: SamplingParams) -> ContinuousBatcher:
        """The scheduler for one batch: room for its longest prompt, its tokens and the longest
        draft (k tokens, or a tree source's node budget); the sources with the engine's cost model
        and guard and the batch's sampling settings."""
        width = max([self.k] + [d.max_nodes for d in self.sources]) if self.sources else 0
        max_len = min(self.model.max_context, max(len(p) for p in prompts) + params.max_new_tokens + width + 2)
        native = getattr(self.model, "native", False)
        scheduler = ContinuousBatcher(
            self.model, self.eos_ids, self.sources, method=self.method, k_max=self.k, policy=self.policy,
            max_batch=len(prompts) if native else 1, max_queue=len(prompts), max_context=max_len,
            thread=False, shared=params, fill_context=True, raise_errors=True, prefix_cache=self.prefix_cache)
        if scheduler.guard is not None:  # (None: no source, or a fixed k)
            scheduler.guard = self.guard  # (None: the caller turned the engine's guard off)
            if self.guard is not None:
                self.guard.begin()
        return scheduler
