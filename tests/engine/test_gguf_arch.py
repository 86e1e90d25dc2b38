"""The architectures GGUF files carry, each checked against an oracle that shares no code with specdec.

Tiny files written by the test (tests/tiny_gguf.py), the logits compared with transformers' own
GGUF loading of the same file (its dequantiser, its undoing of llama.cpp's q/k row order, its
architecture code), the greedy tokens compared too:
  * Llama with grouped-query attention (4 query heads, 2 K/V heads), tied and untied head;
  * Qwen2 (q/k/v bias), untied and tied head;
  * Mistral as llama.cpp writes it (architecture "llama", a SentencePiece-style vocabulary with
    BOS): transformers' Mistral model over the weights transformers read from the file;
  * RoPE scaling: Llama 3's frequency factors (rope_freqs.weight, computed in the test as
    llama.cpp's converter computes them from a Llama-3.1 rope_scaling), linear and YaRN metadata:
    the rotary frequencies against transformers' rope-init functions and against llama.cpp's YaRN
    formula written out here, the logits against transformers with that scaling at positions
    where it matters.
Each rule is also broken once on purpose (the bias dropped, the scaling ignored) to show the
comparison catches it. Unsupported variants (a RoPE scaling type, an architecture, a tensor no
supported architecture reads, a YaRN setting) each give one line naming it, before any block is
read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_helpers import (FAR, THETA, TOKENS, TOL, greedy_hf, greedy_native, hf_logits, hf_model, llama_cpp_inv_freq,
                          llama_cpp_rope_factors, load, mistral_from_transformers, native_logits, rel_err)
from gguf_random import F16, F32, NAMES, Q4_K, Q8_0
from specdec.types import SpecdecError
from tiny_gguf import HEAD_DIM, write_tiny_gguf


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf_arch")


@pytest.fixture(autouse=True)
def float_products(monkeypatch):
    """Architecture checks compare on the exact float path (the float product over the dequantised
    blocks), so any difference from transformers is the architecture's. The default 8-bit-activation
    path's rounding is bounded per product in test_gguf_types.py and end to end in test_gguf_native.py."""
    monkeypatch.setenv("SPECDEC_GGUF_ACT8", "0")


def tiny(directory: Path, stem: str, arch: str, t: int, **kw) -> Path:
    p = directory / f"{stem}-{NAMES[t]}.gguf"
    if not p.exists():
        write_tiny_gguf(p, arch, t, **kw)
    return p


# -- architectures -------------------------------------------------------------------------------
ARCHS = {  # stem: (arch, write_tiny_gguf keywords)
    "llama-gqa": ("llama", {}),
    "llama-gqa-untied": ("llama", {"untied": True}),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"untied": False}),
}


@pytest.mark.parametrize("stem", ARCHS)
@pytest.mark.parametrize("t", [F16, Q8_0])
def test_logits_and_greedy_tokens_equal_transformers(gguf_dir, stem, t):
    arch, kw = ARCHS[stem]
    path = tiny(gguf_dir, stem, arch, t, **kw)
    m, hf = load(path).model, hf_model(path)
    assert m.cfg.num_kv_heads < m.cfg.num_heads  # grouped-query attention
    assert m.cfg.tie_embeddings == ("output.weight" not in m.gguf.tensors)
    ref = hf_logits(hf, TOKENS)
    assert float(ref.abs().max()) > 1.0  # (not a degenerate model)
    assert rel_err(native_logits(m, TOKENS), ref) <= TOL
    prompt = TOKENS[0].tolist()
    assert greedy_native(m, prompt) == greedy_hf(hf, prompt)


def test_qwen2_without_its_qkv_bias_is_caught(gguf_dir):
    """The Qwen2 comparison above can fail: the same model without the q/k/v bias parts from it."""
    path = tiny(gguf_dir, "qwen2", "qwen2", F16)
    m = load(path).model
    for blk in m.layers:
        assert blk.wqkv.bias is not None
        blk.wqkv.bias = None
        blk.fast = blk.fast_step_args()  # (the direct step calls hold the bias too)
    assert rel_err(native_logits(m, TOKENS), hf_logits(hf_model(path), TOKENS)) > 100 * TOL


