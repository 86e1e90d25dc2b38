"""GGUF files computed from in place (models/gguf_file.py, models/gguf_model.py, loader.load_gguf).

Tiny Llama and Qwen2 files with random blocks of every supported type (tests/tiny_gguf.py):
  * logits equal transformers' own GGUF loading of the same file (its dequantiser, its
    architecture code, its undoing of llama.cpp's q/k row order) within float32 rounding;
  * a verified token's logits equal decoding it alone, bit for bit (the kernels' row stability);
  * greedy speculation (prompt lookup, a draft model read from another GGUF file, an EAGLE tree)
    equals plain greedy decoding;
  * the tokenizer comes from the file's metadata and matches transformers';
  * a corrupt block, a truncated file, an unsupported type and an unsupported architecture each
    give one clear error before any model is built.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_random import BF16, F16, F32, NAMES, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from model_helpers import random_eagle
from oracle import one_thread
from specdec import kernels
from specdec.types import SamplingParams, SpecdecError
from tiny_gguf import EOS_ID, VOCAB, write_tiny_gguf

ALL_TYPES = (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


def tiny(directory: Path, arch: str, t: int, seed: int = 0, **kw) -> Path:
    p = directory / f"{arch}-{NAMES[t]}-{seed}{''.join(f'-{k}{v}' for k, v in kw.items())}.gguf"
    if not p.exists():
        write_tiny_gguf(p, arch, t, seed, **kw)
    return p


def load(path: Path, tokenizer: bool = False):
    from specdec.models.loader import load_model

    return load_model(str(path), quiet=True, with_tokenizer=tokenizer)


def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        return hf(tokens).logits


def on_kernels(model) -> bool:
    from specdec.models.gguf_model import reference_linear

    return model.head.op is not reference_linear


TOKENS = torch.tensor([[5, 17, 99, 200, 3, 8, 260, 42, 42, 7]])


@pytest.mark.parametrize("arch,t", [("llama", t) for t in ALL_TYPES] + [("qwen2", t) for t in (F16, Q8_0, Q4_K, Q6_K)])
def test_logits_equal_transformers_gguf_loading(gguf_dir, arch, t, monkeypatch):
    """The float path (SPECDEC_GGUF_ACT8=0) within float32 rounding of transformers. The quantised
    types' default 8-bit-activation path (kernels.gguf_act8) only roughly: each product is the rounded
    activations' product to ~1e-7 (tests/unit/test_gguf_types.py), but the rounding (~0.5% a product)
    compounds through these random layers (up to ~6% of the largest logit on Q6_K)."""
    path = tiny(gguf_dir, arch, t)
    ref = hf_logits(path, TOKENS)
    scale = float(ref.abs().max())
    assert scale > 1.0  # (the model is not degenerate)
    for act8, tol in (("0", 2e-5), ("1", 0.1 if t in kernels.ACT8_SLICE else 2e-5)):
        monkeypatch.setenv("SPECDEC_GGUF_ACT8", act8)
        m = load(path).model
        T = TOKENS.shape[1]
        logits, _ = m(TOKENS, torch.arange(T)[None], m.new_cache(1, 32))
        assert float((logits - ref).abs().max()) <= tol * scale, (NAMES[t], act8)


def test_qwen2_with_a_q6_k_head_on_q4_k_matrices_as_q4_k_m_files_mix_them(gguf_dir, monkeypatch):
    path = tiny(gguf_dir, "qwen2", Q4_K, head_type=Q6_K)
    ref = hf_logits(path, TOKENS)
    for act8, tol in (("0", 2e-5), ("1", 0.1)):
        monkeypatch.setenv("SPECDEC_GGUF_ACT8", act8)
        m = load(path).model
        assert {p[1] for p in m.head.parts} == {Q6_K}
        logits, _ = m(TOKENS, torch.arange(TOKENS.shape[1])[None], m.new_cache(1, 32))
        assert float((logits - ref).abs().max()) <= tol * float(ref.abs().max()), act8


def test_a_wrong_q_k_row_order_is_caught(gguf_dir, monkeypatch):
    """The test above can fail: with llama.cpp's q/k rows left in its own order the logits move."""
    from specdec.models import gguf_model

    monkeypatch.setattr(gguf_model, "llama_row_order", lambda n, h: torch.arange(n))
    path = tiny(gguf_dir, "llama", Q8_0)
    m = load(path).model
    logits, _ = m(TOKENS, torch.arange(TOKENS.shape[1])[None], m.new_cache(1, 32))
    ref = hf_logits(path, TOKENS)
    assert float((logits - ref).abs().max()) > 1e-3 * float(ref.abs().max())


