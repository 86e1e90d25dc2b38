"""What the tests share: tiny random targets with EAGLE and Medusa heads on disk, the draft
sources built over them as the method table builds them, and ways to run requests through the
scheduler (rows joining and leaving) on a clock that does not depend on the machine's load.
Oracles (transformers' greedy decoding, exact probabilities) live in oracle.py."""

from __future__ import annotations

import functools
import itertools
import tempfile
import threading
from pathlib import Path

import torch

from oracle import tiny_hf_llama

V = 32  # the tiny targets' vocabulary
SV = 12  # the vocabulary of the sampling tests' targets: small enough to enumerate 3 tokens exactly
# the sampling tests' two contexts (their continuations are checked by chi-square)
CTX = (tuple(range(SV)) + (3, 1, 4), tuple(reversed(range(SV))) + (5,))

# the tiny models and heads below live here; removed when the test process exits
_TMP = tempfile.TemporaryDirectory(prefix="specdec-tests-")


@functools.lru_cache(maxsize=None)
def target_dir(seed: int, vocab: int = V):
    d = Path(tempfile.mkdtemp(prefix=f"target{seed}-", dir=_TMP.name))
    tiny_hf_llama(seed, vocab=vocab, logit_scale=1.5).save_pretrained(str(d))
    return d


@functools.lru_cache(maxsize=None)
def target(seed: int = 0, vocab: int = V):
    from specdec.models.loader import load_model

    return load_model(str(target_dir(seed, vocab)), quiet=True, with_tokenizer=False)


@functools.lru_cache(maxsize=None)
def head_dir(seed: int = 0, vocab: int = V, noise: float = 0.05):
    """An EAGLE head for target(seed, vocab): its initialisation, perturbed (quality does not
    matter for exactness)."""
    from specdec.drafters.eagle import save_eagle, target_fingerprint
    from specdec.train.eagle import init_head

    tg = target(seed, vocab)
    head = init_head(tg)
    g = torch.Generator().manual_seed(42)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    d = Path(tempfile.mkdtemp(prefix="head-", dir=_TMP.name))
    save_eagle(head, d, {"target": "tiny", "target_vocab_size": vocab, "target_fingerprint": target_fingerprint(tg.model),
                         "vocab_subset": None})
    return d


@functools.lru_cache(maxsize=None)
def heads_dir(seed: int = 0, vocab: int = V, noise: float = 0.3):
    """Three Medusa heads for target(seed, vocab), with a static tree of 8 nodes."""
    from specdec.drafters.eagle import target_fingerprint
    from specdec.drafters.medusa import MedusaHeads, choose_tree, save_medusa

    tg = target(seed, vocab)
    heads = MedusaHeads(tg.model.cfg.hidden_size, 3)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    d = Path(tempfile.mkdtemp(prefix="medusa-", dir=_TMP.name))
    acc = [[0.5, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.2, 0.1]]
    save_medusa(heads, d, {"target": "tiny", "target_vocab_size": vocab, "target_fingerprint": target_fingerprint(tg.model),
                           "vocab_subset": None, "accuracy": acc, "tree": [list(t) for t in choose_tree(acc, 8)]})
    return d


def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in (6, 11, 8)]


def eagle(tree: bool = True, seed: int = 0, vocab: int = V, depth: int = 5, width: int = 4, nodes: int = 24,
          trim: bool = True):
    """The EAGLE head of target(seed, vocab) as a source: a dynamic tree, or its chain."""
    from specdec.drafters.eagle import EagleDrafter, load_eagle

    head, meta = load_eagle(head_dir(seed, vocab), target(seed, vocab))
    return EagleDrafter(head, target(seed, vocab).model, meta.get("vocab_subset"), tree=tree, depth=depth,
                        width=width, nodes=nodes, trim=trim)


