"""The decode loop: prefill -> (propose -> score -> verify -> commit -> record)*.

One loop serves plain and speculative decoding: with no drafter (or k = 0) every step
scores just the pending token. A drafter may return a chain (k tokens in a row) or a tree
(Draft.parents, see tree.py): a tree is scored in one forward with an ancestor mask, the
accepted path is kept in the KV cache (compact) and the drafter is told the path. Drafters
that read the target's hidden states (needs_hidden) get those of every committed position.
Rows of a batch may have different prompt lengths, draft counts and accepted counts; rows
that finish leave the batch at once. In a batch of two or more rows a guard (core.policy.
BatchGuard) lets the drafter propose only while speculative steps commit more tokens per
second than plain ones (a few rows already make a CPU step compute-bound); for drafters that
do not price their own guesses (a draft model, Medusa, an EAGLE head alone) a single row is
guarded too.

Scoring, verification and the cache commit are `core.step.run_step`, the same step the
server's batcher runs; the drafter is used only through `drafters.Drafter`.

The engine yields token ids through a callback and knows nothing about tokenization,
text, files or HTTP. Stop strings are the caller's business (`stop_fn`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import threads
from .core.policy import BatchGuard
from .drafters.base import Draft, DraftContext, Drafter, timing_free
from .core.step import run_step
from .sampling import choose, make_generator
from .types import MAX_GUESSES, GenerationResult, SamplingParams, SpecdecError

OnTokens = Callable[[int, list[int]], None]  # (row, newly committed ids)
StopFn = Callable[[int, list[int]], bool]  # (row, all generated ids) -> stop now?


class Engine:
    def __init__(self, model, drafter=None, k: int = 4, eos_ids=(), k_policy=None) -> None:
        """model: follows the forward contract (native or adapter); drafter: a Drafter or
        None; k: draft length; k_policy: optional object with choose_k(max_k) and
        observe(step record) for adaptive drafting (see core/policy.py)."""
        if not 0 <= k <= MAX_GUESSES:
            raise SpecdecError(f"-k must be between 0 and {MAX_GUESSES} (longer steps are not verified bit for bit "
                               f"as plain decoding computes them), got {k}")
        if drafter is not None and not isinstance(drafter, Drafter):
            raise SpecdecError(f"a drafter must subclass specdec.drafters.Drafter (got {type(drafter).__name__})")
        self.model = model
        self.drafter = drafter
        self.k = k if drafter is not None else 0
        self.eos_ids = set(int(e) for e in eos_ids)
        self.k_policy = k_policy
        self._batches = 0
        # batches of 2+ rows: speculate only while it beats plain decoding, measured (drafters
        # that can sit steps out, all of specdec's: `skip`); see core.policy.BatchGuard. Drafters
        # that do not price their own guesses step by step (`gates_itself`: prompt lookup, auto)
        # are guarded at a single row too, so a draft model or head that does not pay for its
        # cost on this text or machine falls back to plain decoding instead of slowing it down
        self.guard = None
        if drafter is not None and drafter.may_skip:
            self.guard = BatchGuard(min_rows=2 if drafter.gates_itself else 1)

    def learned(self) -> dict:
        """What the drafter, its draft-length policy and the guard learned while decoding, for a
        later run to start from (learned.py); {} when nothing adapts."""
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
        """(name, part) of the parts that adapt: the drafter, the k policy, the guard."""
        return [(n, p) for n, p in (("drafter", self.drafter), ("k_policy", self.k_policy), ("guard", self.guard))
                if p is not None]

    # ------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        on_tokens: OnTokens | None = None,
        stop_fn: StopFn | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (one batch). Returns one result per prompt, in order."""
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
        if len(prompts) > 1 and not getattr(self.model, "native", False):
            # the transformers adapter keeps one row per cache: run rows one by one
            out = []
            for i, p in enumerate(prompts):
                cb = (lambda _r, ids, i=i: on_tokens(i, ids)) if on_tokens else None
                sf = (lambda _r, ids, i=i: stop_fn(i, ids)) if stop_fn else None
                out += self._generate_batch([p], params, cb, sf)
            return out
        return self._generate_batch(prompts, params, on_tokens, stop_fn)

    # ------------------------------------------------------------------------------------
    def _generate_batch(self, prompts, params: SamplingParams, on_tokens, stop_fn) -> list[GenerationResult]:
        """prefill, then (propose -> score, verify, commit -> record) until every row is done."""
        b = self._start(prompts, params, on_tokens, stop_fn)
        keep = self._prefill(b, prompts)
        while self._leave(b, keep):
            threads.tick()  # follow the cores other processes leave free (threads.py)
            t1 = time.perf_counter()
            spec, k_step, draft, room = self._propose(b)
            t2 = time.perf_counter()
            # score, verify, commit / roll back (core/step.py)
            res = run_step(self.model, b.cache, [b.context[r][-1] for r in b.rows], draft, params, b.gen, room,
                           row_keys=b.rows)  # a row samples with its prompt's index as its key
            if self.drafter is not None and draft.tokens.shape[1] > 0:
                self.drafter.commit(res.accepted, paths=res.paths if draft.parents is not None else None)
            keep = self._record(b, spec, k_step, draft, res, (t1, t2, time.perf_counter()))
        for r in b.results:
            r.stats.new_tokens = len(r.tokens)
        return b.results

    def _start(self, prompts, params: SamplingParams, on_tokens, stop_fn) -> "_Batch":
        """A batch's state: its cache (room for the longest draft: k tokens, or a tree drafter's
        node budget), results, generator; the drafter and the guard told a batch begins."""
        drafter = self.drafter
        width = max(self.k, drafter.max_nodes) if drafter is not None else 0
        max_len = min(self.model.max_context, max(len(p) for p in prompts) + params.max_new_tokens + width + 1)
        results = [GenerationResult() for _ in prompts]
        self._batches += 1
        for r, p in zip(results, prompts):
            r.stats.prompt_tokens = len(p)
            r.stats.batch = self._batches
        if drafter is not None:
            drafter.begin(prompts, params, max_len)
        # a seeded sample with guesses drawn from a q: drafting must not depend on timing (timing_free)
        guard = None if timing_free(params) and drafter is not None and drafter.samples_guesses else self.guard
        if guard is not None:
            guard.begin()
        return _Batch(params, make_generator(params.seed), max_len, self.model.new_cache(len(prompts), max_len),
                      results, guard, on_tokens, stop_fn, wants_hidden=drafter is not None and drafter.needs_hidden)

    def _prefill(self, b: "_Batch", prompts) -> list[bool]:
        """Each prompt in a forward of its own, its cache copied into its row (a padded batch
        attends through a mask, whose sums differ from a lone prompt's in the last bits, and
        8-bit activations can turn that into another token: a prompt's text would depend on its
        batch); each row's first token from the logits at its last prompt token. Returns which
        rows go on."""
        t0 = time.perf_counter()
        B = len(prompts)
        lens = [len(p) for p in prompts]
        rows = []  # per prompt: (logits at its last token [1, V], hidden states [L, D])
        for i, p in enumerate(prompts):
            L = len(p)
            one = self.model.new_cache(1, L + 1) if B > 1 else b.cache
            logits, hidden = self.model(torch.tensor([p], dtype=torch.long), torch.arange(L)[None], one,
                                        logits_at=torch.tensor([[L - 1]]))
            if one is not b.cache:
                b.cache.fill_row(i, one)
            rows.append((logits[:, 0], hidden[0, :L]))
        # target features of committed positions not yet handed to a drafter that reads them (EAGLE)
        b.feats = [[hidden] if b.wants_hidden else [] for _, hidden in rows]
        first = choose(torch.cat([lg for lg, _ in rows]), b.params, b.gen, rows=list(range(B)), positions=lens)
        prefill_s = time.perf_counter() - t0
        for r in b.results:
            r.stats.prefill_s = prefill_s
        b.rows = list(range(B))
        b.context = [list(p) + [int(t)] for p, t in zip(prompts, first)]
        b.t_start = time.perf_counter()
        return self._commit_tokens(b.rows, [[int(t)] for t in first], b.results, b.params, b.on_tokens, b.stop_fn,
                                   b.max_len, b.cache)

    def _leave(self, b: "_Batch", keep: list[bool]) -> bool:
        """Finished rows leave the batch (cache and drafter); False when none is left."""
        finished = [i for i, ok in enumerate(keep) if not ok]
        if not finished:
            return True
        now = time.perf_counter() - b.t_start
        for i in finished:
            b.results[b.rows[i]].stats.decode_s = now
        alive = [i for i, ok in enumerate(keep) if ok]
        if not alive:
            return False
        b.cache.reorder_rows(torch.tensor(alive))
        if self.drafter is not None:
            self.drafter.keep_rows(alive)
        b.rows = [b.rows[i] for i in alive]
        return True

    def _propose(self, b: "_Batch") -> tuple[bool, int, Draft, list[int]]:
        """This step's proposal: the draft length (k policy, room, guard), the drafter's guesses
        (chains capped at each row's room), or an empty draft. Returns (speculate, draft length,
        draft, room per row)."""
        drafter, rows, A = self.drafter, b.rows, len(b.rows)
        k_now = self.k_policy.choose_k(self.k) if self.k_policy is not None else self.k
        room = [min(b.params.max_new_tokens - len(b.results[r].tokens) - 1, b.max_len - len(b.context[r]) - 1)
                for r in rows]
        k_step = max(0, min(k_now, max(room)))
        spec = b.guard.speculate(A) if b.guard is not None else True
        if not spec and k_step > 0:
            k_step = 0
            drafter.skip()  # the drafter sits this step out (its timing must not span it)
        if drafter is None or k_step == 0:
            return spec, k_step, Draft.empty(A), room
        hid = None
        if b.wants_hidden:
            hid = [torch.cat(b.feats[r]) if b.feats[r] else None for r in rows]
            for r in rows:
                b.feats[r] = []
        draft = drafter.propose(DraftContext([b.context[r] for r in rows], b.params, b.gen, hid), k_step)
        if draft.parents is None:
            draft.counts = torch.minimum(draft.counts, torch.tensor(room).clamp_min(0))
        elif draft.tokens.shape[1] > 0 and draft.tokens.shape[1] + 1 > b.max_len - int(b.cache.lengths.max()):
            # near the end of the context a tree may not fit: score the pending token alone
            # (the drafter is told nothing was accepted)
            drafter.commit([0] * A, paths=[[] for _ in range(A)])
            draft = Draft.empty(A)
        return spec, k_step, draft, room

    def _record(self, b: "_Batch", spec: bool, k_step: int, draft: Draft, res, times) -> list[bool]:
        """The step's tokens into each row's context and result, its counts and times into the
        stats, the k policy and the guard; returns which rows go on."""
        t1, t2, t3 = times
        new, accepted = [], res.accepted
        guessed = draft.tokens.tolist()
        for i, r in enumerate(b.rows):
            a = accepted[i]
            ids = res.ids(i, guessed[i])
            b.context[r].extend(ids)
            if b.wants_hidden:  # features of the pending token and the accepted drafts
                b.feats[r].append(res.hidden[i, res.kept(i)])
            st = b.results[r].stats
            st.target_forwards += 1
            # a tree counts as a chain as deep as the tree: acceptance by depth
            c = res.proposed_depth(i, int(draft.counts[i]))
            st.proposed += c
            st.accepted += a
            if c:
                st.add_position_counts(c, a)
            st.draft_s += t2 - t1
            st.verify_s += t3 - t2
            new.append(ids)
        if self.k_policy is not None:
            self.k_policy.observe(k_step, draft.counts.tolist(), accepted, t2 - t1, t3 - t2)
        keep = self._commit_tokens(b.rows, new, b.results, b.params, b.on_tokens, b.stop_fn, b.max_len, b.cache)
        if b.guard is not None:
            b.guard.observe(len(b.rows), spec, sum(len(ids) for ids in new), time.perf_counter() - t1)
        return keep

    def _commit_tokens(self, rows, new, results, params, on_tokens, stop_fn, max_len, cache) -> list[bool]:
        """Append each row's new ids, cut at EOS / max_new_tokens / stop; False = row done."""
        keep = []
        for i, (r, ids) in enumerate(zip(rows, new)):
            res = results[r]
            room = params.max_new_tokens - len(res.tokens)
            reason = ""
            for j, t in enumerate(ids):
                if t in self.eos_ids:
                    ids, reason = ids[: j + 1], "eos"
                    break
            if len(ids) >= room:
                ids, reason = ids[:room], reason or "length"
            res.tokens.extend(ids)
            if on_tokens is not None and ids:
                on_tokens(r, ids)
            if not reason and stop_fn is not None and stop_fn(r, res.tokens):
                reason = "stop"
            if not reason and int(cache.lengths[i]) + 2 > max_len:
                reason = "length"  # the context is full
            res.stats.finish_reason = reason
            keep.append(not reason)
        return keep


@dataclass
class _Batch:
    """One `generate` batch's state between the engine's phases."""
    params: SamplingParams
    gen: torch.Generator | None
    max_len: int
    cache: object  # KVCache of the active rows
    results: list[GenerationResult]
    guard: BatchGuard | None  # None: not guarded (no drafter, or a seeded sample)
    on_tokens: OnTokens | None
    stop_fn: StopFn | None
    wants_hidden: bool = False  # the drafter reads the target's hidden states
    rows: list[int] = field(default_factory=list)  # active batch row -> request index
    context: list[list[int]] = field(default_factory=list)  # per request: committed tokens incl. pending
    feats: list[list] = field(default_factory=list)  # per request: features not yet handed to the drafter
    t_start: float = 0.0  # when decoding began (after the prefill)
