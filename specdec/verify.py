"""Pure verification rules for speculative decoding (chains and trees).

Given the target's logits/probabilities at the K+1 positions [pending, d1 .. dK] and the
drafter's K guesses, decide per row how many guesses to accept and which token to emit
next (the *recovered* token after a rejection, the *bonus* token after a full accept).

  greedy      accept while d_i == argmax p_i; then emit argmax p at the first mismatch
              (or at position K after a full accept).
  stochastic  Leviathan et al. 2023, Algorithm 1: accept d_i with probability
              min(1, p_i(d_i) / q_i(d_i)); on rejection emit a sample of
              norm(max(0, p_i - q_i)); after a full accept a bonus sample of p_K.
              q = None means deterministic guesses (q one-hot at d_i): accept with
              probability p_i(d_i), on rejection sample p_i with d_i removed.

Trees (tree.py: node 0 is the pending token, draft node i has a parent among 0..i-1):

  greedy      from the root, follow the child whose token is argmax p at the current node;
              emit argmax p where no child matches.
  stochastic  multi-candidate rejection (SpecInfer; EAGLE): at the current node try its
              children in order; child x with draft distribution q_x is accepted with
              probability min(1, p(x) / q_x(x)); on rejection p <- norm(max(0, p - q_x))
              and the next sibling is tried against that residual. If no child is
              accepted, emit a sample of the residual; at an accepted leaf, a bonus sample
              of p there. Exact when each child was drawn from its q independently given
              the earlier siblings (i.i.d. samples of q, or deterministic candidates with
              q one-hot, where rejecting x just removes x from p).

Both p and q must be *warped the same way* (sampling.warp) before they arrive here.
All randomness comes from the explicit generator. This module knows nothing about models.

Deterministic guesses with text positions (`positions`, `rows`): the sampled rule above is
then carried out as "sample and compare": at each position the target's token is sampled as
plain decoding samples it there (sampling.sample with `position_uniforms` of the same seed, row
and position), the guess is accepted iff it equals that token, and the first token that differs
is the one emitted. For q one-hot this is the same distribution as Algorithm 1 (a guess d is
accepted with probability p(d); after a rejection the token is a sample of p with d removed),
and because the uniform belongs to the position, the committed text is exactly the text plain
sampling draws with that seed: seeded speculative sampling is as reproducible as greedy
decoding, whatever was guessed. Trees: at the current node the target's token is sampled the
same way (the node's depth gives its position) and the child with that token is followed.

Worked example: committed [a b c], pending token c fed with draft [d e f] (K = 3); the
target's logits cover positions (c, d, e, f). If d and e are accepted and f rejected, the
row commits [d e] + one recovered token r sampled at position f's slot (the logits that
followed e): [a b c d e r].
"""

from __future__ import annotations

import torch

from .sampling import argmax, position_uniforms, sample


def _accepted_prefix(ok: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """ok [B, K] bool -> number of leading True within each row's count [B]."""
    K = ok.shape[1]
    valid = torch.arange(K, device=ok.device)[None, :] < counts[:, None]
    return (ok & valid).long().cumprod(dim=1).sum(dim=1)


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor, counts: torch.Tensor):
    """target_logits [B, K+1, V], draft_tokens [B, K], counts [B] -> (num_accepted [B], next_token [B])."""
    best = argmax(target_logits)  # [B, K+1]
    K = draft_tokens.shape[1]
    if K == 0:  # a plain step: nothing to accept (saves a few small tensor ops a step)
        return torch.zeros(best.shape[0], dtype=torch.long), best[:, 0]
    n_acc = _accepted_prefix(draft_tokens == best[:, :K], counts)
    next_token = best.gather(1, n_acc[:, None]).squeeze(1)
    return n_acc, next_token


def verify_stochastic(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    counts: torch.Tensor,
    generator: torch.Generator | None,
    positions: list[int] | None = None,
    rows: list[int] | None = None,
):
    """Exact rejection sampling over chains.

    target_probs [B, K+1, V] (warped), draft_tokens [B, K], draft_probs [B, K, V] or None
    (deterministic guesses), counts [B] -> (num_accepted [B], next_token [B]). With
    deterministic guesses and `positions` (each row's text position of its first guess) and
    `rows` (each row's key): sample and compare (module docstring).
    """
    B, K1, V = target_probs.shape
    K = K1 - 1
    if draft_probs is None and positions is not None:
        return _sample_and_compare_chains(target_probs, draft_tokens, counts, generator, positions, rows)
    p_tok = target_probs[:, :K].gather(2, draft_tokens[:, :, None]).squeeze(2)  # [B, K]
    if draft_probs is None:
        q_tok = torch.ones_like(p_tok)
    else:
        q_tok = draft_probs.gather(2, draft_tokens[:, :, None]).squeeze(2)  # [B, K]
    r = torch.rand(B, K, generator=generator, device=target_probs.device)
    ok = r * q_tok < p_tok  # r < p/q without dividing by a zero q
    n_acc = _accepted_prefix(ok, counts)
    next_token = torch.empty(B, dtype=torch.long, device=target_probs.device)
    for b in range(B):
        i = int(n_acc[b])
        p = target_probs[b, i]  # [V]
        if i < int(counts[b]):  # rejected at position i: sample the residual
            if draft_probs is None:
                resid = p.clone()
                resid[draft_tokens[b, i]] = 0.0
            else:
                resid = (p - draft_probs[b, i]).clamp_min(0.0)
            total = resid.sum()
            # total == 0 only if p == q up to rounding, where rejection has probability ~0
            p = resid / total if float(total) > 0 else p
        next_token[b] = sample(p, generator)
    return n_acc, next_token


