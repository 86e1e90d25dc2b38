"""KV cache rollback (truncate), tree-path acceptance (compact) and capacity checks,
each measured against transformers recomputing the whole sequence from scratch."""

from __future__ import annotations

import pytest
import torch

from model_helpers import TOL, ancestor_mask, get_pair, maxdiff, path_to, prefill_ragged, random_tokens
from specdec.kv_cache import KVCache, with_room
from specdec.types import SpecdecError


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_truncate_then_refeed_equals_scratch(family):
    p = get_pair(family)
    lens = [10, 15, 7]
    true = [random_tokens(n + 6, seed=20 + b) for b, n in enumerate(lens)]
    wrong = torch.tensor([random_tokens(4, seed=30 + b) for b in range(3)])
    cache, _, L = prefill_ragged(p.native, [t[:n] for t, n in zip(true, lens)])
    # feed 4 tokens: the first `keep[b]` are right, the rest wrong (a rejected draft)
    keep = [1, 3, 0]
    feed = wrong.clone()
    for b in range(3):
        feed[b, : keep[b]] = torch.tensor(true[b][lens[b] : lens[b] + keep[b]])
    p.native(feed, L[:, None] + torch.arange(4)[None], cache)
    assert cache.lengths.tolist() == [n + 4 for n in lens]
    cache.truncate(L + torch.tensor(keep))
    assert cache.lengths.tolist() == [n + k for n, k in zip(lens, keep)]
    # re-feed: the next 3 true tokens of each row
    at = [n + k for n, k in zip(lens, keep)]
    toks = torch.tensor([true[b][at[b] : at[b] + 3] for b in range(3)])
    pos = torch.stack([torch.arange(a, a + 3) for a in at])
    logits, _ = p.native(toks, pos, cache)
    for b in range(3):
        ref = p.ref_logits(true[b][: at[b] + 3])[0, -3:]
        assert maxdiff(logits[b], ref) <= TOL, f"row {b}"


def test_truncate_accepts_int_and_list(llama_pair):
    seq = random_tokens(12, seed=40)
    for form in (8, [8], torch.tensor([8])):
        cache = llama_pair.native.new_cache(1, 32)
        llama_pair.native(torch.tensor([seq]), torch.arange(12)[None], cache)
        cache.truncate(form)
        assert cache.lengths.tolist() == [8]
        logits, _ = llama_pair.native(torch.tensor([seq[8:10]]), torch.tensor([[8, 9]]), cache)
        assert maxdiff(logits[0], llama_pair.ref_logits(seq[:10])[0, 8:10]) <= TOL


@pytest.mark.parametrize("family", ["llama", "qwen2", "llama3_rope"])
def test_compact_tree_path_equals_chain(family):
    p = get_pair(family)
    # one tree per row (N = 7 nodes); node 0 is the root
    parents = [
        [-1, 0, 0, 1, 2, 4, 0],  # path [0, 2, 4, 5] skips nodes 1 and 3
        [-1, 0, 1, 2, 0, 4, 5],  # path of length 0: nothing accepted
        [-1, 0, 0, 2, 1, 3, 3],  # path [0, 2, 3, 6] skips 1, 4, 5
        [-1, 0, 1, 2, 3, 4, 5],  # a chain, fully accepted
        [-1, 0, 0, 0, 3, 3, 5],  # path [0]: just the root
    ]
    paths = [[0, 2, 4, 5], [], [0, 2, 3, 6], [0, 1, 2, 3, 4, 5, 6], [0]]
    for pa, path in zip(parents, paths):  # the test's own paths are real root-to-node paths
        assert not path or path_to(pa, path[-1]) == path
    B, N = len(parents), 7
    lens = [9, 14, 5, 11, 8]
    prompts = [random_tokens(n, seed=50 + b) for b, n in enumerate(lens)]
    nodes = torch.tensor([random_tokens(N, seed=60 + b) for b in range(B)])
    nxt = [random_tokens(3, seed=70 + b) for b in range(B)]

    cache, _, base = prefill_ragged(p.native, prompts)
    mask = torch.stack([ancestor_mask(pa) for pa in parents])
    depth = torch.tensor([[len(path_to(pa, i)) - 1 for i in range(N)] for pa in parents])
    p.native(nodes, base[:, None] + depth, cache, attn_mask=mask)

    P = max(len(x) for x in paths)
    path_t = torch.zeros(B, P, dtype=torch.long)
    for b, path in enumerate(paths):
        path_t[b, : len(path)] = torch.tensor(path, dtype=torch.long)
    path_lens = torch.tensor([len(x) for x in paths])
    cache.compact(base, path_t, path_lens)
    assert cache.lengths.tolist() == (base + path_lens).tolist()

    chains = [prompts[b] + [int(nodes[b, j]) for j in paths[b]] for b in range(B)]
    # next token, then a chunk of 2, fed after the accepted path
    at = [len(c) for c in chains]
    for lo, hi in ((0, 1), (1, 3)):
        toks = torch.tensor([nxt[b][lo:hi] for b in range(B)])
        pos = torch.stack([torch.arange(at[b] + lo, at[b] + hi) for b in range(B)])
        logits, _ = p.native(toks, pos, cache)
        for b in range(B):
            ref = p.ref_logits(chains[b] + nxt[b][:hi])[0, -(hi - lo):]
            assert maxdiff(logits[b], ref) <= TOL, f"row {b} path {paths[b]} tokens {lo}:{hi}"