def test_llama3_frequency_factors_divide_the_rotary_frequencies(gguf_dir):
    from specdec.models.llama import rope_inv_freq

    m = load(tiny(gguf_dir, "llama", Q8_0, rope_freqs=True)).model
    base, _ = rope_inv_freq(m.cfg)
    assert torch.allclose(m.inv_freq, base / torch.linspace(1.0, 8.0, 32))


@pytest.mark.parametrize("t", [Q4_K, Q6_K, Q5_0, BF16, Q4_1, Q8_0, Q4_0])
def test_a_verified_tokens_logits_are_its_logits_decoded_alone(gguf_dir, t):
    """After a shared prefill, 5 tokens verified in one call (a chain, and as a batch of 2 rows)
    get bit for bit the logits of feeding them one at a time: the kernels' products, norms and
    attention do not depend on the other rows."""
    m = load(tiny(gguf_dir, "qwen2" if t == BF16 else "llama", t)).model
    if not on_kernels(m):
        pytest.skip("the GGUF kernels do not run here")
    prompt, new = [5, 17, 99, 200], [3, 8, 260, 42, 7]
    with one_thread():
        c1 = m.new_cache(1, 32)
        m(torch.tensor([prompt]), torch.arange(4)[None], c1)
        one = [m(torch.tensor([[tok]]), torch.tensor([[4 + i]]), c1)[0][0, 0] for i, tok in enumerate(new)]
        c2 = m.new_cache(2, 32)
        m(torch.tensor([prompt, prompt]), torch.arange(4)[None].expand(2, 4), c2)
        many, _ = m(torch.tensor([new, new]), torch.arange(4, 9)[None].expand(2, 5), c2)
    for i in range(5):
        assert torch.equal(many[0, i], one[i]) and torch.equal(many[1, i], one[i]), i


def _greedy_all(target, drafters, prompts, n=24):
    from specdec.engine import Engine

    sp = SamplingParams(max_new_tokens=n)
    want = [Engine(target, None, k=0, eos_ids=()).generate([p], sp)[0].tokens for p in prompts]
    with one_thread():
        for name, make in drafters.items():
            for batch in ([prompts[0]], prompts):
                outs = Engine(target, make(), k=4, eos_ids=(), fixed_k=True).generate(batch, sp)
                assert [o.tokens for o in outs] == want[: len(batch)], name
    return want


@pytest.mark.parametrize("arch,t", [("llama", Q4_K), ("qwen2", Q8_0), ("llama", Q6_K)])
def test_greedy_speculation_equals_plain_greedy(gguf_dir, arch, t):
    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.drafters.ngram import NgramDrafter

    target = load(tiny(gguf_dir, arch, t)).model
    draft = load(tiny(gguf_dir, arch, Q8_0, seed=1, layers=1)).model

    def eagle():
        return random_eagle(target)

    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 11, 9)]
    prompts[2] = prompts[2][:4] * 3  # repeats: prompt lookup proposes from the start
    _greedy_all(target, {"ngram": lambda: NgramDrafter(),
                         "draft": lambda: DraftModelDrafter(draft, target_model=target),
                         "draft_self": lambda: DraftModelDrafter(target, target_model=target),
                         "eagle_tree": eagle}, prompts)


