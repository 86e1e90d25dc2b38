"""One speculative step for a set of rows: score -> verify -> commit (docs/design.md, "The step").

The scheduler (`core.scheduler.ContinuousBatcher`, behind `generate` and `serve`) runs its steps
through `run_step`: the proposal (which source guesses, how far) is the scheduler's, what a
proposal does to the rows is here.

- score: the pending token and the guesses of every row in one target forward; a tree with its
  ancestor mask and depths as positions (`tree.masks`), a chain with consecutive positions;
- constrain: a row with a grammar (`Request.constraint`) has every position's disallowed tokens
  masked out of the target's logits before verifying (`constrained`), so greedy and sampled
  verification are exact for the constrained distribution;
- verify: per row, how many guesses hold and the next token (`verify.py`). Rows share one
  sampling setting and one generator (`generate`: one batched call per rule), or each row has
  its own (the server: greedy chain rows in one call, every other row alone with its own
  generator, so a seeded row draws the same random numbers whatever shares its batch; a row
  whose verification raises is reported in `failed`, the others go on);
- commit / roll back: the cache keeps each row's pending token and accepted guesses
  (`truncate` for chains, `keep_paths` for trees).

Worked example: cache `[a b]`, pending `c`, guesses `[d e f]`, two accepted: the cache becomes
`[a b c d e]` and the verified next token is the new pending token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import tree as tree_mod
from ..drafters.base import Draft
from ..sampling import argmax, warp
from ..types import SamplingParams, SpecdecError
from ..verify import verify_greedy, verify_stochastic, verify_tree_greedy, verify_tree_stochastic


@dataclass
class StepResult:
    paths: list[list[int]]  # per row: accepted guesses as 1-based node indices (a chain: 1..n)
    next_ids: list[int]  # per row: the verified token after them (the new pending token)
    logits: torch.Tensor  # [A, K+1, V] the forward's logits, pending token first
    hidden: torch.Tensor  # [A, K+1, D] its final hidden states
    depth: torch.Tensor | None = None  # [A, K+1] node depths of a tree step (None: chains)
    failed: dict[int, Exception] = field(default_factory=dict)  # rows whose own verification raised
    # per row: each guess's chance of holding given that its parent held, where verification
    # sampled (`held_odds`); None for a greedy row (its outcome is all there is to know)
    odds: list[list[float] | None] | None = None

    @property
    def accepted(self) -> list[int]:
        return [len(p) for p in self.paths]

    def ids(self, row: int, guesses: list[int]) -> list[int]:
        """The tokens row `row` commits: its accepted guesses (from `guesses`, that row's proposed
        tokens) and the verified next token."""
        return [guesses[j - 1] for j in self.paths[row]] + [self.next_ids[row]]

    def kept(self, row: int):
        """Index of the forward positions behind the committed tokens (pending + accepted): a
        slice for a chain (a view), a list for a tree."""
        path = self.paths[row]
        return [0] + path if self.depth is not None and path != list(range(1, len(path) + 1)) else slice(0, len(path) + 1)

    def proposed_depth(self, row: int, count: int) -> int:
        """How deep row's proposal reached: its count for a chain, the deepest node for a tree."""
        return int(self.depth[row, : 1 + count].max()) if self.depth is not None else count


