"""EAGLE heads on tiny random targets: greedy output equals transformers' plain greedy output
(chain and dynamic tree, batch 1 and 3), sampled output follows the exact target distribution
(chi-square; chain with the head's q, tree with deterministic candidates), a head made for
another target is refused, and `specdec train eagle`'s pipeline runs end to end (features,
training, save, load) on local data shards. Head quality does not matter for exactness, so
the heads here are small random perturbations of the initialisation or a few training steps."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch

from specdec.drafters import REGISTRY
from specdec.drafters.eagle import EagleDrafter, load_eagle, save_eagle, target_fingerprint
from specdec.engine import Engine
from specdec.models.loader import load_model
from specdec.train.eagle import EagleTrainConfig, init_head, train_eagle
from specdec.types import SamplingParams, SpecdecError

from oracle import exact_joint, hf_greedy, one_thread, tiny_hf_llama
from test_tree import chi2_views

V = 32


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


# the tiny models and heads below live here; removed when the test process exits
_TMP = tempfile.TemporaryDirectory(prefix="specdec-eagle-tests-")


@functools.lru_cache(maxsize=None)
def target_dir(seed: int, vocab: int = V):
    d = Path(tempfile.mkdtemp(prefix=f"target{seed}-", dir=_TMP.name))
    tiny_hf_llama(seed, vocab=vocab, logit_scale=1.5).save_pretrained(str(d))
    return d


@functools.lru_cache(maxsize=None)
def target(seed: int = 0, vocab: int = V):
    return load_model(str(target_dir(seed, vocab)), quiet=True, with_tokenizer=False)


@functools.lru_cache(maxsize=None)
def head_dir(seed: int = 0, vocab: int = V, noise: float = 0.05):
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


def drafter(tree: bool | str, seed: int = 0, vocab: int = V, **kw):
    """tree: False (chain), True (dynamic tree) or "lookup" (prompt lookup + tree, `auto`'s mix)."""
    if tree == "lookup":
        return REGISTRY["lookup-eagle"](target=target(seed, vocab), draft=head_dir(seed, vocab), **kw)
    return REGISTRY["eagle"](target=target(seed, vocab), draft=head_dir(seed, vocab), tree=tree, **kw)


def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in (6, 11, 8)]


@pytest.mark.parametrize("tree,kw", [(False, {}), (True, dict(depth=3, width=2, nodes=5)),
                                     (True, dict(depth=4, width=3, nodes=12)),
                                     ("lookup", dict(depth=3, width=2, nodes=5, min_lookup=1)),
                                     ("lookup", dict(depth=2, width=2, nodes=4, min_lookup=2))])
@pytest.mark.parametrize("batch", [1, 3])
def test_eagle_greedy_equals_transformers(monkeypatch, tree, kw, batch):
    from transformers import AutoModelForCausalLM

    # 14 tokens of a random text must see lookups too: an even prior (a fresh lookup declines
    # every lookup until one would have held)
    monkeypatch.setattr("specdec.drafters.ngram.LOOKUP_PRIOR", 0.5)
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
    hf.generation_config.pad_token_id = 0
    ps = prompts()[:batch]
    want = [hf_greedy(hf, p, 14) for p in ps]
    d = drafter(tree, **kw)
    engine = Engine(target().model, d, k=kw.get("depth", 3))
    if tree == "lookup":
        engine.policy.eager = True  # trees from the first step, so that 14 tokens see both sources (the default probes first)
    res = engine.generate(ps, SamplingParams(max_new_tokens=14))
    assert [r.tokens for r in res] == want
    assert sum(r.stats.proposed for r in res) > 0
    if tree == "lookup":
        assert d.rows_drafted["lookup"] > 0 and d.rows_drafted["eagle"] > 0


