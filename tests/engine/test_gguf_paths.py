"""GGUF metadata that changes what the model computes, each computed as llama.cpp does or answered
by a context limit, checked against oracles that share no code with specdec:

  * heads narrower than hidden / heads (Mistral Nemo's shape), against transformers' GGUF loading;
  * a RoPE factor without a scaling type, or under llama.cpp's older `rope.scale_linear` key: linear,
    as llama.cpp reads it;
  * YaRN with llama.cpp's `yarn_log_multiplier` (Mistral's own-format converter writes 1.0: the cos/sin
    scale cancels to 1) and `attn_factor`: the cos/sin scale against llama.cpp's context set-up
    written out here and transformers' YaRN with mscale / mscale_all_dim, the logits far into the
    context against transformers;
  * a sliding window (`{arch}.attention.sliding_window`): full attention equals it only inside the
    window, so the context is cut there: logits at the last position inside equal transformers'
    Mistral with that window, a longer prompt gets the context error, and speculation (a GGUF
    --draft, prompt lookup) stops at the end of the cut context where plain decoding does;
  * Ministral 3 (`mistral3`: llama's layers, YaRN, attention temperature scaling): logits against
    transformers' Ministral3 over the file's weights; the context cut where the temperature scaling
    starts (transformers' scaled and unscaled models part right there); `specdec serve` with a
    mistral3 --draft answers plain decoding's text;
  * benchmarks/plain_decode.py on a tiny GGUF file, against transformers' GGUF loading.
Each is broken once on purpose (the scaling ignored, the window ignored) to show the comparison
catches it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import urllib.request
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_helpers import (FAR, THETA, TOKENS, TOL, greedy_hf, greedy_native, hf_logits, hf_model, llama_cpp_inv_freq,
                          load, mistral_from_transformers, native_logits, rel_err)
from gguf_random import Q8_0
from specdec.types import SpecdecError
from tiny_gguf import HEAD_DIM, dequantized_state_dict, write_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def float_products(monkeypatch):
    """On the exact float path (as test_gguf_arch.py): any difference from the oracle is the model's."""
    monkeypatch.setenv("SPECDEC_GGUF_ACT8", "0")


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf_paths")


def tiny(directory: Path, stem: str, arch: str = "llama", **kw) -> Path:
    p = directory / f"{stem}.gguf"
    if not p.exists():
        write_tiny_gguf(p, arch, Q8_0, **kw)
    return p


# -- heads narrower than hidden / heads (Mistral Nemo) ----------------------------------------------
def test_heads_narrower_than_hidden_over_heads_equal_transformers(gguf_dir):
    """Mistral Nemo's shape (hidden 5120, 32 heads of 128): `attention.key_length` is the head size,
    q has fewer rows than the hidden size. Logits at the start and 300 positions in, and greedy
    tokens (decoding steps on the kernels), against transformers' GGUF loading."""
    path = tiny(gguf_dir, "nemo", name="Mistral-Nemo-Instruct-2407", tokenizer="llama", head_dim=32)
    m, hf = load(path).model, hf_model(path)
    assert m.cfg.head_dim * m.cfg.num_heads == m.cfg.hidden_size // 2
    for start in (0, 300):
        assert rel_err(native_logits(m, TOKENS, start), hf_logits(hf, TOKENS, start)) <= TOL
    prompt = [1] + TOKENS[0].tolist()
    assert greedy_native(m, prompt) == greedy_hf(hf, prompt)


# -- YaRN as llama.cpp computes it --------------------------------------------------------------
def llama_cpp_yarn_scale(factor: float, log_mul: float, attn_factor: float) -> float:
    """The cos/sin scale of llama.cpp's YaRN: llama_context sets yarn_attn_factor (get_mscale(f, 1) /
    get_mscale(f, log_mul), or get_mscale(f, 1) without a multiplier, over ggml's own 1 + 0.1 ln f,
    times rope.scaling.attn_factor); ggml's rope_yarn multiplies by 1 + 0.1 ln f again."""
    def get_mscale(s, m):
        return 1.0 if s <= 1.0 else 0.1 * m * math.log(s) + 1.0

    a = get_mscale(factor, 1.0) / get_mscale(factor, log_mul) if log_mul != 0.0 else get_mscale(factor, 1.0)
    a *= 1.0 / (1.0 + 0.1 * math.log(factor))
    a *= attn_factor
    return a * (1.0 + 0.1 * math.log(factor))