def test_an_eagle_heads_q8_copies_kept_between_starts_are_the_ones_made(gguf_dir, tmp_path):
    """The Q8_0 copies of an EAGLE head's weights and subset head kept in a folder (written at the
    first start, read back at the next) equal the copies made from the weights; a file cut short is
    made again; a file of the right size is read back as it is (so the folder's name must follow
    what the copies were made from: loader.drafter_copies_dir, which changes with the head's files)."""
    from specdec.models.kernel_glue import drafting_act8
    from specdec.models.loader import drafter_copies_dir

    lm = load(tiny(gguf_dir, "llama", Q8_0))
    if lm.model.rowstable is None:
        pytest.skip(kernels.rowstable_unavailable() or "no kernels")

    def eagle(**kw):  # (a subset of 64 tokens: a head of whole 4-row groups, which Q8_0 copies take)
        return random_eagle(lm.model, vocab_subset=range(64), **kw)

    def copies(d):
        h = d.head
        return [lin.rs_blocks[1] for lin in (h.fc, h.wqkv, h.wo, h.w_gate_up, h.w_down) if lin.rs_blocks] + [d.W_rs[1]]

    fresh = copies(eagle())
    assert len(fresh) == 6 and fresh[-1].dtype == torch.uint8
    kept = tmp_path / "copies"
    first = copies(eagle(saved=kept))
    # (every matrix here has a multiple of 16 rows: on 8-bit activations each copy is in that layout, under its own name)
    tag = ".i8" if drafting_act8(lm.model.rowstable) else ""
    assert sorted(f.name for f in kept.iterdir()) == [f"head{tag}.npy"] + [f"linear{i}{tag}.npy" for i in range(5)]
    again = copies(eagle(saved=kept))
    for got in (first, again):
        assert [torch.equal(a, b) for a, b in zip(got, fresh)] == [True] * 6
    head, linear0 = kept / f"head{tag}.npy", kept / f"linear0{tag}.npy"
    short = head.read_bytes()[:100]
    head.unlink()  # (a new file: `again` still maps the old one, as a start would)
    head.write_bytes(short)
    assert torch.equal(copies(eagle(saved=kept))[-1], fresh[-1])
    linear0.unlink()
    np.save(linear0, np.zeros(fresh[0].numel(), np.uint8))
    assert not torch.equal(copies(eagle(saved=kept))[0], fresh[0])

    head_dir = tmp_path / "head"
    head_dir.mkdir()
    (head_dir / "weights.safetensors").write_bytes(b"x")
    before = drafter_copies_dir(lm, head_dir)
    assert before is not None and before == drafter_copies_dir(lm, head_dir)
    (head_dir / "weights.safetensors").write_bytes(b"yy")
    assert drafter_copies_dir(lm, head_dir) != before
    lm.gguf = None
    assert drafter_copies_dir(lm, head_dir) is None


def test_the_tokenizer_comes_from_the_files_metadata(gguf_dir):
    from transformers import AutoTokenizer

    path = tiny(gguf_dir, "qwen2", Q8_0)
    lm = load(path, tokenizer=True)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "the theater is on the street\n\tat 3 o'clock"
    assert lm.tokenizer.encode(text) == hf.encode(text)
    assert lm.tokenizer.decode(lm.tokenizer.encode(text)) == text
    assert EOS_ID in lm.eos_ids and lm.tokenizer.chat_template is not None
    again = load(path, tokenizer=True)  # from the cache now
    assert again.tokenizer.get_vocab() == lm.tokenizer.get_vocab()


