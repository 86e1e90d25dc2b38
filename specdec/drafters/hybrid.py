"""Prompt lookup first, draft model otherwise (used by `--method auto`).

Per step: rows whose context ends in an n-gram seen before (n >= min_n) take the
prompt-lookup continuation, which costs nothing and is long and accurate when the answer
copies its input (summaries, RAG, code edits); the other rows take the draft model's
guesses. If every row has a lookup, the draft model is not run at all. The draft model
keeps its cache lazily in step (it feeds whatever committed tokens it has not seen), so
skipping it for a step needs no extra work.

Both sources give deterministic guesses in greedy mode; with sampling, lookup guesses are
one-hot (q = 1 at the guess) and draft guesses carry the draft's q. A row's q must match
how its tokens were drawn, so rows are mixed per row: the probabilities of lookup rows
are set to one-hot vectors.
"""

from __future__ import annotations

import torch

from .base import Draft, DraftContext, register
from .ngram import lookup


class HybridDrafter:
    def __init__(self, draft, min_n: int = 2, max_n: int = 4) -> None:
        self.draft = draft  # a DraftModelDrafter
        self.min_n, self.max_n = min_n, max_n
        self.cost_hint = None
        self._used_draft: list[bool] | None = None

    def begin(self, prompts, params, max_len) -> None:
        self.draft.begin(prompts, params, max_len)
        self._used_draft = None

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        B = len(ctx.tokens)
        if max_tokens <= 0:
            self._used_draft = None
            return Draft.empty(B)
        looked = [lookup(t, max_tokens, self.min_n, self.max_n) for t in ctx.tokens]
        need_draft = [not g for g in looked]
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
        d = self.draft.propose(ctx, max_tokens)
        self._used_draft = need_draft
        tokens, counts, probs = d.tokens.clone(), d.counts.clone(), d.probs
        if probs is not None:
            probs = probs.clone()
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
        if self._used_draft is None:
            return  # the draft model did not run this step; it catches up lazily
        self.draft.commit([n if used else 0 for n, used in zip(num_accepted, self._used_draft)])
        self._used_draft = None

    def keep_rows(self, rows) -> None:
        self.draft.keep_rows(rows)


def _one_hot(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, N] -> [B, N, V] one-hot draft distributions (deterministic guesses)."""
    return torch.nn.functional.one_hot(tokens, vocab).float()


@register("hybrid")
def _make(target=None, draft=None, **_):
    from .draft_model import _make as make_draft

    return HybridDrafter(make_draft(target=target, draft=draft))