@pytest.mark.parametrize("graft", [1, 6])
def test_lookup_grafted_onto_the_tree_keeps_greedy_exact(monkeypatch, graft):
    """Every row drafts the tree and its lookup is grafted on (shared prefixes merged, new
    nodes as a branch, at most `graft` of them): greedy output still equals transformers'."""
    from transformers import AutoModelForCausalLM

    from specdec.drafters.hybrid import LookupEagleDrafter

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
    hf.generation_config.pad_token_id = 0
    ps = prompts()
    want = [hf_greedy(hf, p, 24) for p in ps]
    monkeypatch.setattr(LookupEagleDrafter, "prefer_lookup", lambda self, looked: [False] * len(looked))
    d = drafter("lookup", depth=2, width=2, nodes=3, gate=False)
    d.graft = graft
    d.max_nodes = d.eagle.max_nodes + graft
    res = Engine(target().model, d, k=3).generate(ps, SamplingParams(max_new_tokens=24))
    assert [r.tokens for r in res] == want
    assert d.rows_drafted["graft"] > 0 and d.rows_drafted["lookup"] == 0


def test_eagle_needs_the_targets_features():
    """Without the target's hidden states the drafter refuses rather than guessing blind;
    through the engine it receives one feature per committed position."""
    from specdec.drafters.base import DraftContext

    d = drafter(True, depth=2, width=2, nodes=3)
    p = prompts()[0]
    d.begin([p], SamplingParams(), 64)
    with pytest.raises(RuntimeError, match="missing target features"):
        d.propose(DraftContext([p + [1]], SamplingParams(), None), 2)
    d = drafter(False)
    left = []  # the finished row as it leaves the drafter: (pairs in its cache, features known)
    keep_rows = d.keep_rows
    d.keep_rows = lambda rows: (left.append((d.n[0], len(d.feat[0]))), keep_rows(rows))
    [r] = Engine(target().model, d, k=2, fixed_k=True).generate([p], SamplingParams(max_new_tokens=9))
    committed = len(p) + len(r.tokens)
    # features arrive for every scored position; the last step's are handed over at the next proposal
    n, known = left[-1]
    assert n <= known < committed
    assert known >= committed - 1 - 3


SV = 12
CTX = (tuple(range(SV)) + (3, 1, 4), tuple(reversed(range(SV))) + (5,))


def chi2_against(hf, out: dict, params: dict):
    """test_tree's chi-square views of sampled 3-token continuations (context -> list of token
    triples), against the exact distributions of the transformers model `hf` (chi2_views reads
    test_tree's own models: ours are swapped in for the call)."""
    import test_tree

    key = lambda c, t, k, p: exact_joint(hf, list(c), 3, t, k, p)  # noqa: E731
    orig = test_tree.exact
    test_tree.exact = functools.lru_cache(maxsize=None)(key)
    try:
        return chi2_views({c: torch.tensor(v) for c, v in out.items()}, params)
    finally:
        test_tree.exact = orig


@pytest.mark.parametrize("tree,params", [(False, dict(temperature=1.0)), (False, dict(temperature=0.7, top_k=6)),
                                         (True, dict(temperature=0.8, top_p=0.9)),
                                         ("lookup", dict(temperature=0.9))])
def test_eagle_sampling_matches_exact_distribution(monkeypatch, tree, params):
    from transformers import AutoModelForCausalLM

    # lookups must be verified too, on a random text whose lookups rarely hold: an even prior
    # (a fresh lookup declines every lookup until one would have held)
    monkeypatch.setattr("specdec.drafters.ngram.LOOKUP_PRIOR", 0.5)
    tg = target(3, SV)
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(3, SV)), dtype=torch.float32).eval()
    rows = [list(CTX[i % 2]) for i in range(800)]
    out = {c: [] for c in CTX}
    proposed = accepted = 0
    for s in range(5):
        # a fixed k, gate off: trees (and chains drawn from the head's q) at every step, so the check
        # covers them (under the cost model a seeded request takes deterministic guesses, when they pay)
        d = drafter(tree, 3, SV, depth=2, width=3, nodes=6, **({"min_lookup": 2, "min_n": 2, "gate": False} if tree == "lookup" else {}))
        res = Engine(tg.model, d, k=2, fixed_k=True).generate(rows, SamplingParams(max_new_tokens=4, seed=700 + s,
                                                                                   **params))
        for p, r in zip(rows, res):
            out[tuple(p)].append(r.tokens[:3])
            proposed += r.stats.proposed
            accepted += r.stats.accepted
    assert proposed > 0 and 0 < accepted < proposed
    if tree == "lookup":  # lookups alone, trees alone, and trees with a lookup grafted on
        assert d.rows_drafted["lookup"] > 0 and d.rows_drafted["eagle"] > 0 and d.rows_drafted["graft"] > 0

    for label, res in chi2_against(hf, out, params):
        assert not res.rejected, f"eagle tree={tree} {params} {label}: {res}"


