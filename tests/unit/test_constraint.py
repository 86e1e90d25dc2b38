"""Decoding under a grammar (`Request.constraint`, core.step.constrained) on a tiny random target,
against an independent oracle: transformers' logits with the grammar's forbidden tokens masked,
token by token. Greedy output equals the oracle with and without speculation (lookups, EAGLE
trees, the grammar's forced tokens as certain guesses); sampled output follows the exact
constrained distribution (chi-square), and an unmasked verification (a broken rule) fails it."""

from __future__ import annotations

import itertools

import pytest
import torch

import helpers
from helpers import V, prompts, target, target_dir
from specdec.drafters.grammar import GrammarDrafter
from specdec.engine import Engine
from specdec.types import SamplingParams

from oracle import chi2_test, hf_last_logits, histogram, hf_warp


class Grammar:
    """A small grammar over the tiny vocabulary: token 0 never; after a 5, the tokens 6 7 8
    (forced, one choice each); after a 9, only even tokens. The committed state is the list of
    tokens seen; `allowed` tries paths without changing it."""

    def __init__(self, vocab: int = V) -> None:
        self.vocab, self.seen = vocab, []
        self.masked = self.checked = 0  # positions given a whole mask / one token checked

    def _allowed(self, history: list[int]) -> torch.Tensor:
        mask = torch.ones(self.vocab, dtype=torch.bool)
        mask[0] = False
        for back, forced in ((1, 6), (2, 7), (3, 8)):
            if len(history) >= back and history[-back] == 5 and all(history[-b] != 5 for b in range(1, back)):
                only = torch.zeros(self.vocab, dtype=torch.bool)
                only[forced] = True
                return only
        if history and history[-1] == 9:
            mask[1::2] = False
        return mask

    def allowed(self, paths: list[list[int]]) -> torch.Tensor:
        self.masked += len(paths)
        return torch.stack([self._allowed(self.seen + list(p)) for p in paths])

    def accepts(self, ids: list[int]) -> int:
        n = 0
        while n < len(ids) and bool(self._allowed(self.seen + list(ids[:n]))[ids[n]]):
            n += 1
        return n

    def allows(self, paths: list[list[int]], tokens: list[int]) -> list[bool]:
        self.checked += len(paths)
        return [bool(self._allowed(self.seen + list(p))[t]) for p, t in zip(paths, tokens)]

    def advance(self, ids: list[int]) -> None:
        self.seen += list(ids)

    def forced(self, limit: int) -> list[int]:
        out = []
        while len(out) < limit:
            a = self._allowed(self.seen + out)
            if int(a.sum()) != 1:
                break
            out.append(int(a.nonzero()[0]))
        return out

    def finished(self) -> bool:
        return False


@torch.no_grad()
def constrained_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """The oracle: transformers' argmax over the grammar's allowed tokens, one token at a time."""
    g, out = Grammar(), []
    for _ in range(n):
        logits = hf_last_logits(hf, [prompt + out])[0].masked_fill(~g._allowed(out), float("-inf"))
        out.append(int(logits.argmax()))
    return out


def hf():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
    model.generation_config.pad_token_id = 0
    return model


def steering(ps):
    """Prompts that end in a 5 or a 9 (so the grammar acts from the first token), and one that repeats."""
    return [ps[0] + [5], ps[1] + [9], ps[2] + ps[2][:4]]


@pytest.mark.parametrize("sources", ["none", "grammar", "auto"])
def test_greedy_constrained_output_equals_the_masked_oracle(sources):
    model = hf()
    ps = steering(prompts())
    n = 24
    want = [constrained_greedy(model, p, n) for p in ps]
    src = {"none": [], "grammar": [GrammarDrafter()],
           "auto": helpers.auto(depth=3, width=2, nodes=5) + [GrammarDrafter()]}[sources]
    engine = Engine(target().model, src, k=4, fixed_k=sources != "none")
    res = engine.generate(ps, SamplingParams(max_new_tokens=n), constraints=[Grammar() for _ in ps])
    assert [r.tokens for r in res] == want
    for r in res:
        assert 0 not in r.tokens
        for i, t in enumerate(r.tokens[:-3]):
            if t == 5:
                assert r.tokens[i + 1: i + 4] == [6, 7, 8]
    if sources == "grammar":  # the forced tokens were guessed, and each held
        proposed, held = [sum(r.stats.sources.get("grammar", [0, 0])[j] for r in res) for j in (0, 1)]
        assert proposed > 0 and held == proposed, (proposed, held)


