"""GGUF block kernels (specdec/kernels) and their packing (models/gguf_blocks.py).

Oracles: float64 products of the dequantised weights (the kernels), a row computed alone (row
independence: a verification step's rows get the projections plain decoding gives them, bit
for bit), transformers' logits and greedy decoding on tiny random models whose weights are
exactly the blocks' values (the model with blocks attached), and the fp32 copy of the default
model (its 121 matrices must rebuild it bit for bit, or they are left out).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from specdec.models import gguf_blocks as gb

from conftest import ancestor_mask, built_kernels, need_kernels
from oracle import hf_greedy, one_thread, tiny_hf_llama


def kernel_ops():
    return built_kernels("blocks")


def need_ops():
    return need_kernels("blocks")


def rand_q4_1(N: int, K: int, rng) -> tuple:
    """Random Q4_1 blocks as gguf_blocks decodes them: (q [N, nb, 16] nibbles, d, m)."""
    nb = K // 32
    d = (rng.random((N, nb)) * 0.02 + 0.002).astype(np.float16).astype(np.float32)
    m = (-rng.random((N, nb)) * 0.15).astype(np.float16).astype(np.float32)
    return rng.integers(0, 256, (N, nb, 16)).astype(np.uint8), d, m


def rand_q8_0(N: int, K: int, rng) -> tuple:
    nb = K // 32
    d = (rng.random((N, nb)) * 0.01 + 0.001).astype(np.float16).astype(np.float32)
    return rng.integers(-128, 128, (N, nb, 32)).astype(np.int8), d


# layouts: K-major, N-major (float32 activations); the VNNI layout with 8-bit (v) and 16-bit (w) activations
KERNELS = [(kind, layout) for kind in ("Q4_1", "Q8_0") for layout in ("k", "n", "v", "w")]


def packed(kind: str, layout: str, parts) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed blocks in the K-major, N-major or VNNI (v, w) layout, fp32 weights [N, K]) of decoded blocks."""
    if layout in ("v", "w"):
        _, p, _ = gb.pack(kind, parts, "vnni")
    else:
        _, k, n = gb.pack(kind, parts)
        p = k if layout == "k" else n
    w = gb._dequant_q4(*parts) if kind == "Q4_1" else gb._dequant_q8(*parts)
    return p, torch.from_numpy(w)


def kernel(ops, kind: str, layout: str):
    if layout in ("v", "w"):
        from specdec import kernels

        if not kernels.has_vnni():
            pytest.skip("this CPU has no AVX-512 VNNI (the integer kernels)")
    name = ("q4_1_linear" if kind == "Q4_1" else "q8_0_linear") + {"k": "", "n": "_n", "v": "_v", "w": "_w"}[layout]
    return getattr(ops, name)