YARN = {"type": "yarn", "factor": 4.0, "original_context_length": 128}


@pytest.mark.parametrize("log_mul,attn_factor", [(1.0, 1.0), (0.5, 1.0), (0.0, 0.8), (1.0, 1.25)])
def test_yarn_scale_follows_llama_cpp_and_transformers(tmp_path, log_mul, attn_factor):
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    keys = dict(YARN, yarn_log_multiplier=log_mul, attn_factor=attn_factor)
    m = load(write_tiny_gguf(tmp_path / "y.gguf", "llama", Q8_0, layers=1, rope_scaling=keys)).model
    assert m.rope_scaling == pytest.approx(llama_cpp_yarn_scale(4.0, log_mul, attn_factor), rel=1e-6)
    f, _ = llama_cpp_inv_freq(THETA, HEAD_DIM, "yarn", 4.0, 128)
    assert np.allclose(m.inv_freq.double().numpy(), f, rtol=1e-6, atol=0)
    if attn_factor == 1.0:  # transformers' YaRN: mscale 1 over mscale_all_dim = the multiplier
        cfg = PretrainedConfig(hidden_size=m.cfg.hidden_size, num_attention_heads=m.cfg.num_heads, head_dim=HEAD_DIM,
                               max_position_embeddings=m.cfg.max_position)
        cfg.rope_parameters = {"rope_theta": THETA, "rope_type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 128}
        if log_mul:
            cfg.rope_parameters.update(mscale=1.0, mscale_all_dim=log_mul)
        want, scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
        assert m.rope_scaling == pytest.approx(scale, rel=1e-6)
        assert torch.allclose(m.inv_freq, want.float(), rtol=1e-6, atol=0)


def test_yarn_with_a_log_multiplier_equals_transformers_far_into_the_context(gguf_dir):
    """What llama.cpp's Mistral-format converter writes (yarn_log_multiplier 1: cos/sin unscaled)."""
    path = tiny(gguf_dir, "yarn-logmul", context=4096, rope_scaling=dict(YARN, yarn_log_multiplier=1.0))
    m = load(path).model
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 1.0,
            "mscale_all_dim": 1.0}
    ref = hf_logits(hf_model(path, rope), TOKENS, FAR)
    assert rel_err(native_logits(m, TOKENS, FAR), ref) <= TOL
    # the multiplier ignored (YaRN's default scale 1 + 0.1 ln 4): far from it (the comparison can fail)
    plain_yarn = {k: v for k, v in rope.items() if not k.startswith("mscale")}
    assert rel_err(hf_logits(hf_model(path, plain_yarn), TOKENS, FAR), ref) > 100 * TOL


@pytest.mark.parametrize("keys", [{"rope.scaling.factor": 4.0}, {"rope.scale_linear": 4.0}],
                         ids=["factor-without-type", "old-scale-linear-key"])
def test_a_factor_without_a_type_is_linear_as_llama_cpp_reads_it(tmp_path, keys):
    """llama.cpp's default scaling type is linear, and `rope.scale_linear` is its older key for the
    factor (files of 2023): neither may be dropped."""
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    m = load(write_tiny_gguf(tmp_path / "l.gguf", "llama", Q8_0, layers=1, meta=keys)).model
    f, s = llama_cpp_inv_freq(THETA, HEAD_DIM, "linear", 4.0)
    assert np.allclose(m.inv_freq.double().numpy(), f, rtol=1e-6, atol=0) and m.rope_scaling == s
    cfg = PretrainedConfig(hidden_size=m.cfg.hidden_size, num_attention_heads=m.cfg.num_heads, head_dim=HEAD_DIM,
                           max_position_embeddings=m.cfg.max_position)
    cfg.rope_parameters = {"rope_theta": THETA, "rope_type": "linear", "factor": 4.0}
    want, _ = ROPE_INIT_FUNCTIONS["linear"](cfg, "cpu")
    assert torch.allclose(m.inv_freq, want.float(), rtol=1e-6, atol=0)