def test_rows_joining_and_leaving_keep_each_rows_head_cache():
    """The server's pattern: rows join one at a time (the cache's row stores grow) and leave
    (the last row moves into the freed slot, in place), or are kept in any order; each kept
    row's head cache, pair count and features are the ones it had."""
    d = drafter(True)
    d.begin([], None, 40)
    for _ in range(5):  # past the first store of 4 rows
        d.add_row(40)
    g = torch.Generator().manual_seed(3)
    d.k.copy_(torch.randn(d.k.shape, generator=g))
    d.v.copy_(torch.randn(d.v.shape, generator=g))
    d.n = [10, 11, 12, 13, 14]
    d.feat = [[torch.full((2,), float(i))] for i in range(5)]
    for rows in ([0, 4, 2, 3], [2, 0, 1], [1]):  # row 1 leaves (4 moves in); a permutation; one kept
        k, v, n, feat = d.k.clone(), d.v.clone(), list(d.n), list(d.feat)
        d.keep_rows(rows)
        assert torch.equal(d.k, k[rows]) and torch.equal(d.v, v[rows])
        assert d.n == [n[r] for r in rows] and d.feat == [feat[r] for r in rows]
    d.add_row(40)  # a row joins after leaves: empty, the kept row untouched
    assert d.k.shape[0] == 2 and not d.k[1].any() and not d.v[1].any() and d.n[1] == 0


def test_head_for_another_target_is_refused():
    other = target(7)  # same shapes, other weights
    with pytest.raises(SpecdecError, match="trained for another target"):
        load_eagle(head_dir(0), other)
    bigger = target(0, 48)  # another vocabulary
    with pytest.raises(SpecdecError, match="vocabulary"):
        load_eagle(head_dir(0), bigger)
    with pytest.raises(SpecdecError, match="not an EAGLE head"):
        load_eagle(target_dir(0), target(0))


def test_bad_tree_settings_are_refused():
    with pytest.raises(SpecdecError, match=">= 1"):
        drafter(True, depth=0)
    d = drafter(True, depth=2, width=2, nodes=300)
    with pytest.raises(SpecdecError, match="does not fit"):
        Engine(target().model, d, k=2).generate([prompts()[0]], SamplingParams(max_new_tokens=4))


def assert_drafts_exactly(tg, head, meta, prompt, n):
    """A trained head drafts a tree through the engine and greedy output equals transformers'."""
    from transformers import AutoModelForCausalLM

    d = EagleDrafter(head, tg.model, meta["vocab_subset"], tree=True, depth=3, width=2, nodes=6)
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
    hf.generation_config.pad_token_id = 0
    [r] = Engine(tg.model, d, k=3).generate([prompt], SamplingParams(max_new_tokens=n))
    assert r.tokens == hf_greedy(hf, prompt, n)