def integer_oracle(x: torch.Tensor, kind: str, parts, bits: int) -> torch.Tensor:
    """What the integer kernels compute, from their definition (qlinear.cpp), in float64 with exact
    integer dot products: per row and 32-value block, with Q = 127 (8 bits) or 32512 (16 bits),
    da = max |x| / Q and qa = round(x * (Q / max |x|)) (float32, to nearest even); then
    y = sum over blocks of float(q . qa) dw da + mw da sum(qa) (Q4_1, q = 0..15) or float(q . qa)
    dw da (Q8_0). (The 16-bit kernels' split of qa into two bytes is exact, so it does not show.)"""
    Q = np.float32(127 if bits == 8 else 32512)
    xb = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)  # [M, nb, 32]
    amax = np.abs(xb).max(axis=2)
    da = (amax / Q).astype(np.float32)
    inv = np.where(amax > 0, Q / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    qa = np.rint((xb * inv[..., None]).astype(np.float32)).astype(np.int64)  # [M, nb, 32]
    if kind == "Q4_1":
        q, d, m = parts
        qw = np.concatenate([q & 0x0F, q >> 4], axis=2).astype(np.int64)  # [N, nb, 32]
    else:
        q, d = parts
        qw, m = q.astype(np.int64), np.zeros_like(d)
    isum = np.einsum("mbk,nbk->mnb", qa, qw).astype(np.float64)  # exact
    da64 = da.astype(np.float64)
    y = isum * d[None].astype(np.float64) * da64[:, None, :] + m[None].astype(np.float64) * (da64 * qa.sum(2))[:, None, :]
    return torch.from_numpy(y.sum(axis=2))


def rand_blocks(kind: str, N: int, K: int, rng):
    return rand_q4_1(N, K, rng) if kind == "Q4_1" else rand_q8_0(N, K, rng)


# -- the kernels --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,layout", KERNELS)
def test_kernel_matches_float64_product(kind, layout):
    ops = need_ops()
    rng = np.random.default_rng(0)
    N, K = 80, 96  # 80 outputs: five 16-output tiles, one unit of four and one left over (N-major)
    p, w = packed(kind, layout, rand_blocks(kind, N, K, rng))
    op = kernel(ops, kind, layout)
    g = torch.Generator().manual_seed(0)
    parts = rand_blocks(kind, N, K, np.random.default_rng(0))
    for M in list(range(1, 18)) + [33]:
        x = torch.randn(M, K, generator=g)
        y = op(x, p, N)
        exact = x.double() @ w.double().T
        ref = integer_oracle(x, kind, parts, 8 if layout == "v" else 16) if layout in ("v", "w") else exact
        assert y.shape == (M, N) and y.dtype == torch.float32
        assert (y.double() - ref).abs().max().item() < 1e-5 * max(1.0, ref.abs().max().item())
        # and rounded activations stay close to the float product (8 bits: ~0.5%, 16 bits: ~2e-5)
        tol = {"v": 2e-2, "w": 1e-4}.get(layout, 1e-5)
        assert (y.double() - exact).abs().max().item() < tol * exact.abs().max().item()
    # leading dimensions are kept, like F.linear
    x3 = torch.randn(2, 3, K, generator=g)
    assert torch.equal(op(x3, p, N), op(x3.reshape(6, K), p, N).reshape(2, 3, N))


@pytest.mark.parametrize("kind,layout", KERNELS)
def test_a_rows_result_does_not_depend_on_the_other_rows_or_threads(kind, layout):
    """Within a kernel every output is summed in one fixed order whatever the number of rows (the
    kernels split rows into passes of up to 5 or 8 and columns over threads): a row computed with
    1..16 others is bit for bit the row computed alone, on one thread or two."""
    ops = need_ops()
    rng = np.random.default_rng(1)
    N, K = 80, 160
    p, _ = packed(kind, layout, rand_blocks(kind, N, K, rng))
    op = kernel(ops, kind, layout)
    x = torch.randn(17, K, generator=torch.Generator().manual_seed(1))
    alone = torch.stack([op(x[i : i + 1], p, N)[0] for i in range(17)])
    for M in range(1, 18):
        assert torch.equal(op(x[:M], p, N), alone[:M]), M
    with one_thread():
        assert torch.equal(op(x, p, N), alone)


@pytest.mark.parametrize("layout", ["k", "n", "v", "w"])
def test_kernel_refuses_mismatched_shapes(layout):
    ops = need_ops()
    rng = np.random.default_rng(2)
    p, _ = packed("Q4_1", layout, rand_q4_1(16, 64, rng))
    op = kernel(ops, "Q4_1", layout)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        op(torch.randn(2, 96), p, 16)
    with pytest.raises(RuntimeError, match="float32"):
        op(torch.randn(2, 64, dtype=torch.float64), p, 16)


def test_tile_layouts_need_whole_tiles_and_the_vnni_one_float16_scales():
    rng = np.random.default_rng(2)
    assert gb.pack("Q4_1", rand_q4_1(20, 64, rng))[2] is None  # 20 outputs: not a multiple of 16
    assert gb.pack("Q8_0", rand_q8_0(20, 64, rng))[2] is None
    assert gb.pack("Q4_1", rand_q4_1(20, 64, rng), "vnni") == ("Q4_1", None, None)
    q, d, m = rand_q4_1(16, 64, rng)  # the VNNI layout keeps Q4_1 scales as float16: others are refused
    assert gb.pack("Q4_1", (q, d, m), "vnni")[1] is not None
    assert gb.pack("Q4_1", (q, d, m + np.float32(1e-6) * np.abs(m).max()), "vnni") == ("Q4_1", None, None)
    with pytest.raises(ValueError, match="layout"):
        gb.pack("Q4_1", rand_q4_1(16, 64, rng), "int8")


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


# -- a model with blocks attached ---------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def block_models(hidden: int = 64, layout: str = "float"):
    """A tiny transformers Llama whose projections are random Q4_1 blocks and whose head is Q8_0
    (its fp32 weights set to exactly the blocks' values), its native twin, and the blocks packed
    in `layout` (hidden 64: heads of 16; 128: heads of 32, which the fused decoding step takes)."""
    from specdec.models.llama import build_native

    rng = np.random.default_rng(4)
    hf = tiny_hf_llama(0, vocab=64, hidden=hidden)
    blocks, names = {}, {"wqkv": ["q_proj", "k_proj", "v_proj"], "wo": ["o_proj"],
                         "w_gate_up": ["gate_proj", "up_proj"], "w_down": ["down_proj"]}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            for native, parts in names.items():
                mods = [getattr(layer.self_attn if p.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else layer.mlp, p)
                        for p in parts]
                qs = [rand_q4_1(mod.weight.shape[0], mod.weight.shape[1], rng) for mod in mods]
                for mod, q in zip(mods, qs):
                    mod.weight.copy_(torch.from_numpy(gb._dequant_q4(*q)))
                fused = tuple(np.concatenate([q[j] for q in qs], axis=0) for j in range(3))
                blocks[f"layers.{i}.{native}"] = (*gb.pack("Q4_1", fused, layout), fused[1].shape[0])
        qh = rand_q8_0(*hf.lm_head.weight.shape, rng)
        hf.lm_head.weight.copy_(torch.from_numpy(gb._dequant_q8(*qh)))
        blocks["head"] = (*gb.pack("Q8_0", qh, layout), qh[1].shape[0])
    native = build_native(hf.config, hf.state_dict(), pack=True)
    return hf, native, blocks


@pytest.mark.parametrize("hidden", [64, 128])
def test_attached_blocks_give_transformers_logits(hidden):
    from specdec.models.llama import BLOCK_MAX_ROWS

    ops = need_ops()
    hf, native, blocks = block_models(hidden)
    assert native.attach_blocks(ops, blocks) == len(blocks) == 9
    assert native.layers[0].kops is not None
    assert native.block_bytes == sum(v[1].numel() for v in blocks.values())
    g = torch.Generator().manual_seed(5)
    toks = torch.randint(0, 64, (1, 40), generator=g)
    with torch.no_grad():
        ref = hf(input_ids=toks, use_cache=False).logits.float()
    # a prefill longer than BLOCK_MAX_ROWS (the fp32 copy), then steps of 1..6 tokens (the blocks)
    cache = native.new_cache(1, 64)
    n0 = BLOCK_MAX_ROWS + 4
    got = [native(toks[:, :n0], torch.arange(n0)[None], cache)[0]]
    pos = n0
    for T in (1, 2, 3, 6, 4, 1, 3):
        got.append(native(toks[:, pos : pos + T], torch.arange(pos, pos + T)[None], cache)[0])
        pos += T
    assert (torch.cat(got, 1) - ref).abs().max().item() < 1e-4


def vnni_models(hidden: int = 64, act_bits: int = 16):
    """block_models in the VNNI layout, attached with activations of act_bits (skips where this
    CPU has no VNNI)."""
    ops = need_ops()
    kernel(ops, "Q4_1", "v")  # (the skip)
    hf, native, blocks = block_models(hidden, "vnni")
    assert all(v[0].endswith("-vnni") for v in blocks.values())
    native.attach_blocks(ops, blocks, act_bits)
    return hf, native


@pytest.mark.parametrize("hidden,act_bits", [(64, 8), (128, 8), (64, 16), (128, 16)])
def test_vnni_model_is_close_to_transformers_and_verifies_as_it_decodes(hidden, act_bits):
    """On the integer kernels every projection of a step runs one kernel whatever its row count,
    and the kernels' attention is per query: a chain of T tokens scored in one forward (a
    verification) gives bit for bit the logits of decoding them one at a time; prefills (longer
    than BLOCK_MAX_ROWS: the integer kernels too) and steps stay within the activations' rounding
    of transformers (8 bits: a few %; 16 bits: ~1e-4)."""
    from specdec.models.llama import BLOCK_MAX_ROWS

    hf, native = vnni_models(hidden, act_bits)
    g = torch.Generator().manual_seed(5)
    toks = torch.randint(0, 64, (1, 40), generator=g)
    with torch.no_grad():
        ref = hf(input_ids=toks, use_cache=False).logits.float()
    n0 = BLOCK_MAX_ROWS + 4
    chain, alone = native.new_cache(1, 64), native.new_cache(1, 64)
    pre = native(toks[:, :n0], torch.arange(n0)[None], chain)[0]
    native(toks[:, :n0], torch.arange(n0)[None], alone)
    got, pos = [pre], n0
    for T in (1, 2, 9, 6, 2):  # (9: past the old 6-token limit of the kernels' attention)
        step = native(toks[:, pos : pos + T], torch.arange(pos, pos + T)[None], chain)[0]
        one = torch.cat([native(toks[:, p : p + 1], torch.tensor([[p]]), alone)[0] for p in range(pos, pos + T)], 1)
        assert torch.equal(step, one), T
        got.append(step)
        pos += T
    err = (torch.cat(got, 1) - ref).abs().max().item() / ref.abs().max().item()
    assert 0 < err < (0.05 if act_bits == 8 else 1e-3), err  # not the float path's numbers, but close


@pytest.mark.parametrize("act_bits", [8, 16])
def test_vnni_batched_verification_of_more_than_block_max_rows_tokens_is_the_batch_decoded_one_at_a_time(act_bits):
    """A batched step of B rows x T tokens with B * T above BLOCK_MAX_ROWS (a batch verifying its
    guesses, the server's full batch) gives bit for bit the logits of decoding each token's path
    one token a step in the same batch: chains and a tree after ragged prompts, and a step of
    more than 16 tokens (-k 19). (Such steps left the kernels' RMS norm and fused step, and steps
    of 17+ tokens the kernels' attention, for torch's, whose sums differ in the last bits, so a
    near-tie could turn batched or long-k speculative greedy text away from plain decoding's.)"""
    from conftest import prefill_ragged

    from specdec.models.llama import BLOCK_MAX_ROWS

    _, native = vnni_models(128, act_bits)
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
            one, _, _ = prefill_ragged(native, rows, max_len=40)  # the same prefill, bit for bit
            for j, i in enumerate(path):  # token t's path, one token a step for every row
                logits = native(toks[:, i : i + 1], (lens + j)[:, None], one)[0]
            assert torch.equal(logits[:, 0], step[:, t]), (T, t)


@pytest.mark.parametrize("act_bits", [8, 16])
def test_greedy_speculation_on_vnni_equals_plain_greedy_on_vnni(act_bits):
    """The oracle for the integer kernels is their own plain greedy decoding (their numbers are
    not transformers'): every drafter, batch 1 and 3; with 16-bit activations it is also
    transformers' greedy output on these prompts."""
    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.drafters.ngram import NgramDrafter
    from specdec.engine import Engine
    from specdec.types import SamplingParams

    hf, native = vnni_models(128, act_bits)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (6, 11, 9)]
    prompts[2] = prompts[2][:4] * 2
    sp = SamplingParams(max_new_tokens=24)
    want = [o.tokens for o in Engine(native, None, k=0).generate(prompts, sp)]
    assert want == [Engine(native, None, k=0).generate([p], sp)[0].tokens for p in prompts]
    if act_bits == 16:
        assert want == [hf_greedy(hf, p, 24) for p in prompts]
    with one_thread():
        for drafter in (NgramDrafter(adaptive=False), DraftModelDrafter(native)):
            for batch in ([prompts[0]], prompts):
                outs = Engine(native, drafter, k=4).generate(batch, sp)
                assert [o.tokens for o in outs] == want[: len(batch)], type(drafter).__name__


