"""Prompt prefixes computed before, reused: the KV entries of a prompt's first tokens, kept between
requests, so that a request whose prompt starts as an earlier one's did (a system prompt, few-shot
examples, a tool list) prefills only the rest.

Exactness (docs/design.md, "The prefix cache"): a prompt's KV entries and logits must not depend
on whether its prefix came from the cache. That holds here because every prompt of a model the
cache serves is prefilled in chunks of at most ATTEND_MAX_T tokens (`prefill`), each computed as a
verification step computes a chain of guesses: on the row-stable kernels (models/llama.py), whose
every number depends only on the token's own row and the keys before it, never on how many tokens
share the call. So a prompt prefilled whole, from a cached prefix, or one token at a time gives the
same bits (tests/engine/test_prefix_cache.py checks all three). A model without the kernels
(a bfloat16 model, the transformers adapter, no compiler) prefills in one call and caches nothing
(`chunks_exact`).

The cache holds blocks of BLOCK tokens from slot 0, each keyed by its parent block and its own
tokens (a trie of blocks: a block is found only after the same tokens before it), with its keys
and values for every layer and, when the draft sources read hidden states (EAGLE, Medusa), the
final hidden state of its tokens. Least recently used leaves are evicted first within a byte
budget. Only the model thread touches it (the scheduler's prefill).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .types import SpecdecError

BLOCK = 16  # tokens a cached block holds: a hit reuses a prompt's shared prefix rounded down to this
# prompt tokens from slot 0 that are prefilled in chunks (and cached); the rest of a longer prompt runs in
# one call on torch's attention (always from this slot, so its numbers do not depend on the cache
# either): the kernels' attention costs more than torch's for long contexts (docs/benchmarks.md)
CHUNKED_MAX = 2048


def chunks_exact(model) -> bool:
    """Whether `model` computes a prompt chunk of up to ATTEND_MAX_T tokens on the row-stable kernels
    (every projection, norm and attention of a decoding step), so that chunked prefills give the
    same numbers however the prompt is cut and a cached prefix can stand in for computing it."""
    from .models.llama import ATTEND_HEAD_SIZES

    if not getattr(model, "native", False) or getattr(model, "rowstable", None) is None:
        return False
    if model.dtype != torch.float32 or model.attn_dtype != torch.float32:
        return False
    return model.cfg.head_dim in ATTEND_HEAD_SIZES and all(getattr(b, "kops", None) is not None for b in model.layers)


@dataclass(eq=False)
class PrefixBlock:
    """One cached block: the KV entries of BLOCK prompt tokens after its parent's."""

    id: int
    parent: "PrefixBlock | None"
    tokens: tuple
    k: torch.Tensor  # [layers, H_kv, BLOCK, Dh]
    v: torch.Tensor
    hidden: torch.Tensor | None = None  # [BLOCK, D], where a source reads hidden states
    children: int = 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + (0 if self.hidden is None else self.hidden.nbytes)


@dataclass
class PrefixStats:
    lookups: int = 0  # prompts looked up
    hits: int = 0  # prompts that reused at least one block
    reused_tokens: int = 0  # prompt tokens not computed, summed
    prompt_tokens: int = 0  # prompt tokens of the looked-up prompts, summed
    evicted: int = 0  # blocks evicted