# -- a sliding window ---------------------------------------------------------------------------
WINDOW = 16


def test_a_sliding_window_cuts_the_context_where_full_attention_stops_equalling_it(gguf_dir, capsys):
    from specdec.models.loader import load_model

    path = tiny(gguf_dir, "window", name="Mistral-7B-v0.1", meta={"attention.sliding_window": WINDOW})
    lm = load_model(str(path), quiet=False, with_tokenizer=False)
    err = capsys.readouterr().err
    assert f"context cut to {WINDOW} tokens: its sliding window (llama.attention.sliding_window)" in err
    m = lm.model
    assert m.max_context == WINDOW
    x = torch.arange(5, 5 + WINDOW)[None] * 7 % 260  # the whole window
    windowed = mistral_from_transformers(path, WINDOW)
    assert rel_err(native_logits(m, x), hf_logits(windowed, x)) <= TOL
    # one token more and the window masks a key: transformers' windowed and full models part there
    y = torch.cat([x, x[:, :1]], dim=1)
    full = mistral_from_transformers(path, None)
    assert rel_err(hf_logits(windowed, y)[:, -1], hf_logits(full, y)[:, -1]) > 100 * TOL
    assert rel_err(hf_logits(windowed, x), hf_logits(full, x)) <= TOL  # (inside it they agree)
    with pytest.raises(SpecdecError, match=rf"position {WINDOW} is past the model's context of {WINDOW} tokens"):
        native_logits(m, y)


def test_a_prompt_past_the_window_gets_one_line(gguf_dir, capsys):
    from specdec.cli import main

    path = tiny(gguf_dir, "window", name="Mistral-7B-v0.1", meta={"attention.sliding_window": WINDOW})
    capsys.readouterr()
    rc = main(["generate", "x" * (WINDOW + 4), "--raw", "--quiet", "--model", str(path), "--method", "none",
               "--max-new-tokens", "2"])
    out = capsys.readouterr()
    assert rc != 0
    lines = [line for line in (out.err + out.out).splitlines() if line.strip()]
    assert len(lines) == 1 and f"{WINDOW}" in lines[0] and "context" in lines[0], lines


def test_a_window_as_long_as_the_context_cuts_nothing(tmp_path):
    path = write_tiny_gguf(tmp_path / "w.gguf", "qwen2", Q8_0, layers=1, context=256,
                           meta={"attention.sliding_window": 256})
    m = load(path).model
    assert m.max_context == 256 and m.cfg.max_position == 256


def test_speculation_stops_at_the_cut_context_as_plain_decoding_does(gguf_dir, capsys):
    """A Mistral-style target (llama, SentencePiece vocabulary with BOS) cut to a 32-token window,
    through `specdec generate`: a GGUF --draft (another file, and the target itself, whose guesses
    are all accepted up to the last position) and prompt lookup give plain decoding's tokens and
    stop at the same place, the end of the context."""
    from specdec.cli import main

    target = tiny(gguf_dir, "window32", name="Mistral-7B-v0.1", tokenizer="llama",
                  meta={"attention.sliding_window": 32})
    draft = tiny(gguf_dir, "window32-draft", seed=1, layers=1, name="Mistral-7B-v0.1", tokenizer="llama")

    def generate(*argv):
        capsys.readouterr()
        rc = main(["generate", "the theater is on", "--raw", "--json", "--quiet", "--model", str(target),
                   "--max-new-tokens", "40", *argv])
        out = capsys.readouterr().out
        assert rc == 0, out
        [row] = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        return row

    plain = generate("--method", "none")
    assert plain["finish_reason"] == "length"
    assert plain["stats"]["prompt_tokens"] + len(plain["token_ids"]) == 32 and len(plain["token_ids"]) > 4
    # (a draft model at a fixed k: these drafts are as slow as the target, so priced they would not run)
    for argv in (["--method", "draft", "--draft", str(draft), "-k", "4", "--draft-confidence", "0", "--fixed-k"],
                 ["--method", "draft", "--draft", str(target), "-k", "7", "--draft-confidence", "0", "--fixed-k"],
                 ["--method", "ngram"]):
        spec = generate(*argv)
        assert spec["token_ids"] == plain["token_ids"] and spec["finish_reason"] == "length", argv
        if str(target) in argv:  # (the target guessing for itself: all accepted, the last run cut short)
            assert spec["stats"]["accepted"] == spec["stats"]["proposed"] > 0