def medusa(seed: int = 0, vocab: int = V, tree: bool = True):
    from specdec.drafters.medusa import MedusaDrafter, load_medusa

    heads, meta = load_medusa(heads_dir(seed, vocab), target(seed, vocab))
    return MedusaDrafter(heads, target(seed, vocab).model, None, [tuple(x) for x in meta["tree"]] if tree else None)


def draft_model(seed: int = 1, vocab: int = V, lazy: bool = False, confidence: float = 0.0):
    """target(seed, vocab) as a draft model (the target itself when seed is the target's: every
    guess holds)."""
    from specdec.drafters.draft_model import DraftModelDrafter

    return DraftModelDrafter(target(seed, vocab).model, vocab_size=vocab, confidence=confidence, lazy=lazy)


def lookup(min_n: int = 1, max_n: int = 4):
    from specdec.drafters.ngram import NgramDrafter

    return NgramDrafter(min_n, max_n)


def auto(seed: int = 0, vocab: int = V, **kw):
    """auto's sources for target(seed, vocab): prompt lookup beside the EAGLE head's tree."""
    return [lookup(), eagle(True, seed, vocab, **kw)]


def auto_draft(seed: int = 0, draft_seed: int = 1, vocab: int = V):
    """auto with a draft model: prompt lookup beside the draft model (which reads a prompt lazily)."""
    return [lookup(), draft_model(draft_seed, vocab, lazy=True)]


def run_jobs(batcher, jobs, timeout: float = 120.0):
    """Submit (prompt, params) jobs at once (rows join and leave the batch as they finish);
    returns each job's tokens. A batcher without a worker thread is run here, until every job
    is done (every job queued before the first step: the rows join in a fixed order)."""
    from specdec.core.scheduler import Request

    out, done, reqs = [None] * len(jobs), threading.Semaphore(0), []
    for i, (prompt, params) in enumerate(jobs):
        def on_done(reason, stats, i=i):
            out[i] = reason
            done.release()

        r = Request(list(prompt), params, lambda new: None, on_done)
        reqs.append(r)
        batcher.submit(r)
    if batcher.thread is None:
        batcher.run(until=lambda: all(o is not None for o in out))
    for _ in jobs:
        assert done.acquire(timeout=timeout), "a request did not finish"
    assert all(o in ("eos", "length") for o in out), out
    return [r.tokens for r in reqs]


def steady_clock(monkeypatch):
    """time.perf_counter advancing 1 ms a call: every measured time, so every load-aware choice
    (cost model, batch guard), is the same on every run, however loaded the machine."""
    import time

    ticks = itertools.count()
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks) * 1e-3)


def free_sources(batcher) -> None:
    """Price the batcher's on-demand sources nearly free until they draft in use: timed alone, a
    tiny draft model costs about a tiny target's step, so on a busy machine the cost model may
    rightly never draft it, and a test of what drafting does would see none. Nor do they wait
    for the plain steps a fresh engine times first (policy.load.PLAIN_FIRST): short answers
    would be over first."""
    from specdec.policy import FIT_DECAY, DecayedLine
    from specdec.policy.load import PLAIN_FIRST

    batcher.policy._plain_timed = max(batcher.policy._plain_timed, PLAIN_FIRST)

    for stats in batcher.sources.stats:
        if not stats.known:
            stats.time = DecayedLine(FIT_DECAY)
            stats.time.observe(1, 1e-6)


def run_join_leave(b) -> tuple[list, list]:
    """5 requests of different lengths over the batcher's rows (they join and leave mid-run):
    (each answer, transformers' plain greedy answer for it). Closes the batcher."""
    from transformers import AutoModelForCausalLM

    from oracle import hf_greedy, one_thread
    from specdec.types import SamplingParams

    with one_thread():
        hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
        hf.generation_config.pad_token_id = 0
        ps = prompts() + [prompts()[0][:3], prompts()[1][2:]]
        lengths = [14, 9, 20, 6, 17]
        want = [hf_greedy(hf, p, n) for p, n in zip(ps, lengths)]
        try:
            got = run_jobs(b, [(p, SamplingParams(max_new_tokens=n)) for p, n in zip(ps, lengths)])
        finally:
            b.close()
    return got, want


