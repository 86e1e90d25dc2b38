"""EAGLE heads on tiny random targets: greedy output equals transformers' plain greedy output
(chain and dynamic tree, batch 1 and 3), sampled output follows the exact target distribution
(chi-square; chain with the head's q, tree with deterministic candidates), a head made for
another target is refused, and `specdec train eagle`'s pipeline runs end to end (features,
training, save, load) on local data shards. Head quality does not matter for exactness, so
the heads here are small random perturbations of the initialisation or a few training steps."""

from __future__ import annotations

import pytest
import torch

import helpers
from helpers import CTX, SV, V, head_dir, prompts, target, target_dir
from specdec import tree as tree_mod
from specdec.drafters.eagle import EagleDrafter, load_eagle
from specdec.engine import Engine
from specdec.train.eagle import EagleTrainConfig, train_eagle
from specdec.types import SamplingParams, SpecdecError

from oracle import chi2_against, hf_greedy


pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def drafter(tree: bool | str, seed: int = 0, vocab: int = V, **kw):
    """tree: False (the head's chain), True (its dynamic tree) or "lookup" (auto's sources: prompt
    lookup beside the tree)."""
    if tree == "lookup":
        return helpers.auto(seed, vocab, **kw)
    return helpers.eagle(tree, seed, vocab, **kw)


def used(results) -> dict:
    """Row-steps... guesses verified per source over the results (RequestStats.sources)."""
    out = {}
    for r in results:
        for name, (proposed, _) in r.stats.sources.items():
            out[name] = out.get(name, 0) + proposed
    return out


@pytest.mark.parametrize("tree,kw", [(False, {}), (True, dict(depth=3, width=2, nodes=5)),
                                     (True, dict(depth=4, width=3, nodes=12)),
                                     ("lookup", dict(depth=3, width=2, nodes=5)),
                                     ("lookup", dict(depth=2, width=2, nodes=4, trim=False))])
@pytest.mark.parametrize("batch", [1, 3])
def test_eagle_greedy_equals_transformers(monkeypatch, tree, kw, batch):
    from transformers import AutoModelForCausalLM

    # 14 tokens of a random text must see lookups too: an even prior (a fresh lookup declines
    # every lookup until one would have held)
    monkeypatch.setattr("specdec.drafters.ngram.NgramDrafter.prior", 0.5)
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
    hf.generation_config.pad_token_id = 0
    ps = prompts()[:batch]
    want = [hf_greedy(hf, p, 14) for p in ps]
    d = drafter(tree, **kw)
    engine = Engine(target().model, d, k=kw.get("depth", 3))
    engine.policy.eager = True  # every source priced free: 14 tokens see them all
    res = engine.generate(ps, SamplingParams(max_new_tokens=14))
    assert [r.tokens for r in res] == want
    assert sum(r.stats.proposed for r in res) > 0
    if tree == "lookup":
        assert used(res).get("ngram", 0) > 0 and used(res).get("eagle", 0) > 0, used(res)


@pytest.mark.parametrize("k", [4, 9])
def test_lookup_grafted_onto_the_tree_keeps_greedy_exact(monkeypatch, k):
    """Every row drafts the tree and its lookup is grafted on (shared prefixes merged, new
    nodes as a branch, within the step's k slots: 1 or 6 beyond a 3-node tree): greedy output
    still equals transformers'."""
    from transformers import AutoModelForCausalLM

    from specdec.policy import Choice, LoadPolicy

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
    hf.generation_config.pad_token_id = 0
    ps = prompts()
    want = [hf_greedy(hf, p, 24) for p in ps]
    # a fixed k whose every row takes the tree
    monkeypatch.setattr(LoadPolicy, "_fixed", lambda self, quotes, values, A: Choice(self.k_max, [1] * A))
    monkeypatch.setattr("specdec.drafters.ngram.NgramDrafter.prior", 0.5)
    engine = Engine(target().model, drafter("lookup", depth=2, width=2, nodes=3), k=k, fixed_k=True)
    grafts, graft = [], tree_mod.graft

    def counted(tokens, parents, seq, max_nodes):
        out = graft(tokens, parents, seq, max_nodes)
        grafts.append(len(out[0]) - len(tokens))
        return out

    monkeypatch.setattr(tree_mod, "graft", counted)
    res = engine.generate(ps, SamplingParams(max_new_tokens=24))
    assert [r.tokens for r in res] == want
    assert sum(grafts) > 0 and set(used(res)) == {"eagle"}, (grafts, used(res))


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