class PrefixCache:
    """The blocks of earlier prompts within `budget_mb` MiB (module docstring)."""

    def __init__(self, budget_mb: float) -> None:
        if budget_mb < 0:
            raise SpecdecError(f"the prefix cache's budget must be >= 0 MiB (0: off), got {budget_mb}")
        self.budget = int(budget_mb * 2**20)
        self.blocks: OrderedDict[tuple, PrefixBlock] = OrderedDict()  # (parent id, tokens) -> block, least recent first
        self.bytes = 0
        self.stats = PrefixStats()
        self._ids = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def lookup(self, prompt: list[int], need_hidden: bool = False) -> list[PrefixBlock]:
        """The cached blocks that begin `prompt`, in order, at most up to its last token but one's
        block (the last token is always computed: its logits choose the first answer token);
        need_hidden: only blocks that hold hidden states. Marks them recently used."""
        usable = (len(prompt) - 1) // BLOCK
        chain, parent = [], None
        for i in range(usable):
            block = self.blocks.get((0 if parent is None else parent.id, tuple(prompt[i * BLOCK:(i + 1) * BLOCK])))
            if block is None or (need_hidden and block.hidden is None):
                break
            chain.append(block)
            parent = block
        for block in chain:
            self.blocks.move_to_end((0 if block.parent is None else block.parent.id, block.tokens))
        self.stats.lookups += 1
        self.stats.hits += bool(chain)
        self.stats.reused_tokens += len(chain) * BLOCK
        self.stats.prompt_tokens += len(prompt)
        return chain

    def insert(self, prompt: list[int], cache, row: int, chain: list[PrefixBlock],
               hidden: torch.Tensor | None = None) -> None:
        """Keep the full blocks of `prompt` that `chain` (its lookup) did not hold, read from row `row`
        of `cache` (a KVCache holding the prompt's entries from slot 0); hidden [L, D]: the prompt's
        hidden states (or None), stored with new blocks and given to cached ones that lack them."""
        if self.budget <= 0:
            return
        parent = chain[-1] if chain else None
        keep = set(id(b) for b in chain)  # (never evicted for this prompt's own blocks)
        if hidden is not None:
            for i, block in enumerate(chain):
                if block.hidden is None:
                    self._charge(block, hidden[i * BLOCK:(i + 1) * BLOCK].clone(), keep)
        for i in range(len(chain), len(prompt) // BLOCK):
            a = i * BLOCK
            key = (0 if parent is None else parent.id, tuple(prompt[a:a + BLOCK]))
            block = self.blocks.get(key)
            if block is None:
                k = torch.stack([t[row, :, a:a + BLOCK] for t in cache.k])
                v = torch.stack([t[row, :, a:a + BLOCK] for t in cache.v])
                h = None if hidden is None else hidden[a:a + BLOCK].clone()
                size = k.nbytes + v.nbytes + (0 if h is None else h.nbytes)
                if not self._make_room(size, keep):
                    return
                self._ids += 1
                block = PrefixBlock(self._ids, parent, key[1], k, v, h)
                self.blocks[key] = block
                self.bytes += size
                if parent is not None:
                    parent.children += 1
            else:
                self.blocks.move_to_end(key)
            keep.add(id(block))
            parent = block

    def restore(self, chain: list[PrefixBlock], cache, row: int) -> torch.Tensor | None:
        """Write `chain`'s entries into row `row` of `cache` from slot 0 and set its length; returns
        their hidden states [len(chain) * BLOCK, D] where every block holds them, else None."""
        n = len(chain) * BLOCK
        for layer in range(len(cache.k) if chain else 0):  # (a call a layer: a copy a block took 1.6-1.7x as long)
            torch.cat([b.k[layer] for b in chain], dim=1, out=cache.k[layer][row, :, :n])
            torch.cat([b.v[layer] for b in chain], dim=1, out=cache.v[layer][row, :, :n])
        cache.lengths[row] = n
        if chain and all(b.hidden is not None for b in chain):
            return torch.cat([b.hidden for b in chain])
        return None

    def clear(self) -> None:
        self.blocks.clear()
        self.bytes = 0

    def _charge(self, block: PrefixBlock, hidden: torch.Tensor, keep: set) -> None:
        """Give a cached block the hidden states it lacked, if the budget allows (evicting none of `keep`)."""
        if self._make_room(hidden.nbytes, keep):
            block.hidden = hidden
            self.bytes += hidden.nbytes

    def _make_room(self, size: int, keep: set) -> bool:
        """Evict least recently used leaves (blocks no other block continues), never those in
        `keep`, until `size` more bytes fit; False if they cannot."""
        if size > self.budget:
            return False
        while self.bytes + size > self.budget:
            victim = next((key for key, b in self.blocks.items() if b.children == 0 and id(b) not in keep), None)
            if victim is None:
                return False
            block = self.blocks.pop(victim)
            self.bytes -= block.nbytes
            if block.parent is not None:
                block.parent.children -= 1
            self.stats.evicted += 1
        return True


def prefill(model, prompt: list[int], cache, store: PrefixCache | None = None, all_logits: bool = False,
            need_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Prefill `prompt` into row 0 of `cache` (a one-row KVCache, empty) in chunks of up to
    ATTEND_MAX_T tokens from slot 0 (up to CHUNKED_MAX, the rest in one call), taking its cached
    prefix from `store` where it has one (not with all_logits: every position's logits are asked)
    and keeping its blocks there. For a model where `chunks_exact`. Returns (logits [1, M, V]: the
    last token's, or every token's with all_logits; hidden states [1, L, D] or None unless
    need_hidden; prompt tokens taken from the cache)."""
    from .models.llama import ATTEND_MAX_T

    L = len(prompt)
    chain = store.lookup(prompt, need_hidden) if store is not None and not all_logits else []
    start = len(chain) * BLOCK
    cached_hidden = store.restore(chain, cache, 0) if chain else None
    tokens = torch.tensor([prompt])
    none = torch.empty(1, 0, dtype=torch.long)
    logits, hiddens = [], [] if cached_hidden is None else [cached_hidden[None]]
    # chunk ends at multiples of ATTEND_MAX_T (any cut gives the same numbers: these keep chunks whole)
    bounds = [start, *range(start - start % ATTEND_MAX_T + ATTEND_MAX_T, min(L, CHUNKED_MAX), ATTEND_MAX_T), L]
    if CHUNKED_MAX < L and bounds[-2] < CHUNKED_MAX:
        bounds.insert(-1, CHUNKED_MAX)
    for a, e in zip(bounds, bounds[1:]):
        T = e - a
        if T <= ATTEND_MAX_T:
            mask = torch.ones(1, T, T, dtype=torch.bool).tril()  # (also from slot 0: the kernels' attention)
        else:
            mask = None  # (past CHUNKED_MAX: the rest in one call, from that slot)
        at = torch.arange(T)[None] if all_logits else torch.tensor([[T - 1]]) if e == L else none
        out, hidden = model(tokens[:, a:e], torch.arange(a, e)[None], cache, attn_mask=mask, logits_at=at)
        if out is not None:
            logits.append(out)
        if need_hidden:
            hiddens.append(hidden)
    if store is not None:
        full = torch.cat(hiddens, dim=1)[0] if need_hidden else None
        store.insert(prompt[:CHUNKED_MAX], cache, 0, chain, full)
    return torch.cat(logits, dim=1), (torch.cat(hiddens, dim=1) if need_hidden else None), start