@pytest.mark.parametrize("rule", ["checked", "unchecked"])
def test_greedy_rows_are_masked_only_where_their_argmax_is_forbidden(rule):
    """A greedy row's logits are read only for their argmax: each position's argmax is checked
    against the grammar and only the positions whose argmax it forbids get a whole mask (fewer
    masks than checks), with the masked oracle's output. A check that lets every token through
    (the broken rule) writes tokens the grammar forbids."""
    model = hf()
    ps = steering(prompts())
    n = 24
    want = [constrained_greedy(model, p, n) for p in ps]
    grammars = [Grammar() for _ in ps]
    if rule == "unchecked":
        for g in grammars:
            g.allows = lambda paths, tokens: [True] * len(tokens)
    engine = Engine(target().model, [], k=4)
    res = engine.generate(ps, SamplingParams(max_new_tokens=n), constraints=grammars)
    assert ([r.tokens for r in res] == want) == (rule == "checked")
    if rule == "checked":
        masked, checked = sum(g.masked for g in grammars), sum(g.checked for g in grammars)
        assert 0 < masked < checked, (masked, checked)


CTX = [3, 1, 4, 1, 5]


@torch.no_grad()
def exact_constrained(model, ctx: list[int], depth: int, temperature: float) -> torch.Tensor:
    """The exact joint of the next `depth` tokens under the grammar, enumerating every prefix."""
    joint = torch.ones((), dtype=torch.float64)
    for d in range(depth):
        prefixes = list(itertools.product(range(V), repeat=d))
        logits = hf_last_logits(model, [ctx + list(p) for p in prefixes])
        masks = torch.stack([Grammar()._allowed(list(p)) for p in prefixes])
        cond = hf_warp(logits.masked_fill(~masks, float("-inf")), temperature).to(torch.float64)
        joint = joint[..., None] * cond.reshape(*([V] * d), V)
    return joint / joint.sum()


@pytest.mark.parametrize("broken", [False, True])
def test_sampled_constrained_output_follows_the_constrained_distribution(monkeypatch, broken):
    """1200 seeded samples of 3 tokens after a context ending in 9 (so the grammar allows only even
    tokens next, and a 5 later forces 6 7 8), with auto's sources and the grammar's forced tokens
    at a fixed k: the joint follows the exact constrained distribution. Verifying without the mask
    (broken) samples tokens the grammar forbids and fails the check."""
    import specdec.core.step as step_mod

    if broken:
        monkeypatch.setattr(step_mod, "constrained", lambda logits, *rest: logits)
    model = hf()
    ctx = CTX[:-1] + [9]
    params = dict(temperature=0.9)
    got = []
    for s in range(4):
        engine = Engine(target().model, helpers.auto(depth=2, width=2, nodes=3) + [GrammarDrafter()], k=3,
                        fixed_k=True)
        res = engine.generate([ctx] * 300, SamplingParams(max_new_tokens=3, seed=300 + s, **params),
                              constraints=[Grammar() for _ in range(300)])
        got += [r.tokens[:3] for r in res]
    probs = exact_constrained(model, ctx, 3, params["temperature"])
    result = chi2_test(histogram(torch.tensor(got), (V, V, V)), probs, alpha=1e-3)
    assert result.rejected == broken, result


def test_known_offers_lose_the_guesses_the_grammar_forbids():
    """A lookup's chain is cut before its first forbidden token (0 is never allowed; after a 9
    only even tokens), a suffix tree loses the nodes under one (parents renumbered, scores kept),
    an offer with nothing legal is dropped, and rows without a grammar keep theirs."""
    from types import SimpleNamespace

    from specdec.core.proposal import Sources
    from specdec.drafters.base import Offer

    grammar = Grammar()
    grammar.advance([9])  # the next token must be even
    rows = [SimpleNamespace(constraint=grammar)] * 4 + [SimpleNamespace(constraint=None)]
    tree = Offer([2, 3, 4, 0, 6], parents=[0, 1, 1, 3, 0], key=1, scores=[0.9, 0.5, 0.4, 0.3, 0.2])
    offers = [Offer([2, 3, 0, 4], key=3), tree, Offer([3, 4], key=1), None, Offer([0, 1])]
    chain, pruned, odd, none, free = Sources._legal(rows, offers)
    assert chain.tokens == [2, 3] and chain.key == 3
    # node 2 (3 after 2) is legal: only the first token after the 9 must be even; node 4 (a 0) is not
    assert pruned.tokens == [2, 3, 4, 6] and pruned.parents == [0, 1, 1, 0]
    assert pruned.scores == [0.9, 0.5, 0.4, 0.2]
    assert odd is None and none is None and free is offers[4]
