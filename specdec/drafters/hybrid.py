"""Prompt lookup first, a draft model or an EAGLE head otherwise (`--method auto`).

Prompt lookup (the adaptive `NgramDrafter`) costs nothing to run, and its guesses are long and
accurate where the answer copies its input (summaries, RAG, code edits); a second source guesses
everywhere else at a cost. `generate` and `serve` choose per step and row between a row's lookup
and the second source, and how far each goes, with the scheduler's cost model
(core.policy.LoadPolicy, docs/design.md "The policy"): the drafters here hold the two sources
and say what they cost, and their protocol `propose` (run only where the scheduler does not
price them: a target the native loader does not run) follows a fixed rule.

`HybridDrafter` pairs lookup with a draft model: under the cost model (`LoadPolicy.choose_draft`)
a row takes the draft model's guesses where they promise more tokens per second than its lookup;
its protocol rule is: rows with lookup guesses take them, the others the draft model's. The draft
model keeps its cache lazily in step (it feeds whatever committed tokens it has not seen), so
skipping it for a step needs no extra work.

`LookupEagleDrafter` (auto for a target with an EAGLE head, the default target's case) pairs
lookup with an EAGLE tree instead (`LoadPolicy.choose_k`); see its docstring.

Both sources give deterministic guesses in greedy mode; with sampling, lookup guesses are
one-hot (q = 1 at the guess) and draft guesses carry the draft's q. A row's q must match
how its tokens were drawn, so rows are mixed per row: the probabilities of lookup rows
are set to one-hot vectors.
"""

from __future__ import annotations

import math
import time

import torch

from .. import tree as tree_mod
from ..core.policy import PROBE_EVERY, NodeOdds, best_prefix, ema
from ..learned import nonneg
from ..types import SpecdecError
from .base import Draft, DraftContext, Drafter, register, steady, timing_free
from .ngram import NgramDrafter


class _LookupFirst(Drafter):
    """What auto's two drafters share: prompt lookup first (`ngram`) and a second source priced
    by the scheduler's cost model."""

    def __init__(self, min_n: int, max_n: int, gate: bool) -> None:
        self.ngram = NgramDrafter(min_n, max_n)
        self.gate = gate  # priced by the cost model (False: the second source drafts every step)


class HybridDrafter(_LookupFirst):
    """Prompt lookup beside a draft model (`auto --draft MODEL`): the scheduler runs the pair
    under its cost model (method auto: `LoadPolicy.choose_draft`, what the lookup learnt kept in
    `ngram`); `propose` alone gives rows with lookup guesses those and the others the draft
    model's `max_tokens` guesses."""

    samples_guesses = True  # the draft model's rows carry its q

    def __init__(self, draft, min_n: int = 1, max_n: int = 4, gate: bool = True) -> None:
        """draft: a DraftModelDrafter. gate=False: under the scheduler the draft model drafts
        every step (k guesses) for rows whose lookup has fewer than 2 (`--fixed-k`)."""
        super().__init__(min_n, max_n, gate)
        self.draft = draft
        self.lookup = self.ngram  # the lookup of the current batch (`begin`)
        self._used_draft: list[bool] | None = None  # per row of the last proposal: the draft model's guesses

    def begin(self, prompts, params, max_len) -> None:
        self.draft.begin(prompts, params, max_len)
        self.ngram.begin(prompts, params, max_len)
        self.lookup = self.ngram
        if timing_free(params):
            # lookup rows carry one-hot q here (mixed with the draft's q: Algorithm 1), so a seeded
            # request's lookups must follow from its text alone: a lookup of its own, afresh,
            # whose cut prices a guess at the fixed prior and learns from this request only
            self.lookup = NgramDrafter(self.ngram.min_n, self.ngram.max_n)
            self.lookup.policy.clock, self.lookup.policy.probe_every = False, 0
            self.lookup.begin(prompts, params, max_len)
        self._used_draft = None

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        try:
            return self._propose(ctx, max_tokens)
        finally:
            # the lookup times the target's step from here: the draft model's drafting is not part of it
            self.lookup.handed_over()

    def _propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        B = len(ctx.tokens)
        self._used_draft = None
        if max_tokens <= 0:
            return Draft.empty(B)
        looked = self.lookup.lookups(ctx, max_tokens)
        need_draft = [not g for g in looked]
        if not any(need_draft):
            N = max(len(g) for g in looked)
            tokens = torch.zeros(B, N, dtype=torch.long)
            for b, g in enumerate(looked):
                tokens[b, : len(g)] = torch.tensor(g)
            probs = None if ctx.params.greedy else _one_hot(tokens, self.draft.vocab_size)
            return Draft(tokens, torch.tensor([len(g) for g in looked]), probs)
        d = self.draft.propose(ctx, max_tokens)
        self._used_draft = need_draft
        Kd = d.tokens.shape[1]
        K = max(Kd, max(len(g) for g in looked))
        self.lookup.step_tokens = K  # the target verifies the draft model's guesses too
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
        return Draft(tokens, counts, probs)  # (the engine may cap its counts at a row's room)

    def commit(self, num_accepted, paths=None) -> None:
        self.lookup.commit(num_accepted)
        if self._used_draft is None:
            return  # the draft model did not run this step; it catches up lazily
        self.draft.commit([n if u else 0 for n, u in zip(num_accepted, self._used_draft)])
        self._used_draft = None

    def skip(self) -> None:
        """The engine decodes a step without drafting: the lookup does not time across it."""
        self._used_draft = None
        self.lookup.skip()

    def keep_rows(self, rows) -> None:
        self.draft.keep_rows(rows)
        self.lookup.keep_rows(rows)

    def add_row(self, max_len: int, prompt: list[int] | None = None) -> None:
        # the draft model reads the prompt when it first drafts for the row (a catch-up), not now:
        # a request whose lookups do better never pays the draft's prefill
        self.draft.add_row(max_len, None)
        self.lookup.add_row(max_len, prompt)

    def learned(self) -> dict:
        """The lookup's policy, for a later run (learned.py); the draft model's acceptance and
        times are the scheduler's cost model's (`LoadPolicy.learned`)."""
        return {"ngram": self.ngram.learned()}

    def relearn(self, state: dict) -> None:
        if state.get("ngram"):
            self.ngram.relearn(state["ngram"])