def test_train_eagle_pipeline_end_to_end(tmp_path):
    tg = target(0)
    data = tmp_path / "data"
    data.mkdir()
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(24):
        toks = torch.randint(0, V, (40,), generator=g).tolist()
        rows.append((toks, 10, torch.randint(0, V, (30, 4), generator=g), torch.zeros(30, 4)))
    torch.save(rows[:12], data / "shard_0000.pt")
    torch.save(rows[12:], data / "shard_0001.pt")
    out = tmp_path / "head"
    cfg = EagleTrainConfig(steps=6, batch_rows=4, seq_len=16, head_vocab=20, save_every=3)
    train_eagle(tg, out, cfg, data=data, quiet=True)
    assert (out / "features" / "shard_0001.pt").is_file() and (out / "checkpoint.pt").is_file()
    head, meta = load_eagle(out, tg)
    assert meta["train"]["steps"] == 6 and len(meta["vocab_subset"]) == 20
    assert_drafts_exactly(tg, head, meta, prompts()[1], 10)
    # resuming a finished run trains nothing more and leaves the head loadable
    train_eagle(tg, out, cfg, data=data, quiet=True)
    load_eagle(out, tg)


@pytest.mark.parametrize("tree", [False, True])
def test_eagle_long_prompt_short_answer_ragged_batch(tree):
    """The first catch-up feeds a whole prompt; short rows are padded past their own pairs
    (a regression: the padding once ran past the head's cache)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
    hf.generation_config.pad_token_id = 0
    g = torch.Generator().manual_seed(9)
    ps = [torch.randint(0, V, (90,), generator=g).tolist(), torch.randint(0, V, (7,), generator=g).tolist()]
    d = drafter(tree, depth=2, width=2, nodes=4) if tree else drafter(False)
    res = Engine(target().model, d, k=2).generate(ps, SamplingParams(max_new_tokens=3))
    assert [r.tokens for r in res] == [hf_greedy(hf, p, 3) for p in ps]


def test_catch_up_row_by_row_equals_catch_up_together(monkeypatch):
    """A row far behind (a prompt just handed over) catches up on its own: the head's
    proposals are those of one padded batch over all rows."""
    from specdec.drafters.base import DraftContext

    g = torch.Generator().manual_seed(4)
    ps = [torch.randint(0, V, (n,), generator=g).tolist() for n in (60, 5, 33)]
    tg = target()
    hid = []
    for p in ps:
        one = tg.model.new_cache(1, 128)
        _, h = tg.model(torch.tensor([p]), torch.arange(len(p))[None], one)
        hid.append(h[0])
    out = {}
    for alone in (10**6, 0, 16):
        monkeypatch.setattr(EagleDrafter, "CATCH_UP_ALONE", alone)
        d = drafter(True, depth=3, width=2, nodes=6)
        d.begin(ps, SamplingParams(), 128)
        # each prompt's last token is pending; its features cover the prompt's positions
        draft = d.propose(DraftContext([list(p) for p in ps], SamplingParams(), None, [h for h in hid]), 3)
        out[alone] = (draft.tokens, draft.parents, draft.counts, d.last_h.clone())
    ref = out[10**6]
    for alone in (0, 16):
        assert torch.equal(out[alone][0], ref[0]) and torch.equal(out[alone][1], ref[1])
        assert torch.allclose(out[alone][3], ref[3], atol=1e-4)


def test_unrolled_training_steps_match_drafting():
    """Training-time test: step j's prediction at position t equals a plain causal forward of
    the head over the true pairs 0..t followed by the head's own predicted pairs
    (pred_{1..j-1} paired with the true next tokens), i.e. what drafting computes j-1 tokens on."""
    from specdec.train.eagle import unrolled_predictions

    tg = target(0)
    head, _ = load_eagle(head_dir(0), tg)
    head = head.float()
    E = tg.model.embed.weight.detach().float()
    g = torch.Generator().manual_seed(3)
    B, T, D = 2, 9, E.shape[1]
    x_next = torch.randint(0, V, (B, T), generator=g)
    f_in = torch.randn(B, T, D, generator=g)
    with torch.no_grad():
        preds = unrolled_predictions(head, E, x_next, f_in, unroll=3)
        for b in range(B):
            for t in range(T - 2):
                feats = [f_in[b, s] for s in range(t + 1)]
                toks = [int(x_next[b, s]) for s in range(t + 1)]
                for j in range(1, 4):
                    n = len(toks)
                    out = head(torch.nn.functional.embedding(torch.tensor([toks]), E), torch.stack(feats)[None],
                               torch.arange(n)[None])[0, -1]
                    torch.testing.assert_close(preds[j - 1][b, t], out, atol=1e-4, rtol=1e-4)
                    if j < 3:
                        feats.append(out)
                        toks.append(int(x_next[b, t + j]))


def test_train_eagle_unrolled_from_a_trained_head(tmp_path):
    """--unroll and --init: the run starts from the given head and the result still drafts exactly."""
    tg = target(0)
    data = tmp_path / "data"
    data.mkdir()
    g = torch.Generator().manual_seed(1)
    rows = [(torch.randint(0, V, (30,), generator=g).tolist(), 5, torch.zeros(25, 4, dtype=torch.long), torch.zeros(25, 4))
            for _ in range(8)]
    torch.save(rows, data / "shard_0000.pt")
    out = tmp_path / "head"
    cfg = EagleTrainConfig(steps=2, batch_rows=4, seq_len=12, head_vocab=20, unroll=3, init=str(head_dir(0)), lr=0.0)
    train_eagle(tg, out, cfg, data=data, quiet=True)
    head, meta = load_eagle(out, tg)
    start, _ = load_eagle(head_dir(0), tg)
    # lr 0: the saved head is the init head (to bf16 rounding)
    for (name, a), b in zip(head.state_dict().items(), start.state_dict().values()):
        torch.testing.assert_close(a.float(), b.float().to(torch.bfloat16).float(), msg=name)
    assert meta["train"]["unroll"] == 3 and "top1_step3" in meta["final"]
    assert_drafts_exactly(tg, head, meta, prompts()[0], 8)


class _Tree:
    """What the cost model reads of a tree drafter: a tree of 5 nodes that gains `gain` tokens
    (its head's 2 ms a row are the policy's to time: `_fitted_policy`)."""

    usual_nodes = 5

    def __init__(self, gain: float) -> None:
        self.gain = gain

    def tree_tokens(self, k: int) -> float:
        return 1.0 + self.gain * min(1.0, k / 5)


def _fitted_policy(k_max: int = 5):
    """A LoadPolicy whose step-time fit says: a one-row step costs 10 ms plus 1 ms a guess slot;
    the head drafts a tree in 2 ms a row."""
    from specdec.core.policy import LoadPolicy

    policy = LoadPolicy(k_max)
    for i in range(32):
        policy.observe_step(1, i % (k_max + 1), 0.010 + 0.001 * (i % (k_max + 1)))
    policy.observe_head(1, 0.002, True)
    return policy


def test_auto_takes_the_tree_only_where_it_pays_more_than_the_lookup():
    """auto's choice (the scheduler's LoadPolicy, in generate and serve): a row without a lookup
    drafts the tree iff the tree's tokens per second, (1 + gain) / (step + 5 slots + the head's
    2 ms), beat a plain step's by TREE_MARGIN; a row whose lookup is worth more keeps it."""
    step = 1  # (not a probe step: step % 16 != 0)
    # plain: 1 token in 10 ms; a tree: (1 + gain) in 10 + 5 + 2 ms; pays iff 1 + gain > 1.7 * 1.05
    for gain, pays in ((0.9, True), (0.7, False)):
        k, use = _fitted_policy().choose_k([[]], [[1.0]], step, [True], _Tree(gain), room=[100])
        assert use == [pays] and (k == 5 if pays else k == 0), (gain, k, use)
    # a lookup of 3 guesses expected to commit 3.5 tokens beats a tree worth 1.9
    k, use = _fitted_policy().choose_k([[7, 8, 9]], [[1.0, 2.0, 2.8, 3.5]], step, [True], _Tree(0.9), room=[100])
    assert use == [False] and k == 3


