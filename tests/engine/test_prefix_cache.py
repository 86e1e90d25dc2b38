"""The prefix cache (specdec/prefix_cache.py): a prompt whose prefix comes from the cache gets the
KV entries and logits of computing it whole, bit for bit, and so the same tokens, greedy, sampled
and speculative, in batches of hits and misses and after evictions.

The oracle is plain decoding one token at a time (every prompt token its own forward, the way a
decoding step computes it): a chunked prefill, cold or from a cached prefix, must give exactly its
KV entries and last-token logits. `check_matches_one_at_a_time` is shown to fail on a prefill
whose cached prefix is restored one slot off (test_the_check_catches_an_off_by_one)."""

from __future__ import annotations

import functools

import pytest
import torch

from model_helpers import build_hf, need_kernels, random_tokens
from specdec import prefix_cache as pc
from specdec.engine import Engine
from specdec.prefix_cache import BLOCK, PrefixCache, chunks_exact, prefill
from specdec.types import SamplingParams
from tiny_gguf import VOCAB, write_tiny_gguf

Q8_0, Q4_K = 8, 12

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


@functools.lru_cache(maxsize=None)
def gguf_target(arch: str, ggml_type: int, directory: str):
    from pathlib import Path

    from specdec.models.loader import load_model

    path = Path(directory) / f"{arch}-{ggml_type}.gguf"
    write_tiny_gguf(path, arch, ggml_type, seed=3)
    return load_model(str(path), quiet=True, with_tokenizer=False).model


@functools.lru_cache(maxsize=None)
def native_target():
    """A native float32 Llama (a model folder's path) on the row-stable kernels."""
    from specdec.models.llama import build_native

    hf = build_hf("llama", seed=4)
    model = build_native(hf.config, hf.state_dict())
    model.use_rowstable(need_kernels())
    return model.pack()


@pytest.fixture(scope="module", params=["llama-Q8_0", "qwen2-Q4_K", "native-llama"])
def model(request, tmp_path_factory):
    need_kernels()
    if request.param == "native-llama":
        return native_target()
    arch, kind = request.param.split("-")
    return gguf_target(arch, {"Q8_0": Q8_0, "Q4_K": Q4_K}[kind], str(tmp_path_factory.mktemp("gguf")))


def vocab(model) -> int:
    return model.cfg.vocab_size


def one_at_a_time(model, prompt: list[int]):
    """(last logits [V], cache): every prompt token its own forward, as decoding computes it."""
    cache = model.new_cache(1, len(prompt) + 1)
    for t, tok in enumerate(prompt):
        logits, _ = model(torch.tensor([[tok]]), torch.tensor([[t]]), cache)
    return logits[0, -1], cache


def same_kv(a, b, n: int) -> bool:
    return all(torch.equal(x[0, :, :n], y[0, :, :n]) for x, y in zip(a.k + a.v, b.k + b.v))


def check_matches_one_at_a_time(model, prompt: list[int], store: PrefixCache | None) -> int:
    """Prefill `prompt` (from `store`'s cached prefix, if any) and assert its logits and KV entries
    equal one-at-a-time decoding's bit for bit; returns the tokens taken from the cache."""
    cache = model.new_cache(1, len(prompt) + 1)
    logits, _, reused = prefill(model, prompt, cache, store)
    ref_logits, ref_cache = one_at_a_time(model, prompt)
    assert int(cache.lengths[0]) == len(prompt)
    assert torch.equal(logits[0, -1], ref_logits), f"logits differ (reused {reused})"
    assert same_kv(cache, ref_cache, len(prompt)), f"KV entries differ (reused {reused})"
    return reused


def test_models_prefill_in_exact_chunks(model):
    assert chunks_exact(model)


