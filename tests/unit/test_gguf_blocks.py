"""GGUF blocks decoded and packed (models/gguf_blocks.py), the default model on its GGUF file's
blocks, and the EAGLE head drafting on the kernels its target runs on.

Oracles: gguf.quants.dequantize of the same bytes (the decoders the repacking reads through), the
Q8_0 rounding's half step (a drafter's copies), transformers' GGUF loading of the shipped file,
plain greedy decoding, and the head's own steps through torch's norms and attention.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.models import gguf_blocks as gb

from model_helpers import drafting_q8_op, need_kernels
from oracle import tiny_hf_llama


# -- GGUF bytes ---------------------------------------------------------------------------------
def test_q4_0_is_stored_as_q4_1_with_the_same_values():
    """Q4_0 (w = d (q - 8)) becomes Q4_1 with m = -8 d: the rebuilt weights are the same floats."""
    rng = np.random.default_rng(3)
    N, nb = 8, 3
    d = (rng.random((N, nb)) * 0.02 + 0.002).astype(np.float16)
    qs = rng.integers(0, 256, (N, nb, 16)).astype(np.uint8)
    raw = np.concatenate([d.view(np.uint8).reshape(N, nb, 2), qs], axis=2).reshape(N, -1)
    q, d32, m = gb._q4(raw, "Q4_0")
    nib = np.concatenate([qs & 15, qs >> 4], axis=2).astype(np.float32)
    expected = ((nib - 8.0) * d.astype(np.float32)[..., None]).reshape(N, -1)
    assert np.array_equal(gb._dequant_q4(q, d32, m), expected)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_decoders_rebuild_gguf_dequantize_of_the_same_bytes(kind):
    """_q4 / _q8 read a GGUF tensor's bytes into the (q, d[, m]) the packers take; dequantised
    they equal gguf.quants.dequantize of the same bytes (the independent reference: no fp32
    copy of a model is needed to check a packing)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from gguf_random import Q4_0, Q4_1, Q8_0, random_blocks

    t = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q8_0": Q8_0}[kind]
    raw = random_blocks(t, 24, 96, np.random.default_rng(5))
    want = dequantize(raw, GGMLQuantizationType(t)).reshape(24, 96)
    got = gb._dequant_q8(*gb._q8(raw)) if kind == "Q8_0" else gb._dequant_q4(*gb._q4(raw, kind))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * float(np.abs(want).max()))
    if kind == "Q8_0":
        assert np.array_equal(got, want)  # (one rounding each: d * q)
    broken = raw.copy()
    broken[0, 2] ^= 0xFF  # a flipped quant byte is seen
    back = gb._dequant_q8(*gb._q8(broken)) if kind == "Q8_0" else gb._dequant_q4(*gb._q4(broken, kind))
    assert not np.array_equal(back, want)


# -- the default model ------------------------------------------------------------------------
@pytest.mark.default_model
def test_default_model_computes_with_its_blocks(default_model, default_model_float_path):
    """The shipped GGUF computes from its own blocks (Q4_1 projections, Q8_0 embedding and tied
    head), no fp32 copy: on the float path, next-token logits equal transformers' GGUF loading of
    the same file within float32 summation noise, with the same argmax; on 8-bit activations (the
    default: the repacked blocks' q4_1_linear_q8 / q8_0_linear_q8) within the activations' rounding
    of them (model_helpers.assert_act8_close)."""
    from transformers import AutoModelForCausalLM

    from model_helpers import assert_act8_close
    from specdec.models.loader import default_model_path

    ids = default_model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    toks = torch.tensor([ids])
    p = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    with torch.no_grad():
        want = hf(toks).logits[:, -6:]
    for lm in (default_model, default_model_float_path):
        assert lm.weights == "gguf blocks (F32, Q4_1, Q8_0)" and getattr(lm.model, "gguf_native", False)
        m = lm.model
        assert all(lin.weight is None for blk in m.layers for lin in (blk.wqkv, blk.wo, blk.w_gate_up, blk.w_down))
        cache = m.new_cache(1, len(ids) + 8)
        m(toks[:, :-6], torch.arange(len(ids) - 6)[None], cache)
        got = m(toks[:, -6:], torch.arange(len(ids) - 6, len(ids))[None], cache)[0]
        if lm is default_model_float_path:
            assert (got - want).abs().max().item() < 2e-3
            assert torch.equal(got.argmax(-1), want.argmax(-1))
        else:
            assert m.head.rs_blocks[0] is m.rowstable.q8_0_linear_q8
            assert_act8_close(got[0], want[0])
        assert m.weight_bytes_per_token() < m.num_parameters()  # under a byte a weight (fp32: 4)