@pytest.mark.parametrize("hidden", [64, 128])
def test_greedy_speculation_with_blocks_equals_transformers_greedy(hidden):
    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.drafters.ngram import NgramDrafter
    from specdec.engine import Engine
    from specdec.types import SamplingParams

    ops = need_ops()
    hf, native, blocks = block_models(hidden)
    native.attach_blocks(ops, blocks)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (6, 11, 9)]
    prompts[2] = prompts[2][:4] * 2  # repeats, so prompt lookup has matches
    want = [hf_greedy(hf, p, 20) for p in prompts]
    with one_thread():
        for drafter in (None, NgramDrafter(adaptive=False), DraftModelDrafter(native)):
            for batch in ([prompts[0]], prompts):
                outs = Engine(native, drafter, k=4).generate(batch, SamplingParams(max_new_tokens=20))
                assert [o.tokens for o in outs] == want[: len(batch)], type(drafter).__name__


def test_attach_refuses_a_wrong_shape():
    from specdec.types import SpecdecError

    ops = need_ops()
    _, native, blocks = block_models()
    kind, pk, pn, rows = blocks["layers.0.wo"]
    with pytest.raises(SpecdecError, match="rows"):
        native.attach_blocks(ops, {"layers.0.wo": (kind, pk, pn, rows + 4)})


