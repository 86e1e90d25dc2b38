"""The row-stable float32 kernels (specdec/kernels/rowstable.cpp) and the model on them.

Oracles: float64 products and torch's attention (closeness), and a row or token computed alone
(row stability: a verification's tokens get the numbers plain decoding gives them, bit for bit),
transformers' greedy decoding and logits on tiny random models, plain greedy decoding with the
same model. Skipped where the kernels cannot run (no AVX2 / FMA, no compiler).
"""

from __future__ import annotations

import functools

import pytest
import torch

from model_helpers import (ancestor_mask, built_kernels, drafting_q8_op, need_kernels, prefill_ragged, random_eagle,
                           steps_both_ways)
from oracle import hf_greedy, one_thread, tiny_hf_llama


def rs_ops():
    return built_kernels()


def need_rs():
    return need_kernels()


@pytest.mark.parametrize("K,N", [(64, 40), (576, 96), (37, 11), (8, 3)])
def test_linear_is_close_to_float64_and_each_row_is_its_own(K, N):
    ops = need_rs()
    g = torch.Generator().manual_seed(K + N)
    w, x = torch.randn(N, K, generator=g), torch.randn(13, K, generator=g)
    y = ops.linear(x, w)
    ref = (x.double() @ w.double().T).float()
    assert torch.allclose(y, ref, atol=1e-4, rtol=1e-4)
    for i in range(13):
        for M in (1, 2, 4, 5, 9):  # alone, and last or first among others (other row tiles)
            others = torch.randn(M - 1, K, generator=g)
            assert torch.equal(ops.linear(torch.cat([others, x[i : i + 1]]), w)[-1], y[i]), (i, M)
            assert torch.equal(ops.linear(torch.cat([x[i : i + 1], others]), w)[0], y[i]), (i, M)
    assert ops.linear(x.view(13, 1, K), w).shape == (13, 1, N)


@pytest.mark.parametrize("N,K", [(8, 32), (12, 64), (96, 576), (20, 160)])
def test_block_products_are_the_fp32_copys_products_bit_for_bit(N, K):
    """Q4_1 and Q8_0 blocks in gguf_blocks' K-major layout rebuild each weight as the dequantised
    copy holds it and run `linear`'s sums: the same numbers as `linear` over that copy, for any
    number of rows (rows in tiles of 3: 1-8 rows cover every tile shape)."""
    import numpy as np

    from specdec.models import gguf_blocks as gb

    ops = need_rs()
    rng = np.random.default_rng(N * K)
    nb = K // 32
    d4 = (rng.random((N, nb)) * 0.02 + 0.002).astype(np.float16).astype(np.float32)
    m4 = (-rng.random((N, nb)) * 0.15).astype(np.float16).astype(np.float32)
    q4 = rng.integers(0, 256, (N, nb, 16)).astype(np.uint8)
    d8 = (rng.random((N, nb)) * 0.01 + 0.001).astype(np.float16).astype(np.float32)
    q8 = rng.integers(-128, 128, (N, nb, 32)).astype(np.int8)
    cases = [(ops.q4_1_linear, gb._pack_q4(q4, d4, m4), gb._dequant_q4(q4, d4, m4)),
             (ops.q8_0_linear, gb._pack_q8(q8, d8), gb._dequant_q8(q8, d8))]
    g = torch.Generator().manual_seed(N)
    for op, blocks, w in cases:
        w = torch.from_numpy(np.ascontiguousarray(w))
        for M in range(1, 9):
            x = torch.randn(M, K, generator=g)
            assert torch.equal(op(x, blocks, N), ops.linear(x, w)), (op, M)
        x = torch.randn(2, 3, K, generator=g)
        assert torch.equal(op(x, blocks, N), ops.linear(x, w))
        with pytest.raises(RuntimeError, match="shapes"):
            op(torch.randn(1, K + 32), blocks, N)