@pytest.mark.parametrize("tree,params", [(False, dict(temperature=1.0)), (False, dict(temperature=0.7, top_k=6)),
                                         (True, dict(temperature=0.8, top_p=0.9)),
                                         ("lookup", dict(temperature=0.9))])
def test_eagle_sampling_matches_exact_distribution(monkeypatch, tree, params):
    from transformers import AutoModelForCausalLM

    # lookups must be verified too, on a random text whose lookups rarely hold: an even prior
    # (a fresh lookup declines every lookup until one would have held)
    monkeypatch.setattr("specdec.drafters.ngram.NgramDrafter.prior", 0.5)
    tg = target(3, SV)
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(3, SV)), dtype=torch.float32).eval()
    rows = [list(CTX[i % 2]) for i in range(800)]
    out = {c: [] for c in CTX}
    proposed = accepted = 0
    for s in range(5):
        # a fixed k, gate off: trees (and chains drawn from the head's q) at every step, so the check
        # covers them (under the cost model a seeded request takes deterministic guesses, when they pay)
        d = drafter(tree, 3, SV, depth=2, width=3, nodes=6)
        res = Engine(tg.model, d, k=2, fixed_k=True).generate(rows, SamplingParams(max_new_tokens=4, seed=700 + s,
                                                                                   **params))
        for p, r in zip(rows, res):
            out[tuple(p)].append(r.tokens[:3])
            proposed += r.stats.proposed
            accepted += r.stats.accepted
        sources = used(res)
    assert proposed > 0 and 0 < accepted < proposed
    if tree == "lookup":  # lookups alone, and trees (with a lookup grafted on where it had one)
        assert sources.get("ngram", 0) > 0 and sources.get("eagle", 0) > 0, sources

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
    # the stores keep their room through a permutation (a gather) and into the next batch, whose
    # rows start empty: a server's next burst of rows joins without copying the stores again
    stores, room = d._ks, d._ks.shape[0]
    assert room >= 5
    d.k.copy_(torch.randn(d.k.shape, generator=g))
    d.begin([], None, 40)
    for _ in range(5):
        d.add_row(40)
    assert d._ks is stores and d._ks.shape[0] == room
    assert not d.k.any() and not d.v.any() and d.n == [0] * 5
    d.begin([], None, 48)  # another context: stores of another shape
    assert d._ks is not stores and d.k.shape[0] == 0


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
    d = drafter(True, depth=2, width=2, nodes=40)
    with pytest.raises(SpecdecError, match="does not fit"):
        d.begin([prompts()[0]], SamplingParams(), 40)
    d = drafter(True, depth=2, width=2, nodes=300)
    with pytest.raises(SpecdecError, match="at most 48 guesses"):
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
        d = drafter(True, depth=3, width=2, nodes=6, trim=False)
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