# -- GGUF bytes ---------------------------------------------------------------------------------
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
def test_default_model_computes_with_its_blocks(default_model):
    """The shipped GGUF computes from its own blocks (Q4_1 projections, Q8_0 embedding and tied
    head), no fp32 copy; next-token logits equal transformers' GGUF loading of the same file
    within float32 summation noise, with the same argmax."""
    from transformers import AutoModelForCausalLM

    from specdec.models.loader import default_model_path

    lm = default_model
    assert lm.weights == "gguf blocks (F32, Q4_1, Q8_0)" and getattr(lm.model, "gguf_native", False)
    assert all(lin.weight is None for blk in lm.model.layers for lin in (blk.wqkv, blk.wo, blk.w_gate_up, blk.w_down))
    ids = lm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    toks = torch.tensor([ids])
    m = lm.model
    cache = m.new_cache(1, len(ids) + 8)
    m(toks[:, :-6], torch.arange(len(ids) - 6)[None], cache)
    got = m(toks[:, -6:], torch.arange(len(ids) - 6, len(ids))[None], cache)[0]
    p = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    with torch.no_grad():
        want = hf(toks).logits[:, -6:]
    assert (got - want).abs().max().item() < 2e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert m.weight_bytes_per_token() < m.num_parameters()  # under a byte a weight (fp32: 4)


