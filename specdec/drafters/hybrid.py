"""Prompt lookup first, draft model otherwise (used by `--method auto`).

Per step: rows for which prompt lookup (the adaptive `NgramDrafter`: it proposes a match's
continuation only as far as such guesses tend to hold) has guesses take them; they cost
nothing to make and are long and accurate when the answer copies its input (summaries,
RAG, code edits). The other rows take the draft model's guesses. If every row has a
lookup, the draft model is not run at all. The draft model
keeps its cache lazily in step (it feeds whatever committed tokens it has not seen), so
skipping it for a step needs no extra work.

The draft model is only worth running while its guesses pay for themselves: drafting one
token costs c target steps and gains alpha_d tokens on average, so it pays iff
alpha_d > c (the k = 1 case of DESIGN.md's formula). The drafter measures both itself:
alpha_d from the rows the draft model proposed for, the draft time per token from its own
propose calls, and the target step time as the wall time between two propose calls.
While it does not pay, rows without lookup guesses get none (as with `--method ngram`),
and the draft model is probed once every `probe_every` steps. With a `k_policy`
(adaptive.AdaptiveK) the draft model's own draft length is chosen per step from its
measured acceptance and cost; lookup rows are not capped by it.

Both sources give deterministic guesses in greedy mode; with sampling, lookup guesses are
one-hot (q = 1 at the guess) and draft guesses carry the draft's q. A row's q must match
how its tokens were drawn, so rows are mixed per row: the probabilities of lookup rows
are set to one-hot vectors.
"""

from __future__ import annotations

import time

import torch

from .base import Draft, DraftContext, register, timing_free
from .ngram import NgramDrafter


class HybridDrafter:
    def __init__(self, draft, min_n: int = 1, max_n: int = 4, probe_every: int = 16, gate: bool = True,
                 k_policy=None) -> None:
        """gate=False always runs the draft model for rows without a lookup."""
        self.draft = draft  # a DraftModelDrafter
        self.k_policy = k_policy
        self._pending = None  # (draft length, draft seconds) of this step, for k_policy.observe
        self.ngram = NgramDrafter(min_n, max_n)
        self.gate = gate
        self.cost_hint = None
        self.probe_every = probe_every
        self._used_draft: list[bool] | None = None
        self._counts: list[int] = []
        self.acc, self.prop = 1.0, 2.0  # draft-model acceptance, decayed counts (prior 0.5)
        self.t_tok: float | None = None  # seconds to draft one token
        self.t_step: float | None = None  # seconds of one target step (between proposals)
        self._t_end: float | None = None
        self._skipped = 0

    def draft_pays(self) -> bool:
        if not self.gate or self.t_tok is None or not self.t_step:
            return True  # ungated, or not measured yet
        return self.acc / self.prop > self.t_tok / self.t_step

    def begin(self, prompts, params, max_len) -> None:
        self.draft.begin(prompts, params, max_len)
        self.ngram.begin(prompts, params, max_len)
        self._used_draft = None
        self._t_end = None

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        t0 = time.perf_counter()
        if self._t_end is not None:
            step = t0 - self._t_end
            self.t_step = step if self.t_step is None else 0.8 * self.t_step + 0.2 * step
        try:
            return self._propose(ctx, max_tokens)
        finally:
            self._t_end = time.perf_counter()

    def _propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        B = len(ctx.tokens)
        if max_tokens <= 0:
            self._used_draft = None
            return Draft.empty(B)
        ng = self.ngram.propose(ctx, max_tokens)
        looked = [ng.tokens[b, : int(ng.counts[b])].tolist() for b in range(B)]
        need_draft = [not g for g in looked]
        fixed = timing_free(ctx.params)  # a seeded sample: no timing-based gate or length
        if any(need_draft) and not fixed and not self.draft_pays():
            self._skipped += 1
            if self._skipped % self.probe_every:
                need_draft = [False] * B  # the draft model does not pay: lookup rows only
        if not any(need_draft):
            self._used_draft = None
            N = max(len(g) for g in looked)
            tokens = torch.zeros(B, N, dtype=torch.long)
            for b, g in enumerate(looked):
                tokens[b, : len(g)] = torch.tensor(g)
            probs = None
            if not ctx.params.greedy:
                probs = _one_hot(tokens, self.draft.vocab_size)
            return Draft(tokens, torch.tensor([len(g) for g in looked]), probs)
        kd = max_tokens if self.k_policy is None or fixed else max(1, self.k_policy.choose_k(max_tokens))
        catch_up = max(len(t) - len(f) for t, f in zip(ctx.tokens, self.draft.fed))
        t1 = time.perf_counter()
        d = self.draft.propose(ctx, kd)
        t2 = time.perf_counter()
        if catch_up <= kd + 1:  # steady state (not a prompt's prefill): time it
            per_tok = (t2 - t1) / kd
            self.t_tok = per_tok if self.t_tok is None else 0.8 * self.t_tok + 0.2 * per_tok
            self._pending = (kd, t2 - t1)
        self._used_draft = need_draft
        self._counts = d.counts.tolist()
        Kd = d.tokens.shape[1]
        K = max(Kd, max(len(g) for g in looked))
        self.ngram.step_tokens = K  # the target verifies the draft model's guesses too
        tokens = torch.zeros(B, K, dtype=torch.long)
        tokens[:, :Kd] = d.tokens
        counts = d.counts.clone()
        probs = None
        if d.probs is not None:
            probs = torch.zeros(B, K, d.probs.shape[-1])
            probs[:, :Kd] = d.probs
        for b, g in enumerate(looked):
            if g:
                n = len(g)
                tokens[b, :n] = torch.tensor(g)
                tokens[b, n:] = 0
                counts[b] = n
                if probs is not None:
                    probs[b] = _one_hot(tokens[b : b + 1], probs.shape[-1])[0]
        return Draft(tokens, counts, probs)

    def commit(self, num_accepted) -> None:
        self.ngram.commit(num_accepted)  # it learns only from the rows it proposed for
        if self._used_draft is None:
            return  # the draft model did not run this step; it catches up lazily
        used = self._used_draft
        acc = sum(n for n, u in zip(num_accepted, used) if u)
        prop = sum(c for c, u in zip(self._counts, used) if u)
        if prop:
            self.acc, self.prop = 0.9 * self.acc + acc, 0.9 * self.prop + prop
        if self.k_policy is not None and self._pending is not None:
            kd, draft_s = self._pending
            verify_s = time.perf_counter() - self._t_end
            self.k_policy.observe(kd, [c for c, u in zip(self._counts, used) if u],
                                  [n for n, u in zip(num_accepted, used) if u], draft_s, verify_s)
        self._pending = None
        self.draft.commit([n if u else 0 for n, u in zip(num_accepted, used)])
        self._used_draft = None

    def keep_rows(self, rows) -> None:
        self.draft.keep_rows(rows)
        self.ngram.keep_rows(rows)


def _one_hot(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, N] -> [B, N, V] one-hot draft distributions (deterministic guesses)."""
    return torch.nn.functional.one_hot(tokens, vocab).float()


@register("hybrid")
def _make(target=None, draft=None, **_):
    from .draft_model import _make as make_draft

    from ..adaptive import AdaptiveK

    return HybridDrafter(make_draft(target=target, draft=draft), k_policy=AdaptiveK(cost_hint=None))