def test_weights_option_errors(tmp_path):
    """--weights says what does not apply instead of silently doing something else."""
    from specdec.models.loader import check_weights_choice, load_model
    from specdec.types import SpecdecError

    tiny_hf_llama(0, vocab=64, hidden=64).save_pretrained(tmp_path / "hf")
    with pytest.raises(SpecdecError, match="needs a GGUF model"):
        load_model(str(tmp_path / "hf"), quiet=True, with_tokenizer=False, weights="blocks")
    assert load_model(str(tmp_path / "hf"), quiet=True, with_tokenizer=False).weights == "fp32"
    with pytest.raises(SpecdecError, match="weights must be one of"):
        check_weights_choice("int4", False)
    for strict in ("fp32", "int16", "int8"):
        with pytest.raises(SpecdecError, match="a GGUF model computes from its own blocks"):
            check_weights_choice(strict, True)
    check_weights_choice("blocks", True)
    check_weights_choice("auto", True)
    for integer in ("int16", "int8"):  # a folder: no model runs on the integer kernels now
        with pytest.raises(SpecdecError, match="no model runs on the integer kernels"):
            check_weights_choice(integer, False)


# -- drafters on the kernels --------------------------------------------------------------------
def test_quantize_q8_0_error_is_within_half_a_step_and_q8_values_survive():
    g = torch.Generator().manual_seed(8)
    w = torch.randn(16, 96, generator=g)
    kind, pk, rows = gb.quantize_q8_0(w)
    assert kind == "Q8_0" and rows == 16
    # decode the K-major bytes back: per group of 4 rows and block, d[4] then q[4][32]
    raw = pk.numpy().reshape(16 // 4, 3, 4 * 4 + 4 * 32)
    d = raw[:, :, :16].copy().view(np.float32).reshape(4, 3, 4).transpose(0, 2, 1).reshape(16, 3)
    q = raw[:, :, 16:].copy().view(np.int8).reshape(4, 3, 4, 32).transpose(0, 2, 1, 3).reshape(16, 3, 32)
    back = gb._dequant_q8(q, d)
    step = np.repeat(d, 32, axis=1)
    assert np.all(np.abs(back - w.numpy()) <= step / 2 + 1e-7)
    # weights that already are Q8_0 values (a GGUF head's rows) come back exactly
    assert np.array_equal(gb._dequant_q8(*gb._q8(np.concatenate(
        [d.astype(np.float16).view(np.uint8).reshape(16, 3, 2), q.view(np.uint8)], axis=2).reshape(16, -1))), back)
    assert gb.quantize_q8_0(torch.randn(16, 40)) is None  # K not a multiple of 32


def test_a_drafters_copy_on_8bit_activations_holds_the_same_weights():
    """quantize_q8_0(w, act8=True): the same Q8_0 values in q8_0_linear_q8's layout, so its
    product is the float path's product over the same copy up to the activations' 8-bit rounding
    (and far from it where the copy held other weights); 16-row multiples only."""
    ops = need_kernels()
    if not hasattr(ops, "q8_0_linear_q8"):
        pytest.skip("no 8-bit-activation kernels in this build")
    g = torch.Generator().manual_seed(9)
    w, x = torch.randn(48, 96, generator=g), torch.randn(5, 96, generator=g)
    kind, i8, rows = gb.quantize_q8_0(w, act8=True)
    assert kind == "Q8_0i8" and rows == 48 and i8.numel() == 48 * 3 * 36
    _, kmajor, _ = gb.quantize_q8_0(w)
    on_float, on_act8 = ops.q8_0_linear(x, kmajor, 48), ops.q8_0_linear_q8(x, i8, 48)
    scale = on_float.abs().max()
    assert (on_act8 - on_float).abs().max() < 0.02 * scale  # (8-bit activations: ~0.4% a block)
    _, other, _ = gb.quantize_q8_0(torch.randn(48, 96, generator=g), act8=True)
    assert (ops.q8_0_linear_q8(x, other, 48) - on_float).abs().max() > 0.2 * scale
    assert gb.quantize_q8_0(torch.randn(20, 96), act8=True)[0] == "Q8_0"  # (20 rows: the K-major layout)


@pytest.mark.default_model
def test_medusa_heads_score_their_subset_on_the_kernels(default_model):
    """Medusa's subset head runs on the target's kernels (a Q8_0 copy, 8-bit activations by
    default): its scores stay close to the float32 product and its top guesses are the same."""
    from specdec.drafters.medusa import DEFAULT_MEDUSA_DIR, MedusaDrafter, load_medusa

    ops = need_kernels()
    heads, meta = load_medusa(DEFAULT_MEDUSA_DIR, default_model)
    d = MedusaDrafter(heads, default_model.model, meta.get("vocab_subset"))
    assert d.W_rs is not None and d.W_rs[0] == drafting_q8_op(ops)
    h = torch.randn(4, d.W.shape[1], generator=torch.Generator().manual_seed(3)) * 4
    on_kernels, exact = d.W_rs[0](h, *d.W_rs[1:]), h @ d.W.T
    assert (on_kernels - exact).abs().max() < 0.05 * exact.abs().max()
    assert torch.equal(on_kernels.argmax(-1), exact.argmax(-1))


@pytest.mark.default_model
def test_eagle_head_drafts_on_the_kernels_and_stays_exact(default_model):
    """The EAGLE head drafts on the row-stable kernels its GGUF target runs on (Q8_0 copies of its
    projections and subset head); auto's greedy output still equals plain greedy output."""
    from specdec.config import SpecConfig
    from specdec.engine import Engine
    from specdec.methods import sources_for
    from specdec.types import SamplingParams

    ops = need_kernels()
    d = sources_for(SpecConfig(), default_model)[0]  # auto: prompt lookup and the shipped EAGLE head
    head = next(s for s in d if s.label == "eagle")
    assert head.W_rs is not None and head.W_rs[0] == drafting_q8_op(ops)
    assert head.head.wqkv.rs is ops and head.head.wqkv.rs_blocks is not None
    ids = default_model.tokenizer.encode("def fib(n):\n    if n < 2:\n        return n\n")
    sp = SamplingParams(max_new_tokens=40)
    [plain] = Engine(default_model.model, None, k=0).generate([ids], sp)
    # (at a fixed k, trees every step: on a busy machine the cost model may fairly decline them all)
    [spec] = Engine(default_model.model, d, k=8, fixed_k=True).generate([ids], sp)
    assert spec.tokens == plain.tokens and spec.stats.accepted > 0


@pytest.mark.default_model
def test_eagle_head_steps_through_the_kernels_as_through_torch(default_model):
    """Where the head's layer is on the row-stable kernels, its short steps (a step's catch-up,
    the tree's expansions with their visibility mask) run through the kernels' norms and fused
    attention (`_kernel_step`): the same features and cache entries as the torch path (SDPA) up to
    the order of float sums, for a causal catch-up and for a tree step whose nodes see different
    ancestors; and whole tree proposals agree with the torch path's."""
    import torch

    from specdec.config import SpecConfig
    from specdec.drafters.base import DraftContext
    from specdec.methods import sources_for
    from specdec.types import SamplingParams

    ops = need_kernels()
    d = next(s for s in sources_for(SpecConfig(), default_model)[0] if s.label == "eagle")
    assert d.kops is ops
    torch.manual_seed(0)
    D = d.dim
    n0 = 40  # committed pairs already in the cache
    d.begin([[1] * 64], SamplingParams(), 64)
    d.k[:, :, :n0].normal_()
    d.v[:, :, :n0].normal_()
    key = torch.arange(n0 + 3)
    kops = d.kops

    def both(tokens, feats, slots, visible):
        """(kernel path, torch path): output features and the cache entries each wrote."""
        out = []
        for ops in (kops, None):
            k0, v0 = d.k.clone(), d.v.clone()
            d.kops = ops
            with torch.inference_mode():
                y = d._step(tokens, feats, slots, slots, visible)
            S = visible.shape[-1]
            out.append((y, d.k[:, :, :S].clone(), d.v[:, :, :S].clone()))
            d.k, d.v = k0, v0
        d.kops = kops
        return out

    # a catch-up of three pairs (causal) and a tree step: node 2 does not see node 1's slot
    slots = torch.tensor([[n0, n0 + 1, n0 + 2]])
    cases = [(slots, key[None, None, :] <= slots[:, :, None])]
    tree_vis = (key[None, None, :] < n0).repeat(1, 3, 1)
    tree_vis[0, 0, n0] = tree_vis[0, 1, n0 + 1] = tree_vis[0, 2, n0 + 2] = True  # each node itself
    tree_vis[0, 2, n0] = True  # node 3 hangs under node 1
    cases.append((slots, tree_vis))
    for slots_, vis in cases:
        tokens = torch.randint(0, 1000, (1, 3))
        feats = torch.randn(1, 3, D)
        (yk, kk, vk), (yt, kt, vt) = both(tokens, feats, slots_, vis)
        scale = float(yt.abs().max())
        assert (yk - yt).abs().max() <= 1e-4 * scale, "the kernel step's features are off the torch path's"
        assert torch.allclose(kk, kt, atol=1e-4) and torch.allclose(vk, vt, atol=1e-4)
    # whole proposals from a real context: the same trees (or nearly: a near tie may flip)
    ids = default_model.tokenizer.encode("def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1)")
    hidden = default_model.model(torch.tensor([ids]), torch.arange(len(ids))[None], default_model.model.new_cache(1, 64))[1]
    drafts = []
    for ops in (kops, None):
        d.kops = ops
        d.begin([ids], SamplingParams(), 64)
        ctx = DraftContext([ids], SamplingParams(), None, [hidden[0, :-1]])
        drafts.append(d.propose(ctx, 4))
    d.kops = kops
    a, b = drafts
    assert int(a.counts[0]) == int(b.counts[0]) > 1
    assert torch.equal(a.parents, b.parents) and (a.tokens == b.tokens).float().mean() >= 0.8