def test_weights_option_errors(tmp_path):
    """--weights says what does not apply instead of silently doing something else."""
    from specdec.models.loader import check_weights_choice, load_model
    from specdec.types import SpecdecError

    hf, _, _ = block_models()
    hf.save_pretrained(tmp_path / "hf")
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
    kind, pk, pn, rows = gb.quantize_q8_0(w)
    assert kind == "Q8_0" and rows == 16 and pn is not None
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


@pytest.mark.default_model
def test_eagle_head_drafts_on_the_kernels_and_stays_exact(default_model):
    """The EAGLE head drafts on the kernels its target runs on: Q8_0 copies of its projections and
    subset head on the block kernels (a target on its integer blocks), or the row-stable kernels
    (a GGUF target there, as the default model is on every CPU now); auto's greedy output still
    equals plain greedy output."""
    from specdec.drafters.hybrid import lookup_eagle_for
    from specdec.engine import Engine
    from specdec.types import SamplingParams

    need_ops()
    d = lookup_eagle_for(default_model)
    if d.eagle.W_blocks is not None:
        assert d.eagle.head.wqkv.qargs is not None
    else:
        assert d.eagle.W_rs is not None
    ids = default_model.tokenizer.encode("def fib(n):\n    if n < 2:\n        return n\n")
    sp = SamplingParams(max_new_tokens=40)
    [plain] = Engine(default_model.model, None, k=0).generate([ids], sp)
    [spec] = Engine(default_model.model, d, k=8).generate([ids], sp)
    assert spec.tokens == plain.tokens and spec.stats.accepted > 0