def run_step(model, cache, pending: list[int], draft: Draft, params: SamplingParams | list[SamplingParams],
             generators, room: list[int], tree_rows: list[bool] | None = None,
             row_keys: list[int] | None = None, constraints: list | None = None,
             argmax_only: list[bool] | None = None) -> StepResult:
    """Score, verify and commit one step of A rows (`cache` holds exactly these rows).

    pending: each row's pending token; draft: the guesses (`Draft`; `parents` None = chains);
    params/generators: one SamplingParams and one generator shared by every row, or a list of
    each per row; room: tokens each row may still take beyond its pending one (a tree path
    stops there); tree_rows: in a tree step with per-row settings, the rows verified by the
    tree rule (others hold chains, node j under node j - 1; default: all); row_keys: each row's
    key for the uniforms its sampled tokens take at their text positions
    (sampling.position_uniforms; default 0 for every row, for rows with generators of their own);
    constraints: per row its grammar or None; argmax_only: per row, whether only the argmax of its
    logits is read (`constrained`)."""
    A, K = draft.tokens.shape
    is_tree = draft.parents is not None and K > 0
    inp = torch.empty(A, K + 1, dtype=torch.long)
    inp[:, 0] = torch.tensor(pending, dtype=torch.long)
    inp[:, 1:] = draft.tokens
    base = cache.lengths.clone()
    depth = parents = None
    if is_tree:
        parents, mask, depth = tree_mod.masks(draft.parents, draft.counts)
        logits, hidden = model(inp, base[:, None] + depth, cache, attn_mask=mask)
    else:
        logits, hidden = model(inp, base[:, None] + torch.arange(K + 1)[None, :], cache)
    if constraints is not None and any(c is not None for c in constraints):
        logits = constrained(logits, constraints, [_paths(draft, b, parents) for b in range(A)], argmax_only)
    # the text position of each row's first new token (the pending token sits at `base`)
    draws = ((base + 1).tolist(), list(row_keys) if row_keys is not None else [0] * A)
    if isinstance(params, SamplingParams):
        (paths, nxt, odds), failed = _verify_shared(logits, draft, parents, params, generators, room, draws), {}
    else:
        paths, nxt, odds, failed = _verify_per_row(logits, draft, parents, params, generators, room,
                                                   tree_rows if tree_rows is not None else [is_tree] * A, draws)
    if is_tree:
        cache.keep_paths(base, paths)
    elif K > 0:  # (a plain step's one token is what the forward reserved: nothing to roll back)
        cache.truncate(base + 1 + torch.tensor([len(p) for p in paths], dtype=torch.long))
    return StepResult(paths, nxt, logits, hidden, depth, failed, odds)


def held_odds(probs: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor | None,
              draft_probs: torch.Tensor | None, counts: torch.Tensor) -> list[list[float] | None]:
    """Per row, each guess's chance of holding given that its parent held (a chain's parent is
    the guess before it), from the target's warped probabilities [B, K+1, V] at the parent's
    position: a deterministic guess x holds with p(x) (sample and compare), a guess drawn from q
    with sum(min(p, q)) (the rejection rule's acceptance, averaged over q). These are the
    expectations of the 0/1 outcomes, known exactly once the target has scored the guesses, so the
    cost model learns a sampled row's acceptance from them with far less noise than from whether
    one sample matched, and for every guess scored, not only up to the first miss. None for a tree
    drawn from q (its rule weighs siblings together)."""
    B, K = tokens.shape
    if K == 0:
        return [[] for _ in range(B)]
    if draft_probs is not None:
        if parents is not None:
            return [None] * B
        held = torch.minimum(probs[:, :K], draft_probs[:, :K].to(probs.dtype)).sum(-1)  # [B, K]
    else:
        where = parents if parents is not None else torch.arange(K).expand(B, K)
        V = probs.shape[-1]
        held = probs.reshape(B, -1).gather(1, where * V + tokens)  # p at the parent's position, of the guess
    return [row[:n] for row, n in zip(held.tolist(), counts.tolist())]


def _verify_shared(logits, draft: Draft, parents, params: SamplingParams, gen, room, draws):
    """Every row with the same settings and generator: one batched call per rule. draws:
    (positions, row keys) of each row's first new token, for sampled rows (verify.py)."""
    positions, keys = draws
    odds = None
    if parents is not None:
        if params.greedy:
            paths, nxt = verify_tree_greedy(logits, draft.tokens, parents, draft.counts, room)
        else:
            probs = warp(logits, params)
            paths, nxt = verify_tree_stochastic(probs, draft.tokens, parents, draft.probs,
                                                draft.counts, gen, room, positions, keys)
            odds = held_odds(probs, draft.tokens, parents, draft.probs, draft.counts)
        return [list(p) for p in paths], [int(t) for t in nxt], odds
    if params.greedy:
        n_acc, nxt = verify_greedy(logits, draft.tokens, draft.counts)
    else:
        probs = warp(logits, params)
        n_acc, nxt = verify_stochastic(probs, draft.tokens, draft.probs, draft.counts, gen, positions, keys)
        odds = held_odds(probs, draft.tokens, None, draft.probs, draft.counts)
    return [list(range(1, a + 1)) for a in n_acc.tolist()], nxt.tolist(), odds