def test_cold_and_cached_prefills_equal_decoding_one_token_at_a_time(model):
    """A prompt longer than a chunk, cold and then with every length of shared prefix the blocks
    allow (a block boundary inside a chunk, on one, the whole prompt cached but its last token)."""
    V = vocab(model)
    base = random_tokens(150, V, seed=1)
    store = PrefixCache(64)
    assert check_matches_one_at_a_time(model, base, store) == 0
    for shared, tail, want in ((100, 30, 96), (64, 5, 64), (150, 0, 144), (144, 0, 128), (17, 70, 16), (10, 40, 0)):
        prompt = base[:shared] + random_tokens(tail, V, seed=shared)
        assert check_matches_one_at_a_time(model, prompt, store) == want, (shared, tail)
    # the same prompt again: every block but the one holding its last token
    assert check_matches_one_at_a_time(model, base, store) == 144


def test_the_check_catches_an_off_by_one(model, monkeypatch):
    """A cache whose restored prefix is one slot short (the next chunk then starts at the block
    boundary but writes one slot early) must fail check_matches_one_at_a_time."""
    V = vocab(model)
    base = random_tokens(80, V, seed=2)
    store = PrefixCache(64)
    check_matches_one_at_a_time(model, base, store)
    restore = PrefixCache.restore

    def broken(self, chain, cache, row):
        out = restore(self, chain, cache, row)
        cache.lengths[row] -= 1
        return out

    monkeypatch.setattr(PrefixCache, "restore", broken)
    with pytest.raises(AssertionError):
        check_matches_one_at_a_time(model, base[:70] + [1, 2, 3], store)


def test_long_prompts_chunk_up_to_the_cap_then_run_in_one_call(model, monkeypatch):
    """Past CHUNKED_MAX the rest of a prompt runs in one call from that slot: cold or with a cached
    prefix, the same numbers (what is cached stays below the cap)."""
    monkeypatch.setattr(pc, "CHUNKED_MAX", 64)
    V = vocab(model)
    base = random_tokens(140, V, seed=5)
    store = PrefixCache(64)
    cold = model.new_cache(1, 141)
    want, _, _ = prefill(model, base, cold, None)
    prefill(model, base[:100] + [3] * 10, model.new_cache(1, 111), store)
    assert len(store) == 64 // BLOCK  # (blocks of the first 64 tokens only)
    warm = model.new_cache(1, 141)
    got, _, reused = prefill(model, base, warm, store)
    assert reused == 64 and torch.equal(got, want) and same_kv(cold, warm, 140)


def test_all_logits_and_hidden_states(model):
    """prompt_logprobs asks every position's logits: computed, never taken from the cache; the
    hidden states (EAGLE, Medusa read them) of a cached prefix equal the computed ones."""
    V = vocab(model)
    prompt = random_tokens(90, V, seed=6)
    store = PrefixCache(64)
    cold_logits, cold_hidden, _ = prefill(model, prompt, model.new_cache(1, 91), store, need_hidden=True)
    every, _, reused = prefill(model, prompt, model.new_cache(1, 91), store, all_logits=True)
    assert reused == 0 and every.shape[1] == 90 and torch.equal(every[0, -1], cold_logits[0, -1])
    logits, hidden, reused = prefill(model, prompt, model.new_cache(1, 91), store, need_hidden=True)
    assert reused == 80 and torch.equal(hidden, cold_hidden) and torch.equal(logits, cold_logits)


# -- the cache's own bookkeeping ----------------------------------------------------------------


class FakeKV:
    """A KVCache's row layout (layers of [rows, H_kv, S, Dh]) with each slot holding its index."""

    def __init__(self, n: int, layers: int = 2) -> None:
        slots = torch.arange(n, dtype=torch.float32)[None, None, :, None].expand(1, 1, n, 2).contiguous()
        self.k = [slots + 1000 * i for i in range(layers)]
        self.v = [-s for s in self.k]
        self.lengths = torch.zeros(1, dtype=torch.long)


def test_blocks_are_found_only_after_the_same_tokens():
    store = PrefixCache(1)
    a = list(range(50))
    store.insert(a, FakeKV(50), 0, store.lookup(a))
    assert len(store) == 3  # 48 of 50 tokens in whole blocks
    assert len(store.lookup(a[:40])) == 2
    assert store.lookup([99] + a[1:]) == []  # the first block differs: nothing after it matches
    moved = a[:16] + [7] + a[17:]
    assert len(store.lookup(moved)) == 1
    fresh = FakeKV(50)
    chain = store.lookup(a)
    store.restore(chain, fresh, 0)
    assert int(fresh.lengths[0]) == 48 and torch.equal(fresh.k[1][0, :, :48], FakeKV(50).k[1][0, :, :48])