def test_compact_single_row_uniform(llama_pair):
    """Batch of one (the uniform fast path of write/reserve) with a skipping path."""
    p = llama_pair
    prompt = random_tokens(10, seed=80)
    parents = [-1, 0, 0, 1, 2]
    nodes = random_tokens(5, seed=81)
    cache = p.native.new_cache(1, 32)
    p.native(torch.tensor([prompt]), torch.arange(10)[None], cache)
    depth = torch.tensor([[0, 1, 1, 2, 2]])
    p.native(torch.tensor([nodes]), 10 + depth, cache, attn_mask=ancestor_mask(parents)[None])
    cache.compact(torch.tensor([10]), torch.tensor([[0, 2, 4]]), torch.tensor([3]))
    chain = prompt + [nodes[0], nodes[2], nodes[4]]
    t = random_tokens(1, seed=82)
    logits, _ = p.native(torch.tensor([t]), torch.tensor([[13]]), cache)
    assert maxdiff(logits[0, 0], p.ref_logits(chain + t)[0, -1]) <= TOL


def test_truncate_refuses_to_lengthen():
    c = KVCache(num_layers=1, batch_size=2, num_kv_heads=1, head_dim=4, max_len=16)
    c.reserve(5)
    with pytest.raises((ValueError, SpecdecError)):
        c.truncate([6, 5])
    with pytest.raises((ValueError, SpecdecError)):
        c.truncate(-1)
    assert c.lengths.tolist() == [5, 5]
    c.truncate([5, 2])
    assert c.lengths.tolist() == [5, 2]
    with pytest.raises((ValueError, SpecdecError)):
        c.truncate([5, 3])  # row 1 is at 2 now


def test_reserve_raises_when_full():
    c = KVCache(num_layers=1, batch_size=2, num_kv_heads=1, head_dim=4, max_len=8)
    start, uniform = c.reserve(5)
    assert start.tolist() == [0, 0] and uniform == 0
    with pytest.raises(SpecdecError):
        c.reserve(4)
    assert c.lengths.tolist() == [5, 5]  # a refused reserve changes nothing
    c.truncate([5, 2])
    start, uniform = c.reserve(3)  # the longest row decides: 5 + 3 == 8 fits
    assert start.tolist() == [5, 2] and uniform is None
    with pytest.raises(SpecdecError):
        c.reserve(1)


def test_model_forward_raises_when_cache_full(llama_pair):
    cache = llama_pair.native.new_cache(1, 8)
    llama_pair.native(torch.tensor([random_tokens(6, seed=90)]), torch.arange(6)[None], cache)
    with pytest.raises(SpecdecError):
        llama_pair.native(torch.tensor([random_tokens(3, seed=91)]), torch.arange(6, 9)[None], cache)


def test_reorder_rows_then_continue(llama_pair):
    p = llama_pair
    lens = [6, 9, 12]
    full = [random_tokens(n + 2, seed=100 + b) for b, n in enumerate(lens)]
    cache, _, _ = prefill_ragged(p.native, [f[:n] for f, n in zip(full, lens)])
    cache.reorder_rows(torch.tensor([2, 0]))
    toks = torch.tensor([full[2][12:14], full[0][6:8]])
    pos = torch.tensor([[12, 13], [6, 7]])
    logits, _ = p.native(toks, pos, cache)
    assert maxdiff(logits[0], p.ref_logits(full[2])[0, -2:]) <= TOL
    assert maxdiff(logits[1], p.ref_logits(full[0])[0, -2:]) <= TOL


