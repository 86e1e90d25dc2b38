"""A brute-force statement of suffix decoding's draft rule (kernels/suffix_store.cpp), for the
tests: stores are plain lists of sequences; every occurrence is found by scanning every position,
every match length by comparing token by token, and every count by counting the occurrences whose
continuation starts with a node's path. No index, no partition of occurrences."""

from __future__ import annotations

import math


def occurrences(stores: list[tuple[list[list[int]], bool]], context: list[int], max_depth: int, max_walk: int):
    """[(store, sequence, position, match length)]: the positions where the context's last two
    tokens end (where none does, those of its last token), in the order the rule reads them
    (longest match first; then stores in order, each newest first); per store only the newest
    max_walk positions of that pair (or token). stores: per store (its sequences, whether its last
    sequence is still open)."""
    n = len(context)
    found = []
    for k, (seqs, open_) in enumerate(stores):
        mine = []
        for s, seq in enumerate(seqs):
            for p in range(1, len(seq)):
                if n > 1 and seq[p - 1] == context[-2] and seq[p] == context[-1]:
                    mine.append((k, s, p))
        mine.reverse()  # newest first
        mine = mine[:max_walk]
        for k_, s, p in mine:
            if open_ and s == len(seqs) - 1 and p == len(seqs[s]) - 1:
                continue  # the open sequence's last position: nothing follows it yet
            seq = seqs[s]
            length = 0
            while length < min(max_depth, n, p + 1) and seq[p - length] == context[n - 1 - length]:
                length += 1
            found.append((k_, s, p, length))
    if not found:  # no two-token suffix occurs: the last token alone, newest max_walk positions per store
        for k, (seqs, open_) in enumerate(stores):
            mine = [(s, p) for s, seq in enumerate(seqs) for p in range(len(seq)) if seq[p] == context[-1]]
            found += [(k, s, p, 1) for s, p in mine[::-1][:max_walk]
                      if not (open_ and s == len(seqs) - 1 and p == len(seqs[s]) - 1)]
    found.sort(key=lambda o: -o[3])  # stable: stores in order, newest first
    return found


def grow(stores, occ, budget: int, min_prob: float, tree: bool):
    """The best-first tree over the occurrences `occ` (list order = tie order): nodes (token,
    parent, score) and the sum of scores."""
    def follows(o, path):
        seq = stores[o[0]][0][o[1]]
        return seq[o[2] + 1: o[2] + 1 + len(path)] == list(path)

    def count(path):
        return sum(1 for o in occ if follows(o, path))

    def rank(path):
        return min(i for i, o in enumerate(occ) if follows(o, path))

    def kids(path):
        nxt = {}
        for o in occ:
            seq = stores[o[0]][0][o[1]]
            if follows(o, path) and o[2] + 1 + len(path) < len(seq):
                nxt.setdefault(seq[o[2] + 1 + len(path)], None)
        ranked = sorted(nxt, key=lambda t: (-count(path + (t,)), rank(path + (t,))))
        return ranked if tree else ranked[:1]

    nodes, frontier, made = [], [], 0
    paths = {0: ()}
    probs = {0: 1.0}

    def offer(node):
        nonlocal made
        path = paths[node]
        for t in kids(path):
            p = probs[node] * (count(path + (t,)) / count(path))
            if p < min_prob:
                break
            frontier.append((p, made, node, t))
            made += 1

    offer(0)
    while len(nodes) < budget and frontier:
        best = max(frontier, key=lambda c: (c[0], -c[1]))
        frontier.remove(best)
        p, _, parent, t = best
        nodes.append((t, parent, p))
        paths[len(nodes)] = paths[parent] + (t,)
        probs[len(nodes)] = p
        offer(len(nodes))
    return nodes, sum(p for _, _, p in nodes)


def speculate(stores, context, *, max_depth=64, max_nodes=24, alpha=2.0, offset=0.0, min_prob=0.1, max_walk=1024,
              max_occ=256, lengths=8, tree=True, own=0):
    """(nodes [(token, parent, score)], match length, occurrences read): the rule of
    kernels/suffix_store.cpp's sd_speculate, by brute force: the best tree over the first `own`
    stores alone, then over all of them (which must score higher to win)."""
    if not context:
        return [], 0, 0
    best, out = -1.0, ([], 0, 0)
    groups = ([stores[:own]] if own else []) + ([stores] if own < len(stores) else [])
    for group in groups:
        found = occurrences(group, context[-max_depth:], max_depth, max_walk)
        for length in sorted({o[3] for o in found}, reverse=True)[:lengths]:
            occ = [o for o in found if o[3] >= length][:max_occ]
            budget = int(min(max_nodes, math.floor(alpha * length + offset + 1e-9)))
            nodes, score = grow(group, occ, budget, min_prob, tree) if budget > 0 else ([], 0.0)
            if score > best:
                best, out = score, (nodes, length, len(occ))
    return out
