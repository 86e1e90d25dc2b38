"""What the tests of GGUF architectures share: transformers' model of a tiny GGUF file (the oracle),
logits and greedy tokens on both sides, and llama.cpp's RoPE formulas written out."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import torch

THETA = 10000.0  # what tiny_gguf writes
TOKENS = torch.tensor([[5, 17, 99, 200, 3, 8, 260, 42, 42, 7]])
TOL = 2e-5  # float32 sums in another order, relative to the largest logit
FAR = 3000  # positions where the scaled and plain rotations part clearly


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