class LookupEagleDrafter(_LookupFirst):
    """Prompt lookup where the text repeats, an EAGLE tree elsewhere (`--method auto` for a
    target that has an EAGLE head).

    Which rows take their lookup (the adaptive NgramDrafter's whole match continuation) and
    which the EAGLE head's dynamic tree, and how many guesses a row verifies, is chosen per step
    by the scheduler's cost model (`core.policy.LoadPolicy`), in `generate` and `serve` alike:
    a lookup is valued by its learnt per-position acceptance (`expected_tokens`), a tree by its
    measured accepted tokens (`tree_tokens`) and the head's drafting time (the cost model's line,
    `LoadPolicy.head_cost`), both against the step-time fit. The drafter builds the proposal once
    the sources are chosen (`assemble`). Its `propose`, for a caller without
    that cost model (the protocol alone, `--fixed-k`), takes a row's lookup of at least
    `min_lookup` guesses and drafts the tree for the others (`prefer_lookup`).

    Both kinds of guesses are deterministic (q one-hot), so rows mix freely in one tree-shaped
    proposal (a chain is a tree whose node i hangs under node i-1) and the verification stays
    exact, greedy or sampled: a seeded request commits plain sampling's text whatever was drafted
    (verify.py, "sample and compare"), so timing may decide. A row that drafts the tree also gets
    its lookup (if any) grafted onto the tree, up to `graft` extra nodes (shared prefixes merge):
    verification then keeps whichever path holds longer, so a short or shaky lookup costs a few
    nodes instead of the tree. When no row takes the tree the head does not run; it still keeps
    the target features it is handed and catches up lazily the next time it drafts.

    A drafted tree is cut to the nodes worth verifying (`trim`, on by default): each node of the
    head's tree has a path probability, the drafter learns how often nodes of that probability
    are accepted (`core.policy.NodeOdds`), and keeps the best nodes for as long as one more raises
    the expected committed tokens per unit of step time, (1 + sum of kept odds) / (1 + c + r *
    kept), c the head's drafting time in plain steps (as the scheduler prices it, `assemble`'s
    `cost`), r a verified node's. A confident
    head keeps its whole tree, an unsure one a node or two, or none (the row then verifies only
    its lookup, if any). The cut trees' size is the `nodes` the cost model prices."""

    needs_hidden = True

    def __init__(self, eagle, min_n: int = 1, max_n: int = 4, min_lookup: int = 2, probe_every: int = PROBE_EVERY,
                 gate: bool = True, graft: int = 6, trim: bool = True) -> None:
        """gate: let the scheduler's cost model choose each step's sources and length (False:
        every step drafts, each row's source by `prefer_lookup`); trim: verify only the tree's
        nodes worth their verification (every probe_every-th tree step verifies whole trees,
        so the odds of the nodes a cut drops stay measured)."""
        super().__init__(min_n, max_n, gate)
        self.probe_every = probe_every
        self.eagle = eagle
        self.min_lookup = min_lookup
        self.graft = graft  # lookup nodes a tree row may add to its tree (0: none)
        self.trim = trim
        self.odds = NodeOdds()  # P(a tree node is accepted | the head's path probability), learnt
        self._node_p: dict[int, list[float]] = {}  # per tree row: its head nodes' path probabilities
        self._trees = 0  # steps that drafted trees (every probe_every-th verifies them whole: odds stay measured)
        self.max_nodes = eagle.max_nodes + graft
        self.vocab_size = eagle.vocab_size
        self.rows_drafted = {"lookup": 0, "eagle": 0, "graft": 0}  # row-steps each source drafted for (graft:
        # tree rows whose lookup added nodes to the tree)
        self.gain = 1.0  # accepted tokens per tree row-step (decayed; optimistic prior)
        self.nodes = float(eagle.max_nodes or eagle.depth)
        self._tree_rows: list[bool] | None = None
        self._timing = (0.0, True)  # (seconds the head drafted in the last proposal, steady state)

    def prefer_lookup(self, looked: list[list[int]]) -> list[bool]:
        """Per row, whether it takes its lookup rather than the tree when nothing prices the two
        (`propose`, `--fixed-k`): a lookup of at least `min_lookup` guesses (one looked-up token
        is usually a worse bet than the tree, whose first guess alone holds about as often)."""
        return [len(g) >= self.min_lookup for g in looked]

    def draft_timing(self) -> tuple[float, bool]:
        """(seconds the head drafted in the last proposal, 0 when no row took a tree; whether it
        drafted in steady state, not first catching up on a prompt or steps it sat out)."""
        return self._timing

    def expected_tokens(self) -> list[list[float]] | None:
        """The lookup's estimates for its last proposal (NgramDrafter.expected_tokens)."""
        return self.ngram.expected_tokens()

    def tree_tokens(self, k: int) -> float:
        """Expected committed tokens of a row that drafts a tree cut to k nodes: the tree's
        measured accepted tokens at its usual size, pro rata below it."""
        return 1.0 + self.gain * min(1.0, k / max(self.nodes, 1.0))

    @property
    def usual_nodes(self) -> int:
        """The nodes a tree of the usual size holds (what a probe drafts)."""
        return round(self.nodes)

    def begin(self, prompts, params, max_len) -> None:
        self.eagle.begin(prompts, params, max_len)
        self.ngram.begin(prompts, params, max_len)

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """Each row's lookup or the tree, by `prefer_lookup` (the protocol alone: `generate` and
        the server choose through their cost model and call `assemble`); trees are cut at c = 0."""
        self._tree_rows = None
        if max_tokens <= 0:
            self.eagle.remember(ctx)
            return Draft.empty(len(ctx.tokens))
        looked = self.ngram.lookups(ctx, max_tokens)
        tree_rows = [not u for u in self.prefer_lookup(looked)]
        return self.assemble(ctx, looked, tree_rows, max_tokens, self.max_nodes, trim=self.trim)

    def assemble(self, ctx: DraftContext, looked: list[list[int]], tree_rows: list[bool], max_tokens: int,
                 max_nodes: int | None = None, trim: bool = False, cost: float = 0.0) -> Draft:
        """The proposal once each row's source is chosen: the head's tree for rows with
        tree_rows[b], the lookup chain looked[b] (possibly empty) for the others. With
        `max_nodes` above the tree's size, a tree row's lookup is grafted onto its tree too
        (shared prefixes merge; new nodes up to max_nodes in all), so verification takes
        whichever holds longer. The head runs only if some row takes its tree, and then
        expands the tree for those rows alone (every row's new pairs are fed to its cache);
        otherwise it just keeps the handed-over features. `propose` chooses with its own gate; the
        server's batcher with its load model. With `trim`, a tree row keeps only its head's
        nodes worth verifying (`_trim`), the head's drafting time being `cost` plain steps."""
        B = len(ctx.tokens)
        tree = None
        self._node_p = {}
        self._timing = (0.0, True)  # no head ran (yet)
        self._tree_rows = None
        if not any(tree_rows):
            self.eagle.remember(ctx)
            if not any(looked):  # a plain step: nothing to assemble
                self.ngram.step_tokens = 0
                self.ngram.handed_over()
                return Draft.empty(B)
        else:
            # the tree is drafted for the rows that take it only (every row's new pairs are fed)
            sub = [b for b in range(B) if tree_rows[b]]
            # pairs the head has not seen yet: a whole prompt right after a prefill (not a
            # steady-state cost, so not timed), a few tokens in steady state
            behind = max(len(t) - 1 - n for t, n in zip(ctx.tokens, self.eagle.n))
            if trim:
                self._trees += 1
                trim = self._trees % self.probe_every != 0  # else a whole-tree probe
            t1 = time.perf_counter()
            tree = self.eagle.propose(ctx, min(self.eagle.depth, max_tokens), rows=sub,
                                      min_logp=self._min_logp(cost) if trim else None)
            t_head = time.perf_counter() - t1
            self._timing = (t_head, steady(behind, max(self.ngram.max_n, self.eagle.depth)))
            self._tree_rows = list(tree_rows)
        self.rows_drafted["lookup"] += sum(1 for g, t in zip(looked, tree_rows) if g and not t)
        self.rows_drafted["eagle"] += sum(tree_rows) if tree is not None else 0
        rows = []  # per row: (tokens, parents), parent 0 = the pending token, j = node j (1-based)
        i = -1  # the row's index in the tree proposal
        for b in range(B):
            if not tree_rows[b]:
                rows.append((looked[b], list(range(len(looked[b])))))  # a chain: node j+1 under node j
                continue
            i += 1
            n = int(tree.counts[i])
            toks, pars = tree.tokens[i, :n].tolist(), tree.parents[i, :n].tolist()
            probs = [math.exp(v) for v in self.eagle.last_scores[i]] if len(self.eagle.last_scores) > i else []
            if len(probs) == n:
                if trim:
                    toks, pars, probs = self._trim(toks, pars, probs, cost)
                    n = len(toks)
                self._node_p[b] = probs
            if looked[b] and max_nodes is not None and max_nodes > n:
                toks, pars = tree_mod.graft(toks, pars, looked[b], max_nodes)
                self.rows_drafted["graft"] += len(toks) > n
            rows.append((toks, pars))
        N = max(len(t) for t, _ in rows)
        # padded in Python, one tensor each (a tensor per row cost more than the rest of the call)
        tokens = torch.tensor([list(t) + [0] * (N - len(t)) for t, _ in rows], dtype=torch.long).reshape(B, N)
        parents = torch.tensor([list(p) + [0] * (N - len(p)) for _, p in rows], dtype=torch.long).reshape(B, N)
        counts = torch.tensor([len(t) for t, _ in rows], dtype=torch.long)
        # the lookup times the target step from here (the head's drafting is not part of it)
        self.ngram.step_tokens = N
        self.ngram.handed_over()
        if tree is not None:
            sizes = [len(t) for (t, _), on in zip(rows, tree_rows) if on]
            self.nodes = ema(self.nodes, sum(sizes) / len(sizes), 0.9)
        return Draft(tokens, counts, None, parents)

    def _min_logp(self, cost: float) -> float | None:
        """The path log-probability below which `_trim` would drop a node whatever else the tree
        holds: its odds under r / (1 + c), c = `cost`, the least a node must add (None: no such
        bound). Below it the head need not expand."""
        policy = self.ngram.policy
        if policy is None:
            return None
        floor = policy.r / (1.0 + cost)
        lows = (0.0,) + self.odds.EDGES
        worth = [lo for i, lo in enumerate(lows) if self.odds.acc[i] / self.odds.seen[i] > floor]
        if not worth:
            return math.inf  # not even a certain guess pays for its verification
        return math.log(worth[0]) if worth[0] > 0 else None

    def _trim(self, toks: list[int], pars: list[int], probs: list[float], cost: float):
        """The head's tree cut to the nodes worth verifying: by their learnt odds of being accepted
        (`NodeOdds`, from the head's path probabilities), the best first, as many as maximise
        committed tokens per unit of step time given the head's cost c = `cost` (already spent) and r per
        verified node (core.policy.best_prefix). A node's path probability never exceeds its
        parent's, so every cut keeps parents. (`assemble` skips the cut on every probe_every-th
        step with trees, so that the odds of nodes it drops stay measured.) Returns (tokens,
        parents, probs)."""
        policy = self.ngram.policy
        if policy is None:
            return toks, pars, probs
        order = sorted(range(len(toks)), key=lambda j: (-probs[j], j))
        m = best_prefix([self.odds(probs[j]) for j in order], cost, policy.r)
        if m == len(toks):
            return toks, pars, probs
        keep = sorted(j + 1 for j in order[:m])
        toks, pars = tree_mod.prune(toks, pars, keep)
        return toks, pars, [probs[j - 1] for j in keep]

    def skip(self) -> None:
        """The engine decodes a step without drafting (the head's features wait in the engine and
        arrive with the next proposal)."""
        self._tree_rows = None
        self._node_p = {}
        self.ngram.skip()

    def commit(self, num_accepted, paths=None) -> None:
        self.ngram.commit(num_accepted)
        self.eagle.commit(num_accepted, paths)
        if self._tree_rows is not None:
            got = [int(n) for n, t in zip(num_accepted, self._tree_rows) if t]
            if got:
                self.gain = ema(self.gain, sum(got) / len(got), 0.9)
            self._tree_rows = None
        if paths is not None:
            for b, probs in self._node_p.items():  # the head's nodes: held or not, by path probability
                held = set(paths[b])
                for j, p in enumerate(probs, start=1):
                    self.odds.observe(p, j in held)
        self._node_p = {}

    def keep_rows(self, rows) -> None:
        self.eagle.keep_rows(rows)
        self.ngram.keep_rows(rows)
        self._node_p = {}

    def add_row(self, max_len: int, prompt: list[int] | None = None) -> None:
        """A new request joins as the last row (the server's continuous batching); its prompt's
        target features arrive with its first proposal, as after `begin`."""
        self.eagle.add_row(max_len)

    def learned(self) -> dict:
        """The lookup's policy, the tree's gain and size and the nodes' odds, for a later run to
        start from (learned.py; the head's drafting time is the cost model's, saved with it)."""
        return {"ngram": self.ngram.learned(), "gain": self.gain, "nodes": self.nodes, "odds": self.odds.learned()}

    def relearn(self, state: dict) -> None:
        gain, nodes = nonneg(state["gain"], "gain"), nonneg(state["nodes"], "nodes")
        if state.get("ngram"):
            self.ngram.relearn(state["ngram"])
        if state.get("odds"):
            self.odds.relearn(state["odds"])
        if gain is not None:
            self.gain = gain
        if nodes:
            self.nodes = nodes


