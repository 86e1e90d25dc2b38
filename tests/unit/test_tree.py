"""Token trees: the pure helpers, the model's one-forward tree scoring and cache compaction
(against recomputation of each path as a chain), and exactness of tree verification
against independent oracles: greedy output == transformers' plain greedy output, and the
sampled distribution == the exact target distribution (chi-square), with i.i.d. sampled
children (duplicates under one parent), deterministic top-k children, the same token under
two parents, batches of ragged trees, and a broken rule that the same check must catch."""

from __future__ import annotations

import functools

import pytest
import torch

import specdec.core.step
import specdec.engine
from specdec import tree
from specdec.engine import Engine
from specdec.types import SamplingParams

from helpers import CTX, SV
from oracle import TreeDrafter, broken_tree_verify, chi2_views, exact_joint, hf_greedy, native_of, tiny_hf_llama


pytestmark = pytest.mark.usefixtures("one_thread_per_module")


# ---------------------------------------------------------------------------------------
# pure helpers
# ---------------------------------------------------------------------------------------

PARENTS = [0, 0, 1, 1, 2]  # the example in tree.py's docstring


def test_depths_mask_paths_children():
    assert tree.depths(PARENTS) == [0, 1, 1, 2, 2, 2]
    m = tree.ancestor_mask(PARENTS)
    assert m[4].nonzero().flatten().tolist() == [0, 1, 4]
    assert m[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert m[2].nonzero().flatten().tolist() == [0, 2]
    assert tree.path_to(PARENTS, 5) == [0, 2, 5]
    assert tree.children(PARENTS) == [[1, 2], [3, 4], [5], [], [], []]
    assert tree.ancestor_mask(tree.chain(3)).equal(torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_bad_parents_are_refused():
    with pytest.raises(ValueError, match="earlier node"):
        tree.check_parents([0, 2])
    with pytest.raises(ValueError):
        tree.check_parents([-1])


def test_trie_merges_shared_prefixes():
    toks, pars = tree.trie([[5, 6, 7], [5, 6, 8], [9], [5, 1]])
    assert toks == [5, 6, 7, 8, 9, 1]
    assert pars == [0, 1, 2, 2, 0, 1]
    toks, pars = tree.trie([[5, 6, 7], [9, 9]], max_nodes=4)
    assert toks == [5, 6, 7, 9] and pars == [0, 1, 2, 0]


def test_graft_adds_a_chain_to_a_tree():
    # tree: 5 -> (6 -> 7), 5 -> 8, 9 (root's second child)
    toks, pars = [5, 6, 8, 9, 7], [0, 1, 1, 0, 2]
    # follows 5 -> 6 -> 7, then branches off node 5 (the 7) with 1, 2
    assert tree.graft(toks, pars, [5, 6, 7, 1, 2], 10) == (toks + [1, 2], pars + [5, 6])
    # shares only the root's child 9, then a new branch under it
    assert tree.graft(toks, pars, [9, 4], 10) == (toks + [4], pars + [4])
    # nothing new: unchanged; a chain that shares nothing hangs from the root
    assert tree.graft(toks, pars, [5, 8], 10) == (toks, pars)
    assert tree.graft(toks, pars, [3, 3], 10) == (toks + [3, 3], pars + [0, 6])
    # the cap counts every node; the result is a valid tree with no duplicate siblings
    t2, p2 = tree.graft(toks, pars, [5, 6, 7, 1, 2, 3], 6)
    assert t2 == toks + [1] and p2 == pars + [5]
    tree.check_parents(p2)
    assert len({(p, t) for t, p in zip(t2, p2)}) == len(t2)
    assert tree.graft([], [], [4, 4], 1) == ([4], [0])


def test_prune_keeps_a_subtree_in_order_with_parents_renumbered():
    # tree: 5 -> (6 -> 7), 5 -> 8, 9 (root's second child)
    toks, pars = [5, 6, 8, 9, 7], [0, 1, 1, 0, 2]
    assert tree.prune(toks, pars, [5, 1, 2]) == ([5, 6, 7], [0, 1, 2])  # any order in, tree order out
    assert tree.prune(toks, pars, [4, 1, 3]) == ([5, 8, 9], [0, 1, 0])
    assert tree.prune(toks, pars, []) == ([], [])
    assert tree.prune(toks, pars, range(1, 6)) == (toks, pars)
    with pytest.raises(ValueError, match="without its parent"):
        tree.prune(toks, pars, [1, 5])  # node 5 hangs under node 2


def test_batch_and_masks_pad_ragged_trees():
    toks, pars, counts, mask, depth = tree.batch([([3, 4, 5], [0, 1, 0]), ([7], [0])])
    assert toks.tolist() == [[3, 4, 5], [7, 0, 0]] and counts.tolist() == [3, 1]
    assert depth.tolist() == [[0, 1, 2, 1], [0, 1, 1, 1]]  # padding hangs from the root
    assert mask[1, 2].nonzero().flatten().tolist() == [0, 2]
    par, mask2, depth2 = tree.masks(torch.tensor([[0, 1, 0], [0, 1, 2]]), torch.tensor([3, 1]))
    assert par.tolist() == [[0, 1, 0], [0, 0, 0]]
    assert mask2.equal(mask) and depth2.equal(depth)


# ---------------------------------------------------------------------------------------
# the model scores a tree in one forward; the cache keeps one path
# ---------------------------------------------------------------------------------------

V = 32


@functools.lru_cache(maxsize=None)
def greedy_models():
    target_hf = tiny_hf_llama(0, vocab=V)
    draft_hf = tiny_hf_llama(1, vocab=V, layers=1)
    return target_hf, native_of(target_hf), draft_hf


def test_tree_forward_equals_each_path_as_a_chain_and_compact_equals_recomputation():
    _, model, _ = greedy_models()
    ctx = [[1, 2, 3, 4, 5], [6, 7, 8]]
    trees = [([10, 11, 12, 13, 11], PARENTS), ([20, 21], [0, 0])]
    toks, pars, counts, mask, depth = tree.batch(trees)
    cache = model.new_cache(2, 32)
    lens = torch.tensor([len(c) for c in ctx])
    pre = torch.zeros(2, 5, dtype=torch.long)
    for b, c in enumerate(ctx):
        pre[b, : len(c)] = torch.tensor(c)
    model(pre, torch.arange(5)[None].expand(2, 5), cache, logits_at=(lens - 1)[:, None])
    cache.truncate(lens - 1)  # the last context token is the pending root
    base = cache.lengths.clone()
    inp = torch.cat([torch.tensor([[c[-1]] for c in ctx]), toks], 1)
    logits, _ = model(inp, base[:, None] + depth, cache, attn_mask=mask)
    for b, (t, p) in enumerate(trees):
        for node in range(len(t) + 1):
            path = tree.path_to(p, node)
            chain = ctx[b] + [t[j - 1] for j in path[1:]]
            c2 = model.new_cache(1, 32)
            ref, _ = model(torch.tensor([chain]), torch.arange(len(chain))[None], c2, logits_at=torch.tensor([[len(chain) - 1]]))
            torch.testing.assert_close(logits[b, node], ref[0, 0], atol=1e-5, rtol=1e-5)
    # keep path [0, 2, 5] in row 0 and [0, 2] in row 1, then compare the cache with a fresh prefill
    keep = torch.tensor([[0, 2, 5], [0, 2, 0]])
    cache.compact(base, keep, torch.tensor([3, 2]))
    for b, nodes in enumerate(([0, 2, 5], [0, 2])):
        t = trees[b][0]
        chain = ctx[b] + [t[j - 1] for j in nodes[1:]]
        c2 = model.new_cache(1, 32)
        model(torch.tensor([chain]), torch.arange(len(chain))[None], c2, logits_at=torch.tensor([[0]]))
        n = len(chain)
        assert int(cache.lengths[b]) == n
        for layer in range(len(cache.k)):
            torch.testing.assert_close(cache.k[layer][b, :, :n], c2.k[layer][0, :, :n], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(cache.v[layer][b, :, :n], c2.v[layer][0, :, :n], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# greedy exactness
# ---------------------------------------------------------------------------------------

N_NEW = 16


@functools.lru_cache(maxsize=None)
def greedy_prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 9, 7)]


@pytest.mark.parametrize("drafter,mode,branching", [("draft", "topk", (2, 2)), ("target", "topk", (2, 2)),
                                                     ("target", "corrupt", (3, 2, 1)), ("draft", "topk", (1, 1, 1, 1))])
@pytest.mark.parametrize("batch", [1, 3])
def test_tree_greedy_equals_transformers(drafter, mode, branching, batch):
    target_hf, target, draft_hf = greedy_models()
    ps = greedy_prompts()[:batch]
    want = [hf_greedy(target_hf, p, N_NEW) for p in ps]
    d = TreeDrafter(draft_hf if drafter == "draft" else target_hf, branching, mode=mode)
    res = Engine(target, d, k=len(branching)).generate(ps, SamplingParams(max_new_tokens=N_NEW))
    assert [r.tokens for r in res] == want
    accepted = [n for step in d.commits for n in step]
    if drafter == "target":  # the target's own top-1 is among the children: long paths are accepted
        assert max(accepted) >= 2, "no tree path of two or more tokens was ever accepted"
    if mode == "corrupt":
        assert 0 in accepted and 1 in accepted  # rejections at the root and below it
    # paths name real nodes, and each accepted path is a root-to-node path of the proposed tree
    assert all(all(j >= 1 for j in p) for step in d.paths_seen for p in step)


def test_tree_respects_max_new_tokens_inside_an_accepted_path():
    target_hf, target, _ = greedy_models()
    p = greedy_prompts()[0]
    want = hf_greedy(target_hf, p, 5)
    d = TreeDrafter(target_hf, (2, 2, 2), mode="topk")
    [r] = Engine(target, d, k=3).generate([p], SamplingParams(max_new_tokens=5))
    assert r.tokens == want and r.stats.finish_reason == "length"


# ---------------------------------------------------------------------------------------
# sampling exactness (chi-square against the exact distribution)
# ---------------------------------------------------------------------------------------

ROWS, CALLS = 800, 5


@functools.lru_cache(maxsize=None)
def sampling_models():
    target_hf = tiny_hf_llama(3, vocab=SV, logit_scale=1.5)
    draft_hf = tiny_hf_llama(4, vocab=SV, layers=1, logit_scale=1.5)
    return target_hf, native_of(target_hf), draft_hf


@functools.lru_cache(maxsize=None)
def exact(ctx, temperature, top_k, top_p):
    return exact_joint(sampling_models()[0], list(ctx), 3, temperature, top_k, top_p)


def sample_tree(mode, branching, params, seed0, calls=CALLS):
    target_hf, target, draft_hf = sampling_models()
    prompts = [list(CTX[i % 2]) for i in range(ROWS)]
    warp_args = (params["temperature"], params.get("top_k", 0), params.get("top_p", 1.0))
    out = {c: [] for c in CTX}
    acc_depth = [0, 0, 0]
    for s in range(calls):
        # deterministic candidates: the target's own top tokens (so deep paths get accepted);
        # sampled children: the independent draft model's q
        d = TreeDrafter(target_hf if mode == "topk" else draft_hf, branching, mode=mode, warp_args=warp_args)
        res = Engine(target, d, k=len(branching), fixed_k=True).generate(prompts, SamplingParams(max_new_tokens=4, seed=seed0 + s, **params))
        for p, r in zip(prompts, res):
            out[tuple(p)].append(r.tokens[:3])
        for step in d.commits[:1]:  # the first decode step decides x2 and x3
            for n in step:
                acc_depth[min(n, 2)] += 1
    return {c: torch.tensor(v) for c, v in out.items()}, acc_depth


TREE_SETTINGS = [
    ("iid-2x2-t1.0", "iid", (2, 2), dict(temperature=1.0)),
    ("iid-3x1-t0.7-topk6", "iid", (3, 1), dict(temperature=0.7, top_k=6)),
    ("topk-2x2-t0.8-topp0.9", "topk", (2, 2), dict(temperature=0.8, top_p=0.9)),
    ("topk-3x2-t1.0", "topk", (3, 2), dict(temperature=1.0)),
]


@pytest.mark.parametrize("name,mode,branching,params", TREE_SETTINGS, ids=[s[0] for s in TREE_SETTINGS])
def test_tree_sampling_matches_exact_distribution(name, mode, branching, params):
    seed0 = 5000 + 100 * [s[0] for s in TREE_SETTINGS].index(name)
    samples, acc_depth = sample_tree(mode, branching, params, seed0)
    # verification decided x2 and x3: paths of length 0, 1 and 2 all happened
    assert all(n > 0.02 * ROWS * CALLS for n in acc_depth), acc_depth
    for label, res in chi2_views(samples, params, exact):
        assert not res.rejected, f"{name} {label}: tree samples differ from the exact distribution: {res}"


@pytest.mark.parametrize("name", ["iid-2x2-t1.0", "topk-2x2-t0.8-topp0.9"])
def test_broken_tree_rule_is_caught(monkeypatch, name):
    _, mode, branching, params = next(s for s in TREE_SETTINGS if s[0] == name)
    monkeypatch.setattr(specdec.core.step, "verify_tree_stochastic", broken_tree_verify)
    samples, _ = sample_tree(mode, branching, params, seed0=99, calls=3)
    results = chi2_views(samples, params, exact)
    assert any(r.rejected for _, r in results), [f"{lb}: {r}" for lb, r in results]


def test_best_nodes_keeps_the_likeliest_nodes_with_their_parents():
    """The m likeliest nodes by path probability, in the original order with parents renumbered;
    a node's probability never exceeds its parent's, so no kept node loses its parent."""
    from specdec.tree import best_nodes

    #        root
    #   1(.6)     2(.3)
    #  3(.5) 4(.05)  5(.2)
    toks, pars, probs = [10, 20, 30, 40, 50], [0, 0, 1, 1, 2], [0.6, 0.3, 0.5, 0.05, 0.2]
    assert best_nodes(toks, pars, probs, 3) == ([10, 20, 30], [0, 0, 1], [0.6, 0.3, 0.5])
    assert best_nodes(toks, pars, probs, 2) == ([10, 30], [0, 1], [0.6, 0.5])
    assert best_nodes(toks, pars, probs, 4) == ([10, 20, 30, 50], [0, 0, 1, 2], [0.6, 0.3, 0.5, 0.2])
    assert best_nodes(toks, pars, probs, 9) == (toks, pars, probs)