def test_eviction_takes_least_recently_used_leaves_within_the_budget():
    block_bytes = 2 * 2 * 1 * BLOCK * 2 * 4  # k and v, 2 layers, 1 head, BLOCK slots, 2 dims, float32
    store = PrefixCache(5 * block_bytes / 2**20)
    a, b = list(range(48)), list(range(100, 148))
    for p in (a, b):
        store.insert(p, FakeKV(48), 0, store.lookup(p))
    assert store.bytes <= store.budget and len(store) == 5 and store.stats.evicted == 1
    assert len(store.lookup(a + [0])) == 2  # a's last block went (b's were newer), its first two stay
    assert len(store.lookup(b + [0])) == 3
    c = list(range(200, 232))
    store.insert(c, FakeKV(32), 0, store.lookup(c))
    # a was used before b: its leaf, then its first block (a leaf once the other went) made room
    assert len(store.lookup(a + [0])) == 0 and len(store.lookup(b + [0])) == 3 and len(store.lookup(c + [0])) == 2
    assert store.bytes <= store.budget and store.stats.evicted == 3
    under_a_block = PrefixCache(block_bytes / 2**21)
    under_a_block.insert(a, FakeKV(48), 0, [])
    assert len(under_a_block) == 0 and under_a_block.bytes == 0


def test_hidden_states_added_later_never_evict_the_prompts_own_blocks():
    """A prompt cached without hidden states, met again by a source that reads them: its blocks get
    them where the budget allows, and a full budget evicts none of that prompt's own blocks."""
    block_bytes = 2 * 2 * 1 * BLOCK * 2 * 4
    a = list(range(48))
    store = PrefixCache(3 * block_bytes / 2**20)  # room for a's blocks, none for their hidden states
    store.insert(a, FakeKV(48), 0, store.lookup(a))
    chain = store.lookup(a + [0])
    store.insert(a + [0], FakeKV(49), 0, chain, hidden=torch.ones(49, 4))
    assert len(store) == 3 and all(b.hidden is None for b in chain) and store.stats.evicted == 0
    roomy = PrefixCache(1)
    roomy.insert(a, FakeKV(48), 0, roomy.lookup(a))
    chain = roomy.lookup(a + [0])
    roomy.insert(a + [0], FakeKV(49), 0, chain, hidden=torch.arange(49.0)[:, None].expand(49, 4))
    assert len(roomy.lookup(a + [0], need_hidden=True)) == 3
    assert torch.equal(roomy.restore(chain, FakeKV(49), 0)[:, 0], torch.arange(48.0))


# -- through the engine -------------------------------------------------------------------------


def shared_prompts(V: int) -> list[list[int]]:
    """Requests as an agent sends them: a long shared prefix, then each its own question."""
    system = random_tokens(70, V, seed=11)
    return [system + random_tokens(n, V, seed=20 + n) for n in (9, 14, 30, 5)] + [random_tokens(40, V, seed=9)]


def sources_for(method: str):
    from specdec.drafters.ngram import NgramDrafter
    from specdec.drafters.suffix import SuffixDrafter, forget_shared

    forget_shared()
    return {"none": None, "ngram": [NgramDrafter(1, 4)], "suffix": [SuffixDrafter()]}[method]


