"""The one proposal path: a step's guesses from the scheduler's draft sources (docs/design.md,
"The speculative step").

Each step in a batch the batch guard may turn the step plain before anything is offered; else
every known source offers what it has (`Drafter.offer`), the cost model
(policy.LoadPolicy.choose) prices every offer and every on-demand source against plain decoding
and chooses the cap K and each row's source, the chosen
on-demand sources draft for their rows, and the rows' guesses are packed as one proposal: chains
side by side, or a tree step where any row verifies a tree (a chain is a tree whose node j hangs
under node j - 1), a row's known chain grafted onto its drafted tree where the step has slots for
it. After verification `Sources.commit` tells the on-demand sources and the cost model what held;
known offers are scored against the committed text at the next step (`policy.Hindsight`), verified
or not. Nothing here asks which class a source is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from .. import tree as tree_mod
from ..drafters.base import Draft, DraftContext, Drafter, timing_free
from ..policy import BatchGuard, Hindsight, LoadPolicy, ProbeSchedule, Quote
from ..types import SamplingParams

_GREEDY = SamplingParams()  # deterministic guesses: one-hot q, exact for sampled rows too


@dataclass
class Plan:
    """One step's proposal, from the choice to the verification."""
    A: int
    room: list[int]  # tokens each row may still take beyond its pending one
    k: int = 0  # the step's cap on guesses (0: a plain step)
    reason: str = ""  # why the step is plain ("cost", "guard", "nothing", "warming", "room", "fixed")
    source: list[int | None] = field(default_factory=list)  # per row: the source whose guesses it verifies
    guesses: list[list[int]] = field(default_factory=list)  # per row: its guessed tokens (tree nodes in order)
    parents: list[list[int] | None] = field(default_factory=list)  # per row: tree parents, None for a chain
    probs: list[torch.Tensor | None] = field(default_factory=list)  # per row: q of sampled guesses [n, V]
    drafted: dict[int, Draft] = field(default_factory=dict)  # on-demand source -> its draft this step
    t_draft: float = 0.0  # seconds the on-demand sources drafted
    steady: bool = True  # and whether they drafted in steady state (no catch-up first)
    probe: bool = False

    def draft(self) -> Draft:
        """The guesses as the forward takes them: [A, K] tokens, counts, q, and parents when any
        row verifies a tree."""
        K = max((len(g) for g in self.guesses), default=0)
        tokens = torch.tensor([g + [0] * (K - len(g)) for g in self.guesses], dtype=torch.long).reshape(self.A, K)
        counts = torch.tensor([len(g) for g in self.guesses], dtype=torch.long)
        parents = None
        if K and any(p is not None for p in self.parents):
            parents = torch.tensor([(p if p is not None else list(range(len(g)))) + [0] * (K - len(g))
                                    for g, p in zip(self.guesses, self.parents)], dtype=torch.long)
        probs = None
        if K and any(q is not None for q in self.probs):
            V = next(q for q in self.probs if q is not None).shape[-1]
            probs = torch.nn.functional.one_hot(tokens, V).float()
            for b, q in enumerate(self.probs):
                if q is not None:
                    probs[b, : len(q)] = q
        return Draft(tokens, counts, probs, parents)