def _verify_per_row(logits, draft: Draft, parents, params: list[SamplingParams], gens, room, tree_rows, draws):
    """Each row with its own settings: greedy chain rows (the usual case) in one call (the same
    argmax per row as one call per row, a tenth of a millisecond each), every other row alone;
    a sampled chain row verifies its own guesses only, so the random numbers a seeded row draws
    do not depend on how wide other rows' drafts made the batch. Guesses are deterministic
    (q one-hot); each sampled row samples at its own text positions (draws, as in _verify_shared)."""
    positions, keys = draws
    A = len(params)
    paths = [list(range(1, int(c) + 1)) for c in draft.counts]  # chain: node j hangs under node j - 1
    nxt = [0] * A
    odds: list[list[float] | None] = [None] * A
    plain = [b for b in range(A) if params[b].greedy and not (parents is not None and tree_rows[b])]
    if plain:
        sel = slice(None) if len(plain) == A else torch.tensor(plain)
        a, n = verify_greedy(logits[sel], draft.tokens[sel], draft.counts[sel])
        for b, ab, nb in zip(plain, a.tolist(), n.tolist()):
            paths[b], nxt[b] = paths[b][:ab], nb
    failed: dict[int, Exception] = {}
    done = set(plain)
    for b in range(A):
        if b in done:
            continue
        try:
            lg, gt, c = logits[b : b + 1], draft.tokens[b : b + 1], draft.counts[b : b + 1]
            if parents is not None and tree_rows[b]:
                if params[b].greedy:
                    p, n = verify_tree_greedy(lg, gt, parents[b : b + 1], c, [room[b]])
                else:
                    probs = warp(lg, params[b])
                    p, n = verify_tree_stochastic(probs, gt, parents[b : b + 1], None, c, gens[b],
                                                  [room[b]], positions[b : b + 1], keys[b : b + 1])
                    odds[b] = held_odds(probs, gt, parents[b : b + 1], None, c)[0]
                paths[b], nxt[b] = list(p[0]), int(n[0])
            else:
                m = int(c[0])
                probs = warp(lg[:, : m + 1], params[b])
                a, n = verify_stochastic(probs, gt[:, :m], None, c, gens[b], positions[b : b + 1], keys[b : b + 1])
                paths[b], nxt[b] = paths[b][: int(a[0])], int(n[0])
                odds[b] = held_odds(probs, gt[:, :m], None, None, c)[0]
        except Exception as e:  # noqa: BLE001 - this row's own failure: the caller ends it alone
            failed[b], paths[b] = e, []
    return paths, nxt, odds, failed


def _paths(draft: Draft, row: int, parents) -> list[list[int]]:
    """Row `row`'s path of guessed tokens to each position of its forward: [] for the pending
    token's, then each guess's (a chain's prefix, or a tree node's ancestors and itself)."""
    n = int(draft.counts[row])
    toks = draft.tokens[row, :n].tolist()
    if parents is None:
        return [toks[:j] for j in range(draft.tokens.shape[1] + 1)]
    par = parents[row].tolist()
    out = [[]]
    for j in range(1, draft.tokens.shape[1] + 1):
        out.append(out[par[j - 1]] + [toks[j - 1]] if j <= n else [])
    return out


def constrained(logits: torch.Tensor, constraints: list, paths: list[list[list[int]]],
                argmax_only: list[bool] | None = None) -> torch.Tensor:
    """logits [B, P, V] with the tokens each row's grammar forbids at each position set to -inf:
    position p of row b follows the committed text and then paths[b][p] (rows without a constraint
    as they are). A position where the grammar allows no token is the request's own error.

    argmax_only: rows whose logits are read only for their argmax (greedy, no logprobs): where
    a position's argmax is allowed it is the masked argmax too (masking only removes tokens, and
    a tie goes to the lower id either way), so only the positions whose argmax the grammar
    forbids are masked: one token checked per position instead of a whole mask."""
    out = None
    P = logits.shape[1]
    for b, constraint in enumerate(constraints):
        if constraint is None:
            continue
        where = list(range(min(P, len(paths[b]))))
        if argmax_only is not None and argmax_only[b]:
            top = argmax(logits[b, : len(where)]).tolist()
            ok = constraint.allows([paths[b][p] for p in where], top)
            where = [p for p in where if not ok[p]]
            if not where:
                continue
        allowed = constraint.allowed([paths[b][p] for p in where])[:, : logits.shape[-1]]
        if not bool(allowed.any(dim=-1).all()):
            raise SpecdecError("the request's grammar allows no token here (the schema cannot be completed)")
        if out is None:
            out = logits.clone()
        index = torch.tensor(where, dtype=torch.long)
        out[b, index] = out[b, index].masked_fill(~allowed.to(out.device), float("-inf"))
    return logits if out is None else out