def test_a_gguf_draft_model_loads_on_the_same_path_with_the_same_tokenizer_check(gguf_dir):
    from specdec.methods import draft_source

    target = load(tiny(gguf_dir, "llama", Q4_K), tokenizer=True)
    draft = load(tiny(gguf_dir, "llama", Q8_0, seed=1, layers=1), tokenizer=True)
    d = draft_source(target, draft)
    assert d.model is draft.model
    from specdec.engine import Engine

    sp = SamplingParams(max_new_tokens=12)
    prompt = target.tokenizer.encode("the theater")
    want = Engine(target.model, None, k=0, eos_ids=()).generate([prompt], sp)[0].tokens
    assert Engine(target.model, d, k=3, eos_ids=(), fixed_k=True).generate([prompt], sp)[0].tokens == want


# -- one clear error each ----------------------------------------------------------------------
def _copy(src: Path, dst: Path, mutate) -> Path:
    b = bytearray(src.read_bytes())
    mutate(b)
    dst.write_bytes(bytes(b))
    return dst


def test_a_corrupt_block_names_its_tensor(gguf_dir, tmp_path):
    from specdec.models.gguf_file import GGUFFile

    src = tiny(gguf_dir, "llama", Q4_K)
    t = GGUFFile(src).tensors["blk.1.ffn_up.weight"]
    bad = _copy(src, tmp_path / "bad.gguf", lambda b: b.__setitem__(slice(t.offset + 144 * 3, t.offset + 144 * 3 + 2),
                                                                     np.float16(np.inf).tobytes()))
    with pytest.raises(SpecdecError, match=r"corrupt: tensor blk\.1\.ffn_up\.weight \(Q4_K\).*block 3") as e:
        load(bad)
    assert "\n" not in str(e.value)


def test_a_truncated_file_says_so(gguf_dir, tmp_path):
    src = tiny(gguf_dir, "llama", Q8_0)
    data = src.read_bytes()
    for cut in (len(data) - 1000, 200):  # in the tensor data; in the header
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(SpecdecError, match="truncated") as e:
            load(tmp_path / "cut.gguf")
        assert "\n" not in str(e.value)


def test_an_unsupported_type_names_the_tensor_and_the_supported_ones(tmp_path, monkeypatch):
    """From the header alone: no block is read before the refusal."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from specdec.models import gguf_file

    def no_block_reads(self, t):
        raise AssertionError(f"read the blocks of {t.name} before refusing")

    monkeypatch.setattr(gguf_file.GGUFFile, "check_tensor", no_block_reads)

    w = GGUFWriter(str(tmp_path / "q2k.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 84), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q2_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SpecdecError, match=r"token_embd\.weight is of type Q2_K.*supported: F32, F16, BF16, Q4_0"):
        load(tmp_path / "q2k.gguf")


def test_an_unsupported_architecture_is_named(tmp_path):
    from gguf import GGUFWriter

    w = GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SpecdecError, match=r"architecture 'gpt2' is not supported \(supported: llama, mistral3, "
                                           r"qwen2, qwen3, gemma2, gemma3, phi3; "):
        load(tmp_path / "gpt2.gguf")


def test_weights_choices_that_do_not_apply_to_a_gguf_are_refused(gguf_dir):
    from specdec.models.loader import load_model

    with pytest.raises(SpecdecError, match="--weights fp32: a GGUF model computes from its own blocks"):
        load_model(str(tiny(gguf_dir, "llama", Q8_0)), quiet=True, with_tokenizer=False, weights="fp32")


def test_sampled_row_check_catches_a_kernel_that_misreads_a_type(gguf_dir, monkeypatch):
    from specdec.models import gguf_model

    path = tiny(gguf_dir, "llama", Q5_1)
    orig = gguf_model.kernel_ops

    def broken(rs):
        lin, rows, ok = orig(rs)
        return (lambda x, raw, t, n, k: lin(x, raw, t, n, k) * (1.0 + 1e-3)), rows, ok

    monkeypatch.setattr(gguf_model, "kernel_ops", broken)
    with pytest.raises(SpecdecError, match=r"misread tensor .* \(Q5_1\)"):
        load(path)


def test_a_tokenizer_class_of_its_own_is_read_plainly_only_where_it_matches_transformers(tmp_path):
    """_mark_plain_if_equal keeps transformers' class where a probe text tokenizes differently."""
    from transformers import AutoTokenizer

    from specdec.models import tokenizer as tk

    src = tiny(tmp_path, "llama", Q8_0)
    hf = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    for broken in (False, True):
        d = tmp_path / f"tok{int(broken)}"
        hf.save_pretrained(str(d))
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["tokenizer_class"] = "SomeTokenizer"
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        if broken:  # the saved tokenizer.json no longer tokenizes as `hf` does
            tj = json.loads((d / "tokenizer.json").read_text())
            tj["model"]["merges"] = tj["model"]["merges"][:1]
            (d / "tokenizer.json").write_text(json.dumps(tj))
        tk._mark_plain_if_equal(d, hf)
        kept = json.loads((d / "tokenizer_config.json").read_text())["tokenizer_class"]
        assert kept == ("SomeTokenizer" if broken else "TokenizersBackend")


