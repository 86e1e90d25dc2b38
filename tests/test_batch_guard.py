"""The engine's BatchGuard: in batches it lets drafters propose only while speculative steps
commit more tokens per second than plain ones. Unit checks of its choices on synthetic
rates, and the engine with steps alternating between speculative and plain (drafters sit
steps out and catch up): greedy output still equals plain decoding (transformers' greedy as
the oracle), for every drafter that can sit steps out (prompt lookup, a draft model, lookup +
draft model, Medusa, the EAGLE tree, lookup + tree), and sampled batches still follow the
target's exact distribution. The server's batcher behind the same guard stays exact too."""

from __future__ import annotations

import pytest
import torch

from specdec.adaptive import BatchGuard
from specdec.drafters import REGISTRY
from specdec.engine import Engine
from specdec.types import SamplingParams

from oracle import hf_greedy
from test_eagle import V, drafter, prompts, target, target_dir

pytestmark = pytest.mark.real_guard


def test_single_rows_always_speculate():
    g = BatchGuard()
    assert all(g.speculate(1) for _ in range(50))
    assert g.decisions == {True: 0, False: 0}


def run(g: BatchGuard, rows: int, spec_rate: float, plain_rate: float, steps: int) -> list[bool]:
    out = []
    for _ in range(steps):
        s = g.speculate(rows)
        g.observe(rows, s, int(spec_rate if s else plain_rate), 1.0)
        out.append(s)
    return out


def test_guard_falls_back_to_plain_where_speculation_loses_and_returns_when_it_wins():
    g = BatchGuard(probe_every=16)
    first = run(g, 4, spec_rate=80, plain_rate=100, steps=64)
    assert first[:2] == [True, False]  # speculate first, then measure a plain step
    assert sum(first[16:]) <= 4  # afterwards plain, with a speculative probe every 16 steps
    assert any(first[16:])  # ... which keeps speculation measured
    # the text turns repetitive: speculation now commits more per second, and the probes see it
    later = run(g, 4, spec_rate=180, plain_rate=100, steps=64)
    assert sum(later[32:]) >= 30  # speculating again, with a plain probe every 16 steps
    assert not all(later[32:])


def test_bands_are_measured_apart():
    g = BatchGuard()
    run(g, 8, spec_rate=50, plain_rate=100, steps=40)  # a full batch: plain wins
    two = run(g, 2, spec_rate=150, plain_rate=100, steps=40)  # two rows: speculation wins
    assert sum(two[8:]) >= 28


class Alternate(BatchGuard):
    """Speculate on every other step (a stand-in for the measured choice)."""

    def speculate(self, rows: int) -> bool:
        self.n = getattr(self, "n", 0) + 1
        choice = rows < self.min_rows or self.n % 2 == 0
        self.decisions[choice] += 1
        return choice


def make(kind, kw):
    """A drafter for the tiny target: prompt lookup, a draft model (a second, differently seeded
    tiny model), lookup + draft model (auto-draft), Medusa heads, the EAGLE tree or lookup + tree."""
    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.drafters.hybrid import HybridDrafter
    from specdec.drafters.ngram import NgramDrafter

    if kind == "ngram":
        return NgramDrafter()
    if kind in ("draft", "hybrid"):
        d = DraftModelDrafter(target(1).model, vocab_size=V)
        return d if kind == "draft" else HybridDrafter(d, min_n=2, max_n=3, gate=False)
    if kind == "medusa":
        from test_medusa import heads_dir

        return REGISTRY["medusa"](target=target(), draft=heads_dir())
    return drafter(kind, **kw)


@pytest.mark.parametrize("kind,kw", [("ngram", {}), ("draft", {}), ("hybrid", {}), ("medusa", {}),
                                     (True, dict(depth=3, width=2, nodes=5)),
                                     ("lookup", dict(depth=3, width=2, nodes=5, min_lookup=1))])
def test_steps_alternating_plain_and_speculative_stay_exact(kind, kw):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
    ps = prompts()
    ps = [p + p[:5] for p in ps]  # some repetition, so prompt lookup finds matches
    want = [hf_greedy(hf, p, 16) for p in ps]
    d = make(kind, kw)
    eng = Engine(target().model, d, k=4)
    eng.guard = Alternate()
    res = eng.generate(ps, SamplingParams(max_new_tokens=16))
    assert [r.tokens for r in res] == want
    assert eng.guard.decisions[True] > 0 and eng.guard.decisions[False] > 0
    assert sum(r.stats.proposed for r in res) > 0


