"""Token trees for verifying many candidate continuations in one target forward (pure).

A tree of N draft nodes hangs below the *root*, the row's pending token (node 0). Draft
node i (1..N) holds token `tokens[i-1]` and has parent `parents[i-1]` in 0..i-1, so nodes
come in topological order and a chain is parents = [0, 1, 2, ...]. Example:

        root (pending c)           parents = [0, 0, 1, 1, 2]
        ├── 1: d ── 3: f           depths  = [0, 1, 1, 2, 2, 2]   (root first)
        │      └── 4: g
        └── 2: e ── 5: h

In the verification forward node j sits at position base + depth(j) and attends to the
committed prefix and to its ancestors (itself included), which `ancestor_mask` gives.
After verification the accepted path (root first) is kept and the KV cache compacted
(kv_cache.compact). Rows of a batch may carry trees of different sizes: `batch` pads
them with nodes that see only the root and themselves and are never on a path.

This module knows nothing about models or probabilities; verification lives in verify.py.
"""

from __future__ import annotations

import torch


def check_parents(parents: list[int]) -> None:
    for i, p in enumerate(parents):
        if not 0 <= p <= i:
            raise ValueError(f"tree node {i + 1} has parent {p}; parents must name an earlier node (0 = root)")


def depths(parents: list[int]) -> list[int]:
    """Depth of every node, root (0) first."""
    d = [0]
    for p in parents:
        d.append(d[p] + 1)
    return d


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[N+1, N+1] bool: m[i, j] = node j is node i or one of its ancestors."""
    n = len(parents) + 1
    m = torch.zeros(n, n, dtype=torch.bool)
    m[0, 0] = True
    for i, p in enumerate(parents, start=1):
        m[i] = m[p]
        m[i, i] = True
    return m


def path_to(parents: list[int], node: int) -> list[int]:
    """Nodes from the root to `node`, root first."""
    out = [node]
    while node:
        node = parents[node - 1]
        out.append(node)
    return out[::-1]


def children(parents: list[int]) -> list[list[int]]:
    """children[j]: the nodes whose parent is j, in index order (node 0 = root)."""
    ch: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents, start=1):
        ch[p].append(i)
    return ch


def chain(n: int) -> list[int]:
    return list(range(n))


def trie(sequences: list[list[int]], max_nodes: int | None = None) -> tuple[list[int], list[int]]:
    """Merge candidate continuations into a prefix tree: (tokens, parents). Earlier
    sequences come first among siblings; stops adding nodes at max_nodes."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for seq in sequences:
        _insert(tokens, parents, index, seq, max_nodes)
    return tokens, parents


def _insert(tokens: list[int], parents: list[int], index: dict, seq: list[int], max_nodes: int | None) -> None:
    """Walk `seq` down from the root through the nodes it shares, appending the rest (in place)."""
    node = 0
    for t in seq:
        key = (node, int(t))
        if key not in index:
            if max_nodes is not None and len(tokens) >= max_nodes:
                break
            tokens.append(int(t))
            parents.append(node)
            index[key] = len(tokens)
        node = index[key]


def prune(tokens: list[int], parents: list[int], keep: list[int]) -> tuple[list[int], list[int]]:
    """The subtree of nodes `keep` (1-based, any order; must hold every kept node's parent), in
    the original order, parents renumbered. ValueError if a kept node's parent is not kept."""
    kept = sorted(set(keep))
    new = {0: 0}
    out_tok, out_par = [], []
    for i in kept:
        p = parents[i - 1]
        if p not in new:
            raise ValueError(f"prune: node {i} is kept without its parent {p}")
        out_tok.append(tokens[i - 1])
        out_par.append(new[p])
        new[i] = len(out_tok)
    return out_tok, out_par


def best_nodes(toks: list[int], pars: list[int], probs: list[float], m: int):
    """The tree's m most likely nodes by path probability (ties: the earlier node), as (tokens,
    parents, probs) in the original order. A node's path probability never exceeds its parent's,
    so the kept nodes hold their parents."""
    if m >= len(toks):
        return toks, pars, probs
    keep = sorted(j + 1 for j in sorted(range(len(toks)), key=lambda j: (-probs[j], j))[:m])
    toks, pars = prune(toks, pars, keep)
    return toks, pars, [probs[j - 1] for j in keep]


def graft(tokens: list[int], parents: list[int], seq: list[int], max_nodes: int) -> tuple[list[int], list[int]]:
    """Add the chain `seq` (continuing from the root) to the tree (tokens, parents): follow the
    nodes it shares with the tree, append the rest as a branch (new nodes after the old
    ones, so parents still come before children). Stops at max_nodes nodes in all."""
    tokens, parents = list(tokens), list(parents)
    index = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents), start=1)}
    _insert(tokens, parents, index, seq, max_nodes)
    return tokens, parents


def batch(trees: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad per-row trees (tokens, parents) to one size N.

    Returns tokens [B, N], parents [B, N] (padding nodes hang from the root), counts [B],
    mask [B, N+1, N+1] (ancestor masks; padding sees the root and itself), depth [B, N+1].
    """
    B = len(trees)
    N = max((len(t) for t, _ in trees), default=0)
    tokens = torch.zeros(B, N, dtype=torch.long)
    parents = torch.zeros(B, N, dtype=torch.long)
    counts = torch.zeros(B, dtype=torch.long)
    mask = torch.zeros(B, N + 1, N + 1, dtype=torch.bool)
    depth = torch.zeros(B, N + 1, dtype=torch.long)
    for b, (toks, par) in enumerate(trees):
        check_parents(par)
        n = len(toks)
        counts[b] = n
        full = list(par) + [0] * (N - n)
        tokens[b, :n] = torch.tensor(toks, dtype=torch.long)
        parents[b] = torch.tensor(full, dtype=torch.long)
        mask[b] = ancestor_mask(full)
        depth[b] = torch.tensor(depths(full), dtype=torch.long)
    return tokens, parents, counts, mask, depth


def masks(parents: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From a drafter's parents [B, N] and node counts [B]: (parents with padding nodes
    hung from the root [B, N], ancestor masks [B, N+1, N+1], depths [B, N+1])."""
    B, N = parents.shape
    par = parents.clone()
    par[torch.arange(N)[None, :] >= counts[:, None]] = 0
    rows = par.tolist()
    for r in rows:
        check_parents(r)
    mask = torch.stack([ancestor_mask(r) for r in rows]) if B else torch.zeros(0, N + 1, N + 1, dtype=torch.bool)
    depth = torch.tensor([depths(r) for r in rows], dtype=torch.long).view(B, N + 1)
    return par, mask, depth