def _sample_at(p: torch.Tensor, generator, row: int, position: int) -> int:
    """The token plain sampling draws from p [V] at this row and text position."""
    return int(sample(p, None, position_uniforms(generator, [row], [position])))


def _sample_and_follow(probs, generator, row: int, position: int, child_with) -> tuple[list[int], int]:
    """Sample and compare (module docstring) along one row's deterministic guesses: at each node
    (0: the pending token) the target's token is sampled as plain decoding samples it at that
    depth's text position, and the guess that holds it, `child_with(node, depth, token)` (None:
    no guess does), is followed. probs: [N+1, V] per node. Returns (the nodes followed, the
    first sampled token no guess held)."""
    node, path = 0, []
    while True:
        token = _sample_at(probs[node], generator, row, position + len(path))
        child = child_with(node, len(path), token)
        if child is None:
            return path, token
        path.append(child)
        node = child


def _sample_and_compare_chains(target_probs, draft_tokens, counts, generator, positions, rows):
    """Deterministic chains: node j + 1 (guess j) hangs under node j; guesses are accepted while
    they equal the token sampled at their position."""
    guesses, cnt = draft_tokens.tolist(), counts.tolist()
    n_acc, nxt = [], []
    for b in range(target_probs.shape[0]):
        def next_guess(node, depth, token, g=guesses[b], n=cnt[b]):
            return node + 1 if node < n and g[node] == token else None

        path, token = _sample_and_follow(target_probs[b], generator, rows[b], positions[b], next_guess)
        n_acc.append(len(path))
        nxt.append(token)
    return torch.tensor(n_acc, dtype=torch.long), torch.tensor(nxt, dtype=torch.long)


def _tree_children(parents_row: list[int], count: int) -> list[list[int]]:
    ch: list[list[int]] = [[] for _ in range(count + 1)]
    for i in range(count):
        ch[parents_row[i]].append(i + 1)
    return ch


def verify_tree_greedy(target_logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, counts: torch.Tensor,
                       max_depth: list[int] | None = None):
    """target_logits [B, N+1, V] (root first), tokens/parents [B, N], counts [B] ->
    (paths: per row the accepted draft nodes root excluded, next_token [B]).
    max_depth [B] (optional): accept at most this many nodes per row."""
    best = argmax(target_logits).tolist()  # [B, N+1]
    toks, pars, cnt = tokens.tolist(), parents.tolist(), counts.tolist()
    paths, nxt = [], []
    for b in range(len(toks)):
        ch = _tree_children(pars[b], cnt[b])
        node, path = 0, []
        while max_depth is None or len(path) < max_depth[b]:
            want = best[b][node]
            child = next((c for c in ch[node] if toks[b][c - 1] == want), None)
            if child is None:
                break
            path.append(child)
            node = child
        paths.append(path)
        nxt.append(best[b][node])
    return paths, torch.tensor(nxt, dtype=torch.long)


def verify_tree_stochastic(
    target_probs: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    draft_probs: torch.Tensor | None,
    counts: torch.Tensor,
    generator: torch.Generator | None,
    max_depth: list[int] | None = None,
    positions: list[int] | None = None,
    rows: list[int] | None = None,
):
    """Exact multi-candidate rejection sampling over trees.

    target_probs [B, N+1, V] (warped, root first), tokens/parents [B, N], draft_probs
    [B, N, V] (node i's q, the distribution it was drawn from at its parent) or None
    (deterministic candidates), counts [B] -> (paths, next_token [B]). max_depth as in
    verify_tree_greedy (a node past it is never tried, as if it were not drafted). With
    deterministic candidates and `positions` (each row's text position of a depth-1 node) and
    `rows` (each row's key): sample and compare (module docstring).
    """
    toks, pars, cnt = tokens.tolist(), parents.tolist(), counts.tolist()
    paths, nxt = [], []
    for b in range(len(toks)):
        ch = _tree_children(pars[b], cnt[b])
        node, path = 0, []
        if draft_probs is None and positions is not None:
            def child_with(node, depth, token, ch=ch, tb=toks[b], limit=None if max_depth is None else max_depth[b]):
                if limit is not None and depth >= limit:
                    return None  # a node past max_depth is never tried
                return next((c for c in ch[node] if tb[c - 1] == token), None)

            path, token = _sample_and_follow(target_probs[b], generator, rows[b], positions[b], child_with)
            paths.append(path)
            nxt.append(token)
            continue
        while True:
            p = target_probs[b, node]
            accepted = None
            tried = ch[node] if max_depth is None or len(path) < max_depth[b] else []
            for c in tried:
                x = toks[b][c - 1]
                qx = 1.0 if draft_probs is None else float(draft_probs[b, c - 1, x])
                u = float(torch.rand((), generator=generator))
                if u * qx < float(p[x]):
                    accepted = c
                    break
                if draft_probs is None:
                    resid = p.clone()
                    resid[x] = 0.0
                else:
                    resid = (p - draft_probs[b, c - 1]).clamp_min(0.0)
                total = resid.sum()
                if float(total) > 0:  # 0 only if p == q up to rounding (rejection had probability ~0)
                    p = resid / total
            if accepted is None:
                nxt.append(int(sample(p, generator)))
                break
            path.append(accepted)
            node = accepted
        paths.append(path)
    return paths, torch.tensor(nxt, dtype=torch.long)
