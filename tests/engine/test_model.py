"""The native model against transformers (the oracle), fp32, max abs logit diff <= 1e-4.

Covers every native family (Llama tied/untied, llama3 and linear RoPE, Qwen2 with q/k/v
bias, Mistral), full-sequence and incremental forwards through the KV cache, ragged
batches, and the tree path (attn_mask).
"""

from __future__ import annotations

import pytest
import torch

from model_helpers import (TOL, Pair, ancestor_mask, check_verification_equals_one_at_a_time, get_pair, maxdiff, path_to,
                           prefill_ragged, random_tokens)
from specdec.models.llama import native_support_problem


# -- full sequence --------------------------------------------------------------------
def test_full_forward_matches_transformers(pair: Pair):
    B, T = 2, 40
    toks = torch.tensor([random_tokens(T, seed=1), random_tokens(T, seed=2)])
    pos = torch.arange(T)[None].expand(B, T)
    ref = pair.ref_logits(toks)
    cache = pair.native.new_cache(B, 64)
    logits, hidden = pair.native(toks, pos, cache)
    assert logits.shape == (B, T, pair.hf.config.vocab_size)
    assert maxdiff(logits, ref) <= TOL
    # hidden: the final-normed state the LM head reads
    with torch.no_grad():
        ref_hidden = pair.hf.model(input_ids=toks, position_ids=pos, use_cache=False).last_hidden_state
    assert hidden.shape == (B, T, pair.hf.config.hidden_size)
    assert maxdiff(hidden, ref_hidden) <= TOL
    assert cache.lengths.tolist() == [T, T]


def test_long_prefill_in_chunks_matches_transformers(pair: Pair, monkeypatch):
    """A float32 chain longer than PREFILL_CHUNK runs in chunks (each through every layer before
    the next): the same logits, hidden states and cache as transformers' one pass, batched too,
    with logits_at picking positions from any chunk."""
    from specdec.models import llama

    monkeypatch.setattr(llama, "PREFILL_CHUNK", 7)
    B, T = 2, 40
    toks = torch.tensor([random_tokens(T, seed=11), random_tokens(T, seed=12)])
    pos = torch.arange(T)[None].expand(B, T)
    ref = pair.ref_logits(toks)
    cache = pair.native.new_cache(B, 64)
    logits, hidden = pair.native(toks, pos, cache)
    assert maxdiff(logits, ref) <= TOL and hidden.shape == (B, T, pair.hf.config.hidden_size)
    assert cache.lengths.tolist() == [T, T]
    at = torch.tensor([[39, 3], [20, 6]])
    picked, _ = pair.native(toks, pos, pair.native.new_cache(B, 64), logits_at=at)
    assert maxdiff(picked, torch.stack([ref[0, [39, 3]], ref[1, [20, 6]]])) <= TOL
    # the cache it left decodes on exactly as after one pass
    nxt = torch.tensor([[5], [9]])
    step, _ = pair.native(nxt, torch.full((B, 1), T), cache)
    full = pair.ref_logits(torch.cat([toks, nxt], 1))[:, -1:]
    assert maxdiff(step, full) <= TOL


def test_logits_at_selects_positions(llama_pair: Pair):
    toks = torch.tensor([random_tokens(12, seed=3), random_tokens(12, seed=4)])
    ref = llama_pair.ref_logits(toks)
    cache = llama_pair.native.new_cache(2, 32)
    at = torch.tensor([[11, 3], [0, 7]])
    logits, _ = llama_pair.native(toks, torch.arange(12)[None].expand(2, 12), cache, logits_at=at)
    expect = torch.stack([ref[0, [11, 3]], ref[1, [0, 7]]])
    assert maxdiff(logits, expect) <= TOL


# -- incremental through the cache ------------------------------------------------------
def test_incremental_matches_full(pair: Pair):
    # long enough that llama3 / linear RoPE scaling is exercised past original_max (64)
    seq = random_tokens(90, seed=5)
    ref = pair.ref_logits(seq)[0]  # [T, V]
    cache = pair.native.new_cache(1, 128)
    # prefill 70, then 1, 1, a chunk of 3, 1, a chunk of 3, ...
    steps = [70, 1, 1, 3, 1, 3, 2, 1, 5, 3]
    assert sum(steps) == len(seq)
    at = 0
    for n in steps:
        toks = torch.tensor([seq[at : at + n]])
        logits, _ = pair.native(toks, torch.arange(at, at + n)[None], cache)
        assert maxdiff(logits[0], ref[at : at + n]) <= TOL, f"step at {at} (+{n})"
        at += n
        assert cache.lengths.tolist() == [at]