@pytest.mark.parametrize("method", ["none", "ngram", "suffix"])
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, seed=3)], ids=["greedy", "sampled"])
def test_engine_hits_give_the_tokens_of_cold_prefills(model, method, sampling):
    """Requests in order through one engine (later ones hit what earlier ones left) give the tokens
    each gets alone with an empty cache; a batch of hits and misses too; and a tiny budget (blocks
    evicted as requests come) changes nothing either."""
    V = vocab(model)
    prompts = shared_prompts(V)
    params = SamplingParams(max_new_tokens=12, **sampling)

    def run(batch, store):
        return Engine(model, sources_for(method), k=4, prefix_cache=store).generate(batch, params)

    cold = [run([p], None)[0].tokens for p in prompts]  # (no cache: the same chunks, nothing reused)
    assert cold == [run([p], PrefixCache(0))[0].tokens for p in prompts[:2]] + cold[2:]  # (0 MiB keeps nothing)
    engine = Engine(model, sources_for(method), k=4, prefix_cache=PrefixCache(64))
    results = [engine.generate([p], params)[0] for p in prompts]
    assert [r.tokens for r in results] == cold
    assert [r.stats.cached_tokens for r in results] == [0, 64, 64, 64, 0]
    # a batch of hits and misses (rows sample keyed by their place in the batch: against the same batch)
    batch = [prompts[4], prompts[0], prompts[2], prompts[1]]
    want = [r.tokens for r in run(batch, None)]
    store = PrefixCache(64)
    run([prompts[3]], store)
    got = run(batch, store)
    assert [r.tokens for r in got] == want
    assert [r.stats.cached_tokens for r in got] == [0, 64, 64, 64]
    small = PrefixCache(pc_bytes(model, 5) / 2**20)  # 5 blocks: every request evicts
    tight = Engine(model, sources_for(method), k=4, prefix_cache=small)
    assert [tight.generate([p], params)[0].tokens for p in prompts] == cold
    assert small.stats.evicted > 0 and small.bytes <= small.budget


def pc_bytes(model, blocks: int) -> int:
    c = model.cfg
    return blocks * 2 * c.num_layers * c.num_kv_heads * BLOCK * c.head_dim * 4


def test_a_model_without_the_kernels_prefills_in_one_call(monkeypatch):
    """A model that cannot prefill in exact chunks prefills in one call and caches nothing: the
    batcher ignores the cache (one that can prefills in chunks, cache or not)."""
    from specdec.core.scheduler import ContinuousBatcher

    model = native_target()
    monkeypatch.setattr(model, "rowstable", None)
    assert not chunks_exact(model)
    batcher = ContinuousBatcher(model, (), [], max_batch=1, max_context=64, thread=False,
                                prefix_cache=PrefixCache(8))
    assert batcher.prefix is None and not batcher.chunked
    monkeypatch.undo()
    assert ContinuousBatcher(model, (), [], max_batch=1, max_context=64, thread=False).chunked


def test_default_model_agent_trace(default_model):
    """The default model on an agent-like trace (benchmarks/data/agentic/sql-shots.jsonl: one system
    prompt with few-shot examples, a question each): later requests take the shared prefix from the
    cache, and greedy answers, plain and suffix, equal those of cold prefills."""
    import json
    from pathlib import Path

    from specdec.text import encode_prompt

    trace = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "agentic" / "sql-shots.jsonl"
    rows = [json.loads(line) for line in trace.read_text().splitlines()[:3]]
    prompts = [encode_prompt(default_model.tokenizer, r["messages"], None, None) for r in rows]
    model, params = default_model.model, SamplingParams(max_new_tokens=8)
    eos = default_model.eos_ids
    cold = [Engine(model, None, eos_ids=eos).generate([p], params)[0].tokens for p in prompts]
    for method in ("none", "suffix"):
        engine = Engine(model, sources_for(method), k=8, eos_ids=eos, prefix_cache=PrefixCache(64))
        results = [engine.generate([p], params)[0] for p in prompts]
        assert [r.tokens for r in results] == cold, method
        assert all(r.stats.cached_tokens >= 256 for r in results[1:]), [r.stats.cached_tokens for r in results]
    # the last prompt's KV entries and logits from the others' prefix equal a cold prefill's
    store = PrefixCache(64)
    for p in prompts[:2]:
        prefill(model, p, model.new_cache(1, len(p) + 1), store)
    L = len(prompts[2])
    warm, cold_cache = model.new_cache(1, L + 1), model.new_cache(1, L + 1)
    got, _, reused = prefill(model, prompts[2], warm, store)
    want, _, _ = prefill(model, prompts[2], cold_cache, None)
    assert reused >= 256 and torch.equal(got, want) and same_kv(warm, cold_cache, L)