def fitted(policy, rows: int = 1, plain: float = 1.0, per_guess: float = 0.1, repeats: int = 8) -> None:
    """Feed `policy` steps of `rows` rows at every cap, each `plain` seconds plus `per_guess` of
    that a guess slot: its step-time fit then prices a plain step at `plain` and a guess at r =
    per_guess plain steps."""
    for _ in range(repeats):
        for k in range(policy.k_max + 1):
            policy.observe_step(rows, k, plain * (1.0 + per_guess * k))


def method_sources(method: str, tg, **settings) -> list:
    """The sources specdec.methods' table builds for `method` on the loaded target `tg`, with the
    SpecConfig fields `settings` (draft=PATH, tree=False, tree_nodes=N, ...)."""
    from specdec.config import SpecConfig
    from specdec.methods import TABLE

    return TABLE[method].build(SpecConfig(method=method, **settings), tg, True)


def batcher(sources, seed: int = 0, vocab: int = V, k_max: int = 6, max_batch: int = 3, adaptive: bool = True,
            thread: bool = True, method: str = "", **kw):
    """A scheduler over target(seed, vocab) with these sources, as the server runs it."""
    from specdec.core.scheduler import ContinuousBatcher

    return ContinuousBatcher(target(seed, vocab).model, (), sources, method=method, k_max=k_max, max_batch=max_batch,
                             max_context=96, max_queue=2048, adaptive=adaptive, thread=thread, **kw)


def pinned_costs(monkeypatch, draft: float, guess: float) -> None:
    """Every cost model prices a proposal's drafting at `draft` plain steps and a verified guess
    at `guess`, whatever the machine's timing: what a source that cuts its guesses by their cost
    (an EAGLE tree) reads, made deterministic."""
    from specdec.policy import LoadPolicy

    monkeypatch.setattr(LoadPolicy, "draft_steps", lambda self, stats, drafting, rows: draft)
    monkeypatch.setattr(LoadPolicy, "guess_steps", lambda self, rows: guess)


def pinned_timing(monkeypatch, step: float = 0.01, per_guess: float = 0.001, draft: float = 0.003) -> None:
    """Every cost model learns these times instead of the measured ones: a step of A rows with k
    guess slots `step` * (1 + per_guess / step * A * k) seconds, a proposal `draft` seconds a unit
    (a guess, a tree), a catch-up `draft` / 10 a token read, and a source timed alone the same. Its
    choices then depend on what held, not on how loaded the machine is."""
    from specdec.drafters.base import Drafter
    from specdec.policy import LoadPolicy

    observe_step, observe_drafting = LoadPolicy.observe_step, LoadPolicy.observe_drafting
    monkeypatch.setattr(LoadPolicy, "observe_step",
                        lambda self, rows, k, seconds, drafted=None, settling=False: observe_step(
                            self, rows, k, step + per_guess * rows * k, drafted, settling))
    monkeypatch.setattr(LoadPolicy, "observe_drafting",
                        lambda self, stats, rows, seconds, units, steady, behind=0: observe_drafting(
                            self, stats, rows, draft * max(units, 1) + (draft / 10 * behind if not steady else 0.0),
                            units, steady, behind))
    classes, todo = [], [Drafter]
    while todo:  # every drafter class, subclasses of subclasses too
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    for cls in classes:
        if "time_alone" in vars(cls):
            monkeypatch.setattr(cls, "time_alone", lambda self: (draft, draft / 10))


def always_drafting(monkeypatch, policy) -> None:
    """`policy` drafts every step as at a fixed k (every row its best source), while still pricing
    nothing else differently: what a test of exactness under other choices (a guard, say) needs."""
    def choose(quotes, step, room, fixed=False):
        return policy._fixed(quotes, [policy._known_values(q) if q.stats.known else None for q in quotes], len(room))

    monkeypatch.setattr(policy, "choose", choose)
