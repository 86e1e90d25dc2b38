"""Suffix decoding's stores and drafter (specdec/drafters/suffix.py, kernels/suffix_store.cpp):
drafts equal a brute-force statement of the rule (suffix_reference.py) on random and repetitive
token streams; eviction keeps the bound and forgets; appending step by step equals building at
once; save/load round-trips and refuses another tokenizer; offers are well-formed trees; greedy
speculation with them equals plain decoding; seeded best-of-n samples drafting from each other
commit plain sampling's text; and on the recorded agent traces they accept at least as much as
Arctic Inference's SuffixDecodingCache (where that is installed)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

import suffix_reference as ref
from specdec.drafters.base import DraftContext
from specdec.drafters.suffix import (MAX_NODES, PROMPT_TAIL, SuffixCache, SuffixDrafter, SuffixParams, TokenStore, speculate)
from specdec.tree import check_parents, depths
from specdec.types import SamplingParams, SpecdecError

TRACES = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "agentic"


def build(seqs: list[list[int]], open_last: bool) -> tuple[TokenStore, tuple]:
    """A native store of `seqs` (the last left open if asked) and the reference's view of it."""
    store = TokenStore()
    for i, s in enumerate(seqs):
        store.append(s)
        if not (open_last and i == len(seqs) - 1):
            store.close()
    kept = [s for s in seqs if s]  # an empty sequence is never opened
    return store, (kept, open_last and bool(seqs and seqs[-1]))


def native(stores, context, params: SuffixParams, own: int = 0):
    d = speculate(stores, context, params, own)
    return list(zip(d.tokens, d.parents, d.scores)), d.match_len, d.occurrences


def reference(views, context, params: SuffixParams, own: int = 0):
    fields = ("max_depth", "max_nodes", "alpha", "offset", "min_prob", "max_walk", "max_occ", "lengths", "tree")
    return ref.speculate(list(views), list(context), own=own, **{f: getattr(params, f) for f in fields})


def random_params(rng: random.Random) -> SuffixParams:
    return SuffixParams(max_depth=rng.choice([2, 3, 8, 64]), max_nodes=rng.choice([1, 4, 24]),
                        alpha=rng.choice([1.0, 2.0, 8.0]), offset=rng.choice([0.0, 1.0]),
                        min_prob=rng.choice([0.0, 0.1, 0.4]), tree=rng.random() < 0.7,
                        max_walk=rng.choice([1, 3, 4096]), max_occ=rng.choice([1, 2, 256]), lengths=rng.choice([1, 3]))


def stream(rng: random.Random, kind: str, n: int) -> list[int]:
    """Random tokens over a small vocabulary, or phrases repeated with edits (agent-like text)."""
    if kind == "random":
        return [rng.randrange(6) for _ in range(n)]
    phrases = [[rng.randrange(50) for _ in range(rng.randint(2, 7))] for _ in range(5)]
    out: list[int] = []
    while len(out) < n:
        out += rng.choice(phrases) if rng.random() < 0.8 else [rng.randrange(50)]
    return out[:n]


@pytest.mark.parametrize("kind", ["random", "repetitive"])
def test_drafts_equal_the_brute_force_rule(kind):
    rng = random.Random(kind)
    drafted = 0
    for _ in range(250):
        stores, views = [], []
        for _ in range(rng.randint(1, 3)):
            seqs = [stream(rng, kind, rng.randint(0, 40)) for _ in range(rng.randint(1, 4))]
            store, view = build(seqs, rng.random() < 0.5)
            stores.append(store)
            views.append(view)
        params = random_params(rng)
        source = rng.choice([s for v in views for s in v[0]] or [[0, 1]])
        cut = rng.randint(0, len(source))
        context = source[:cut] + stream(rng, kind, rng.randint(0, 3))  # often a context that occurs
        own = rng.randint(0, len(stores))  # the first `own` stores alone compete with all of them
        got = native(stores, context, params, own)
        assert got == reference(views, context, params, own), (params, context, views, own)
        drafted += bool(got[0])
    assert drafted >= 40  # the comparison saw many non-empty drafts