def test_rms_norm_is_torchs_within_rounding_and_per_row():
    ops = need_rs()
    x, w = torch.randn(3, 5, 64), torch.rand(64)
    y = ops.rms_norm(x, w, 1e-5)
    assert torch.allclose(y, torch.nn.functional.rms_norm(x, (64,), w, 1e-5), atol=1e-5)
    assert torch.equal(ops.rms_norm(x[1:2, 2:3], w, 1e-5)[0, 0], y[1, 2])


@pytest.mark.parametrize("Dh", [32, 128])
def test_attention_is_sdpas_within_rounding_each_query_as_alone_and_rows_stop_at_their_keys(Dh):
    """Ragged rows with a tree's mask: close to SDPA; every query's output equals the query attended
    alone over its visible keys compacted (no mask, no other rows); row_keys (each row's last
    visible slot) gives the same bits while skipping the padding up to the longest row. (Head size
    128: the VNNI build takes two queries of a K/V head at once, paired differently in each call.)"""
    from specdec.models.llama import additive_mask

    ops = need_rs()
    g = torch.Generator().manual_seed(3)
    B, H, Hkv, Smax = 3, 6, 2, 80
    parents = [-1, 0, 0, 1, 3]
    T = len(parents)
    tree = ancestor_mask(parents)  # [T, T] bool: node t sees its ancestors and itself
    lens = torch.tensor([20, 47, 33])
    S = int(lens.max()) + T
    kc, vc = torch.randn(B, Hkv, Smax, Dh, generator=g), torch.randn(B, Hkv, Smax, Dh, generator=g)
    q = torch.randn(B, H, T, Dh, generator=g)
    rel = torch.arange(S)[None] - lens[:, None]  # [B, S]
    allowed = (rel[:, None, :] < 0) | ((rel[:, None, :] >= 0) & (rel[:, None, :] < T) &
                                       tree.expand(B, T, T).gather(2, rel.clamp(0, T - 1)[:, None, :].expand(B, T, S)))
    mask = additive_mask(allowed, H // Hkv)
    o = ops.attend(q, kc, vc, S, mask)
    assert torch.equal(ops.attend(q, kc, vc, S, mask, lens + T), o)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(B, Hkv, (H // Hkv) * T, Dh), kc[:, :, :S], vc[:, :, :S], attn_mask=mask).view(B, H, T, Dh)
    assert torch.allclose(o, ref, atol=1e-5)
    for b in range(B):
        for t in range(T):
            keep = allowed[b, t].nonzero()[:, 0]  # its visible slots, compacted
            k1, v1 = kc[b : b + 1, :, keep].contiguous(), vc[b : b + 1, :, keep].contiguous()
            alone = ops.attend(q[b : b + 1, :, t : t + 1].contiguous(), k1, v1, len(keep), None)
            assert torch.equal(alone[0, :, 0], o[b, :, t]), (b, t)
    with pytest.raises(RuntimeError, match="row_keys"):
        ops.attend(q, kc, vc, S, mask, torch.tensor([0, 5, 5]))


@functools.lru_cache(maxsize=None)
def rs_models(hidden: int):
    """A tiny random transformers Llama and the native model from its weights on the row-stable
    kernels (head size 16 at hidden 64: rotation in torch; 32 at hidden 128: the fused rotation +
    attention call for steps of up to BLOCK_MAX_ROWS row-tokens), packed for its long prefills."""
    from specdec.models.llama import build_native

    ops = need_rs()
    hf = tiny_hf_llama(seed=hidden, vocab=64, hidden=hidden, layers=2)
    native = build_native(hf.config, hf.state_dict())
    native.use_rowstable(ops)
    native.pack()
    assert native.rowstable is ops and native.layers[0].wqkv.weight is not None
    return hf, native


@pytest.mark.parametrize("hidden", [64, 128])
def test_rowstable_model_is_close_to_transformers_and_batched_steps_are_tokens_decoded_one_at_a_time(hidden):
    """Chains and a tree after ragged prompts, in steps of B rows x T tokens up to 20 tokens a row
    (B * T above BLOCK_MAX_ROWS: the torch rotation and `attend`), give each token bit for bit the
    logits of decoding its path one token a step in the same batch (4 row-tokens: the fused call);
    and a prefill then steps stay within float rounding of transformers."""
    from specdec.models.llama import BLOCK_MAX_ROWS

    hf, native = rs_models(hidden)
    g = torch.Generator().manual_seed(21)
    rows = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (9, 5, 12, 7)]
    B = len(rows)
    tree = ancestor_mask([-1, 0, 0, 1, 3, 4])
    for T, mask in ((5, None), (9, None), (6, tree), (20, None)):
        assert B * T > BLOCK_MAX_ROWS
        toks = torch.randint(0, 64, (B, T), generator=g)
        cache, _, lens = prefill_ragged(native, rows, max_len=40)
        depth = mask.sum(-1) - 1 if mask is not None else torch.arange(T)
        am = None if mask is None else mask[None].expand(B, T, T)
        step = native(toks, lens[:, None] + depth[None], cache, attn_mask=am)[0]
        for t in range(T):
            path = [i for i in range(T) if (mask[t, i] if mask is not None else i <= t)]
            one, _, _ = prefill_ragged(native, rows, max_len=40)
            for j, i in enumerate(path):
                logits = native(toks[:, i : i + 1], (lens + j)[:, None], one)[0]
            assert torch.equal(logits[:, 0], step[:, t]), (T, t)
    toks = torch.randint(0, 64, (1, 30), generator=g)
    with torch.no_grad():
        ref = hf(input_ids=toks, use_cache=False).logits.float()
    cache = native.new_cache(1, 40)
    got = [native(toks[:, :20], torch.arange(20)[None], cache)[0]]
    for p in range(20, 30, 5):
        got.append(native(toks[:, p : p + 5], torch.arange(p, p + 5)[None], cache)[0])
    assert torch.allclose(torch.cat(got, 1), ref, atol=1e-4, rtol=1e-4)


def test_layers_on_blocks_take_the_direct_step_calls_with_the_general_paths_numbers(monkeypatch):
    """A model whose projections are all on (Q8_0) blocks on the AVX2 kernels makes its decoding
    steps as direct kernel calls (Block.fast, no Linear.forward in between): for ragged rows and
    a tree, each token's logits equal decoding it alone, and equal the general path's (torch's
    rotation and `attend`, FUSED_DECODING_STEP off) bit for bit."""
    from specdec.models import llama
    from specdec.models.gguf_blocks import quantize_q8_0
    from specdec.models.llama import build_native

    ops = need_rs()
    hf, _ = rs_models(128)
    native = build_native(hf.config, hf.state_dict())
    blocks = {f"layers.{i}.{a}": quantize_q8_0(getattr(blk, a).weight)
              for i, blk in enumerate(native.layers) for a in ("wqkv", "wo", "w_gate_up", "w_down")}
    assert native.use_rowstable(ops, blocks) == len(blocks)
    native.pack()
    assert all(blk.fast is not None for blk in native.layers)
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (8, 3, 11)]
    B = len(rows)
    tree = ancestor_mask([-1, 0, 0, 1, 3])
    toks = torch.randint(0, 64, (B, 5), generator=g)
    depth = tree.sum(-1) - 1

    def step():
        cache, _, lens = prefill_ragged(native, rows, max_len=32)
        return lens, native(toks, lens[:, None] + depth[None], cache, attn_mask=tree[None].expand(B, 5, 5))[0]

    lens, fast = step()
    monkeypatch.setattr(llama, "FUSED_DECODING_STEP", False)
    assert torch.equal(step()[1], fast)
    monkeypatch.setattr(llama, "FUSED_DECODING_STEP", True)
    for t in range(5):
        path = [i for i in range(5) if tree[t, i]]
        one, _, _ = prefill_ragged(native, rows, max_len=32)
        for j, i in enumerate(path):
            logits = native(toks[:, i : i + 1], (lens + j)[:, None], one)[0]
        assert torch.equal(logits[:, 0], fast[:, t]), t


def test_fused_decoding_step_gives_the_python_paths_numbers(monkeypatch):
    """On fp32 weights (no direct step calls), the kernels' one-call decoding step (rotation, cache
    write, attention) computes what the step through torch's rotation and the kernels' `attend`
    computes, bit for bit: chains and a tree, one row and a ragged batch."""
    from specdec.models import llama

    _, native = rs_models(128)
    assert all(blk.fast is None for blk in native.layers)
    tree = ancestor_mask([-1, 0, 0, 1])
    steps_both_ways(native, 12, ((1, None), (3, None), (4, tree)),
                    lambda on: monkeypatch.setattr(llama, "FUSED_DECODING_STEP", on))


def test_greedy_speculation_on_rowstable_equals_plain_greedy_and_transformers():
    """Every drafter at batch 1 and 3 gives plain greedy decoding's tokens on the row-stable
    model, and those are transformers' greedy tokens on these prompts."""
    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.drafters.ngram import NgramDrafter
    from specdec.engine import Engine
    from specdec.types import SamplingParams

    hf, native = rs_models(128)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (6, 11, 9)]
    prompts[2] = prompts[2][:4] * 2
    sp = SamplingParams(max_new_tokens=24)
    want = [o.tokens for o in Engine(native, None, k=0).generate(prompts, sp)]
    assert want == [Engine(native, None, k=0).generate([p], sp)[0].tokens for p in prompts]
    assert want == [hf_greedy(hf, p, 24) for p in prompts]
    with one_thread():
        for drafter in (NgramDrafter(), DraftModelDrafter(native)):
            for batch in ([prompts[0]], prompts):
                outs = Engine(native, drafter, k=4, fixed_k=True).generate(batch, sp)
                assert [o.tokens for o in outs] == want[: len(batch)], type(drafter).__name__