def test_a_tree_that_does_not_pay_is_only_probed_and_greedy_stays_exact(monkeypatch):
    """While the cost model finds the tree not paying (its head priced far above a step), rows
    take plain lookups and the tree is drafted only as probes; greedy output stays equal to plain
    decoding whatever the choice (here also a random one each step)."""
    import random

    from transformers import AutoModelForCausalLM

    from specdec.core.policy import LoadPolicy

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
    hf.generation_config.pad_token_id = 0
    ps = prompts()
    want = [hf_greedy(hf, p, 80) for p in ps]
    monkeypatch.setattr(LoadPolicy, "head_cost", lambda self, A: 10.0 * A)
    d = drafter("lookup", depth=3, width=2, nodes=5)
    engine = Engine(target().model, d, k=3)
    res = [engine.generate([p], SamplingParams(max_new_tokens=80))[0] for p in ps]
    assert [x.tokens for x in res] == want
    steps = sum(x.stats.target_forwards for x in res)
    assert 0 < d.rows_drafted["eagle"] <= steps // 16 + len(ps)  # probes only
    noise = random.Random(0)
    monkeypatch.setattr(LoadPolicy, "head_cost", lambda self, A: noise.choice([0.0, 10.0]) * A)
    d = drafter("lookup", depth=3, width=2, nodes=5)
    res = Engine(target().model, d, k=3).generate(ps, SamplingParams(max_new_tokens=40))
    assert [x.tokens for x in res] == [w[:40] for w in want]
    assert d.rows_drafted["eagle"] > 0


