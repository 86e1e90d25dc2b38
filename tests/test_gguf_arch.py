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

import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_random import F16, F32, NAMES, Q4_K, Q8_0
from specdec.types import SpecdecError
from tiny_gguf import HEAD_DIM, write_tiny_gguf

THETA = 10000.0  # what tiny_gguf writes


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


def load(path: Path, tokenizer: bool = False):
    from specdec.models.loader import load_model

    return load_model(str(path), quiet=True, with_tokenizer=tokenizer)


def hf_model(path: Path, rope: dict | None = None):
    """transformers' model of the GGUF file; `rope`: rope_parameters put in its config and its
    rotary embedding rebuilt from them (transformers does not read llama.cpp's scaling keys)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    if rope is not None:
        hf.config.rope_parameters = {"rope_theta": THETA, **rope}
        hf.model.rotary_emb = type(hf.model.rotary_emb)(hf.config)
    return hf


def native_logits(m, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
    T = tokens.shape[1]
    logits, _ = m(tokens, start + torch.arange(T)[None], m.new_cache(1, 32))
    return logits


def hf_logits(hf, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
    with torch.no_grad():
        return hf(tokens, position_ids=start + torch.arange(tokens.shape[1])[None]).logits


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / float(b.abs().max())


def greedy_native(m, prompt: list[int], n: int = 12) -> list[int]:
    from specdec.engine import Engine
    from specdec.types import SamplingParams

    return Engine(m, None, k=0, eos_ids=()).generate([prompt], SamplingParams(max_new_tokens=n))[0].tokens


def greedy_hf(hf, prompt: list[int], n: int = 12) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


TOKENS = torch.tensor([[5, 17, 99, 200, 3, 8, 260, 42, 42, 7]])
TOL = 2e-5  # float32 sums in another order, relative to the largest logit


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


def mistral_from_transformers(path: Path, window: int | None = None):
    """transformers' Mistral model over the weights transformers reads from the file (it builds its
    Llama model for llama.cpp's Mistral files; its own GGUF Mistral path needs a gguf-py that
    knows the name), with a sliding window of `window` tokens (None, the default: off, as
    llama.cpp attends to the whole context)."""
    from transformers import MistralConfig, MistralForCausalLM

    hf = hf_model(path)
    c = hf.config
    cfg = MistralConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                        rope_theta=THETA, max_position_embeddings=c.max_position_embeddings,
                        tie_word_embeddings=c.tie_word_embeddings, sliding_window=window,
                        attn_implementation="eager")
    mistral = MistralForCausalLM(cfg).eval()
    mistral.load_state_dict(hf.state_dict(), strict=True)
    return mistral


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


def llama_cpp_rope_factors(theta: float, dim: int, s: dict) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py writes it for a Llama-3.1 rope_scaling."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1.0 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out)


def llama_cpp_inv_freq(theta: float, dim: int, rtype: str, factor: float, n_ctx_orig: int = 0,
                       beta_fast: float = 32.0, beta_slow: float = 1.0) -> tuple[np.ndarray, float]:
    """(frequencies, cos/sin scale) as ggml's rope computes them (ggml_rope_yarn_corr_dims,
    rope_yarn_ramp, rope_yarn) for linear (freq_scale = 1/factor) and YaRN (ext_factor 1)."""
    freq_scale = 1.0 / factor
    extrap = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    if rtype == "linear":
        return extrap * freq_scale, 1.0

    def corr_dim(n_rot):
        return dim * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(0.0, math.floor(corr_dim(beta_fast))), min(dim - 1.0, math.ceil(corr_dim(beta_slow)))
    y = (np.arange(dim // 2) - low) / max(0.001, high - low)
    ramp_mix = 1.0 - np.clip(y, 0.0, 1.0)
    return extrap * freq_scale * (1 - ramp_mix) + extrap * ramp_mix, 1.0 + 0.1 * math.log(1.0 / freq_scale)


SCALED = {  # stem: (write_tiny_gguf keywords, transformers' rope_parameters)
    "llama3": ({"rope_freqs": llama_cpp_rope_factors(THETA, HEAD_DIM, LLAMA31)}, LLAMA31),
    "linear": ({"rope_scaling": {"type": "linear", "factor": 4.0}}, {"rope_type": "linear", "factor": 4.0}),
    "yarn": ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_context_length": 128}},
             {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
}
FAR = 3000  # positions where the scaled and plain rotations part clearly


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