@pytest.mark.default_model
def test_eagle_head_steps_through_the_kernels_as_through_torch(default_model):
    """Where the head's layer is on the integer kernels, its short steps (a step's catch-up, the
    tree's expansions with their visibility mask) run through the kernels' norms and fused
    attention (`_kernel_step`): the same features and cache entries as the torch path (SDPA) up to
    the order of float sums, for a causal catch-up and for a tree step whose nodes see different
    ancestors; and whole tree proposals agree with the torch path's."""
    import torch

    from specdec.drafters.base import DraftContext
    from specdec.drafters.hybrid import lookup_eagle_for
    from specdec.models.llama import is_vnni
    from specdec.types import SamplingParams

    need_ops()
    if not is_vnni(getattr(default_model.model, "head_q", None)):
        pytest.skip("the target is not on the integer kernels on this CPU")
    d = lookup_eagle_for(default_model).eagle
    assert d.kops is not None
    torch.manual_seed(0)
    D = d.embed.shape[1]
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


# -- the kernels' attention ---------------------------------------------------------------------
def _sdpa_reference(q, kc, vc, S, mask):
    B, H, T, Dh = q.shape
    Hkv = kc.shape[1]
    G = H // Hkv
    k, v = kc[:, :, :S].double(), vc[:, :, :S].double()
    qf = q.double().reshape(B, Hkv, G * T, Dh)
    scores = qf @ k.transpose(-1, -2) / Dh**0.5
    if mask is not None:
        scores = scores + mask.double()
    return (torch.softmax(scores, -1) @ v).reshape(B, H, T, Dh)