def test_hf_layer_state_is_the_dequantised_layer_in_transformers_order(gguf_dir):
    """What training an EAGLE head from a GGUF target reads: the layer as transformers loads it."""
    from tiny_gguf import dequantized_state_dict

    path = tiny(gguf_dir, "llama", Q4_K)
    got = load(path).model.hf_layer_state(1)
    want = dequantized_state_dict(path)
    assert got.keys() <= want.keys() and len(got) == 9
    for k, v in got.items():
        assert torch.equal(v, want[k]), k


@pytest.mark.parametrize("arch,t", [("llama", Q4_K), ("qwen2", Q6_K), ("qwen2", Q8_0), ("qwen2", Q5_0)])
def test_a_direct_decoding_step_gives_the_general_paths_numbers(gguf_dir, arch, t):
    """A decoding step of a GGUF model calls its kernels straight from Block.fast (llama's q/k
    outputs reordered, Qwen2's q/k/v bias added, as GGUFLinear.forward does): the same logits bit
    for bit as the step through Linear.forward, for chains, a tree and a ragged batch. Without
    the bias in the direct calls (a broken rule) Qwen2's logits differ."""
    from model_helpers import ancestor_mask, direct_step_switch, steps_both_ways

    m = load(tiny(gguf_dir, arch, t)).model
    if not on_kernels(m):
        pytest.skip("the GGUF kernels do not run here")
    fast = [blk.fast for blk in m.layers]
    tree = ancestor_mask([-1, 0, 0, 1])
    with one_thread():
        steps_both_ways(m, 11, ((1, None), (5, None), (4, tree)), direct_step_switch(m, fast))
        if arch == "qwen2":
            no_bias = [((op, args, None, order), *rest) for (op, args, _, order), *rest in fast]
            with pytest.raises(AssertionError):
                steps_both_ways(m, 11, ((1, None),), direct_step_switch(m, no_bias))


