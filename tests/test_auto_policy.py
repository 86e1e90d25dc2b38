"""`--method auto`'s fall-back to plain decoding, counted in drafter calls and verified nodes (not
wall time): a tree that is never accepted ends up drafted only as rare probes, greedy and
seeded-sampled alike; a short answer pays for no probe at all; a seeded sample's text does not
depend on the clock. Tiny random target and head (test_eagle's)."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.drafters import ngram
from specdec.drafters.hybrid import LookupEagleDrafter
from specdec.engine import Engine
from specdec.types import SamplingParams

from test_eagle import V, drafter, prompts, target

SEEDED = dict(temperature=0.8, seed=3)


def plain(ps, params):
    return [r.tokens for r in Engine(target().model).generate(ps, params)]


def never_accepted(d: LookupEagleDrafter, bad: int) -> list[int]:
    """Make the head's every tree node the token `bad`; returns a list that grows by one per tree call."""
    calls, propose = [], d.eagle.propose

    def wrong(ctx, k, rows=None, min_logp=None):
        tree = propose(ctx, k, rows=rows, min_logp=min_logp)
        tree.tokens = torch.full_like(tree.tokens, bad)
        calls.append(len(ctx.tokens[0]))
        return tree

    d.eagle.propose = wrong
    return calls


def unused_token(outputs) -> int:
    seen = {t for out in outputs for t in out}
    return next(t for t in range(V - 1, -1, -1) if t not in seen)


@pytest.fixture
def no_lookups(monkeypatch):
    """Every step would draft the tree: the gate alone decides."""
    monkeypatch.setattr(ngram.SuffixIndex, "match", lambda *a, **k: (0, []))


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_tree_never_accepted_ends_up_as_rare_probes(no_lookups, sampling):
    n = 300
    params = SamplingParams(max_new_tokens=n, **(SEEDED if sampling == "seeded" else {}))
    p = prompts()[1]
    want = plain([p], params)
    d = drafter("lookup", depth=3, width=2, nodes=5)
    trees = never_accepted(d, unused_token(want) if sampling == "greedy" else V - 1)
    [res] = Engine(target().model, d, k=3).generate([p], params)
    assert [res.tokens] == want  # sampled too: the seed's text, whatever was drafted (verify.py)
    steps = res.stats.target_forwards
    late = [c for c in trees if c - len(p) > n // 2]  # tree calls in the second half
    # probes every 16, 32, 64, 128 steps at most once a tree has failed: a handful in 150 steps
    assert 1 <= len(trees) <= 12 and len(late) <= 3, (len(trees), steps)
    # and verified little beyond the pending token: at most the probes' nodes
    assert res.stats.proposed <= 5 * len(trees) * 4


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_short_answer_pays_for_no_probe(no_lookups, sampling):
    """A fresh drafter: nothing measured, 40 tokens to go, so probing (the head catching up on
    the whole prompt) could not pay back; the head is never run."""
    params = SamplingParams(max_new_tokens=40, **(SEEDED if sampling == "seeded" else {}))
    p = prompts()[1]
    d = drafter("lookup", depth=3, width=2, nodes=5)
    trees = never_accepted(d, 0)
    [res] = Engine(target().model, d, k=3).generate([p], params)
    assert trees == [] and res.stats.proposed == 0
    assert [res.tokens] == plain([p], params)


def test_the_probes_wait_for_room_a_broken_rule_would_probe(no_lookups):
    """The room rule can fail: without it the same short answer probes at step 16."""
    d = drafter("lookup", depth=3, width=2, nodes=5)
    d.probe_room = 0
    trees = never_accepted(d, 0)
    Engine(target().model, d, k=3).generate([prompts()[1]], SamplingParams(max_new_tokens=40))
    assert len(trees) >= 1


def test_seeded_text_ignores_timing(monkeypatch):
    """A seeded sample's text does not depend on what was drafted: noise in every measured time
    and a learnt state from elsewhere (which change the trees drafted) change nothing."""
    ps = prompts()
    params = SamplingParams(max_new_tokens=90, **SEEDED)

    def run(noisy: bool):
        d = drafter("lookup", depth=3, width=2, nodes=5)
        if noisy:
            noise = random.Random(7)
            d.gain, d.t_draft, d.t_step = 5.0, 0.001, 0.01  # a learnt state that says the tree pays
            monkeypatch.setattr(LookupEagleDrafter, "cost", lambda self: noise.uniform(0, 3))
        return [r.tokens for r in Engine(target().model, d, k=3).generate(ps, params)]

    first = run(False)
    assert run(True) == first
    monkeypatch.undo()
    assert run(False) == first


def test_learned_key_tells_greedy_from_sampled():
    from specdec.config import SpecConfig
    from specdec.flags import build_parser

    class Target:
        path, weights = "m.gguf", "fp32"

    keys = {SpecConfig.from_args(build_parser().parse_args(["generate", "x", *flags])).learned_key(Target())
            for flags in ([], ["--temperature", "0.7"], ["--temperature", "0.7", "--seed", "1"])}
    assert len(keys) == 2  # greedy, sampled (seeded or not)


def test_a_draft_model_pays_only_above_its_drafting_and_verification_cost(monkeypatch):
    """HybridDrafter (auto with a draft model) runs the draft while a drafted token's acceptance
    exceeds c (its drafting time in plain steps) plus r (verifying it): a draft accepted 30% of
    the time at c = 0.2 pays where verifying is cheap (r 0.05) and not where it is dear (r 0.15)."""
    from specdec.drafters.hybrid import HybridDrafter
    from specdec.drafters.ngram import LengthPolicy

    d = HybridDrafter(draft=None)
    d.acc, d.prop = 0.3, 1.0
    d.t_tok, d.t_step = 0.002, 0.01
    monkeypatch.setattr(LengthPolicy, "step_seconds", lambda self: 0.01)
    monkeypatch.setattr(LengthPolicy, "r", property(lambda self: 0.05))
    assert d.draft_pays()
    monkeypatch.setattr(LengthPolicy, "r", property(lambda self: 0.15))
    assert not d.draft_pays()


def test_the_lookup_times_the_target_step_without_the_draft_models_drafting():
    """HybridDrafter hands its proposal over after the draft model drafted: the lookup's clock (its
    fitted plain step, from which c is priced) starts there, not before the drafting, which
    would make a slow draft look cheap."""
    import time

    from specdec.drafters.base import Draft, DraftContext
    from specdec.drafters.hybrid import HybridDrafter
    from specdec.types import SamplingParams

    class SlowDraft:
        vocab_size = V

        def begin(self, prompts, params, max_len):
            pass

        def propose(self, ctx, k):
            time.sleep(0.05)
            return Draft(torch.zeros(len(ctx.tokens), k, dtype=torch.long), torch.full((len(ctx.tokens),), k))

        def draft_timing(self):
            return 0.05, True

    d = HybridDrafter(SlowDraft(), gate=False)
    tokens = [list(range(10))]  # no repeats: no lookup, the draft model drafts
    d.begin(tokens, SamplingParams(), 64)
    d.propose(DraftContext(tokens, SamplingParams(), None), 3)
    assert time.perf_counter() - d.lookup._t_end < 0.04
