"""Medusa heads on tiny random targets: the static-tree choice against brute force, greedy
output equal to transformers' (chain and tree, batch 1 and 3), sampled output following the
exact target distribution (chi-square), a head set for another target refused, and the
training pipeline end to end on local shards (reusing EAGLE-style features)."""

from __future__ import annotations

import itertools

import pytest
import torch

from helpers import CTX, SV, V, heads_dir, method_sources, prompts, target, target_dir
from specdec.drafters.medusa import choose_tree, load_medusa
from specdec.engine import Engine
from specdec.train.medusa import MedusaTrainConfig, train_medusa
from specdec.types import SamplingParams, SpecdecError

from oracle import chi2_against, hf_greedy


pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def test_choose_tree_is_the_most_probable_prefix_closed_set():
    acc = [[0.6, 0.25, 0.1], [0.5, 0.15], [0.4]]  # no ties among the candidates
    tree = choose_tree(acc, 6)
    prob = lambda t: torch.tensor([acc[i][r] for i, r in enumerate(t)]).prod().item()  # noqa: E731
    everything = [t for d in (1, 2, 3) for t in itertools.product(*[range(len(a)) for a in acc[:d]])]
    best = sorted(everything, key=prob, reverse=True)[:6]
    assert sorted(tree) == sorted(best)
    assert all(t[:-1] in tree for t in tree if len(t) > 1)  # every prefix present
    assert tree.index((0,)) < tree.index((0, 0))  # prefixes come first


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_medusa_greedy_equals_transformers(tree, batch):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
    hf.generation_config.pad_token_id = 0
    ps = prompts()[:batch]
    [d] = method_sources("medusa", target(), draft=str(heads_dir()), tree=tree)
    res = Engine(target().model, d, k=3, fixed_k=True).generate(ps, SamplingParams(max_new_tokens=14))
    assert [r.tokens for r in res] == [hf_greedy(hf, p, 14) for p in ps]
    assert sum(r.stats.proposed for r in res) > 0


def test_medusa_sampling_matches_exact_distribution():
    from transformers import AutoModelForCausalLM

    tg = target(3, SV)
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(3, SV)), dtype=torch.float32).eval()
    params = dict(temperature=1.0, top_k=8)
    rows = [list(CTX[i % 2]) for i in range(800)]
    out = {c: [] for c in CTX}
    for s in range(5):
        [d] = method_sources("medusa", tg, draft=str(heads_dir(3, SV, 1.0)), tree_nodes=6)
        # (a fixed k: the tree at every step, so the check covers it)
        res = Engine(tg.model, d, k=2, fixed_k=True).generate(rows, SamplingParams(max_new_tokens=4, seed=900 + s,
                                                                                   **params))
        for p, r in zip(rows, res):
            out[tuple(p)].append(r.tokens[:3])
    for label, res in chi2_against(hf, out, params):
        assert not res.rejected, f"medusa {label}: {res}"


def test_timing_medusa_alone_prices_it_before_its_first_proposal():
    """MedusaDrafter.time_alone (run when a scheduler starts, as for the other model drafters):
    a positive time per whole-tree proposal and nothing to catch up on; the rows' features stay
    as they were, so the next proposal is the one an untimed drafter makes; and a new adaptive
    scheduler's cost model has the source timed before any step (unpriced, a fresh engine's
    first probe was priced as free)."""
    from specdec.drafters.base import DraftContext

    tg = target()
    timed, plain = (method_sources("medusa", tg, draft=str(heads_dir()))[0] for _ in range(2))
    feature = torch.randn(1, tg.model.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    for d in (timed, plain):
        d.begin([prompts()[0]], SamplingParams(), 64)
        d.propose(DraftContext([prompts()[0]], SamplingParams(), None, hidden=[feature]), 8)
    per_proposal, per_read = timed.time_alone()
    assert per_proposal > 0 and per_read == 0.0
    ctx = DraftContext([prompts()[0]], SamplingParams(), None)
    a, b = timed.propose(ctx, 8), plain.propose(ctx, 8)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    engine = Engine(tg.model, method_sources("medusa", tg, draft=str(heads_dir())), k=4)
    engine._scheduler(prompts()[:1], SamplingParams(max_new_tokens=4))
    stats = engine.policy.sources["medusa"]
    assert stats.timed and stats.draft_seconds(1) > 0 and engine.policy.steps.all.weight == 0


def test_heads_for_another_target_are_refused():
    with pytest.raises(SpecdecError, match="trained for another target"):
        load_medusa(heads_dir(0), target(7))
    with pytest.raises(SpecdecError, match="not a Medusa heads folder"):
        load_medusa(target_dir(0), target(0))


def test_train_medusa_pipeline_end_to_end(tmp_path):
    tg = target(0)
    data = tmp_path / "data"
    data.mkdir()
    g = torch.Generator().manual_seed(1)
    rows = [(torch.randint(0, V, (40,), generator=g).tolist(), 10, torch.randint(0, V, (30, 4), generator=g),
             torch.zeros(30, 4)) for _ in range(30)]
    torch.save(rows, data / "shard_0000.pt")
    out = tmp_path / "medusa"
    cfg = MedusaTrainConfig(num_heads=3, steps=5, batch_rows=4, seq_len=16, head_vocab=24, tree_nodes=5, topk=3)
    train_medusa(tg, out, cfg, data, quiet=True)
    heads, meta = load_medusa(out, tg)
    assert len(meta["accuracy"]) == 3 and len(meta["tree"]) == 5
    assert all(0.0 <= a <= 1.0 for row in meta["accuracy"] for a in row)
    [d] = method_sources("medusa", tg, draft=str(out))
    p = prompts()[2]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
    hf.generation_config.pad_token_id = 0
    [r] = Engine(tg.model, d, k=3).generate([p], SamplingParams(max_new_tokens=10))
    assert r.tokens == hf_greedy(hf, p, 10)
