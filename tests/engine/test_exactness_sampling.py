"""Sampling exactness, end to end (docs/design.md "Why the output is exact").

A tiny random target (vocabulary 16) and two fixed contexts of different lengths, batched
together (ragged rows). The exact distribution of the first three generated tokens,
P(x1, x2, x3) = p(x1|c) p(x2|c,x1) p(x3|c,x1,x2) after temperature / top-k / top-p, is
enumerated with transformers' forward and transformers' own logits warpers (not specdec).
The engine then samples thousands of continuations with each drafter and a chi-square
test (family-wise alpha = 1e-3 per setting, Bonferroni-split over its checks; small cells
pooled) compares the empirical distribution with the exact one.

Which tokens speculation decides: x1 comes from the prefill (the target samples it
directly). With max_new_tokens = 4 and k >= 2 the first decode step drafts two tokens, so
x2 and x3 are decided by verification at chain depths 1 and 2; with max_new_tokens = 3 the
step drafts one token, so x2 is decided at depth 1 and x3 is the bonus token after a full
accept. The tests assert that drafts were proposed, accepted and rejected at those depths.
A broken engine (recovered token sampled from p instead of the residual) must be rejected
by the same check.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import specdec.core.step
import specdec.engine
from specdec.drafters.base import DraftContext
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.engine import Engine
from specdec.types import SamplingParams

from oracle import (
    ConfidentlyWrongDrafter,
    RandomGuessDrafter,
    TreeDrafter,
    UniformDrafter,
    broken_verify_stochastic,
    chi2_test,
    exact_joint,
    histogram,
    native_of,
    tiny_hf_llama,
)

ALPHA = 1e-3  # family-wise per setting: split (Bonferroni) over its 2 contexts x 3 views
V = 16
N_CHECK = 3  # tokens whose joint distribution is checked
ROWS = 1000  # rows per generate call (half per context)
CALLS = 6  # generate calls (seeds) per setting -> 3000 samples per context


pytestmark = pytest.mark.usefixtures("one_thread_per_module")


@functools.lru_cache(maxsize=None)
def models():
    target_hf = tiny_hf_llama(3, vocab=V, logit_scale=1.5)
    draft_hf = tiny_hf_llama(4, vocab=V, layers=1, logit_scale=1.5)
    return target_hf, native_of(target_hf), native_of(draft_hf)


@functools.lru_cache(maxsize=None)
def contexts() -> tuple[tuple[int, ...], ...]:
    # every vocabulary token occurs in each context, so prompt lookup always has a match
    g = torch.Generator().manual_seed(1)
    a = torch.randperm(V, generator=g).tolist() + torch.randint(0, V, (6,), generator=g).tolist()
    b = torch.randperm(V, generator=g).tolist() + torch.randint(0, V, (3,), generator=g).tolist()
    return tuple(a), tuple(b)


@functools.lru_cache(maxsize=None)
def exact(ctx: tuple[int, ...], temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    return exact_joint(models()[0], list(ctx), N_CHECK, temperature, top_k, top_p)


def make_drafter(name: str, temperature: float, top_k: int, top_p: float):
    target_hf, target, draft = models()
    return {
        # fixed lengths: the adaptive rule would learn to stop guessing on a random model
        "ngram": lambda: NgramDrafter(),
        "draft_model": lambda: DraftModelDrafter(draft),
        "draft_self": lambda: DraftModelDrafter(target),
        # rows stop guessing after a doubtful token (the draft's own probability < 0.1):
        # different lengths per row and step, chosen from the draft's random numbers
        "draft_confident": lambda: DraftModelDrafter(draft, confidence=0.1),
        # q = the target's p restricted to even ids and renormalised: the residual lives
        # on the odd ids only
        "draft_self_subset": lambda: DraftModelDrafter(target, vocab_subset=list(range(0, V, 2))),
        "uniform": lambda: UniformDrafter(V),
        "confidently_wrong": lambda: ConfidentlyWrongDrafter(target_hf, temperature, top_k, top_p),
        "random_guesses": lambda: RandomGuessDrafter(V, seed=5, mode="random"),
        # lookup rows carry one-hot q, draft rows the draft's q, mixed within a batch
        "hybrid": lambda: [NgramDrafter(2, 3), DraftModelDrafter(draft, lazy=True)],
    }[name]()


def sample(drafter, params: dict, k: int, max_new: int, seed0: int, rows: int = ROWS, calls: int = CALLS):
    """Per context: samples [N, N_CHECK]; plus the summed stats of all rows."""
    _, target, _ = models()
    ctxs = contexts()
    prompts = [list(ctxs[i % 2]) for i in range(rows)]
    out = {c: [] for c in ctxs}
    stats = dict(proposed=0, accepted=0, rows_with_drafts=0, proposed_by_pos=[0] * k, accepted_by_pos=[0] * k)
    for s in range(calls):
        # (a fixed k: every step drafts, a draft model from its q)
        engine = Engine(target, drafter, k=k, fixed_k=True)
        res = engine.generate(prompts, SamplingParams(max_new_tokens=max_new, seed=seed0 + s, **params))
        for p, r in zip(prompts, res):
            assert len(r.tokens) == max_new and r.stats.finish_reason == "length"
            out[tuple(p)].append(r.tokens[:N_CHECK])
            stats["proposed"] += r.stats.proposed
            stats["accepted"] += r.stats.accepted
            stats["rows_with_drafts"] += r.stats.proposed > 0
            for name in ("proposed_by_pos", "accepted_by_pos"):
                for i, n in enumerate(getattr(r.stats, name)):
                    stats[name][i] += n
    return {c: torch.tensor(v) for c, v in out.items()}, stats


def check(samples, params: dict):
    """Chi-square per context on three views of the same samples: the joint of (x1, x2),
    the joint of (x2, x3) (x1 summed out) and the full joint of (x1, x2, x3). The 2-token
    views have fewer, fuller cells and so more power; the 3-token view misses nothing."""
    results = []
    alpha = ALPHA / (3 * len(samples))
    for i, (ctx, s) in enumerate(samples.items()):
        joint = exact(ctx, params["temperature"], params.get("top_k", 0), params.get("top_p", 1.0))  # [V, V, V]
        views = [
            ("x1,x2", s[:, :2], joint.sum(2)),
            ("x2,x3", s[:, 1:], joint.sum(0)),
            ("x1,x2,x3", s, joint),
        ]
        for label, obs, probs in views:
            res = chi2_test(histogram(obs, tuple(probs.shape)), probs, alpha)
            results.append((f"context {i} ({label})", res))
    return results


# name, drafter, warping, k, max_new_tokens
SETTINGS = [
    ("ngram-t0.7-depth2", "ngram", dict(temperature=0.7), 2, 4),
    ("ngram-t1.0-topk5-bonus", "ngram", dict(temperature=1.0, top_k=5), 4, 3),
    ("draft-t1.0-topp0.8-depth2", "draft_model", dict(temperature=1.0, top_p=0.8), 2, 4),
    ("draft-t0.7-topk8-topp0.9-bonus", "draft_model", dict(temperature=0.7, top_k=8, top_p=0.9), 1, 3),
    ("draft-self-t1.0-bonus", "draft_self", dict(temperature=1.0), 1, 3),
    ("draft-confident-t1.0-topk12-depth2", "draft_confident", dict(temperature=1.0, top_k=12), 2, 4),
    ("draft-self-subset-t0.8-topk10-depth2", "draft_self_subset", dict(temperature=0.8, top_k=10), 2, 4),
    ("uniform-t1.0-topk6-depth2", "uniform", dict(temperature=1.0, top_k=6), 2, 4),
    ("uniform-t0.7-bonus", "uniform", dict(temperature=0.7), 1, 3),
    ("confwrong-t0.7-topp0.9-depth2", "confidently_wrong", dict(temperature=0.7, top_p=0.9), 2, 4),
    ("confwrong-t1.0-bonus", "confidently_wrong", dict(temperature=1.0), 1, 3),
    ("randguess-t1.0-depth2", "random_guesses", dict(temperature=1.0), 3, 4),
    ("hybrid-t0.8-topp0.9-depth2", "hybrid", dict(temperature=0.8, top_p=0.9), 2, 4),
]


@pytest.mark.parametrize("name,drafter_name,params,k,max_new", SETTINGS, ids=[s[0] for s in SETTINGS])
def test_speculative_sampling_matches_exact_distribution(name, drafter_name, params, k, max_new):
    drafter = make_drafter(drafter_name, params["temperature"], params.get("top_k", 0), params.get("top_p", 1.0))
    seed0 = 1000 * (1 + [s[0] for s in SETTINGS].index(name))
    samples, st = sample(drafter, params, k, max_new, seed0)

    # speculation really decided the checked tokens
    n_rows = ROWS * CALLS
    assert st["proposed"] > 0
    min_share = 0.5 if drafter_name == "random_guesses" else 0.95  # random counts may be 0
    assert st["rows_with_drafts"] >= min_share * n_rows, st
    depth = min(k, max_new - 2)  # drafts per row in the first decode step
    assert st["proposed_by_pos"][depth - 1] > 0.2 * n_rows, st  # drafts reached the deepest checked position
    assert st["accepted"] > 0
    if drafter_name == "draft_self":
        assert st["accepted"] == st["proposed"]  # q == p: always accepted, x3 is the bonus
    else:
        assert st["accepted"] < st["proposed"]  # rejections happened: recovered tokens used
    if depth > 1 and drafter_name != "draft_self":
        assert st["accepted_by_pos"][1] > 0  # verification at depth 2 accepted some drafts
    if drafter_name == "draft_confident":  # some rows stopped after their first guess, others went on
        assert 0.2 * st["proposed_by_pos"][0] < st["proposed_by_pos"][1] < 0.8 * st["proposed_by_pos"][0], st

    for label, res in check(samples, params):
        assert not res.rejected, f"{name}, {label}: speculative samples differ from the exact distribution: {res}"


BROKEN_SETTINGS = [
    "uniform-t0.7-bonus",
    "draft-confident-t1.0-topk12-depth2",
    "uniform-t1.0-topk6-depth2",
    "draft-t1.0-topp0.8-depth2",
    "confwrong-t0.7-topp0.9-depth2",
    "ngram-t1.0-topk5-bonus",
]


@pytest.mark.parametrize("name", BROKEN_SETTINGS)
def test_broken_engine_is_caught(monkeypatch, name):
    """The same check must reject an engine whose rejection step samples p, not the residual.
    (Not with random deterministic guesses: averaged over a uniformly random guess x that
    mistake happens to be unbiased, p(x) 1[y=x] + (1 - p(x)) p(y) averaging to p(y).)"""
    _, drafter_name, params, k, max_new = next(s for s in SETTINGS if s[0] == name)
    monkeypatch.setattr(specdec.core.step, "verify_stochastic", broken_verify_stochastic)
    drafter = make_drafter(drafter_name, params["temperature"], params.get("top_k", 0), params.get("top_p", 1.0))
    samples, st = sample(drafter, params, k, max_new, seed0=77, calls=4 if drafter_name == "ngram" else 3)
    assert st["proposed"] > 0 and st["accepted"] < st["proposed"]
    results = check(samples, params)
    report = [f"{lb}: {r}" for lb, r in results]
    assert any(r.rejected for _, r in results), f"the broken engine passed: {report}"


@pytest.mark.parametrize("drafter_name", ["ngram", "draft_model", "uniform"])
def test_same_seed_same_output(drafter_name):
    params = dict(temperature=0.8, top_k=10, top_p=0.95)
    _, target, _ = models()
    prompts = [list(c) for c in contexts()] * 3

    def run(seed):
        d = make_drafter(drafter_name, 0.8, 10, 0.95)
        res = Engine(target, d, k=3).generate(prompts, SamplingParams(max_new_tokens=12, seed=seed, **params))
        return [r.tokens for r in res]

    a, b, c = run(11), run(11), run(12)
    assert a == b
    assert a != c


@pytest.mark.parametrize(
    "drafter_name",
    [
        "draft_model",
        "draft_self_subset",
    ],
)
def test_draft_probs_carry_no_autograd_graph(drafter_name):
    """Draft probabilities are plain data: no autograd graph built on every draft step."""
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=0)
    d = make_drafter(drafter_name, 1.0, 0, 1.0)
    ctx = [list(c) for c in contexts()]
    d.begin(ctx, params, 64)
    draft = d.propose(DraftContext(ctx, params, torch.Generator().manual_seed(0)), 2)
    assert draft.probs is not None
    assert not draft.probs.requires_grad


@pytest.mark.parametrize("drafter_name", ["ngram_adaptive", "hybrid_adaptive", "draft_adaptive"])
def test_same_seed_same_sample_whatever_the_timing(monkeypatch, drafter_name):
    """Priced drafting chooses lengths (and whether the draft model runs) from measured times;
    with a seed, a sampled request must not depend on them, or the same seed would give another
    sample. The cost model's choices are replaced by noise here, differently in each run (a
    draft model that drew its guesses from q for seeded rows would fail this)."""
    import random

    from specdec.policy import Choice, LoadPolicy

    _, target, draft = models()
    noise = random.Random(0)
    monkeypatch.setattr(LoadPolicy, "guess_steps", lambda self, rows: noise.uniform(0.0, 2.0))

    def noisy(self, quotes, step, room, fixed=False):
        pick = [noise.choice([None] + [i for i, q in enumerate(quotes) if q.ok[b]]) for b in range(len(room))]
        return Choice(noise.randint(0, self.k_max), pick)

    monkeypatch.setattr(LoadPolicy, "choose", noisy)
    prompts = [list(c) for c in contexts()] * 2
    params = SamplingParams(max_new_tokens=20, seed=11, temperature=0.9, top_p=0.95)

    def run():
        d = {"ngram_adaptive": NgramDrafter, "draft_adaptive": lambda: DraftModelDrafter(draft),
             "hybrid_adaptive": lambda: [NgramDrafter(2, 3), DraftModelDrafter(draft, lazy=True)]}[drafter_name]()
        res = Engine(target, d, k=4).generate(prompts, params)
        assert sum(r.stats.proposed for r in res) > 0
        return [r.tokens for r in res]

    first = run()
    assert all(run() == first for _ in range(2))
    # and the draws still depend on the seed
    other = Engine(target, NgramDrafter(), k=4).generate(prompts, dataclasses.replace(params, seed=12))
    assert [r.tokens for r in other] != first


@pytest.mark.parametrize("drafter_name", ["ngram", "ngram_adaptive", "random_guesses", "tree_topk", "tree_corrupt",
                                         "draft_priced", "hybrid_priced"])
@pytest.mark.parametrize("params", [dict(temperature=0.7), dict(temperature=1.0, top_k=5, top_p=0.9)])
def test_deterministic_guesses_commit_plain_samplings_text(monkeypatch, drafter_name, params):
    """With deterministic guesses, seeded speculative sampling commits exactly the text plain
    sampling draws with that seed (verify.py, "sample and compare"), row by row, whatever was
    guessed and however many guesses held; and a prompt's text does not depend on the rows
    after it in its batch."""
    _, target, _ = models()
    prompts = [list(c) for c in contexts()] * 3
    sp = SamplingParams(max_new_tokens=24, seed=21, **params)
    want = [r.tokens for r in Engine(target).generate(prompts, sp)]
    assert len({tuple(t) for t in want}) > 2  # rows draw different numbers
    if drafter_name == "ngram_adaptive":
        d = NgramDrafter()
    elif drafter_name.endswith("_priced"):  # a seeded row's draft-model guesses are its argmax
        from specdec.policy import Choice, LoadPolicy

        # (the cost model lets every row take the draft model: these answers are short)
        monkeypatch.setattr(LoadPolicy, "choose", lambda self, quotes, step, room, fixed=False: Choice(
            self.k_max, [len(quotes) - 1 if quotes[-1].ok[b] else None for b in range(len(room))]))
        d = DraftModelDrafter(models()[2], lazy=drafter_name == "hybrid_priced")
        d = [NgramDrafter(2, 3), d] if drafter_name == "hybrid_priced" else d
    elif drafter_name.startswith("tree_"):  # deterministic trees (probs None), of the target's top tokens
        warp_args = (params["temperature"], params.get("top_k", 0), params.get("top_p", 1.0))
        d = TreeDrafter(models()[0], (2, 2), mode=drafter_name[5:], warp_args=warp_args)
    else:
        d = make_drafter(drafter_name, params["temperature"], params.get("top_k", 0), params.get("top_p", 1.0))
    engine = Engine(target, d, k=4)
    if drafter_name.startswith("ngram"):
        # a fresh batch of this many rows prices a guess slot at a row's whole share of the step
        # until it has timed steps: timed steps with cheap guesses, so lookups are verified here
        from helpers import fitted

        fitted(engine.policy, rows=len(prompts), per_guess=0.01)
    res = engine.generate(prompts, sp)
    assert [r.tokens for r in res] == want
    assert sum(r.stats.accepted for r in res) > 0 and sum(r.stats.proposed for r in res) > sum(r.stats.accepted for r in res)
    assert [r.tokens for r in Engine(target).generate(prompts[:1], sp)] == want[:1]


def test_one_uniform_reused_across_positions_is_caught(monkeypatch):
    """Sample and compare needs its own uniform per text position: a verification that reuses one
    uniform for every position of a step couples the tokens it commits, and the chi-square check
    must reject it."""
    import specdec.verify

    real = specdec.verify.position_uniforms
    monkeypatch.setattr(specdec.verify, "position_uniforms", lambda gen, rows, positions: real(gen, rows, [0] * len(positions)))
    name = "ngram-t0.7-depth2"
    _, drafter_name, params, k, max_new = next(s for s in SETTINGS if s[0] == name)
    samples, st = sample(make_drafter(drafter_name, 0.7, 0, 1.0), params, k, max_new, seed0=91, calls=3)
    assert st["accepted"] > 0
    results = check(samples, params)
    assert any(r.rejected for _, r in results), [f"{lb}: {r}" for lb, r in results]


def test_unseeded_rows_carry_the_draft_models_q_and_lookup_rows_one_hot(monkeypatch):
    """Auto with a draft model in `generate`, unseeded sampling: rows that take the draft model's
    guesses carry its q (drawn from it, so more of them hold), rows that take their lookup a
    one-hot q at their guesses, in the one draft the step verifies (Algorithm 1 for both); and
    the rows still decode to the end."""
    import specdec.core.scheduler as scheduler

    _, target, draft = models()
    seen = []
    run_step = scheduler.run_step

    def spy(model, cache, pending, d, *args, **kwargs):
        seen.append(d)
        return run_step(model, cache, pending, d, *args, **kwargs)

    monkeypatch.setattr(scheduler, "run_step", spy)
    from specdec.policy import Choice, LoadPolicy

    # (the cost model's choice, made here: even rows take the draft model, odd ones their lookup)
    monkeypatch.setattr(LoadPolicy, "choose", lambda self, quotes, step, room, fixed=False: Choice(
        self.k_max, [1 if b % 2 == 0 else 0 for b in range(len(room))]))
    prompts = [list(c) for c in contexts()] * 2
    params = SamplingParams(max_new_tokens=16, temperature=0.9)
    # (unigram lookup: every token occurs in each context, so a lookup row always has guesses;
    # bigrams of sampled text rarely recur there, and a step could carry none)
    res = Engine(target, [NgramDrafter(1, 3), DraftModelDrafter(draft, lazy=True)], k=3).generate(prompts, params)
    assert all(len(r.tokens) == 16 for r in res)
    rows = {"draft": 0, "lookup": 0}
    for d in seen:
        if d.tokens.shape[1] == 0 or d.probs is None:  # (no row took the draft model: one-hot q throughout)
            continue
        assert d.probs.shape[:2] == d.tokens.shape
        for b in range(d.tokens.shape[0]):
            n = int(d.counts[b])
            q = d.probs[b, :n]
            at = q.gather(1, d.tokens[b, :n, None])[:, 0]
            if n and bool((at == 1.0).all()) and bool((q.sum(-1) == 1.0).all()):
                rows["lookup"] += 1  # (a draft row whose q put all its mass on its guesses would count here)
            elif n:
                assert bool((at > 0).all()) and torch.allclose(q.sum(-1), torch.ones(n)), "a draft row's q"
                rows["draft"] += 1
    assert rows["draft"] > 0 and rows["lookup"] > 0, rows


@pytest.mark.parametrize("source", ["draft_model", "tree"])
@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_the_cost_model_learns_a_sampled_rows_acceptance_from_the_targets_odds(monkeypatch, temperature, source):
    """Seeded sampling under the cost model (one-hot guesses): each step that verified an on-demand
    source's guesses (a draft model's chain; a tree of the draft's top tokens, cut to the step's
    cap) hands the cost model, per row, the target's probability of every guess at its parent's
    position in the tree the step verified (softmax(logits / T) of the step's own forward,
    computed here), the chance that sample and compare accepts it, and that tree's parents;
    greedy rows hand none (their outcome is exact)."""
    import specdec.core.scheduler as scheduler
    from specdec.policy import Choice, LoadPolicy

    target_hf, target, draft = models()
    steps, handed = [], []
    run_step = scheduler.run_step

    def spy(model, cache, pending, d, *args, **kwargs):
        res = run_step(model, cache, pending, d, *args, **kwargs)
        steps.append((d, res))
        return res

    observe = LoadPolicy.observe_outcome

    def spy_outcome(self, stats, reached, accepted, odds=None, parents=None):
        handed.append((len(steps), reached, odds, parents))
        return observe(self, stats, reached, accepted, odds=odds, parents=parents)

    monkeypatch.setattr(scheduler, "run_step", spy)
    monkeypatch.setattr(LoadPolicy, "observe_outcome", spy_outcome)
    # (the cost model's choice made here: every row drafts, under a cap of 3)
    monkeypatch.setattr(LoadPolicy, "choose", lambda self, quotes, step, room, fixed=False: Choice(3, [0] * len(room)))
    drafter = DraftModelDrafter(draft) if source == "draft_model" else TreeDrafter(target_hf, (2, 2), mode="topk")
    params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=3)
    Engine(target, drafter, k=3).generate([list(c) for c in contexts()], params)
    checked = 0
    for at, reached, odds, parents in handed:
        d, res = steps[at - 1]
        if temperature == 0.0:
            assert odds is None
            continue
        assert d.probs is None  # (one-hot guesses: a seeded row under the cost model)
        for b, depth in enumerate(reached):
            if not depth:
                continue
            n = int(d.counts[b])
            at_parent = d.parents[b, :n] if d.parents is not None else torch.arange(n)
            p = torch.softmax(res.logits[b].double() / temperature, dim=-1)
            want = p[at_parent, d.tokens[b, :n]]
            assert odds[b] == pytest.approx(want.tolist(), rel=1e-4, abs=1e-6)
            if d.parents is not None:
                assert parents[b] == d.parents[b, :n].tolist()
            checked += 1
    assert checked >= 4 if temperature else handed