def test_incremental_batch_uniform(llama_pair: Pair):
    rows = [random_tokens(20, seed=6), random_tokens(20, seed=7)]
    refs = [llama_pair.ref_logits(r)[0] for r in rows]
    cache = llama_pair.native.new_cache(2, 32)
    at = 0
    for n in (12, 1, 3, 1, 3):
        toks = torch.tensor([r[at : at + n] for r in rows])
        logits, _ = llama_pair.native(toks, torch.arange(at, at + n)[None].expand(2, n), cache)
        for b in range(2):
            assert maxdiff(logits[b], refs[b][at : at + n]) <= TOL
        at += n


# -- ragged batch ---------------------------------------------------------------------------
def test_ragged_batch_equals_rows_alone(pair: Pair):
    lens = [9, 16]
    full = [random_tokens(lens[0] + 6, seed=8), random_tokens(lens[1] + 6, seed=9)]
    prompts = [f[:n] for f, n in zip(full, lens)]
    refs = [pair.ref_logits(f)[0] for f in full]  # each row alone, from scratch
    cache, logits, L = prefill_ragged(pair.native, prompts)
    for b, n in enumerate(lens):
        assert maxdiff(logits[b, :n], refs[b][:n]) <= TOL
    assert cache.lengths.tolist() == lens
    # continuation per row: one token, a chunk of 3, then two single tokens
    at = list(lens)
    for n in (1, 3, 1, 1):
        toks = torch.tensor([full[b][at[b] : at[b] + n] for b in range(2)])
        pos = torch.stack([torch.arange(at[b], at[b] + n) for b in range(2)])
        logits, _ = pair.native(toks, pos, cache)
        for b in range(2):
            assert maxdiff(logits[b], refs[b][at[b] : at[b] + n]) <= TOL, f"row {b} at {at[b]} (+{n})"
            at[b] += n
        assert cache.lengths.tolist() == at


@pytest.mark.parametrize("family", ["llama", "llama3_rope", "linear_rope"])
def test_the_rotation_table_gives_the_rotation_at_each_position(family):
    """A step reads cos / sin from the model's table of positions (made once, grown as positions
    do): bit for bit what computing them at the step's positions gives, before and after the
    table grows; the table read one position off (a broken rule) differs."""
    m = get_pair(family).native
    g = torch.Generator().manual_seed(0)
    for hi in (10, 1500, 5000):
        pos = torch.randint(0, hi, (3, 7), generator=g)
        for table, direct in zip(m._rope(pos), m._rope(pos, m.inv_freq, m.rope_scaling)):
            assert table.shape == direct.shape and torch.equal(table, direct)
    assert m._rope_table[0].shape[0] > int(pos.max())
    assert not torch.equal(m._rope(pos + 1)[0], m._rope(pos, m.inv_freq, m.rope_scaling)[0])


# -- tree path ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2", "llama3_rope"])
def test_causal_attn_mask_equals_none(family):
    p = get_pair(family)
    prompts = [random_tokens(7, seed=10), random_tokens(12, seed=11)]
    new = torch.tensor([random_tokens(5, seed=12), random_tokens(5, seed=13)])
    outs = []
    for mask in (None, torch.tril(torch.ones(2, 5, 5, dtype=torch.bool))):
        cache, _, lens = prefill_ragged(p.native, prompts)
        pos = lens[:, None] + torch.arange(5)[None]
        logits, _ = p.native(new, pos, cache, attn_mask=mask)
        outs.append(logits)
    assert maxdiff(outs[0], outs[1]) <= 1e-6
    for b in range(2):
        ref = p.ref_logits(prompts[b] + new[b].tolist())[0, -5:]
        assert maxdiff(outs[1][b], ref) <= TOL


@pytest.mark.parametrize("family", ["llama", "llama_tied", "qwen2", "linear_rope"])
def test_tree_mask_equals_chains(family):
    p = get_pair(family)
    parents = [[-1, 0, 0, 1, 2, 3, 1], [-1, 0, 1, 0, 3, 0, 2]]
    N = len(parents[0])
    prompts = [random_tokens(6, seed=14), random_tokens(11, seed=15)]
    nodes = torch.tensor([random_tokens(N, seed=16), random_tokens(N, seed=17)])
    cache, _, lens = prefill_ragged(p.native, prompts)
    mask = torch.stack([ancestor_mask(pa) for pa in parents])  # [B, N, N]
    depth = torch.tensor([[len(path_to(pa, i)) - 1 for i in range(N)] for pa in parents])
    pos = lens[:, None] + depth
    logits, _ = p.native(nodes, pos, cache, attn_mask=mask)
    assert cache.lengths.tolist() == (lens + N).tolist()
    for b in range(2):
        for i in range(N):
            chain = prompts[b] + [int(nodes[b, j]) for j in path_to(parents[b], i)]
            ref = p.ref_logits(chain)[0, -1]
            assert maxdiff(logits[b, i], ref) <= TOL, f"row {b} node {i}"