def test_compact_with_empty_paths(llama_pair):
    """Every row rejects the whole tree: paths [B, 0], the cache returns to `base`."""
    p = llama_pair
    prompts = [random_tokens(5, seed=110), random_tokens(8, seed=111)]
    cache, _, base = prefill_ragged(p.native, prompts)
    nodes = torch.tensor([random_tokens(3, seed=112), random_tokens(3, seed=113)])
    mask = ancestor_mask([-1, 0, 0])[None].expand(2, 3, 3)
    p.native(nodes, base[:, None] + torch.tensor([[0, 1, 1]]), cache, attn_mask=mask)
    cache.compact(base, torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    assert cache.lengths.tolist() == base.tolist()
    t = [random_tokens(1, seed=114), random_tokens(1, seed=115)]
    logits, _ = p.native(torch.tensor(t), base[:, None], cache)
    for b in range(2):
        assert maxdiff(logits[b, 0], p.ref_logits(prompts[b] + t[b])[0, -1]) <= TOL


@pytest.mark.parametrize("B", [1, 3])
def test_compact_moves_match_a_slot_by_slot_reference(B):
    """compact only moves entries from a row's first skipped node on (batch of one: one
    index_select per tensor); every slot it keeps must hold what a plain per-entry copy puts
    there, for random increasing paths incl. paths already in place and empty ones."""
    g = torch.Generator().manual_seed(120)
    for trial in range(40):
        c = KVCache(num_layers=2, batch_size=B, num_kv_heads=2, head_dim=3, max_len=24)
        for t in c.k + c.v:
            t.copy_(torch.randn(t.shape, generator=g))
        base = torch.randint(0, 8, (B,), generator=g)
        paths = []
        for b in range(B):
            nodes = sorted(torch.randperm(9, generator=g)[: int(torch.randint(0, 6, (1,), generator=g))].tolist())
            if trial % 4 == 0:
                nodes = list(range(len(nodes)))  # a chain-shaped path: nothing moves
            paths.append(([0] + [n + 1 for n in nodes]) if nodes or trial % 3 else [])  # [0]: just the root
        P = max(len(p) for p in paths)
        path_t = torch.zeros(B, P, dtype=torch.long)
        for b, p in enumerate(paths):
            path_t[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        before = [t.clone() for t in c.k + c.v]
        c.compact(base, path_t, torch.tensor([len(p) for p in paths]))
        assert c.lengths.tolist() == [int(base[b]) + len(paths[b]) for b in range(B)]
        for t, old in zip(c.k + c.v, before):
            for b, p in enumerate(paths):
                b0 = int(base[b])
                assert torch.equal(t[b, :, :b0], old[b, :, :b0]), "the committed prefix changed"
                for i, node in enumerate(p):
                    assert torch.equal(t[b, :, b0 + i], old[b, :, b0 + node]), (trial, b, p, i)


def test_rows_joining_and_leaving_keep_their_entries():
    """Rows join one at a time past the room kept for them, leave (the last row into the freed
    slot, or in order) and are permuted: each kept row's committed entries and length are the
    ones it had, against the same operations done by concatenation and indexing (slots past a
    row's length are never read, and a row moved in place does not carry them)."""
    g = torch.Generator().manual_seed(5)

    def same(got, want, lengths) -> bool:
        return all(torch.equal(a[b, :, :n], w[b, :, :n]) for a, w in zip(got, want) for b, n in enumerate(lengths))

    def one_row(length: int) -> KVCache:
        c = KVCache(2, 1, 2, 4, 16)
        for t in c.k + c.v:
            t.copy_(torch.randn(t.shape, generator=g))
        c.lengths[0] = length
        return c

    cache = KVCache(2, 0, 2, 4, 16)
    want_k, want_v, want_len = [t.clone() for t in cache.k], [t.clone() for t in cache.v], []
    for n in range(6):  # past the first room of 4 rows
        row = one_row(n + 3)
        want_k = [torch.cat([a, b]) for a, b in zip(want_k, row.k)]
        want_v = [torch.cat([a, b]) for a, b in zip(want_v, row.v)]
        want_len.append(n + 3)
        cache.append_rows(row)
    for order in ([0, 5, 2, 3, 4], [3, 1, 0, 2], [0, 2], [1, 0]):  # row 1 leaves, a permutation, in order, a swap
        cache.reorder_rows(torch.tensor(order))
        want_k, want_v = [t[order] for t in want_k], [t[order] for t in want_v]
        want_len = [want_len[r] for r in order]
        assert same(cache.k + cache.v, want_k + want_v, want_len)
        assert cache.lengths.tolist() == want_len and cache.batch_size == len(order)
        assert all(t.shape[0] == len(order) for t in cache.k + cache.v)
    last = one_row(7)
    cache.append_rows(last)  # joins after leaves: the kept rows untouched, the new one whole
    assert same([t[:2] for t in cache.k + cache.v], want_k + want_v, want_len)
    assert all(torch.equal(t[2], o[0]) for t, o in zip(cache.k + cache.v, last.k + last.v))
    assert cache.lengths.tolist() == want_len + [7] and cache.k[0].shape[0] == 3


def test_with_room_keeps_the_rows_and_grows_only_when_full():
    """Rows joining one at a time: the same stores while they have room, else new ones with twice
    the rows needed that hold the kept rows unchanged."""
    a, b = torch.randn(3, 2, 5), torch.randn(3, 2, 5)
    assert with_room([a, b], 2, 1) == [a, b]  # room for one more: nothing copied
    grown = with_room([a, b], 3, 1)
    assert [t.shape[0] for t in grown] == [8, 8]
    assert torch.equal(grown[0][:3], a) and torch.equal(grown[1][:3], b)
    assert with_room(grown, 4, 4) == grown
