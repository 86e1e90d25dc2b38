"""The decode loop: prefill -> (propose -> score -> verify -> commit -> record)*.

One loop serves plain and speculative decoding: with no drafter (or k = 0) every step
scores just the pending token. A drafter may return a chain (k tokens in a row) or a tree
(Draft.parents, see tree.py): a tree is scored in one forward with an ancestor mask, the
accepted path is kept in the KV cache (compact) and the drafter is told the path. Drafters
that read the target's hidden states (needs_hidden) get those of every committed position.
Rows of a batch may have different prompt lengths, draft counts and accepted counts; rows
that finish leave the batch at once. In a batch of two or more rows a guard (adaptive.
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
from typing import Callable

import torch

from . import threads
from .adaptive import BatchGuard
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
        observe(step record) for adaptive drafting (see adaptive.py)."""
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
        # that can sit steps out, all of specdec's: `skip`); see adaptive.BatchGuard. Drafters
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
        model, drafter = self.model, self.drafter
        B = len(prompts)
        gen = make_generator(params.seed)
        k_max = self.k
        # room for the longest draft: k tokens, or a tree drafter's node budget
        width = max(k_max, drafter.max_nodes) if drafter is not None else 0
        max_len = min(model.max_context, max(len(p) for p in prompts) + params.max_new_tokens + width + 1)
        results = [GenerationResult() for _ in range(B)]
        self._batches += 1
        for r, p in zip(results, prompts):
            r.stats.prompt_tokens = len(p)
            r.stats.batch = self._batches
        cache = model.new_cache(B, max_len)
        if drafter is not None:
            drafter.begin(prompts, params, max_len)
        guard = None if timing_free(params) else self.guard  # a seeded sample: drafting must not depend on timing
        if guard is not None:
            guard.begin()

        # prefill: right-padded prompts; each row's logits at its last prompt token
        t0 = time.perf_counter()
        lens = torch.tensor([len(p) for p in prompts])
        T = int(lens.max())
        toks = torch.zeros(B, T, dtype=torch.long)
        for b, p in enumerate(prompts):
            toks[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        pos = torch.arange(T)[None, :].expand(B, T)
        logits, hidden = model(toks, pos, cache, logits_at=(lens - 1)[:, None])
        cache.truncate(lens)
        # target features of committed positions not yet handed to a drafter that reads them (EAGLE)
        wants_hidden = drafter is not None and drafter.needs_hidden
        feats = [[hidden[b, : len(p)]] if wants_hidden else [] for b, p in enumerate(prompts)]
        first = choose(logits[:, 0], params, gen)
        prefill_s = time.perf_counter() - t0
        for r in results:
            r.stats.prefill_s = prefill_s

        rows = list(range(B))  # active batch row -> request index
        context = [list(p) + [int(t)] for p, t in zip(prompts, first)]  # committed tokens incl. pending
        t_start = time.perf_counter()
        keep = self._commit_tokens(rows, [[int(t)] for t in first], results, params, on_tokens, stop_fn, max_len, cache)

        while True:
            finished = [i for i, ok in enumerate(keep) if not ok]
            if finished:
                now = time.perf_counter() - t_start
                for i in finished:
                    results[rows[i]].stats.decode_s = now
                alive = [i for i, ok in enumerate(keep) if ok]
                if not alive:
                    break
                cache.reorder_rows(torch.tensor(alive))
                if drafter is not None:
                    drafter.keep_rows(alive)
                rows = [rows[i] for i in alive]
            A = len(rows)
            threads.tick()  # follow the cores other processes leave free (threads.py)

            # 1 propose
            t1 = time.perf_counter()
            k_now = self.k_policy.choose_k(k_max) if self.k_policy is not None else k_max
            room = [min(params.max_new_tokens - len(results[r].tokens) - 1, max_len - len(context[r]) - 1) for r in rows]
            k_step = max(0, min(k_now, max(room)))
            spec = guard.speculate(A) if guard is not None else True
            if not spec and k_step > 0:
                k_step = 0
                drafter.skip()  # the drafter sits this step out (its timing must not span it)
            if drafter is not None and k_step > 0:
                hid = None
                if wants_hidden:
                    hid = [torch.cat(feats[r]) if feats[r] else None for r in rows]
                    for r in rows:
                        feats[r] = []
                draft = drafter.propose(DraftContext([context[r] for r in rows], params, gen, hid), k_step)
                if draft.parents is None:
                    draft.counts = torch.minimum(draft.counts, torch.tensor(room).clamp_min(0))
            else:
                draft = Draft.empty(A)
            K = draft.tokens.shape[1]
            is_tree = draft.parents is not None and K > 0
            if is_tree and K + 1 > max_len - int(cache.lengths.max()):
                # near the end of the context a tree may not fit: score the pending token alone
                # (the drafter is told nothing was accepted)
                drafter.commit([0] * A, paths=[[] for _ in range(A)])
                draft, K, is_tree = Draft.empty(A), 0, False
            t2 = time.perf_counter()

            # 2-4 score, verify, commit / roll back (core/step.py)
            res = run_step(model, cache, [context[r][-1] for r in rows], draft, params, gen, room)
            n_acc = res.accepted
            if drafter is not None and K > 0:
                if is_tree:
                    drafter.commit(n_acc, paths=res.paths)
                else:
                    drafter.commit(n_acc)
            t3 = time.perf_counter()

            # 5 record
            new = []
            guessed = draft.tokens.tolist()
            for i, r in enumerate(rows):
                a = n_acc[i]
                ids = res.ids(i, guessed[i])
                context[r].extend(ids)
                if wants_hidden:  # features of the pending token and the accepted drafts
                    feats[r].append(res.hidden[i, res.kept(i)])
                st = results[r].stats
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
                self.k_policy.observe(k_step, draft.counts.tolist(), n_acc, t2 - t1, t3 - t2)
            keep = self._commit_tokens(rows, new, results, params, on_tokens, stop_fn, max_len, cache)
            if guard is not None:
                guard.observe(A, spec, sum(len(ids) for ids in new), time.perf_counter() - t1)
        for r in results:
            r.stats.new_tokens = len(r.tokens)
        return results

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