def test_the_reference_notices_a_broken_rule():
    """The comparison can fail: the reference that counts the open sequence's tail as an
    occurrence differs from the native drafts."""
    store, view = build([[1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2]], True)
    params = SuffixParams(min_prob=0.0)
    got = native([store], [7, 1, 2], params)
    assert got == reference([view], [7, 1, 2], params)
    assert got[0][0][0] == 3 and got[0][0][2] == pytest.approx(2 / 3)  # 1 2 -> 3 twice, -> 4 once
    assert got != reference([(view[0], False)], [7, 1, 2], params)  # the tail counted: 2/4
    assert native([store], [1, 2, 3, 1, 2], params)[0][0][0] == 4  # the longest match wins: 1 2 3 1 2 -> 4


def test_a_fresh_process_makes_its_shared_cache_first():
    """A suffix drafter built before any store (as `--method auto` does) loads the native library
    inside shared_cache(): that must not wait on the lock shared_cache already holds."""
    code = "from specdec.drafters.suffix import shared_cache; print(shared_cache().store.sequences)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "0"


def test_bench_times_each_call_with_the_shared_cache_emptied():
    """`bench` (and validate) call forget_shared before each timed request: a repeat of a prompt,
    or the same prompt under the next method, finds none of its earlier answers to draft from."""
    from specdec.bench.runner import Runner, run
    from specdec.bench.tasks import Task
    from specdec.drafters.suffix import forget_shared, shared_cache

    seen = []

    def call(ids, params):
        seen.append(shared_cache().tokens)
        shared_cache().insert(ids, [5, 6, 7, 8])  # what a finished request leaves behind
        return [5, 6, 7, 8], None

    tasks = [Task("a", "qa", "x", False), Task("b", "qa", "y", False)]
    run([Runner("none", "specdec", call), Runner("suffix", "specdec", call)], tasks, [[1, 2], [3, 4]],
        SamplingParams(max_new_tokens=4), repeats=2, quiet=True)
    assert seen == [0] * 8
    assert shared_cache().tokens > 0
    forget_shared()
    assert shared_cache().tokens == 0 and shared_cache().requests == 0


def test_a_rows_own_store_skips_its_own_tail():
    """The context's own last position is not an occurrence (nothing follows it yet), but a closed
    sequence's last position is (a request that ended there)."""
    store, _ = build([[5, 6, 7, 5, 6]], True)
    d = speculate([store], [5, 6, 7, 5, 6], SuffixParams(min_prob=0.0))
    assert d.tokens[:3] == [7, 5, 6] and d.scores[0] == 1.0
    closed, _ = build([[5, 6, 7], [9, 5, 6]], False)
    d = speculate([closed], [1, 5, 6], SuffixParams(min_prob=0.0))
    assert d.tokens == [7] and d.scores == [0.5]


def test_appending_step_by_step_equals_building_at_once():
    rng = random.Random(3)
    seqs = [stream(rng, "repetitive", rng.randint(5, 60)) for _ in range(6)]
    once, _ = build(seqs, True)
    steps = TokenStore()
    for i, s in enumerate(seqs):
        at = 0
        while at < len(s):
            k = rng.randint(1, 4)
            steps.append(s[at:at + k])
            at += k
        if i < len(seqs) - 1:
            steps.close()
    assert list(steps.export()) == list(once.export())
    for _ in range(100):
        params = random_params(rng)
        context = stream(rng, "repetitive", rng.randint(2, 12))
        assert native([steps], context, params) == native([once], context, params)