# -- Ministral 3 (mistral3) ---------------------------------------------------------------------
ORIG = 128  # YaRN's original context, where the temperature scaling starts
MINISTRAL_YARN = {"type": "yarn", "factor": 4.0, "original_context_length": ORIG, "yarn_log_multiplier": 1.0}


def ministral3_from_transformers(path: Path, beta: float):
    """transformers' Ministral3 model with YaRN (mscale = mscale_all_dim = 1) and Llama 4 attention
    scaling `beta`, over the file's weights (gguf.quants.dequantize; transformers' GGUF loading does
    not read mistral3)."""
    from transformers import Ministral3Config, Ministral3ForCausalLM
    from transformers.utils import logging as hf_logging

    from tiny_gguf import FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB

    hf_logging.set_verbosity_error()
    cfg = Ministral3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                           num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                           rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=True,
                           sliding_window=None, attn_implementation="eager",
                           rope_parameters={"rope_type": "yarn", "rope_theta": THETA, "factor": 4.0,
                                            "original_max_position_embeddings": ORIG, "beta_fast": 32.0,
                                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                            "llama_4_scaling_beta": beta})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Ministral3ForCausalLM(cfg).eval()
    sd = dequantized_state_dict(path)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    model.load_state_dict(sd, strict=True)
    return model


def test_a_ministral3_file_equals_transformers_inside_its_exact_context(gguf_dir, capsys):
    from specdec.models.loader import load_model

    path = tiny(gguf_dir, "ministral3", "mistral3", name="Ministral-3-3B-Instruct-2512", tokenizer="llama",
                context=4096, rope_scaling=MINISTRAL_YARN, meta={"attention.temperature_scale": 0.1})
    lm = load_model(str(path), quiet=False, with_tokenizer=False)
    assert f"context cut to {ORIG} tokens: attention temperature scaling" in capsys.readouterr().err
    m = lm.model
    assert m.max_context == ORIG and m.rope_scaling == pytest.approx(1.0, rel=1e-7)
    start = ORIG - TOKENS.shape[1]  # the last positions before the temperature scaling starts
    scaled = ministral3_from_transformers(path, 0.1)
    ref = hf_logits(scaled, TOKENS, start)
    assert rel_err(native_logits(m, TOKENS, start), ref) <= TOL
    # the YaRN frequencies matter there: the file read without its scaling parts from transformers
    plain = hf_logits(hf_model_rope_default(path), TOKENS, start)
    assert rel_err(plain, ref) > 100 * TOL
    # past the cut transformers' scaled and unscaled models part: the cut is where it must be
    unscaled = ministral3_from_transformers(path, 0.0)
    assert rel_err(hf_logits(unscaled, TOKENS, start), ref) <= TOL
    assert rel_err(hf_logits(unscaled, TOKENS, ORIG), hf_logits(scaled, TOKENS, ORIG)) > 100 * TOL
    with pytest.raises(SpecdecError, match=rf"past the model's context of {ORIG} tokens"):
        native_logits(m, TOKENS, ORIG)


def hf_model_rope_default(path: Path):
    """transformers' Ministral3 over the file's weights with plain RoPE (no YaRN, no temperature)."""
    model = ministral3_from_transformers(path, 0.0)
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": THETA, "llama_4_scaling_beta": 0.0,
                                    "original_max_position_embeddings": ORIG}
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    return model