@functools.lru_cache(maxsize=None)
def rs_target(on_blocks: bool):
    """rs_models(128), or (on_blocks) a copy whose LM head is read from Q8_0 blocks on the AVX2
    kernels, as a GGUF model's is: what makes drafters take Q8_0 copies of their own weights."""
    from specdec.models.gguf_blocks import quantize_q8_0
    from specdec.models.llama import build_native

    hf, native = rs_models(128)
    if on_blocks:
        native = build_native(hf.config, hf.state_dict())
        native.use_rowstable(rs_ops(), {"head": quantize_q8_0(native.lm_head_weight())})
        native.pack()
        assert native.head_rs_blocks is not None
    return hf, native


@pytest.mark.parametrize("on_blocks", [False, True])
def test_eagle_head_drafts_on_the_rowstable_kernels_and_greedy_stays_exact(on_blocks):
    """Where the target's steps are on the AVX2 kernels, an EAGLE head drafts on them too: its
    projections and output head (Q8_0 copies where the target reads GGUF blocks, here its LM head;
    else fp32) and its short steps' norms and fused attention. Its trees match the same head's
    through torch's norms and attention, and greedy speculation with it equals plain greedy
    decoding of the same model at batch 1 and 3 (and transformers' where the model is fp32)."""
    from specdec.drafters.base import DraftContext
    from specdec.engine import Engine
    from specdec.types import SamplingParams

    ops = need_rs()
    hf, native = rs_target(on_blocks)

    def make():
        return random_eagle(native, noise=0.3)

    d, ref = make(), make()
    assert d.kops is ops and d.W_rs[0] == (drafting_q8_op(ops) if on_blocks else ops.linear)
    assert all(lin.rs is ops and (lin.rs_blocks is not None) == on_blocks
               for lin in (d.head.fc, d.head.wqkv, d.head.wo, d.head.w_gate_up, d.head.w_down))
    ref.kops = None  # the same head's numbers through torch's norms, rotation and SDPA
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (6, 11, 9)]
    hid = []
    for p in prompts:
        hid.append(native(torch.tensor([p]), torch.arange(len(p))[None], native.new_cache(1, 64))[1][0])
    props = []
    for dr in (d, ref):
        dr.begin(prompts, SamplingParams(), 64)
        props.append(dr.propose(DraftContext([list(p) for p in prompts], SamplingParams(), None, list(hid)), 3))
    assert torch.equal(props[0].counts, props[1].counts) and props[0].counts.sum() > 0
    for b in range(len(prompts)):
        n = int(props[0].counts[b])
        assert torch.equal(props[0].tokens[b, :n], props[1].tokens[b, :n])
        assert torch.equal(props[0].parents[b, :n], props[1].parents[b, :n])
    sp = SamplingParams(max_new_tokens=20)
    want = [Engine(native, None, k=0).generate([p], sp)[0].tokens for p in prompts]
    if not on_blocks:
        assert want == [hf_greedy(hf, p, 20) for p in prompts]
    with one_thread():
        for batch in ([prompts[0]], prompts):
            outs = Engine(native, make(), k=3, fixed_k=True).generate(batch, sp)
            assert [o.tokens for o in outs] == want[: len(batch)]
            assert sum(o.stats.proposed for o in outs) > 0