@pytest.mark.parametrize("Dh", [16, 32, 64, 128])
def test_attention_kernel_matches_float64_and_a_verified_token_attends_as_alone(Dh):
    """Grouped-query attention over the first S cache slots, with no mask or an additive mask in
    the model's folded layout ([B, 1, G*T, S], row g*T + t): within 1e-5 of a float64 softmax; and
    token t of a verified block (a tree: it sees the prefix and its ancestors only; the kernel
    takes its 15 queries a K/V head in passes of several) gives bit for bit what decoding it alone
    over exactly those keys gives."""
    from specdec.models.llama import LlamaModel

    ops = need_ops()
    g = torch.Generator().manual_seed(9)
    B, H, Hkv, Smax = 2, 6, 2, 80
    kc, vc = torch.randn(B, Hkv, Smax, Dh, generator=g), torch.randn(B, Hkv, Smax, Dh, generator=g)
    q1 = torch.randn(B, H, 1, Dh, generator=g)
    assert (ops.attend(q1, kc, vc, 50, None) - _sdpa_reference(q1, kc, vc, 50, None)).abs().max() < 1e-5
    # a tree of 5 nodes after a prefix of `base` slots: parents -1 (the pending token), 0, 0, 1, 3;
    # after 46 slots, decoding a node alone moves its keys across a 16-slot boundary of the kernel
    parents = [-1, 0, 0, 1, 3]
    T = len(parents)
    anc = ancestor_mask(parents)
    for base in (40, 46):
        start = torch.full((B,), base)
        mask = LlamaModel._mask(start, base, T, base + T, anc[None].expand(B, T, T), Hkv and H // Hkv)
        q = torch.randn(B, H, T, Dh, generator=g)
        out = ops.attend(q, kc, vc, base + T, mask)
        assert (out - _sdpa_reference(q, kc, vc, base + T, mask)).abs().max() < 1e-5
        for t in range(T):
            # the same token decoded alone: its ancestors' entries written right after the prefix
            path = [i for i in range(T) if anc[t, i]]
            k2, v2 = kc.clone(), vc.clone()
            k2[:, :, base : base + len(path)] = kc[:, :, [base + i for i in path]]
            v2[:, :, base : base + len(path)] = vc[:, :, [base + i for i in path]]
            alone = ops.attend(q[:, :, t : t + 1], k2, v2, base + len(path), None)
            assert torch.equal(alone[:, :, 0], out[:, :, t]), (base, t)
    if Dh == 16:  # head sizes the kernel has no pass for are refused, not misread
        with pytest.raises(RuntimeError, match="head size"):
            ops.attend(torch.randn(1, 2, 1, 48), torch.randn(1, 1, 8, 48), torch.randn(1, 1, 8, 48), 4, None)


def test_argmax_kernel_gives_torchs_indices():
    """The greedy argmax through the kernels: torch's index on every row (the first maximum; ties,
    the first NaN, all -inf, -0.0 vs 0.0), vocabularies that are and are not multiples of 16,
    batched and non-contiguous; sampling.argmax_last uses it once the kernels are loaded."""
    from specdec.sampling import argmax_last

    ops = need_ops()
    g = torch.Generator().manual_seed(14)
    for shape in [(1, 49152), (6, 49152), (3, 5), (2, 17), (1, 1), (4, 3, 33), (16, 8192)]:
        x = torch.randn(*shape, generator=g)
        assert torch.equal(ops.argmax_rows(x), x.argmax(-1)), shape
    nan, inf = float("nan"), float("-inf")
    odd = torch.tensor([[1.0, nan, 3.0, nan], [inf] * 4, [2.0, 5.0, 5.0, 1.0], [0.0, -0.0, 0.0, -1.0]])
    assert ops.argmax_rows(odd).tolist() == odd.argmax(-1).tolist() == [1, 0, 1, 0]
    ties = torch.randint(0, 3, (5, 100), generator=g).float()
    assert torch.equal(ops.argmax_rows(ties), ties.argmax(-1))
    strided = torch.randn(6, 2 * 49152, generator=g)[:, ::2]
    assert torch.equal(ops.argmax_rows(strided), strided.argmax(-1))
    assert torch.equal(argmax_last(strided), strided.argmax(-1))
    assert torch.equal(argmax_last(strided.double()), strided.double().argmax(-1))  # not float32: torch's
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(torch.zeros(2, 0))


def test_rms_norm_kernel_matches_torch_row_by_row():
    ops = need_ops()
    g = torch.Generator().manual_seed(10)
    x, w = torch.randn(2, 7, 64, generator=g), 1 + 0.2 * torch.randn(64, generator=g)
    y = ops.rms_norm(x, w, 1e-6)
    assert (y - torch.nn.functional.rms_norm(x, (64,), w, 1e-6)).abs().max() < 1e-5
    assert torch.equal(ops.rms_norm(x[1, 3:4], w, 1e-6)[0], y[1, 3])  # a row alone, bit for bit
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.rms_norm(torch.randn(2, 40), torch.randn(40), 1e-6)


def test_linear_on_blocks_keeps_its_bias_packed_or_not():
    from specdec.models.llama import Linear

    ops = need_ops()
    g = torch.Generator().manual_seed(11)
    for pack in (False, True):
        lin = Linear(64, 32, bias=True)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(32, 64, generator=g))
            lin.bias.copy_(torch.randn(32, generator=g))
        x = torch.randn(3, 64, generator=g)
        ref = torch.nn.functional.linear(x, lin.weight, lin.bias)
        lin.attach(ops, gb.quantize_q8_0(lin.weight))
        if pack:
            lin.pack()
        assert (lin.forward(x) - ref).abs().max() < 0.05 * ref.abs().max()  # Q8_0 copy: close, and biased