class Sources:
    """The scheduler's draft sources and what it keeps for each: the cost model's stats of it,
    per row the hindsight of its offers (known sources) and the target features it has not been
    handed (sources that read them)."""

    def __init__(self, drafters: list[Drafter], policy: LoadPolicy, k_max: int, shared: SamplingParams | None,
                 slots: int) -> None:
        self.drafters, self.policy, self.k_max, self.shared, self.slots = drafters, policy, k_max, shared, slots
        self.stats = [policy.source(d.label, d.known, d.max_nodes > 0, d.prior, d.max_nodes, d.holds_on)
                      for d in drafters]
        self.known = [i for i, d in enumerate(drafters) if d.known]
        self.on_demand = [i for i, d in enumerate(drafters) if not d.known]
        self.hidden = [i for i, d in enumerate(drafters) if d.needs_hidden]
        self.hindsight: list[list[Hindsight]] = [[] for _ in drafters]  # per source, per row
        self.fixed = not policy.adaptive or any(not d.may_skip for d in drafters)

    @property
    def needs_hidden(self) -> bool:
        return bool(self.hidden)

    @property
    def labels(self) -> tuple[str, ...]:
        """The sources' names (what a request's `sources` choose among)."""
        return tuple(d.label for d in self.drafters)

    def time_alone(self) -> None:
        """Price each on-demand source nothing has timed yet by timing it alone (a few forwards
        of its own), rather than in a request."""
        for i in self.on_demand:
            stats = self.stats[i]
            if stats.timed or self.k_max == 0:
                continue
            times = self.drafters[i].time_alone()
            if times is not None:
                per_unit, per_read = times
                stats.time.observe(1, per_unit)
                stats.t_catch = per_read

    # -- rows ---------------------------------------------------------------------------
    def join(self, row) -> None:
        for d, rows in zip(self.drafters, self.hindsight):
            d.join(row)
            rows.append(Hindsight())

    def finish(self, row: int, tokens: list[int]) -> None:
        for d in self.drafters:
            d.finish_row(row, tokens)

    def keep_rows(self, keep: list[int]) -> None:
        for d, rows in zip(self.drafters, self.hindsight):
            d.keep_rows(keep)
            rows[:] = [rows[r] for r in keep]

    # -- a step -------------------------------------------------------------------------
    def plan(self, rows, step: int, room: list[int], guard: BatchGuard | None, space: list[int] | None = None) -> Plan:
        """This step's proposal for the requests `rows` (the scheduler's), each with `context`,
        `spec_k`, `sources` (the source names it allows, None: all), `feats` and `params`. room:
        the tokens each row may still take beyond its pending one; space: the cache slots each
        has left for guesses (default: room)."""
        A = len(rows)
        plan = Plan(A, room, source=[None] * A)
        if self.k_max == 0 or not self.drafters:
            return self._plain(plan, "nothing")
        if guard is not None and not self.fixed and not guard.speculate(A):
            # the batch guard measures plain decoding faster at this batch size: no offers, no
            # pricing (at 16 rows the offers, their hindsight and the chooser cost ~1.5 ms of a
            # 16 ms step, all of it single-threaded Python). A step the guard lets through as its
            # probe may still be declined by the cost model below: the probe is then spent
            # unmeasured and its gap doubles, rather than pricing every step until one speculates
            return self._sit_out(plan, "guard")
        tokens = [r.context for r in rows]
        ctx = DraftContext(tokens, _GREEDY, None, room=room)
        quotes: list[Quote | None] = [None] * len(self.drafters)
        offered = False
        for i in self.known:
            d = self.drafters[i]
            offers = d.offer(ctx, self.policy.long_max if d.long_chains else self.k_max)
            if any(o is not None for o in offers):
                offers = self._legal(rows, offers)
                offered = offered or any(o is not None and o.tokens for o in offers)
            self._remember(i, tokens, offers)
            quotes[i] = Quote(self.stats[i], self._allowed(d, rows, room), offers=offers)
        if guard is not None and not self.fixed and A < guard.min_rows and self.on_demand and not offered \
                and not guard.priced(A) \
                and ProbeSchedule.wait_all([self.stats[i].probes for i in self.on_demand], 1.0 / A):
            # nothing known on offer and the cost model declined the on-demand sources lately:
            # unpriced, as a batch's band would be (BatchGuard.priced), unless one of them is due
            # for a probe (ProbeSchedule.wait_all: the step is then priced, and the probe made).
            # (Decided before the on-demand sources are quoted: most steps of a declined source)
            return self._sit_out(plan, "cost")
        for i in self.on_demand:
            d = self.drafters[i]
            quotes[i] = Quote(self.stats[i], self._allowed(d, rows, room), lags=d.lags(tokens),
                              every_row=not d.partial_rows)
        choice = self.policy.choose(quotes, step, room, fixed=self.fixed)
        plan.k, plan.probe, plan.reason = choice.k, choice.probe, choice.reason
        # a row's node budget, within the cache slots it has left (`space`, default: its room); a
        # chain is cut to its room too, a tree's paths to it at verification; k_max, or a long
        # known chain's cap (Drafter.long_chains) beyond the slots every row keeps free, within
        # every row's space (the step pads each row's forward to its longest)
        space = space or room
        batch_space = max(self.slots, min(space, default=0))
        caps = [max(0, min(choice.k, r.spec_k if r.spec_k is not None else self._most(s), free, batch_space))
                if left > 0 else 0 for r, s, left, free in zip(rows, choice.source, room, space)]
        plan.source = [s if c > 0 else None for s, c in zip(choice.source, caps)]
        plan.guesses, plan.parents, plan.probs = [[] for _ in range(A)], [None] * A, [None] * A
        for b, s in enumerate(plan.source):
            if s is not None and self.drafters[s].known:
                self._take_offer(plan, b, quotes[s].offers[b], caps[b], room[b], quotes[s].stats.odds)
        for i in self.on_demand:
            want = [s == i for s in plan.source]
            if any(want):
                self._draft(plan, i, rows, want, caps, quotes)
            elif self.drafters[i].may_skip:
                self.drafters[i].skip()
        if not any(plan.guesses):
            return self._plain(plan, plan.reason or "cost")
        return plan

    @staticmethod
    def _allowed(d: Drafter, rows, room: list[int]) -> list[bool]:
        """The rows that may take source d's guesses: room left, speculation not off for the
        request, and d among the sources it allows."""
        return [left > 0 and r.spec_k != 0 and (r.sources is None or d.label in r.sources)
                for r, left in zip(rows, room)]

    @staticmethod
    def _legal(rows, offers: list) -> list:
        """Known offers without the guesses their row's grammar forbids: a chain cut before its
        first such token, a tree without the nodes whose path holds one (verification would refuse
        them and everything under them), so offers are priced and verified as far as they can
        hold; a lookup that copies the schema from the prompt offers nothing."""
        out = []
        for r, offer in zip(rows, offers):
            constraint = getattr(r, "constraint", None)
            if offer is None or constraint is None or not offer.tokens:
                out.append(offer)
                continue
            if offer.parents is None:
                n = constraint.accepts(offer.tokens)
                out.append(offer if n == len(offer.tokens) else replace(offer, tokens=list(offer.tokens[:n])) if n else None)
                continue
            paths: dict[int, list[int]] = {0: []}  # kept node (1-based, 0: the root) -> its path
            new_index, toks, pars, scores = {0: 0}, [], [], []
            for j, (token, parent) in enumerate(zip(offer.tokens, offer.parents), start=1):
                if parent not in paths:
                    continue
                path = paths[parent] + [token]
                if constraint.accepts(path) < len(path):
                    continue
                paths[j], new_index[j] = path, len(toks) + 1
                toks.append(token)
                pars.append(new_index[parent])
                if offer.scores is not None:
                    scores.append(offer.scores[j - 1])
            out.append(offer if len(toks) == len(offer.tokens) else
                       replace(offer, tokens=toks, parents=pars, scores=scores if offer.scores is not None else None)
                       if toks else None)
        return out

    def _most(self, source: int | None) -> int:
        """The most guesses a row verifying `source` may take in one step."""
        return self.policy.long_max if source is not None and self.drafters[source].long_chains else self.k_max

    def _sit_out(self, plan: Plan, reason: str) -> Plan:
        """A plain step decided before any source was priced: the on-demand sources skip it."""
        for i in self.on_demand:
            if self.drafters[i].may_skip:
                self.drafters[i].skip()
        return self._plain(plan, reason)

    def _plain(self, plan: Plan, reason: str) -> Plan:
        plan.k, plan.reason = 0, reason
        plan.source = [None] * plan.A
        plan.guesses, plan.parents, plan.probs = [[] for _ in range(plan.A)], [None] * plan.A, [None] * plan.A
        return plan

    def _remember(self, i: int, tokens: list[list[int]], offers) -> None:
        """Score source i's open offers against the text that followed them, then keep this
        step's offers open (`policy.Hindsight`)."""
        stats, rows = self.stats[i], self.hindsight[i]
        for b, (text, offer) in enumerate(zip(tokens, offers)):
            if rows[b].open:
                rows[b].score(text, stats.acceptance, stats.odds)
            if offer is not None and offer.tokens:
                rows[b].add(len(text), offer.key, list(offer.tokens), offer.parents, offer.scores)

    @staticmethod
    def _take_offer(plan: Plan, b: int, offer, cap: int, room: int, odds) -> None:
        """Row b verifies a known offer, cut to its cap (a chain to its room too, a tree to its
        best `cap` nodes: by the chance that their paths hold under the source's learnt `odds`,
        the policy's own valuation, where the tree is scored)."""
        if offer is None:
            return
        if offer.parents is None:
            plan.guesses[b] = list(offer.tokens[:min(cap, room)])
            return
        toks, pars = list(offer.tokens), list(offer.parents)
        values = odds.tree_values(offer.scores, pars) if offer.scores else [1.0 / (j + 1) for j in range(len(toks))]
        toks, pars, _ = tree_mod.best_nodes(toks, pars, values, cap)
        plan.guesses[b], plan.parents[b] = toks, pars

    def _draft(self, plan: Plan, i: int, rows, want: list[bool], caps: list[int], quotes) -> None:
        """On-demand source i drafts for the rows that took it; its time is priced (steady) or
        counted as a catch-up."""
        d, stats, A = self.drafters[i], self.stats[i], plan.A
        n = sum(want)
        params, generator = self._guess_params(rows)
        drafting = n if d.partial_rows else A
        ctx = DraftContext([r.context for r in rows], params, generator, self._hand_over(i, rows), room=plan.room,
                           want=want, draft_cost=self.policy.draft_steps(stats, drafting, A),
                           guess_cost=self.policy.guess_steps(A))
        behind = max((lag for lag, w in zip(quotes[i].lags or [0] * A, want) if w), default=0)
        t0 = time.perf_counter()
        # a tree's node budget, or a chain's length (within its row's room)
        draft = d.propose(ctx, max(c if d.max_nodes else min(c, left) for c, left, w in zip(caps, plan.room, want) if w))
        seconds, steady = time.perf_counter() - t0, True
        timing = d.draft_timing()
        if timing is not None:
            seconds, steady = timing
        plan.t_draft += seconds
        plan.steady = plan.steady and steady
        plan.drafted[i] = draft
        width = draft.tokens.shape[1]
        if width:
            self.policy.observe_drafting(stats, drafting, seconds, 1 if d.max_nodes else width, steady, behind)
        sizes = []
        for b in range(A):
            if not want[b]:
                continue
            count = min(int(draft.counts[b]), caps[b]) if b < draft.counts.shape[0] else 0
            if draft.parents is None:
                count = min(count, plan.room[b])
            toks = draft.tokens[b, :count].tolist()
            if draft.probs is not None:  # guesses drawn from q (a chain's, or each tree node's)
                plan.probs[b] = draft.probs[b, :count]
            if draft.parents is None:
                plan.guesses[b] = toks
                continue
            pars = draft.parents[b, :count].tolist()
            sizes.append(len(toks))
            known = self._known_chain(quotes, b)
            if known and draft.probs is None:  # a row's known chain on its tree: whichever holds longer
                toks, pars = tree_mod.graft(toks, pars, known[: caps[b]], max(self.slots, caps[b]))
                toks, pars = toks[: caps[b]], pars[: caps[b]]
            plan.guesses[b], plan.parents[b] = toks, pars
        if d.max_nodes:
            self.policy.observe_nodes(stats, sizes)

    def _known_chain(self, quotes, b: int) -> list[int]:
        """Row b's longest known chain offer (grafted onto a drafted tree)."""
        best: list[int] = []
        for i in self.known:
            offer = quotes[i].offers[b] if quotes[i].ok[b] else None
            if offer is not None and offer.parents is None and len(offer.tokens) > len(best):
                best = list(offer.tokens)
        return best

    def _hand_over(self, i: int, rows) -> list | None:
        """Each row's target features that source i has not been handed (each goes once)."""
        if i not in self.hidden:
            return None
        out = []
        for r in rows:
            feats = r.feats.get(i, [])
            out.append((feats[0] if len(feats) == 1 else torch.cat(feats)) if feats else None)
            r.feats[i] = []
        return out

    def keep_features(self, row, hidden: torch.Tensor) -> None:
        """Row `row`'s new committed positions' target features, for every source that reads them."""
        for i in self.hidden:
            row.feats.setdefault(i, []).append(hidden)

    def _guess_params(self, rows) -> tuple[SamplingParams, torch.Generator | None]:
        """The settings a source guesses with: `generate`'s shared ones for its sampled rows (guesses
        drawn from q hold more often), else greedily (one-hot q: the server, greedy rows). A seeded
        sampled row draws from q only where nothing measured shapes its guesses (a fixed k, no known
        source beside it): its text must not depend on timing, and deterministic guesses make sure it
        does not (verify.py, "sample and compare")."""
        shared = self.shared
        fixed = self.fixed and not self.known
        if shared is not None and not shared.greedy and (fixed or not timing_free(shared)):
            return shared, rows[0].generator
        return _GREEDY, None

    def commit(self, plan: Plan, paths: list[list[int]], reached: list[int],
               odds: list[list[float] | None] | None = None) -> None:
        """Tell each on-demand source that drafted what its rows kept (`paths`: per row the
        accepted nodes; `reached`: how deep its proposal went), and the cost model what held
        (with `odds`, a sampled row's chance of each guess holding: `step.held_odds`)."""
        accepted = [len(p) for p in paths]
        for i, draft in plan.drafted.items():
            mine = [s == i for s in plan.source]
            tree = draft.parents is not None
            self.drafters[i].commit([a if m else 0 for a, m in zip(accepted, mine)],
                                    paths=[p if m else [] for p, m in zip(paths, mine)] if tree else None)
            self.policy.observe_outcome(self.stats[i], [r if m else 0 for r, m in zip(reached, mine)],
                                        [a if m else 0 for a, m in zip(accepted, mine)],
                                        odds=[o if m else None for o, m in zip(odds, mine)] if odds else None,
                                        parents=plan.parents if tree else None)

    def learned(self) -> dict:
        out = {}
        for d in self.drafters:
            state = d.learned()
            if state:
                out[d.label] = state
        return out

    def relearn(self, state: dict) -> None:
        for d in self.drafters:
            if state.get(d.label):
                d.relearn(state[d.label])
