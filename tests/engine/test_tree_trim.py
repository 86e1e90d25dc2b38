"""EAGLE tree trimming: the learnt odds of a node being accepted by its path probability
(policy.NodeOdds), the choice of how many nodes to verify (policy.best_prefix, against a brute
force), and the head's cut on a tiny random target: only nodes worth verifying go out (every
PROBE_EVERY-th tree whole), and greedy output still equals transformers' plain greedy output."""

from __future__ import annotations

import json
import random

import pytest
import torch

from helpers import eagle, pinned_costs, prompts, target, target_dir
from specdec.engine import Engine
from specdec.policy import PROBE_EVERY, NodeOdds, best_prefix
from specdec.types import SamplingParams

from oracle import hf_greedy

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def test_node_odds_start_at_the_heads_word_and_learn():
    odds = NodeOdds()
    assert odds(0.95) == pytest.approx(0.95) and odds(0.5) == pytest.approx(0.525) and odds(0.0) == pytest.approx(0.01)
    for _ in range(400):
        odds.observe(0.5, False)
        odds.observe(0.97, True)
    assert odds(0.5) < 0.05 and odds(0.55) == odds(0.5)  # one bin
    assert odds(0.97) > 0.9 and odds(0.3) == pytest.approx(0.375)  # other bins untouched
    again = NodeOdds()
    again.relearn(json.loads(json.dumps(odds.learned())))
    assert again(0.5) == pytest.approx(odds(0.5)) and max(again.seen) == pytest.approx(8.0)
    with pytest.raises(ValueError):
        again.relearn({"acc": [0.0] * 3, "seen": [1.0] * 3})
    with pytest.raises(ValueError):
        again.relearn({"acc": [2.0] * 10, "seen": [1.0] * 10})


def test_best_prefix_maximises_tokens_per_step_time():
    # (1 + 0.7 + 0.4 + 0.25) / (1 + 0.6 + 0.15 * 3) = 1.146 beats 2 nodes (1.105) and 4 (1.136)
    assert best_prefix([0.7, 0.4, 0.25, 0.15, 0.1], c=0.6, r=0.15) == 3
    assert best_prefix([0.0, 0.0], c=0.5, r=0.1) == 0
    assert best_prefix([0.3, 0.2, 0.01], c=0.0, r=0.0) == 3
    assert best_prefix([], c=0.5, r=0.1) == 0
    rng = random.Random(0)
    for _ in range(300):
        vals = sorted((rng.random() ** 2 for _ in range(rng.randrange(0, 9))), reverse=True)
        c, r = rng.random(), rng.random() * 0.4
        rates = [(1 + sum(vals[:m])) / (1 + c + r * m) for m in range(len(vals) + 1)]
        assert rates[best_prefix(vals, c, r)] == pytest.approx(max(rates))


def test_trimmed_trees_keep_greedy_exact_and_verify_only_nodes_worth_it(monkeypatch):
    """Odds fixed at 0 below p = 0.3 and 1 from there (with a prior too heavy to move): every
    tree that is not a whole-tree probe sends exactly the nodes with p >= 0.3, some trees are
    cut, and greedy output equals transformers'. (A fixed k: a tree every step.)"""
    from transformers import AutoModelForCausalLM

    d = eagle(True, depth=3, width=2, nodes=6)
    lows = (0.0,) + NodeOdds.EDGES
    d.odds.seen = [1e9] * len(lows)
    d.odds.acc = [1e9 if lo >= 0.3 else 0.0 for lo in lows]
    sent, cuts = [], []
    trim, commit = d._trim, d.commit

    def spy_trim(toks, pars, probs, cost, r):
        out = trim(toks, pars, probs, cost, r)
        cuts.append((len(toks), len(out[0])))
        return out

    def spy_commit(num_accepted, paths=None):
        probe = d._trees % PROBE_EVERY == 0  # this step's trees went out whole
        sent.extend((list(p), probe) for p in d._node_p.values())
        return commit(num_accepted, paths)

    d._trim, d.commit = spy_trim, spy_commit
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
    hf.generation_config.pad_token_id = 0
    ps = prompts()
    want = [hf_greedy(hf, p, 40) for p in ps]
    got = [Engine(target().model, d, k=3, fixed_k=True).generate([p], SamplingParams(max_new_tokens=40))[0].tokens
           for p in ps]
    assert got == want
    assert any(n_out < n_in for n_in, n_out in cuts)  # some trees were cut
    assert any(probe for _, probe in sent)  # and some sent whole
    for probs, probe in sent:
        if not probe:
            assert all(p >= 0.3 for p in probs)
    assert any(p < 0.3 for probs, probe in sent if probe for p in probs)  # a probe measured the weak nodes