def test_guard_is_off_for_seeded_samples_of_sampled_guesses(monkeypatch):
    """A seeded sampled batch whose guesses are drawn from a q (an EAGLE chain) drafts on every
    step: timing must not decide its random numbers. With deterministic guesses (a tree) the
    seeded text does not depend on the drafting, and the guard is asked as for greedy batches."""
    calls = []
    monkeypatch.setattr(BatchGuard, "speculate", lambda self, rows: calls.append(rows) or False)
    seeded = SamplingParams(max_new_tokens=8, temperature=0.8, seed=3)
    chain = Engine(target().model, drafter(False), k=3)
    res = chain.generate(prompts(), seeded)
    assert calls == [] and sum(r.stats.proposed for r in res) > 0
    chain.generate(prompts(), SamplingParams(max_new_tokens=8))
    assert calls  # greedy: the guard is asked
    calls.clear()
    Engine(target().model, drafter(True, depth=3, width=2, nodes=5), k=3).generate(prompts(), seeded)
    assert calls


def test_server_batcher_with_steps_turned_plain_stays_exact():
    """The server's batcher behind the same guard: with steps alternately turned plain (rows
    joining and leaving), every answer still equals plain greedy decoding and trees still ran."""
    from test_batcher import _auto_batcher, run_join_leave

    b = _auto_batcher(True)
    b.guard = Alternate()
    got, want = run_join_leave(b)
    assert got == want
    assert b.guard.decisions[True] > 0 and b.guard.decisions[False] > 0
    assert b.stats()["tree_rows"] > 0


@pytest.mark.parametrize("broken", [False, True])
def test_sampling_with_steps_alternating_plain_and_speculative_follows_the_target(monkeypatch, broken):
    """Sampled batches whose steps alternate between plain and speculative (auto's lookup +
    tree) still follow the target's exact distribution (chi-square over the first 3 tokens,
    transformers' probabilities as the oracle). A broken plain step (the most likely token
    instead of a sample) must be caught by the same check."""
    from test_eagle import CTX, SV, chi2_against
    from transformers import AutoModelForCausalLM

    import specdec.core.step as step_mod

    if broken:  # plain steps take the most likely token instead of sampling it
        orig_verify = step_mod.verify_stochastic

        def verify(probs, tokens, q, counts, gen, *draws):
            if int(counts.sum()) == 0:
                return torch.zeros_like(counts), probs[:, 0].argmax(-1)
            return orig_verify(probs, tokens, q, counts, gen, *draws)

        monkeypatch.setattr(step_mod, "verify_stochastic", verify)
    params = dict(temperature=0.9)
    tg = target(3, SV)
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(3, SV)), dtype=torch.float32).eval()
    rows = [list(CTX[i % 2]) for i in range(800)]
    out = {c: [] for c in CTX}
    guard = Alternate()
    for s in range(5):
        d = drafter("lookup", 3, SV, depth=2, width=3, nodes=6, min_lookup=2, min_n=2)
        eng = Engine(tg.model, d, k=2)
        eng.guard = guard
        res = eng.generate(rows, SamplingParams(max_new_tokens=4, seed=900 + s, **params))
        for p, r in zip(rows, res):
            out[tuple(p)].append(r.tokens[:3])
    assert guard.decisions[True] > 0 and guard.decisions[False] > 0
    results = chi2_against(hf, out, params)
    rejected = [label for label, r in results if r.rejected]
    assert bool(rejected) == broken, (broken, results)


def test_a_single_row_has_a_band_of_its_own_when_guarded():
    """min_rows=1 (the engine's guard for drafters that do not price their own guesses): one row
    falls back to plain decoding where speculation loses, measured apart from batches of two."""
    g = BatchGuard(min_rows=1, probe_every=16)
    one = run(g, 1, spec_rate=60, plain_rate=100, steps=64)
    assert sum(one[16:]) <= 4 and any(one[16:])
    two = run(g, 2, spec_rate=150, plain_rate=100, steps=40)
    assert sum(two[8:]) >= 28


def test_engine_guards_single_rows_only_for_drafters_without_a_gate_of_their_own():
    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.drafters.ngram import NgramDrafter

    model = target(0).model
    assert Engine(model, DraftModelDrafter(target(1).model, vocab_size=V), k=4).guard.min_rows == 1
    assert Engine(model, NgramDrafter(), k=4).guard.min_rows == 2
    assert Engine(model, NgramDrafter(adaptive=False), k=4).guard.min_rows == 1
    assert Engine(model, None).guard is None