def test_a_drafters_row_store_follows_its_tokens_and_rebuilds_on_a_change():
    cache = SuffixCache()
    d = SuffixDrafter(cache, SuffixParams(min_prob=0.0))
    d.begin([], None, 64)
    prompt = [1, 2, 3, 4, 1, 2]
    d.add_row(64, prompt)
    ctx = prompt + [3]
    for extra in ([4], [1, 2], [3]):
        ctx = ctx + extra
        got = d.offer(DraftContext([ctx], SamplingParams(), None), MAX_NODES)[0]
        store, view = build([ctx], True)
        want = native([store, cache.store], ctx, d.params, own=1)
        assert (got.tokens, got.parents, got.scores) == tuple(map(list, zip(*want[0]))) if want[0] else got is None
    other = [9, 9, 8, 9, 9]  # not an extension: the row's store starts again
    got = d.offer(DraftContext([other], SamplingParams(), None), MAX_NODES)[0]
    assert got.tokens[0] == 8


def test_eviction_keeps_the_bound_and_forgets_the_oldest():
    rng = random.Random(5)
    cache = SuffixCache(max_tokens=2000)
    outputs = [stream(rng, "repetitive", rng.randint(20, 200)) for _ in range(400)]
    sizes = []
    for i, out in enumerate(outputs):
        cache.insert([7, 7, 7, 7, 7], out)
        assert cache.tokens <= 2000
        sizes.append(cache.memory_bytes)
    kept = [seq for seq in _split(cache.store.export())]
    n = len(kept)
    assert kept == [[7] * PROMPT_TAIL + out for out in outputs[-n:]]  # the newest, in order
    assert cache.tokens > 2000 - 200 - PROMPT_TAIL
    assert max(sizes[200:]) < 2 * max(sizes[:100])  # dead space is given back, not kept growing
    # drafts see only what is kept: equal to the reference over the kept sequences
    for _ in range(50):
        params = random_params(rng)
        context = stream(rng, "repetitive", rng.randint(2, 12))
        assert native([cache.store], context, params) == reference([(kept, False)], context, params)
    by_count = SuffixCache(max_tokens=10**6, max_requests=3)
    for out in outputs[:10]:
        by_count.insert([], out)
    assert by_count.requests == 3 and [s for s in _split(by_count.store.export())] == outputs[7:10]


def _split(values) -> list[list[int]]:
    out, cur = [], []
    for v in values.tolist():
        if v == -1:
            out.append(cur)
            cur = []
        else:
            cur.append(v)
    assert not cur, "every cached request is closed"
    return out


def test_save_and_load_round_trip_and_refuse_another_tokenizer(tmp_path):
    rng = random.Random(9)
    cache = SuffixCache(max_tokens=5000)
    for _ in range(30):
        cache.insert(stream(rng, "repetitive", 12), stream(rng, "repetitive", rng.randint(10, 80)))
    path = tmp_path / "suffix.cache"
    cache.save(path, "tok-abc")
    again = SuffixCache(max_tokens=5000)
    assert again.load(path, "tok-abc") == 30
    assert list(again.store.export()) == list(cache.store.export())
    for _ in range(30):
        params = random_params(rng)
        context = stream(rng, "repetitive", rng.randint(2, 12))
        assert native([again.store], context, params) == native([cache.store], context, params)
    with pytest.raises(SpecdecError) as e:
        SuffixCache().load(path, "tok-xyz")
    msg = str(e.value)
    assert "tok-abc" in msg and "tok-xyz" in msg and "\n" not in msg
    smaller = SuffixCache(max_tokens=500)  # this cache's bounds apply to what it loads
    smaller.load(path, "tok-abc")
    assert 0 < smaller.tokens <= 500
    assert SuffixCache().load(tmp_path / "absent.cache", "tok-abc") == 0
    (tmp_path / "bad.cache").write_bytes(b"not a cache\n")
    with pytest.raises(SpecdecError, match="not a specdec suffix cache"):
        SuffixCache().load(tmp_path / "bad.cache", "tok-abc")
    data = path.read_bytes()
    (tmp_path / "cut.cache").write_bytes(data[:-6])
    with pytest.raises(SpecdecError, match="cut short"):
        SuffixCache().load(tmp_path / "cut.cache", "tok-abc")
    header = data[:data.index(b"\n") + 1]
    values = (len(data) - len(header)) // 4
    (tmp_path / "odd.cache").write_bytes(header + (-5).to_bytes(4, "little", signed=True) * values)
    with pytest.raises(SpecdecError, match="damaged"):
        SuffixCache().load(tmp_path / "odd.cache", "tok-abc")