@pytest.mark.parametrize("on_blocks", [False, True])
@pytest.mark.parametrize("subset", [None, list(range(0, 64, 2))])
def test_draft_model_drafts_on_the_rowstable_kernels_and_greedy_stays_exact(on_blocks, subset):
    """Where the target's steps are on the AVX2 kernels, a draft model given the target
    (DraftModelDrafter(target_model=...)) computes its steps there too: Q8_0 copies of its
    projections (and of its head, or its vocabulary-subset head) where the target reads blocks,
    fp32 weights otherwise; greedy speculation with it equals plain greedy decoding at batch 1
    and 3."""
    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.engine import Engine
    from specdec.models.llama import build_native
    from specdec.types import SamplingParams

    ops = need_rs()
    _, native = rs_target(on_blocks)
    dhf = tiny_hf_llama(seed=77, vocab=64, hidden=64, layers=1)

    def make():
        return DraftModelDrafter(build_native(dhf.config, dhf.state_dict()), vocab_subset=subset, target_model=native)

    d = make()
    assert d.model.rowstable is ops and d.model.packed
    assert all((lin.rs_blocks is not None) == on_blocks for blk in d.model.layers
               for lin in (blk.wqkv, blk.wo, blk.w_gate_up, blk.w_down))
    if subset is None:
        assert d.head_rs is None and (d.model.head_rs_blocks is not None) == on_blocks
    else:
        assert d.head_rs[0] == (drafting_q8_op(ops) if on_blocks else ops.linear) and d.head_packed is None
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (7, 10, 5)]
    prompts[1] = prompts[1][:5] * 2
    sp = SamplingParams(max_new_tokens=20)
    want = [Engine(native, None, k=0).generate([p], sp)[0].tokens for p in prompts]
    with one_thread():
        for batch in ([prompts[0]], prompts):
            outs = Engine(native, make(), k=4, fixed_k=True).generate(batch, sp)  # (every step drafts)
            assert [o.tokens for o in outs] == want[: len(batch)]
            assert sum(o.stats.proposed for o in outs) > 0