def test_a_tree_that_does_not_pay_is_only_probed_and_greedy_stays_exact(monkeypatch):
    """While the cost model finds the tree not paying (its head priced far above a step), rows
    take plain lookups and the tree is drafted only as probes; greedy output stays equal to plain
    decoding whatever the choice (here also a random one each step)."""
    import random

    from transformers import AutoModelForCausalLM

    from specdec.policy import SourceStats

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
    hf.generation_config.pad_token_id = 0
    ps = prompts()
    want = [hf_greedy(hf, p, 80) for p in ps]
    dear = lambda self, rows: 10.0 * rows if self.name == "eagle" else 0.0  # noqa: E731
    monkeypatch.setattr(SourceStats, "draft_seconds", dear)
    engine = Engine(target().model, drafter("lookup", depth=3, width=2, nodes=5), k=3)
    res = [engine.generate([p], SamplingParams(max_new_tokens=80))[0] for p in ps]
    assert [x.tokens for x in res] == want
    steps = sum(x.stats.target_forwards for x in res)
    assert used(res).get("eagle", 0) <= 5 * (steps // 16 + len(ps)), used(res)  # probes only
    # a random choice each step (plain, the lookup or the tree, per row): whatever is verified,
    # the text stays plain decoding's
    from specdec.policy import Choice

    noise = random.Random(0)
    engine = Engine(target().model, drafter("lookup", depth=3, width=2, nodes=5), k=3)

    def choose(quotes, step, room, fixed=False):
        names = [q.stats.name for q in quotes]
        src = []
        for b in range(len(room)):
            pick = noise.choice([None, "eagle", "ngram"])
            src.append(names.index(pick) if pick in names and quotes[names.index(pick)].ok[b] else None)
        drafted = any(i is not None for i in src)
        return Choice(engine.policy.k_max if drafted else 0, src, reason="" if drafted else "cost")

    monkeypatch.setattr(engine.policy, "choose", choose)
    res = engine.generate(ps, SamplingParams(max_new_tokens=40))
    assert [x.tokens for x in res] == [w[:40] for w in want]
    assert used(res).get("eagle", 0) > 0 and used(res).get("ngram", 0) > 0, used(res)


def test_a_fresh_auto_scheduler_times_the_head_alone_and_prices_its_trees(monkeypatch):
    """A fresh auto engine times the EAGLE head alone (a few proposals on a scratch cache) before
    any request, so its trees are priced from the first step, catch-up included; priced as cheap,
    the trees are drafted. Greedy output stays equal to plain decoding either way. (Lookups are off,
    so only the tree could guess; the clock is steady, so the choice is the same on any machine.)"""
    from transformers import AutoModelForCausalLM

    from specdec.drafters import ngram
    from specdec.policy import FIT_DECAY, DecayedLine

    monkeypatch.setattr(ngram.SuffixIndex, "match", lambda *a, **k: (0, []))
    helpers.steady_clock(monkeypatch)
    p = prompts()[1]
    engine = Engine(target().model, drafter("lookup", depth=3, width=2, nodes=5), k=3)
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
    hf.generation_config.pad_token_id = 0
    want = hf_greedy(hf, p, 60)
    [res] = engine.generate([p], SamplingParams(max_new_tokens=60))
    assert res.tokens == want
    head = engine.policy.sources["eagle"]
    assert head.timed and head.t_catch is not None
    head.time, head.t_catch = DecayedLine(FIT_DECAY), 0.0
    head.time.observe(1, 1e-6)
    [res] = engine.generate([p], SamplingParams(max_new_tokens=60))
    assert res.tokens == want
    assert res.stats.sources.get("eagle", [0])[0] > 0


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
    """A proposal for some rows (`DraftContext.want`: auto's rows that take the tree) drafts only
    those and gives them the drafts a proposal for the whole batch gives; a row left out has no
    guesses, still has its new pairs fed, and drafts later as a row that never sat out."""
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
    every, some = (drafter(True, depth=3, width=2, nodes=6, trim=False) for _ in range(2))
    for d in (every, some):
        d.begin(ps, SamplingParams(), 128)
    ctx = lambda toks, h, want=None: DraftContext([list(t) for t in toks], SamplingParams(), None, list(h),  # noqa: E731
                                                  want=want)
    ref = every.propose(ctx(ps, hid), 3)
    part = some.propose(ctx(ps, hid, [True, False, True]), 3)
    assert part.tokens.shape[0] == 3 and int(part.counts[1]) == 0
    for b in [0, 2]:
        n = int(ref.counts[b])
        assert int(part.counts[b]) == n
        assert torch.equal(part.tokens[b, :n], ref.tokens[b, :n]) and torch.equal(part.parents[b, :n], ref.parents[b, :n])
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
    head, _ = load_eagle(head_dir(0, V, 0.2), tg)
    d = EagleDrafter(head, tg.model, None, tree=True, depth=depth, width=width, nodes=nodes, trim=False)
    hid = []
    for p in ps:
        _, h = tg.model(torch.tensor([p]), torch.arange(len(p))[None], tg.model.new_cache(1, 64))
        hid.append(h[0])
    d.begin(ps, SamplingParams(), 64)
    got = d.propose(DraftContext([list(p) for p in ps], SamplingParams(), None, list(hid)), nodes)

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


@pytest.mark.parametrize("tree", [False, True])
def test_a_far_behind_row_reads_its_last_window(monkeypatch, tree):
    """A row further behind than CATCH_UP_WINDOW pairs (a prompt, declined steps) reads only the
    last window, into a cache started there: the head's output at the pending token equals its
    training forward (`EagleHead.forward`, causal) over those pairs alone, after a catch-up
    within the window on the same cache, and after a second far one (a cache left with a hole
    where the window starts is caught); the chain's next guess is the head over the window and
    its first guess; the lag priced is the window. (Positions are the text's; the rotation being
    relative, a shifted position would give the same guesses.)"""
    from specdec.drafters.base import DraftContext

    monkeypatch.setattr(EagleDrafter, "CATCH_UP_WINDOW", 8)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, V, (60,), generator=g).tolist()
    tg = target()
    _, hid = tg.model(torch.tensor([prompt]), torch.arange(len(prompt))[None], tg.model.new_cache(1, 128))
    hid = hid[0]
    d = drafter(tree, depth=3, width=2, nodes=6, trim=False)
    head = d.head

    def oracle(tokens, first):
        """The head's output at the last pair, over pairs first .. len(tokens) - 2 alone."""
        idx = torch.arange(first, len(tokens) - 1)
        emb = d.embed(torch.tensor(tokens)[idx + 1])[None]
        with torch.inference_mode():
            out = head(emb.to(d.dtype), hid[idx][None].to(d.dtype), idx[None])
        return out[0, -1]

    d.begin([prompt], SamplingParams(), 128)
    assert d.lags([prompt]) == [8]  # priced as the window, not the 59 pairs behind it
    d.propose(DraftContext([list(prompt[:30])], SamplingParams(), None, [hid[:29]]), 3)
    assert d.base == [21] and d.n == [29]
    assert torch.allclose(d.last_h[0].float(), oracle(prompt[:30], 21).float(), atol=1e-4)
    # 5 more pairs (within the window): read on top of the same cache
    d.propose(DraftContext([list(prompt[:35])], SamplingParams(), None, [hid[29:34]]), 3)
    assert d.base == [21] and d.n == [34]
    assert torch.allclose(d.last_h[0].float(), oracle(prompt[:35], 21).float(), atol=1e-4)
    # far behind again: the cache starts over at the new window
    draft = d.propose(DraftContext([list(prompt)], SamplingParams(), None, [hid[34:]]), 3)
    assert d.base == [51] and d.n == [59]
    assert torch.allclose(d.last_h[0].float(), oracle(prompt, 51).float(), atol=1e-4)
    if not tree:  # the chain's second guess: the head over the window and its first guess, at position 59
        first = d._ids(d._logits(d.last_h).argmax(-1))
        assert int(draft.tokens[0, 0]) == int(first[0])
        idx = torch.arange(51, 59)
        emb = d.embed(torch.cat((torch.tensor(prompt)[idx + 1], first)))[None].to(d.dtype)
        feats = torch.cat((hid[idx].to(d.dtype), d.last_h.to(d.dtype)))[None]
        with torch.inference_mode():
            out = head(emb, feats, torch.arange(51, 60)[None])
        assert int(draft.tokens[0, 1]) == int(d._ids(d._logits(out[0, -1:]).argmax(-1))[0])
    # a wrong reading (the whole backlog) would differ: the check can fail
    assert not torch.allclose(oracle(prompt, 0).float(), oracle(prompt, 51).float(), atol=1e-4)