def test_offers_are_well_formed_trees():
    rng = random.Random(11)
    cache = SuffixCache()
    for _ in range(40):
        cache.insert([1, 2], stream(rng, "repetitive", rng.randint(10, 120)))
    d = SuffixDrafter(cache, SuffixParams(max_nodes=12, alpha=4.0, min_prob=0.05))
    d.begin([], None, 256)
    rows = [stream(rng, "repetitive", 30) for _ in range(3)]
    for r in rows:
        d.add_row(256, r)
    trees = 0
    for step in range(20):
        rows = [r + stream(rng, "repetitive", 2) for r in rows]
        room = [rng.choice([1, 3, 100]) for _ in rows]
        for offer, rm in zip(d.offer(DraftContext(rows, SamplingParams(), None, room=room), 12), room):
            if offer is None:
                continue
            n = len(offer.tokens)
            assert 0 < n <= 12 and len(offer.parents) == len(offer.scores) == n
            check_parents(offer.parents)  # parents before children
            assert max(depths(offer.parents)) <= rm
            for i, p in enumerate(offer.parents):
                assert 0 < offer.scores[i] <= 1 and (p == 0 or offer.scores[i] <= offer.scores[p - 1])
            trees += any(p != i for i, p in enumerate(offer.parents))
    assert trees > 0
    d.finish_row(1, rows[1])
    assert cache.requests == 41


def test_greedy_speculation_with_suffix_drafts_equals_plain_decoding():
    """Through the scheduler (offers priced by the cost model at a fixed k, trees and chains), in
    Engine.generate and in the batcher with rows joining and leaving: drafts from a cache that holds
    right, altered and unrelated continuations, so guesses are accepted and rejected; every answer
    equals transformers' greedy decoding."""
    import torch
    from transformers import AutoModelForCausalLM

    from oracle import hf_greedy, one_thread
    from helpers import V, prompts, run_join_leave, target, target_dir
    from specdec.core.scheduler import ContinuousBatcher
    from specdec.engine import Engine

    with one_thread():
        hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
        hf.generation_config.pad_token_id = 0
        ps = prompts()
        want = [hf_greedy(hf, p, 16) for p in ps]
        rng = random.Random(0)
        proposed = accepted = 0
        for tree in (True, False):
            cache = SuffixCache()
            for p, w in zip(ps, want):  # the right answer once, altered copies (newer) twice
                cache.insert(p, w)
                for _ in range(2):
                    cache.insert(p, [t if rng.random() < 0.8 else rng.randrange(V) for t in w])
            d = SuffixDrafter(cache, SuffixParams(tree=tree, max_nodes=8, alpha=4.0, min_prob=0.0))
            res = Engine(target().model, d, k=8, fixed_k=True).generate(ps, SamplingParams(max_new_tokens=16))
            assert [r.tokens for r in res] == want
            proposed += sum(r.stats.proposed for r in res)
            accepted += sum(r.stats.accepted for r in res)
        assert 0 < accepted < proposed
        d = SuffixDrafter(cache, SuffixParams(max_nodes=8, alpha=4.0, min_prob=0.0))
        b = ContinuousBatcher(target().model, (), [d], method="suffix", k_max=8, max_batch=3, max_context=96,
                              adaptive=False)
        got, want = run_join_leave(b)
        assert got == want and b.stats().proposed > 0


def _replay(source, requests) -> list[int]:
    """Accepted guesses per step over the requests in order (benchmarks/suffix_replay.py's rule)."""
    import sys

    sys.path.insert(0, str(TRACES.parents[1]))
    from suffix_replay import accepted

    out = []
    for req in requests:
        prompt, answer = req["prompt_ids"], req["output_ids"]
        source.start(prompt)
        i = 0
        while i < len(answer) - 1:
            tokens, parents = source.draft(prompt + answer[:i + 1])
            a = min(accepted(tokens, parents, answer[i + 1:]), len(answer) - 1 - i)
            out.append(a)
            i += a + 1
        source.stop(prompt, answer)
    return out