def test_lookup_eagle_drafts_its_first_tree_as_a_probe_and_times_it_on_the_next_step(monkeypatch):
    """A fresh auto engine decodes with prompt lookup alone until the first probe (16 steps
    that would have drafted a tree); that probe catches the head up on the context, so the next
    step that may probe does so again, in steady state, and times the head (its cost measured). Greedy output
    stays equal to plain decoding. (Lookups are switched off, so that every step would draft a
    tree.)"""
    from transformers import AutoModelForCausalLM

    from specdec.drafters import ngram

    monkeypatch.setattr(ngram.SuffixIndex, "match", lambda *a, **k: (0, []))  # no lookups: every step wants the tree
    d = drafter("lookup", depth=3, width=2, nodes=5)
    p = prompts()[1]
    tree_steps, eagle_propose = [], d.eagle.propose

    def tree(ctx, k, rows=None, min_logp=None):
        tree_steps.append(len(ctx.tokens[0]) - len(p))  # the decode step it drafts for (0: the first)
        return eagle_propose(ctx, k, rows=rows, min_logp=min_logp)

    d.eagle.propose = tree
    engine = Engine(target().model, d, k=3)
    [res] = engine.generate([p], SamplingParams(max_new_tokens=60))
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
    hf.generation_config.pad_token_id = 0
    assert res.tokens == hf_greedy(hf, p, 60)
    # no tree before the first probe, 16 declined steps in; the probe (catching the head up) is
    # repeated at once in steady state (one step later if that step is the lookup's length probe)
    assert tree_steps[0] >= 15 and tree_steps[1] - tree_steps[0] <= 2, tree_steps
    assert engine.policy.head_time.weight > 0  # ... and timed the head's drafting