@pytest.mark.parametrize(
    "rope",
    [
        dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64),
        dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
             beta_fast=16.0, beta_slow=2.0, attention_factor=1.3),
    ],
    ids=["yarn", "yarn_attention_factor"],
)
def test_yarn_rope_matches_transformers(rope):
    """The module claims YaRN too (attention scaling folded into cos/sin)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from model_helpers import COMMON, randomize_
    from specdec.models.llama import build_native

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**COMMON, rope_parameters=rope), attn_implementation="eager")
    hf = randomize_(hf, seed=4).eval()
    native = build_native(hf.config, hf.state_dict())
    toks = torch.tensor([random_tokens(100, seed=18)])
    with torch.no_grad():
        ref = hf(input_ids=toks, use_cache=False).logits
    logits, _ = native(toks, torch.arange(100)[None], native.new_cache(1, 128))
    assert maxdiff(logits, ref) <= TOL


# -- which configs are native -------------------------------------------------------------
def test_native_support_problem():
    from transformers import GPT2Config, LlamaConfig

    from model_helpers import hf_config

    assert native_support_problem(GPT2Config()) is not None
    assert "gpt2" in native_support_problem(GPT2Config())
    for fam in ("llama", "llama_tied", "llama3_rope", "linear_rope", "qwen2", "mistral"):
        assert native_support_problem(hf_config(fam)) is None, fam
    assert native_support_problem(LlamaConfig(hidden_act="gelu")) is not None
    dyn = LlamaConfig(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    assert native_support_problem(dyn) is not None


# -- the default model ---------------------------------------------------------------------
@pytest.mark.default_model
def test_default_model_matches_transformers(default_model, default_model_float_path):
    """On the float path (SPECDEC_GGUF_ACT8=0) within float32 summation noise of transformers; on
    8-bit activations (the default) within their rounding (model_helpers.assert_act8_close)."""
    from transformers import AutoModelForCausalLM

    from model_helpers import assert_act8_close

    lm = default_model_float_path
    assert lm.backend == "native"
    tok = lm.tokenizer
    msgs = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    assert len(ids) > 10
    from pathlib import Path

    p = Path(lm.gguf)  # transformers' own GGUF loading of the same file
    hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    full = ids + [int(tok.encode(" Paris")[0])]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([full]), use_cache=False).logits.float()[0]
    T = len(ids)
    # the plain (unpacked) native model over the file's dequantised weights, and the prepacked
    # (oneDNN) one: they sum in another order, so allow 2.5e-4 absolute on logits of magnitude ~30
    # (< 1e-5 relative); the loader's model computes from the file's blocks within the same noise
    from specdec.models.llama import build_native
    from tiny_gguf import dequantized_state_dict

    sd = dequantized_state_dict(p)
    plain = build_native(lm.hf_config, sd, pack=False)
    fp32 = build_native(lm.hf_config, sd, pack=True)
    auto_tol = PACKED_TOL
    for model, tol in ((plain, TOL), (fp32, PACKED_TOL), (lm.model, auto_tol)):
        cache = model.new_cache(1, 128)
        logits, _ = model(torch.tensor([ids]), torch.arange(T)[None], cache)
        assert maxdiff(logits[0], ref[:T]) <= tol
        assert torch.equal(logits[0].argmax(-1), ref[:T].argmax(-1))
        # one decode step through the cache
        logits, _ = model(torch.tensor([[full[-1]]]), torch.tensor([[T]]), cache)
        assert maxdiff(logits[0, 0], ref[T]) <= tol
    cache = default_model.model.new_cache(1, 128)
    logits, _ = default_model.model(torch.tensor([full]), torch.arange(T + 1)[None], cache)
    assert_act8_close(logits[0], ref)


PACKED_TOL = 2.5e-4
INT16_TOL = 5e-2


def test_packed_tiny_models_match_transformers(pair):
    """The prepacked (oneDNN) fast path on the tiny families, through the cache."""
    hf = pair.hf
    from specdec.models.llama import build_native

    packed = build_native(hf.config, hf.state_dict(), pack=True)
    x = torch.randint(0, hf.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(input_ids=x).logits.float()
    cache = packed.new_cache(2, 16)
    a, _ = packed(x[:, :6], torch.arange(6)[None].expand(2, 6), cache)
    b, _ = packed(x[:, 6:], torch.arange(6, 9)[None].expand(2, 3), cache)
    assert maxdiff(torch.cat([a, b], 1), ref) <= TOL


@pytest.mark.parametrize("bias", [False, True])
def test_linear_packed_in_bfloat16(bias):
    """Linear.pack(bfloat16) (drafting heads): fp32 in, fp32 out, the product of the
    bf16-rounded weight and input; the plain weight is released."""
    from specdec.models.llama import Linear, mkldnn_packing_available

    if not mkldnn_packing_available(torch.bfloat16):
        pytest.skip("oneDNN cannot pack bfloat16 weights on this CPU (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")

    g = torch.Generator().manual_seed(0)
    lin = Linear(64, 96, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 64, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(96, generator=g))
    w = lin.weight.detach().clone()
    b = None if not bias else lin.bias.detach().clone()
    x = torch.randn(3, 5, 64, generator=g)
    lin.pack(torch.bfloat16)
    assert lin.weight is None and lin.pack_dtype == torch.bfloat16
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (3, 5, 96)
    ref = torch.nn.functional.linear(x.bfloat16().float(), w.bfloat16().float(),
                                     None if b is None else b.bfloat16().float())
    torch.testing.assert_close(y, ref, atol=0.1, rtol=0.02)  # bf16 output rounding
    exact = torch.nn.functional.linear(x, w, b)
    assert (y - exact).abs().max() > 0  # it did run in bf16, not silently in fp32


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_packed_linear_pads_short_calls():
    """Calls of fewer than MIN_PACKED_ROWS rows run padded: same result as the plain product for
    every real row (whatever earlier calls left in the padding buffer), the caller's shape, in and
    out of inference mode, and from two threads at once (each has its own buffer)."""
    import threading

    from specdec.models import llama

    assert llama.MIN_PACKED_ROWS > 1
    g = torch.Generator().manual_seed(5)
    W, bias = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    packed = torch.ops.mkldnn._reorder_linear_weight(W, llama.PACK_BATCH_HINT)
    shapes = [(1, 1, 24), (3, 24), (1, 2, 24), (2, 1, 24), (7, 24), (24,)]
    for shape in shapes:
        x = torch.randn(shape, generator=g)
        for bias_ in (None, bias):
            y = llama.packed_linear(x, packed, bias_)
            assert y.shape == (*shape[:-1], 40)
            torch.testing.assert_close(y, torch.nn.functional.linear(x, W, bias_), atol=1e-4, rtol=1e-5)
    x = torch.randn(2, 24, generator=g)
    with torch.inference_mode():
        a = llama.packed_linear(x, packed)
    torch.testing.assert_close(llama.packed_linear(x, packed), a)  # the buffer is usable outside too
    errors = []

    def worker(seed):
        gg = torch.Generator().manual_seed(seed)
        for _ in range(200):
            xs = torch.randn(1, 24, generator=gg)
            if not torch.allclose(llama.packed_linear(xs, packed), xs @ W.T, atol=1e-4):
                errors.append(seed)
                return

    threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_build_native_skips_random_init_only_while_loading():
    """build_native builds its modules without random init (the weights are loaded next);
    the switch must be off again afterwards, also when the weights turn out to be missing."""
    from transformers import LlamaConfig

    from model_helpers import COMMON
    from specdec.models.llama import LlamaConfig as NativeConfig, LlamaModel, build_native
    from specdec.types import SpecdecError

    hf = LlamaConfig(**COMMON)
    with pytest.raises(SpecdecError, match="missing"):
        build_native(hf, {})
    torch.manual_seed(0)
    fresh = LlamaModel(NativeConfig.from_hf(hf))  # outside build_native: the usual random init
    w = fresh.layers[0].wqkv.weight
    assert float(w.detach().std()) > 0 and torch.isfinite(w).all()
    assert float(fresh.embed.weight.detach().std()) > 0.5  # nn.Embedding's N(0, 1) init


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bfloat16_verification_equals_one_at_a_time_bit_for_bit(family):
    """In bfloat16 a forward over several new tokens (a chain, a tree, a ragged batch) gives
    each token exactly the logits that decoding its path one token at a time gives: the
    attention runs in float64 (`attn_dtype`), so greedy speculation cannot drift from plain
    greedy decoding. (Attending in bfloat16 differs by whole bf16 steps here.)"""
    from specdec.models.llama import build_native

    p = get_pair(family)
    model = build_native(p.hf.config, p.hf.state_dict(), dtype=torch.bfloat16, pack=True)
    assert model.attn_dtype == torch.float64
    check_verification_equals_one_at_a_time(model)