def test_early_stop_drops_only_nodes_the_trim_would_drop(monkeypatch):
    """The head stops expanding once every frontier node's path probability is below what a
    node must reach to be kept: on every step of a run, the nodes of probability >= p* of the
    head's full tree and of its early-stopped tree are the same paths, and the early stop
    saves head steps."""
    import math

    d = eagle(True, depth=4, width=2, nodes=8)
    steps = {"full": 0, "cut": 0}
    head_step, propose = d._step, d._propose_tree
    mode = ["full"]

    def count_step(*a, **k):
        steps[mode[0]] += 1
        return head_step(*a, **k)

    def paths(draft, scores, p_min):
        toks, pars = draft.tokens[0].tolist(), draft.parents[0].tolist()
        out = set()
        for j, s in enumerate(scores, start=1):
            if math.exp(s) >= p_min:
                path, i = [], j
                while i:
                    path.append(toks[i - 1])
                    i = pars[i - 1]
                out.add(tuple(reversed(path)))
        return out

    compared = []

    def both(h, depth, sel=None, min_logp=None):
        mode[0] = "cut"
        cut = propose(h, depth, sel, min_logp=math.log(0.2))
        cut_scores = list(d.last_scores[0])
        mode[0] = "full"
        full = propose(h, depth, sel)
        compared.append(paths(full, d.last_scores[0], 0.2) == paths(cut, cut_scores, 0.2))
        d.last_scores = [cut_scores]  # the scores of the tree handed back (the drafter cuts by them)
        return cut

    d._step, d._propose_tree = count_step, both
    for p in prompts():
        Engine(target().model, d, k=4, fixed_k=True).generate([p], SamplingParams(max_new_tokens=30))
    assert len(compared) > 20 and all(compared)
    assert steps["cut"] < steps["full"]


def test_sampling_through_trimmed_trees_matches_exact_distribution(monkeypatch):
    """Sampled requests get cut trees: with the cut's costs pinned so that it is deterministic
    (c 0.3, r 0.1), the sampled continuations still follow the target's exact distribution
    (chi-square)."""
    from transformers import AutoModelForCausalLM

    from helpers import CTX, SV
    from oracle import chi2_against

    pinned_costs(monkeypatch, draft=0.3, guess=0.1)
    tg = target(3, SV)
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(3, SV)), dtype=torch.float32).eval()
    rows = [list(CTX[i % 2]) for i in range(800)]
    out = {c: [] for c in CTX}
    cuts = []
    params = dict(temperature=0.9)
    for s in range(5):
        d = eagle(True, 3, SV, depth=2, width=3, nodes=6)
        trim = d._trim

        def spy(toks, pars, probs, cost, r, trim=trim):
            out = trim(toks, pars, probs, cost, r)
            cuts.append((len(toks), len(out[0])))
            return out

        d._trim = spy
        res = Engine(tg.model, d, k=2, fixed_k=True).generate(rows, SamplingParams(max_new_tokens=4, seed=900 + s,
                                                                                   **params))
        for p, r in zip(rows, res):
            out[tuple(p)].append(r.tokens[:3])
    assert any(n_out < n_in for n_in, n_out in cuts)  # trees were cut
    assert any(n_out > 0 for _, n_out in cuts)  # and cut trees still verified nodes
    for label, res in chi2_against(hf, out, params):
        assert not res.rejected, f"trimmed trees {params} {label}: {res}"