def _steps_both_ways(native, seed: int, cells, switch) -> None:
    """Decoding steps (cells: (T, tree mask or None)) after ragged prompts, one row and two, with
    switch(True) then switch(False) in force: the logits must be equal bit for bit."""
    from conftest import prefill_ragged

    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (9, 5)]
    for batch in ([rows[0]], rows):
        B = len(batch)
        outs = []
        for on in (True, False):
            switch(on)
            cache, _, _ = prefill_ragged(native, batch, max_len=40)
            step = []
            for T, mask in cells:
                toks = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(T))
                depth = mask.sum(-1) - 1 if mask is not None else torch.arange(T)
                am = None if mask is None else mask[None].expand(B, T, T)
                step.append(native(toks, cache.lengths[:, None] + depth[None], cache, attn_mask=am)[0])
            outs.append(torch.cat(step, 1))
        assert torch.equal(outs[0], outs[1]), B


def direct_step_switch(model, fast: list | None = None):
    """switch(on) for _steps_both_ways: every layer's direct decoding-step calls (Block.fast, or
    `fast` given in their place) on, or off (the step through Linear.forward); asserts that every
    layer has them."""
    fast = [blk.fast for blk in model.layers] if fast is None else fast
    assert all(f is not None for f in fast)

    def switch(on):
        for blk, f in zip(model.layers, fast):
            blk.fast = f if on else None

    return switch


def test_fused_decoding_step_gives_the_python_paths_numbers(monkeypatch):
    """The kernels' one-call decoding step (rotation, cache write, attention; silu * up) computes
    what the step through torch ops and the kernels' attention computes, bit for bit: chains and
    a tree, one row and a ragged batch."""
    from specdec.models import llama

    ops = need_ops()
    _, native, blocks = block_models(128)
    native.attach_blocks(ops, blocks)
    tree = ancestor_mask([-1, 0, 0, 1])
    _steps_both_ways(native, 12, ((1, None), (3, None), (4, tree)),
                     lambda on: monkeypatch.setattr(llama, "FUSED_DECODING_STEP", on))


@pytest.mark.parametrize("act_bits", [8, 16])
def test_direct_decoding_step_on_integer_kernels_gives_the_general_paths_numbers(act_bits):
    """With every projection on the integer kernels (no biases), a decoding step calls the kernels
    straight from Block.fast, skipping Linear.forward and friends: the same calls, so the same
    logits bit for bit as the general path, for chains, a tree and a ragged batch; and a model
    whose projections are not all on them (heads of 16: no fused step) takes the general path."""
    _, native = vnni_models(128, act_bits)
    switch = direct_step_switch(native)
    tree = ancestor_mask([-1, 0, 0, 1])
    _steps_both_ways(native, 13, ((1, None), (5, None), (4, tree), (16, None)), switch)
    _, small = vnni_models(64, act_bits)
    assert all(blk.fast is None for blk in small.layers)