def _one_hot(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, N] -> [B, N, V] one-hot draft distributions (deterministic guesses)."""
    return torch.nn.functional.one_hot(tokens, vocab).float()


@register("lookup-eagle")
def _make_lookup_eagle(target=None, draft=None, depth: int = 4, width: int = 2, nodes: int = 5,
                       min_lookup: int = 2, min_n: int = 1, gate: bool = True, **_):
    """draft: an EAGLE head folder."""
    from .eagle import _make as make_eagle

    return LookupEagleDrafter(make_eagle(target=target, draft=draft, tree=True, depth=depth, width=width, nodes=nodes),
                              min_n=min_n, min_lookup=min_lookup, gate=gate)


def lookup_eagle_for(target, head=None):
    """`auto`'s drafter for a server (`specdec serve`, validate's load test): prompt lookup + the
    EAGLE head `head` (a folder), or the head shipped for the default target when head is None,
    with the tree shape of `generate --method auto`'s defaults (depth 4, width 2, 5 nodes).
    None when there is no head for this target."""
    from .eagle import default_eagle_for, is_eagle_dir

    path = head
    if path is None and getattr(target.model, "native", False):
        path = default_eagle_for(target)
    if path is None:
        return None
    if not is_eagle_dir(path):
        raise SpecdecError(f"{path} is not an EAGLE head folder (no specdec_eagle.json); use a head from "
                           "`specdec train eagle`")
    return _make_lookup_eagle(target=target, draft=path, depth=4, width=2, nodes=5)


@register("hybrid")
def _make(target=None, draft=None, confidence: float | None = None, **_):
    from .draft_model import _make as make_draft

    return HybridDrafter(make_draft(target=target, draft=draft, confidence=confidence))