@pytest.mark.parametrize("arch,t", [("llama", Q4_1), ("llama", Q8_0), ("llama", Q4_K), ("qwen2", Q6_K)])
def test_a_decoding_step_in_one_call_a_layer_gives_the_python_calls_numbers(gguf_dir, arch, t, monkeypatch):
    """Where a layer's projections are all on repacked blocks on 8-bit activations (Q4_1 / Q8_0 on
    both builds, the K-quants on VNNI), its decoding step is one decode_layer call, the same kernel
    calls made from C++, and a step whose layers all are is one decode_layers call: the same logits
    bit for bit as the calls made from Python, for chains, a tree and a ragged batch, a call a layer
    or one for all; Qwen2's q/k/v bias goes into the call. With the norms swapped in the call, or
    Qwen2's bias left out (broken rules), they differ."""
    from model_helpers import ancestor_mask, steps_both_ways
    from specdec.models import llama

    m = load(tiny(gguf_dir, arch, t)).model
    if not on_kernels(m) or not kernels.gguf_act8():
        pytest.skip("the GGUF kernels' 8-bit path does not run here")
    args = [llama.decode_layer_args(blk.fast, blk.kops) for blk in m.layers]
    kquant = t in (Q4_K, Q6_K)
    if kquant and kernels.rowstable_isa() != "avx512vnni":
        # the AVX2 build's K-quants on the file's blocks: the Python calls
        assert all(a is None for a in args)
        return
    assert all(a is not None for a in args)
    assert {k for a in args for k in a[3]} == ({2} if kquant else {1} if t == Q8_0 else {0})
    assert all((a[9] is not None) == (arch == "qwen2") for a in args)
    tree = ancestor_mask([-1, 0, 0, 1])
    cells = ((1, None), (5, None), (4, tree))
    with one_thread():
        for stack in (False, True):
            monkeypatch.setattr(llama, "DECODE_LAYERS_OP", stack)
            steps_both_ways(m, 13, cells, lambda on: monkeypatch.setattr(llama, "DECODE_LAYER_OP", on))
        assert m._stack is not None and m._stack[1] is not None  # (the steps above took decode_layers)
        right = llama.decode_layer_args
        if arch == "qwen2":
            broken = lambda a: (*a[:9], None)  # noqa: E731
        else:
            broken = lambda a: (a[1], a[0], *a[2:])  # noqa: E731
        monkeypatch.setattr(llama, "decode_layer_args", lambda f, k: broken(right(f, k)))
        for stack in (False, True):
            monkeypatch.setattr(llama, "DECODE_LAYERS_OP", stack)
            for blk in m.layers:
                blk._decode_layer = None
            m._stack = None
            with pytest.raises(AssertionError):
                steps_both_ways(m, 13, cells[:1], lambda on: monkeypatch.setattr(llama, "DECODE_LAYER_OP", on))


@pytest.mark.parametrize("t", [Q4_K, Q5_K, Q6_K])
def test_k_quant_projections_run_on_their_repacked_blocks(gguf_dir, t):
    """On 8-bit activations a Q4_K / Q5_K / Q6_K model's projections run on kq_linear_q8 over repacked
    blocks (llama's q/k rows reordered inside q and inside k), so the tests above (transformers'
    logits, a verified token's logits alone, speculation equal to plain) cover that path; each
    gives the rounded activations' product by gguf's dequantised rows, in its output order."""
    from gguf.quants import dequantize

    m = load(tiny(gguf_dir, "llama", t)).model
    if not on_kernels(m) or not kernels.gguf_act8():
        pytest.skip("the GGUF kernels' 8-bit path does not run here")
    blk = m.layers[0]
    if kernels.rowstable_isa() != "avx512vnni":  # the AVX2 build keeps the file's blocks
        assert all(getattr(lin.rs_blocks[0] if lin.rs_blocks else None, "__name__", "") != "kq_linear_q8"
                   for lin in (blk.wqkv, blk.wo, blk.w_gate_up, blk.w_down))
        pytest.skip("kq_linear_q8 runs on AVX-512 VNNI builds only")
    g = torch.Generator().manual_seed(0)
    for lin in (blk.wqkv, blk.wo, blk.w_gate_up, blk.w_down):
        op, *args = lin.rs_blocks
        assert getattr(op, "__name__", "") == "kq_linear_q8"
        w = np.concatenate([dequantize(raw.numpy(), typ).reshape(n, k) for raw, typ, n, k in lin.parts])
        if lin.out_order is not None:
            w = w[lin.out_order.numpy()]
        x = torch.randn(3, lin.in_features, generator=g)
        xq, _ = kernels.act8_slices(x.numpy(), 256)
        y = op(x, *args)
        w = w.astype(np.float64)
        assert (np.abs(y.double().numpy() - xq @ w.T) <= 1e-5 * (np.abs(xq) @ np.abs(w).T) + 1e-30).all()
        assert torch.equal(lin(x), y if lin.bias is None else y + lin.bias)