def test_use_rowstable_refuses_what_it_cannot_compute():
    from specdec.models.llama import build_native
    from specdec.types import SpecdecError

    ops = need_rs()
    hf = tiny_hf_llama(seed=1, vocab=64, hidden=64, layers=1)
    with pytest.raises(SpecdecError, match="before pack"):
        build_native(hf.config, hf.state_dict(), pack=True).use_rowstable(ops)
    with pytest.raises(SpecdecError, match="float32"):
        build_native(hf.config, hf.state_dict(), dtype=torch.bfloat16).use_rowstable(ops)


@pytest.mark.default_model
@pytest.mark.parametrize("path", ["act8", "float"])
def test_default_model_verifies_bit_for_bit_on_the_row_stable_kernels(path, default_model, default_model_float_path):
    """The default model's decoding steps are on the row-stable kernels, on 8-bit activations (the
    default) and on the float path: a 6-token verification gives each token the logits of decoding
    it alone, bit for bit; a long prefill over the same tokens (float32 norms and attention, then
    the same products) gives them within float rounding (the float path) or within what the
    activations' rounding makes of that rounding (act8: model_helpers.assert_act8_close)."""
    from model_helpers import assert_act8_close

    lm = default_model if path == "act8" else default_model_float_path
    model = lm.model
    need_rs()
    assert model.rowstable is not None
    op = model.layers[0].w_gate_up.rs_blocks[0]
    assert op is (model.rowstable.q4_1_linear_q8 if path == "act8" else model.rowstable.q4_1_linear)
    ids = lm.tokenizer.encode("Tell me about the sea. " * 12 + "The three primary colors are")
    L = len(ids)
    assert L > 64  # a prefill long enough for oneDNN (step_call)
    with torch.inference_mode():
        chain, alone = model.new_cache(1, L + 8), model.new_cache(1, L + 8)
        first = model(torch.tensor([ids]), torch.arange(L)[None], chain)[0][0, -1].argmax()
        model(torch.tensor([ids]), torch.arange(L)[None], alone)
        toks, singles = [int(first)], []
        for j in range(6):
            lg = model(torch.tensor([[toks[-1]]]), torch.tensor([[L + j]]), alone)[0][0, 0]
            singles.append(lg)
            toks.append(int(lg.argmax()))
        step = model(torch.tensor([toks[:6]]), (L + torch.arange(6))[None], chain)[0][0]
        for j in range(6):
            assert torch.equal(step[j], singles[j]), j
        # a long prefill over the same tokens
        ref = model(torch.tensor([ids + toks[:6]]), torch.arange(L + 6)[None], model.new_cache(1, L + 8))[0]
    if path == "float":
        assert torch.allclose(step, ref[0, L:], atol=2e-3), float((step - ref[0, L:]).abs().max())
    else:
        assert_act8_close(step, ref[0, L:])


