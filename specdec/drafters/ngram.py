"""Prompt-lookup drafting (Saxena 2023; transformers' `prompt_lookup_num_tokens`).

Match the last n tokens of the context (n from max_n down to min_n) against earlier
context (prompt and generated text); propose the tokens that followed the most recent
earlier match. Guesses are deterministic (q one-hot), and cost almost nothing.
"""

from __future__ import annotations

import torch

from .base import Draft, DraftContext, register


def lookup(tokens: list[int], max_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Tokens that followed the latest earlier occurrence of the longest matching suffix."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n :]
        # scan right to left so the most recent match wins; the match must end before L
        for start in range(L - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + max_tokens]
                if follow:
                    return follow
    return []


class NgramDrafter:
    cost_hint = 0.0

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def begin(self, prompts, params, max_len) -> None:
        pass

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        guesses = [lookup(t, max_tokens, self.min_n, self.max_n) if max_tokens > 0 else [] for t in ctx.tokens]
        B, N = len(guesses), max((len(g) for g in guesses), default=0)
        tokens = torch.zeros(B, N, dtype=torch.long)
        for b, g in enumerate(guesses):
            tokens[b, : len(g)] = torch.tensor(g, dtype=torch.long)
        return Draft(tokens, torch.tensor([len(g) for g in guesses], dtype=torch.long))

    def commit(self, num_accepted) -> None:
        pass

    def keep_rows(self, rows) -> None:
        pass


@register("ngram")
def _make(target=None, draft=None, min_n: int = 1, max_n: int = 3, **_):
    return NgramDrafter(min_n=min_n, max_n=max_n)