def test_head_forward_matches_a_plain_reference_layer():
    """The head's layer (roll-form rotary embedding from a cached table, fused q/k rotation)
    against a reference written out here with transformers' rotate_half and repeated K/V heads,
    at positions past the table's first size (so the table must grow)."""
    import torch.nn.functional as F

    tg = target(0)
    head, _ = load_eagle(head_dir(0), tg)
    head = head.float()
    D, H, Hkv, Dh = head.hidden, head.heads, head.kv_heads, head.head_dim
    g = torch.Generator().manual_seed(11)
    B, T = 2, 5
    emb, feat = torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g)
    pos = torch.tensor([[0, 1, 2, 3, 4], [3000, 3001, 3002, 3003, 3004]])

    def rot(x, p):  # x [B, h, T, Dh]
        freqs = p[..., None].float() * head.inv_freq
        e = torch.cat((freqs, freqs), -1)[:, None]
        half = torch.cat((-x[..., Dh // 2:], x[..., : Dh // 2]), -1)
        return x * e.cos() + half * e.sin()

    with torch.no_grad():
        x = F.linear(torch.cat((emb, feat), -1), head.fc.weight, head.fc.bias)
        h = F.rms_norm(x, (D,), head.attn_norm, head.eps)
        qkv = F.linear(h, head.wqkv.weight).view(B, T, H + 2 * Hkv, Dh).transpose(1, 2)
        q, k, v = rot(qkv[:, :H], pos), rot(qkv[:, H : H + Hkv], pos), qkv[:, H + Hkv :]
        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        att = (q @ k.transpose(-1, -2)) / Dh ** 0.5 + torch.full((T, T), float("-inf")).triu(1)
        o = (att.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * Dh)
        x = x + F.linear(o, head.wo.weight)
        gate, up = F.linear(F.rms_norm(x, (D,), head.mlp_norm, head.eps), head.w_gate_up.weight).chunk(2, -1)
        ref = x + F.linear(F.silu(gate) * up, head.w_down.weight)
        torch.testing.assert_close(head(emb, feat, pos), ref, atol=1e-5, rtol=1e-5)


def test_drafting_for_some_rows_equals_drafting_for_all():
    """`propose(..., rows=...)` drafts only the rows asked for (auto's rows that take the tree)
    and gives them the drafts a proposal for the whole batch gives; a row left out still has
    its new pairs fed, and drafts later as a row that never sat out."""
    from specdec.drafters.base import DraftContext

    g = torch.Generator().manual_seed(8)
    ps = [torch.randint(0, V, (n,), generator=g).tolist() for n in (40, 5, 23)]
    more = [torch.randint(0, V, (2,), generator=g).tolist() for _ in ps]
    tg = target()
    hid, hid2 = [], []
    for p, m in zip(ps, more):
        full = p + m
        _, h = tg.model(torch.tensor([full]), torch.arange(len(full))[None], tg.model.new_cache(1, 128))
        hid.append(h[0, : len(p)])
        hid2.append(h[0, len(p):])  # the features of the two tokens committed next
    every, some = drafter(True, depth=3, width=2, nodes=6), drafter(True, depth=3, width=2, nodes=6)
    for d in (every, some):
        d.begin(ps, SamplingParams(), 128)
    ctx = lambda toks, h: DraftContext([list(t) for t in toks], SamplingParams(), None, list(h))
    ref = every.propose(ctx(ps, hid), 3)
    part = some.propose(ctx(ps, hid), 3, rows=[0, 2])
    assert part.tokens.shape[0] == 2
    for i, b in enumerate([0, 2]):
        n = int(ref.counts[b])
        assert int(part.counts[i]) == n
        assert torch.equal(part.tokens[i, :n], ref.tokens[b, :n]) and torch.equal(part.parents[i, :n], ref.parents[b, :n])
    assert some.n == every.n  # row 1 sat out of the tree, not out of the cache
    toks2 = [p + m for p, m in zip(ps, more)]
    ref2 = every.propose(ctx(toks2, hid2), 3)
    got2 = some.propose(ctx(toks2, hid2), 3)
    assert some.n == every.n == [len(t) - 1 for t in toks2]
    assert torch.equal(got2.counts, ref2.counts)
    for b in range(3):
        n = int(ref2.counts[b])
        assert torch.equal(got2.tokens[b, :n], ref2.tokens[b, :n]) and torch.equal(got2.parents[b, :n], ref2.parents[b, :n])


@pytest.mark.parametrize("depth,width,nodes", [(3, 2, 5), (4, 3, 9), (2, 4, 4)])
def test_dynamic_tree_equals_a_path_by_path_reference(monkeypatch, depth, width, nodes):
    """The batched tree drafting (one head step per depth over the whole frontier, through
    the ancestry mask and the head's cache) proposes exactly the nodes of a slow reference
    that runs the head causally over each path's own sequence of pairs: EAGLE-2's rule (keep
    the `width` best frontier nodes per depth by cumulative log-probability, then the `nodes`
    best overall), for every row of a ragged batch."""
    from specdec.drafters.base import DraftContext

    monkeypatch.setenv("SPECDEC_DRAFT_FP32", "1")  # fp32 head in both, so scores agree to rounding
    g = torch.Generator().manual_seed(21)
    ps = [torch.randint(0, V, (n,), generator=g).tolist() for n in (9, 4, 14, 6, 11, 3, 8, 17)]
    tg = target()
    # a strongly perturbed head: peaked attention, so a node that missed an ancestor would show
    d = REGISTRY["eagle"](target=tg, draft=head_dir(0, V, 0.2), tree=True, depth=depth, width=width, nodes=nodes)
    hid = []
    for p in ps:
        _, h = tg.model(torch.tensor([p]), torch.arange(len(p))[None], tg.model.new_cache(1, 64))
        hid.append(h[0])
    d.begin(ps, SamplingParams(), 64)
    got = d.propose(DraftContext([list(p) for p in ps], SamplingParams(), None, list(hid)), depth)

    head = d.head
    E = tg.model.embed.weight.detach().float()
    Wt = tg.model.lm_head_weight().detach().float()

    def out_after(p, feats0, path_toks, path_feats):
        """The head's output at the last pair of committed pairs + a path's pairs."""
        toks = p[1:] + path_toks
        feats = torch.cat([feats0] + [f[None] for f in path_feats])
        with torch.no_grad():
            o = head(E[torch.tensor(toks)][None], feats[None], torch.arange(len(toks))[None])
        return o[0, -1]

    for b, p in enumerate(ps):
        feats0 = hid[b][: len(p) - 1]  # pair t = (feature t, token t + 1)
        root = out_after(p, feats0, [], [])
        # nodes: path (tuple of tokens) -> (score, feature the node's own pair carries)
        lp = torch.log_softmax(root @ Wt.T, -1)
        top = lp.topk(width)
        frontier = [((int(t),), float(s), root) for s, t in zip(top.values, top.indices)]
        nodes_all = {path: sc for path, sc, _ in frontier}
        for _ in range(1, depth):
            cands = []
            for path, sc, feat in frontier:
                chain_feats, f = [], root
                # features along the path: each node's pair carries its parent's output
                outs = []
                for j in range(len(path)):
                    chain_feats.append(f)
                    f = out_after(p, feats0, list(path[: j + 1]), chain_feats)
                    outs.append(f)
                lp = torch.log_softmax(outs[-1] @ Wt.T, -1)
                top = lp.topk(width)
                cands += [(path + (int(t),), sc + float(s), outs[-1]) for s, t in zip(top.values, top.indices)]
            cands.sort(key=lambda c: -c[1])
            for path, sc, _ in cands:
                nodes_all[path] = sc
            frontier = cands[:width]
        best = sorted(nodes_all.items(), key=lambda kv: -kv[1])[:nodes]
        want = {path for path, _ in best if all(path[:i] in nodes_all and path[:i] in dict(best) for i in range(1, len(path)))}
        # the proposal's paths
        n = int(got.counts[b])
        toks, pars = got.tokens[b, :n].tolist(), got.parents[b, :n].tolist()
        paths = []
        for i in range(n):
            paths.append((paths[pars[i] - 1] if pars[i] else ()) + (toks[i],))
        assert set(paths) == want, (b, sorted(paths), sorted(want))