def test_a_mistral_file_as_llama_cpp_writes_it(gguf_dir):
    from transformers import AutoTokenizer

    path = tiny(gguf_dir, "mistral", "llama", Q8_0, name="Mistral-7B-Instruct-v0.3", tokenizer="llama")
    lm = load(path, tokenizer=True)
    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "the theater is on the street"
    ids = lm.tokenizer.encode(text)
    assert ids == hf_tok.encode(text) and ids[0] == 1  # <s> added, as the file says
    assert lm.tokenizer.decode(ids, skip_special_tokens=True) == text and 2 in lm.eos_ids
    mistral = mistral_from_transformers(path)
    x = torch.tensor([ids])
    assert rel_err(native_logits(lm.model, x), hf_logits(mistral, x)) <= TOL
    assert greedy_native(lm.model, ids) == greedy_hf(mistral, ids)


# -- RoPE scaling --------------------------------------------------------------------------------
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


SCALED = {  # stem: (write_tiny_gguf keywords, transformers' rope_parameters)
    "llama3": ({"rope_freqs": llama_cpp_rope_factors(THETA, HEAD_DIM, LLAMA31)}, LLAMA31),
    "linear": ({"rope_scaling": {"type": "linear", "factor": 4.0}}, {"rope_type": "linear", "factor": 4.0}),
    "yarn": ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_context_length": 128}},
             {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
}
def scaled_file(gguf_dir, stem: str) -> Path:
    arch = "qwen2" if stem == "yarn" else "llama"  # (Qwen2.5 files carry YaRN; Llama 3.1 files the factors)
    return tiny(gguf_dir, f"rope-{stem}", arch, Q8_0, context=4096, **SCALED[stem][0])


@pytest.mark.parametrize("stem", SCALED)
def test_rope_frequencies_equal_transformers_rope_init(gguf_dir, stem):
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    m = load(scaled_file(gguf_dir, stem)).model
    params = SCALED[stem][1]
    cfg = PretrainedConfig(hidden_size=m.cfg.hidden_size, num_attention_heads=m.cfg.num_heads, head_dim=HEAD_DIM,
                           max_position_embeddings=m.cfg.max_position)
    cfg.rope_parameters = {"rope_theta": THETA, **params}
    want, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
    assert torch.allclose(m.inv_freq, want.float(), rtol=1e-6, atol=0)
    assert m.rope_scaling == pytest.approx(scale, rel=1e-7)
    if stem != "llama3":  # llama.cpp's own formula, written out in this test
        f, s = llama_cpp_inv_freq(THETA, HEAD_DIM, params["rope_type"], params["factor"],
                                  params.get("original_max_position_embeddings", 0))
        assert np.allclose(m.inv_freq.double().numpy(), f, rtol=1e-6, atol=0)
        assert m.rope_scaling == pytest.approx(s, rel=1e-7)


@pytest.mark.parametrize("stem", SCALED)
def test_scaled_rope_logits_equal_transformers_far_into_the_context(gguf_dir, stem):
    path = scaled_file(gguf_dir, stem)
    m = load(path).model
    ref = hf_logits(hf_model(path, SCALED[stem][1]), TOKENS, FAR)
    assert rel_err(native_logits(m, TOKENS, FAR), ref) <= TOL
    # the same file without its scaling: far from transformers' scaled model (the test can fail)
    plain = hf_logits(hf_model(path, {"rope_type": "default"}), TOKENS, FAR)
    assert rel_err(plain, ref) > 100 * TOL


@pytest.mark.parametrize("stem", SCALED)
def test_ignoring_the_scaling_is_caught(gguf_dir, stem, monkeypatch):
    from specdec.models import gguf_file

    monkeypatch.setattr(gguf_file.GGUFFile, "rope_parameters", lambda self, theta: {"rope_type": "default",
                                                                                   "rope_theta": theta})
    path = scaled_file(gguf_dir, stem)
    m = load(path).model
    if stem == "llama3":  # the factors are a tensor: drop them as a loader that ignored it would
        m.inv_freq = m.inv_freq * torch.from_numpy(SCALED[stem][0]["rope_freqs"]).float()
    ref = hf_logits(hf_model(path, SCALED[stem][1]), TOKENS, FAR)
    assert rel_err(native_logits(m, TOKENS, FAR), ref) > 100 * TOL


# -- one clear line each, before any block is read ---------------------------------------------------
def _no_block_reads(monkeypatch):
    """Make reading any block fail loudly: the refusal must come from the header alone."""
    from specdec.models import gguf_file

    def boom(self, t):
        raise AssertionError(f"read the blocks of {t.name} before refusing")

    monkeypatch.setattr(gguf_file.GGUFFile, "check_tensor", boom)


@pytest.mark.parametrize("keys,match", [
    ({"type": "longrope", "factor": 4.0}, r"RoPE scaling 'longrope' \(llama\.rope\.scaling\.type\) is not supported; "
                                         r"supported: none, linear, yarn, and Llama 3's frequency factors"),
    ({"type": "yarn", "factor": 4.0}, r"YaRN RoPE scaling without llama\.rope\.scaling\.original_context_length"),
    ({"type": "yarn", "factor": 4.0, "original_context_length": 128, "yarn_attn_factor": 0.5},
     r"YaRN with llama\.rope\.scaling\.yarn_attn_factor = 0\.5 is not supported"),
    ({"type": "linear", "factor": 4.0, "attn_factor": 2.0},
     r"llama\.rope\.scaling\.attn_factor = 2 with RoPE scaling 'linear' is not supported \(only with yarn\)"),
])
def test_unsupported_rope_scaling_is_named(tmp_path, monkeypatch, keys, match):
    path = write_tiny_gguf(tmp_path / "r.gguf", "llama", Q8_0, layers=1, rope_scaling=keys)
    _no_block_reads(monkeypatch)
    with pytest.raises(SpecdecError, match=match) as e:
        load(path)
    assert "\n" not in str(e.value)


def test_a_tensor_no_supported_architecture_reads_is_named(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "x.gguf", "llama", Q8_0, layers=1, extra_tensor="blk.0.attn_output.bias")
    _no_block_reads(monkeypatch)
    with pytest.raises(SpecdecError, match=r"tensor blk\.0\.attn_output\.bias \(1 such\) is not part of the llama "
                                           r"model specdec computes"):
        load(path)


@pytest.mark.parametrize("meta,match", [
    ({"expert_count": 8}, r"a mixture of experts \(llama\.expert_count = 8\) is not supported"),
    ({"attention.scale": 0.5}, r"an attention scale of 0\.5 \(llama\.attention\.scale; 1 / sqrt\(64\) = 0\.125 "
                               r"is what specdec computes\) is not supported"),
])
def test_a_setting_the_model_would_not_compute_is_named(tmp_path, monkeypatch, meta, match):
    path = write_tiny_gguf(tmp_path / "s.gguf", "llama", Q8_0, layers=1, meta=meta)
    _no_block_reads(monkeypatch)
    with pytest.raises(SpecdecError, match=match) as e:
        load(path)
    assert "\n" not in str(e.value)


def test_an_attention_scale_of_one_over_root_head_size_is_read(tmp_path):
    path = write_tiny_gguf(tmp_path / "s.gguf", "llama", Q8_0, layers=1, meta={"attention.scale": HEAD_DIM ** -0.5})
    assert load(path).model.cfg.head_dim == HEAD_DIM


@pytest.mark.parametrize("arch", ["mistral", "qwen3moe", "gemma3n"])
def test_an_unsupported_architecture_is_named_before_any_block_is_read(tmp_path, monkeypatch, arch):
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, F32, layers=1)
    _no_block_reads(monkeypatch)
    with pytest.raises(SpecdecError, match=rf"architecture '{arch}' is not supported \(supported: llama, mistral3, "
                                           r"qwen2, qwen3, gemma2, gemma3, phi3; "
                                           r"llama\.cpp writes Mistral"):
        load(path)