@pytest.mark.default_model
def test_default_model_on_gguf_blocks_computes_the_fp32_copys_numbers(default_model_float_path):
    """The default model on the float path (SPECDEC_GGUF_ACT8=0) reads its GGUF file's bytes
    through its repacked blocks and gguf_rows; the same model built from the file's dequantised
    weights (gguf.quants.dequantize) on the row-stable float32 kernels computes the same steps (one token, and a 5-token
    verification) to the same logits bit for bit: the blocks change the bytes read, not the
    numbers."""
    from pathlib import Path

    from specdec.models.llama import build_native
    from tiny_gguf import dequantized_state_dict

    lm = default_model_float_path
    ops = need_rs()
    if not getattr(lm.model, "gguf_native", False) or lm.model.rowstable is None:
        pytest.skip("the default model is not on the GGUF kernels here")
    fp32 = build_native(lm.hf_config, dequantized_state_dict(Path(lm.gguf)))
    fp32.use_rowstable(ops)
    fp32.pack()
    ids = lm.tokenizer.encode("Name a planet and one fact about it.")
    L = len(ids)
    outs = []
    with torch.inference_mode():
        for m in (lm.model, fp32):
            cache = m.new_cache(1, L + 8)
            m(torch.tensor([ids]), torch.arange(L)[None], cache)
            one = m(torch.tensor([[ids[-1]]]), torch.tensor([[L]]), cache)[0]
            five = m(torch.tensor([ids[:5]]), (L + 1 + torch.arange(5))[None], cache)[0]
            outs.append((one, five))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