def test_ministral3_speculative_greedy_equals_plain(gguf_dir):
    from specdec.drafters.ngram import NgramDrafter
    from specdec.engine import Engine
    from specdec.types import SamplingParams

    path = tiny(gguf_dir, "ministral3", "mistral3", name="Ministral-3-3B-Instruct-2512", tokenizer="llama",
                context=4096, rope_scaling=MINISTRAL_YARN, meta={"attention.temperature_scale": 0.1})
    m = load(path).model
    prompt = [1, 5, 17, 99, 200, 5, 17, 99, 3]
    params = SamplingParams(max_new_tokens=24)
    plain = Engine(m, None, k=0, eos_ids=()).generate([prompt], params)[0].tokens
    spec = Engine(m, NgramDrafter(), k=4, eos_ids=()).generate([prompt], params)[0]
    assert spec.tokens == plain and len(plain) == 24


def test_serve_a_ministral3_target_with_a_gguf_draft(gguf_dir):
    """`specdec serve` on the Ministral 3 file (SentencePiece vocabulary with BOS, YaRN, the context
    cut at 128) with a one-layer mistral3 --draft: a greedy completion is plain decoding's text,
    the draft guessed, and a request past the cut context gets a 400 naming the context."""
    import urllib.error

    from server_helpers import post, served

    from specdec.engine import Engine
    from specdec.models.loader import load_model
    from specdec.text import TextStream
    from specdec.types import SamplingParams

    target = tiny(gguf_dir, "ministral3", "mistral3", name="Ministral-3-3B-Instruct-2512", tokenizer="llama",
                  context=4096, rope_scaling=MINISTRAL_YARN, meta={"attention.temperature_scale": 0.1})
    draft = tiny(gguf_dir, "ministral3-draft", "mistral3", seed=1, layers=1, name="Ministral-3-3B-Instruct-2512",
                 tokenizer="llama", context=4096, rope_scaling=MINISTRAL_YARN,
                 meta={"attention.temperature_scale": 0.1})
    prompt, n = "the theater is on the street", 16
    lm = load_model(str(target), quiet=True)
    [r] = Engine(lm.model, None, k=0, eos_ids=()).generate([lm.tokenizer.encode(prompt)],
                                                            SamplingParams(max_new_tokens=n))
    # the server's incremental decoder (a random model's bytes that form no character are shown as
    # they come, where decoding all at once replaces the whole byte run: docs/design.md, "Text")
    stream = TextStream(lm.tokenizer)
    want = "".join(stream.push([t]) for t in r.tokens) + stream.finish()
    args = ["--model", str(target), "--method", "draft", "--draft", str(draft), "--fixed-k", "-k", "4"]
    with served(args) as (url, _):
        got = post(url + "/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0})
        text = got["choices"][0]["text"]
        assert text and want.startswith(text)
        with urllib.request.urlopen(url + "/metrics", timeout=10) as m:
            metrics = m.read().decode()
        proposed = [x for x in metrics.splitlines() if x.startswith("specdec_draft_tokens_proposed_total ")]
        assert proposed and float(proposed[0].split()[1]) > 0
        with pytest.raises(urllib.error.HTTPError) as e:
            post(url + "/v1/completions", {"prompt": prompt, "max_tokens": ORIG, "temperature": 0})
        assert e.value.code == 400 and f"{ORIG} tokens" in e.value.read().decode()


def test_temperature_scaling_without_a_length_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", "mistral3", Q8_0, layers=1, meta={"attention.temperature_scale": 0.1})
    with pytest.raises(SpecdecError, match=r"attention temperature scaling \(mistral3\.attention\.temperature_scale "
                                           r"= 0\.1\) without a temperature length or YaRN original context"):
        load(path)


# -- benchmarks/plain_decode.py on a GGUF target ----------------------------------------------------
def test_plain_decode_benchmark_runs_on_a_gguf_file(gguf_dir):
    path = tiny(gguf_dir, "bench-qwen2", "qwen2")
    env = dict(os.environ, SPECDEC_GGUF_ACT8="0", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plain_decode.py"), "--model", str(path),
                        "--prompts", "2", "--max-new-tokens", "8", "--repeats", "1", "--threads", "1"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["weights"].startswith("gguf blocks") and result["specdec_tok_s"] > 0
    assert result["greedy_outputs_equal"] == "2/2"  # transformers' own GGUF loading, the same greedy tokens