@pytest.mark.parametrize("trace", ["sql", "extract", "report", "tools", "samples"])
def test_suffix_drafts_accept_at_least_what_arctics_do(trace):
    """On a recorded agent trace, replayed in order: the accepted guesses per step of suffix
    trees are at least those of Arctic Inference's SuffixDecodingCache with the same node budget
    and score floor (its trees), and more than prompt lookup's."""
    pytest.importorskip("arctic_inference.suffix_decoding", reason=(
        "arctic-inference is not installed: it ships only an sdist whose build needs torch, cmake and nanobind "
        "(pip install arctic-inference); the brute-force reference tests above always run"))
    import sys

    sys.path.insert(0, str(TRACES.parents[1]))
    from suffix_replay import Arctic, Lookup, Suffix

    requests = [json.loads(line) for line in (TRACES / f"{trace}.recorded.jsonl").read_text().splitlines()]
    mine = _replay(Suffix(True, []), requests)
    arctic = _replay(Arctic(True, []), requests)
    lookup = _replay(Lookup([]), requests)
    mean = lambda xs: sum(xs) / len(xs)
    assert mean(mine) >= mean(arctic), (mean(mine), mean(arctic))
    assert mean(mine) > mean(lookup)


def _best_of_n(cache: SuffixCache, prompt: list[int], seeds) -> list:
    """Seeded samples (temperature 0.8, one per seed) of one prompt, one after another through the
    scheduler with a suffix drafter over `cache` (so later samples draft from earlier ones)."""
    from helpers import target
    from specdec.engine import Engine

    out = []
    for seed in seeds:
        d = SuffixDrafter(cache, SuffixParams(max_nodes=8, alpha=4.0, min_prob=0.0))
        sp = SamplingParams(max_new_tokens=24, temperature=0.8, seed=seed)
        out.append(Engine(target().model, d, k=8, fixed_k=True).generate([prompt], sp)[0])
    return out


def test_best_of_n_samples_draft_from_earlier_ones_and_commit_plain_samplings_text(monkeypatch):
    """Best-of-n: 8 seeded samples of one prompt at temperature 0.8, one after another; from the
    second on, each drafts from the samples before it in the cache, and guesses hold and fail.
    Deterministic guesses verified by sample and compare commit exactly the text plain sampling
    draws with the same seed (verify.py), so each sample equals plain decoding's. A verification
    that samples a position with another position's uniform breaks that, and the check sees it."""
    import specdec.verify
    from helpers import prompts, target
    from oracle import one_thread
    from specdec.engine import Engine

    with one_thread():
        prompt = prompts()[0]
        plain = [Engine(target().model).generate([prompt], SamplingParams(max_new_tokens=24, temperature=0.8,
                                                                         seed=seed))[0].tokens for seed in range(8)]
        assert len({tuple(t) for t in plain}) > 4  # the seeds draw different samples
        cache = SuffixCache()
        got = _best_of_n(cache, prompt, range(8))
        assert [r.tokens for r in got] == plain
        assert cache.requests == 8  # every sample joined the cache
        later = got[1:]
        accepted, proposed = sum(r.stats.accepted for r in later), sum(r.stats.proposed for r in later)
        assert 0 < accepted < proposed  # later samples took guesses, and some failed
        # ... from the earlier samples: each alone (an empty cache) accepts fewer
        alone = [_best_of_n(SuffixCache(), prompt, [seed])[0] for seed in range(1, 8)]
        assert [r.tokens for r in alone] == plain[1:]
        assert sum(r.stats.accepted for r in alone) < 0.75 * accepted  # (14 against 28 when written)

        real = specdec.verify.position_uniforms
        monkeypatch.setattr(specdec.verify, "position_uniforms",
                            lambda gen, rows, positions: real(gen, rows, [p + 1 for p in positions]))
        broken = _best_of_n(SuffixCache(), prompt, range(8))
        assert [r.tokens for r in broken] != plain
