"""Qwen3, Gemma 2, Gemma 3 and Phi-3 on the native model (models/families.py), each checked against
an oracle that shares no code with specdec.

GGUF files written by the test (tests/tiny_gguf.py, as llama.cpp's converter writes these
architectures) are compared with transformers' own GGUF loading of the same file (its
dequantiser, its undoing of Gemma's 1 + w norms, its architecture code: logits and greedy
tokens), with transformers' settings put to what llama.cpp computes where its GGUF reader does not
read them (Phi-3's partial rotation, LongRoPE and window; Gemma 2's caps from the file). Hugging
Face folders of the same architectures (tiny random transformers models, saved and loaded) are
compared with the transformers model they came from. Sliding windows are a few tokens wide, so
every prompt and answer crosses them: a verified token's logits equal decoding it alone, bit for
bit (chains, trees, ragged batches, a tree's accepted path kept by keep_paths), and greedy
speculation (prompt lookup, a draft model of the same family, an EAGLE tree, EAGLE and Medusa heads
trained on the target) equals plain greedy decoding. Each rule is broken once on purpose (the
sqrt(hidden) scale, Gemma's + 1, the caps, the window, the q/k norms, the partial rotation, the
second RoPE base) to show the comparison catches it; an unsupported variant is one line.
"""

from __future__ import annotations

import functools
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_helpers import greedy_hf, greedy_native, load, rel_err
from gguf_random import F16, NAMES, Q4_K, Q5_0, Q6_K, Q8_0
from model_helpers import random_eagle
from oracle import one_thread
from specdec.types import SamplingParams, SpecdecError
from tiny_gguf import VOCAB, write_tiny_gguf

WINDOW = 6  # the tiny files' sliding window: every test's context crosses it
FILES = {  # stem: (architecture, write_tiny_gguf keywords)
    "qwen3": ("qwen3", dict(head_dim=128)),
    # 7 layers: 0-4 and 6 slide (llama.cpp's period of 6), 5 attends to all; two RoPE bases
    "gemma3": ("gemma3", dict(head_dim=256, rope_base=1e6, layers=7, meta={"attention.sliding_window": WINDOW})),
    "gemma2": ("gemma2", dict(head_dim=256, layers=3, meta={"attention.sliding_window": WINDOW})),
    # caps written in the file, strong enough to matter (llama.cpp's defaults are 50 and 30)
    "gemma2-caps": ("gemma2", dict(head_dim=256, layers=3, meta={"attention.sliding_window": WINDOW,
                                                                "attn_logit_softcapping": 1.5,
                                                                "final_logit_softcapping": 2.0})),
    "phi3": ("phi3", {}),
    # Phi-4-mini's shape: a quarter of each head unrotated, LongRoPE's factors, and a window
    "phi3-longrope": ("phi3", dict(rotary_dim=32, rope_factors=True, context=4096,
                                   meta={"rope.scaling.original_context_length": 64, "attention.sliding_window": 9})),
}
TOL = 2e-5  # float32 sums in another order, relative to the largest logit
TOKENS = torch.tensor([[5, 17, 99, 200, 3, 8, 260, 42, 42, 7, 11, 12, 13, 14, 15, 16]])


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


@pytest.fixture(autouse=True)
def float_products(monkeypatch):
    """Comparisons with transformers on the exact float path (the float product over the dequantised
    blocks), so any difference is the architecture's; speculation tests run on it too (exactness
    does not depend on the path: tests/engine/test_gguf_native.py)."""
    monkeypatch.setenv("SPECDEC_GGUF_ACT8", "0")


def tiny(directory: Path, stem: str, t: int = Q8_0, seed: int = 0, **kw) -> Path:
    arch, base = FILES[stem]
    extra = f"-{zlib.crc32(repr(sorted(kw.items())).encode()):08x}" if kw else ""
    p = directory / f"{stem}-{NAMES[t]}-{seed}{extra}.gguf"
    if not p.exists():
        write_tiny_gguf(p, arch, t, seed, **{**base, **kw})
    return p


def transformers_model(path: Path, stem: str):
    """transformers' model of the file, its GGUF reader's config completed with what llama.cpp
    computes and that reader leaves at transformers' defaults: Gemma 2's caps from the file;
    Phi-3's partial rotation, LongRoPE factors and window (a Phi3 model rebuilt over the weights
    transformers read)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    meta = FILES[stem][1].get("meta", {})
    if "attn_logit_softcapping" in meta:
        hf.config.final_logit_softcapping = meta["final_logit_softcapping"]
        for layer in hf.model.layers:
            layer.self_attn.attn_logit_softcapping = meta["attn_logit_softcapping"]
    if stem == "phi3-longrope":
        from transformers import Phi3Config, Phi3ForCausalLM

        c, kw = hf.config, FILES[stem][1]
        half = kw["rotary_dim"] // 2
        cfg = Phi3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, rms_norm_eps=c.rms_norm_eps,
                         max_position_embeddings=kw["context"], original_max_position_embeddings=64,
                         sliding_window=meta["attention.sliding_window"], tie_word_embeddings=False,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                          "partial_rotary_factor": kw["rotary_dim"] / (c.hidden_size // c.num_attention_heads),
                                          "short_factor": np.linspace(1.0, 1.7, half).tolist(),
                                          "long_factor": np.linspace(2.0, 8.0, half).tolist(),
                                          "original_max_position_embeddings": 64},
                         attn_implementation="eager")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            phi = Phi3ForCausalLM(cfg).eval()
        phi.load_state_dict(hf.state_dict(), strict=True)
        hf = phi
    return hf


@functools.lru_cache(maxsize=None)
def _reference(path: Path, stem: str) -> torch.Tensor:
    with torch.no_grad():
        return transformers_model(path, stem)(TOKENS).logits


def native_logits(m, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    logits, _ = m(tokens, torch.arange(tokens.shape[1])[None], m.new_cache(1, 40))
    return logits


def stepwise_logits(m, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    """The logits of every token decoded one at a time after a 1-token prefill: each step on the
    kernels, through the windows."""
    cache = m.new_cache(1, 40)
    return torch.cat([m(tokens[:, t:t + 1], torch.tensor([[t]]), cache)[0] for t in range(tokens.shape[1])], 1)


# -- against transformers ------------------------------------------------------------------------
@pytest.mark.parametrize("stem,t", [(s, t) for s in FILES for t in (F16, Q8_0)]
                         + [("qwen3", Q4_K), ("gemma3", Q6_K), ("gemma3", Q5_0), ("phi3-longrope", Q4_K)])
def test_logits_and_greedy_tokens_equal_transformers(gguf_dir, stem, t):
    path = tiny(gguf_dir, stem, t)
    m = load(path).model
    ref = _reference(path, stem)
    assert float(ref.abs().max()) > 1.0  # (not a degenerate model)
    assert rel_err(native_logits(m), ref) <= TOL  # a prefill (torch's ops)
    assert rel_err(stepwise_logits(m), ref) <= TOL  # decoding steps (the kernels)
    prompt = TOKENS[0, :6].tolist()
    assert greedy_native(m, prompt) == greedy_hf(transformers_model(path, stem), prompt)


def test_the_settings_the_files_carry_are_read(gguf_dir):
    """What the model computes from each file's metadata, as llama.cpp reads it."""
    g3 = load(tiny(gguf_dir, "gemma3")).model.cfg
    assert g3.sliding_layers == (True,) * 5 + (False, True) and g3.sliding_window == WINDOW
    assert g3.local_rope_theta == 10000.0 and g3.rope_theta == 1e6 and g3.embed_scale == 16.0
    assert g3.attn_scale == 256 ** -0.5 and g3.tie_embeddings and g3.qk_norm and g3.sandwich_norms
    g2 = load(tiny(gguf_dir, "gemma2-caps")).model.cfg
    assert (g2.attn_softcap, g2.final_softcap) == (1.5, 2.0) and g2.sliding_layers == (True, False, True)
    assert load(tiny(gguf_dir, "gemma2")).model.cfg.final_softcap == 30.0  # (llama.cpp's defaults)
    phi = load(tiny(gguf_dir, "phi3-longrope")).model
    assert phi.cfg.rotary_dim == 32 and phi.cfg.max_position == 64  # (LongRoPE's short factors hold up to there)
    assert phi.rope_scaling == pytest.approx(np.sqrt(1 + np.log(4096 / 64) / np.log(64)))


def _phi_whole_head(m):
    m.inv_freq = torch.cat([m.inv_freq, m.inv_freq])  # (every dimension of a head rotates)


def _phi_no_factors(m):
    from specdec.models.families import default_inv_freq

    m.inv_freq, m.rope_scaling = default_inv_freq(10000.0, 32), 1.0


BROKEN = {  # case: (file, what a loader that got the rule wrong computes, applied to the loaded model)
    "embedding scale": ("gemma3", lambda m: setattr(m, "embed_scale", None)),
    "norms' + 1 added again": ("gemma2", lambda m: [p.add_(1.0) for n, p in m.named_parameters() if "norm" in n]),
    "caps": ("gemma2-caps", lambda m: [setattr(b, "softcap", 0.0) for b in m.layers]
             + [setattr(m.cfg, "final_softcap", 0.0)]),
    "window": ("gemma3", lambda m: [setattr(b, "sliding", False) for b in m.layers]),
    "one RoPE base": ("gemma3", lambda m: setattr(m, "local_inv_freq", m.inv_freq)),
    "q/k norms": ("qwen3", lambda m: [setattr(b, n, None) for b in m.layers for n in ("q_norm", "k_norm")]),
    "whole-head rotation": ("phi3-longrope", _phi_whole_head),
    "LongRoPE factors": ("phi3-longrope", _phi_no_factors),
    "Phi-3 window": ("phi3-longrope", lambda m: [setattr(b, "sliding", False) for b in m.layers]),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_rule_is_caught(gguf_dir, case):
    """The comparison above can fail: each rule broken once, the logits leave transformers'."""
    stem, breaks = BROKEN[case]
    path = tiny(gguf_dir, stem)
    m = load(path).model
    with torch.no_grad():
        breaks(m)
    assert rel_err(stepwise_logits(m), _reference(path, stem)) > 100 * TOL


# -- Hugging Face folders ------------------------------------------------------------------------
COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, rms_norm_eps=1e-6)


def hf_config(family: str):
    from transformers import Gemma2Config, Gemma3TextConfig, Phi3Config, Qwen3Config

    if family == "qwen3":
        return Qwen3Config(**COMMON, head_dim=32, max_position_embeddings=256, tie_word_embeddings=False)
    if family == "gemma2":
        return Gemma2Config(**COMMON, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
                            max_position_embeddings=256, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    if family == "gemma3":
        return Gemma3TextConfig(**COMMON, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                max_position_embeddings=256, sliding_window_pattern=3,
                                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                    "rope_theta": 100000.0},
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})
    if family == "phi3":
        return Phi3Config(**COMMON, max_position_embeddings=512, original_max_position_embeddings=128,
                          sliding_window=7, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                           "short_factor": [1.0 + 0.1 * i for i in range(4)],
                                           "long_factor": [2.0 + i for i in range(4)],
                                           "original_max_position_embeddings": 128})
    raise KeyError(family)


@functools.lru_cache(maxsize=None)
def hf_folder(family: str, seed: int = 0) -> Path:
    """A tiny random transformers model of the family saved as a folder (every parameter drawn at
    random: norms around 1 as they multiply, so Gemma's stored weight around 0)."""
    import tempfile

    from model_helpers import randomize_
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32, attn_implementation="eager")
    randomize_(hf, seed)
    if family.startswith("gemma"):
        with torch.no_grad():
            for n, p in hf.named_parameters():
                if n.endswith("norm.weight"):
                    p.sub_(1.0)
    d = Path(tempfile.mkdtemp(prefix=f"specdec-{family}-"))
    hf.save_pretrained(str(d))
    return d


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_a_hugging_face_folder_runs_natively_as_transformers_computes_it(family):
    from transformers import AutoModelForCausalLM

    from specdec.models.loader import load_model

    d = hf_folder(family)
    lm = load_model(str(d), quiet=True, with_tokenizer=False)
    assert lm.backend == "native" and lm.model.rowstable is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager").eval()
    tokens = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
    assert rel_err(native_logits(lm.model, tokens), ref) <= TOL
    assert rel_err(stepwise_logits(lm.model, tokens), ref) <= TOL
    prompt = tokens[0, :5].tolist()
    assert greedy_native(lm.model, prompt, 16) == greedy_hf(hf, prompt, 16)
    if family.startswith("gemma"):  # (the + 1 of every norm: dropped, the logits part)
        with torch.no_grad():
            for n, p in lm.model.named_parameters():
                if "norm" in n:
                    p.sub_(1.0)
        assert rel_err(stepwise_logits(lm.model, tokens), ref) > 100 * TOL


@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_speculation_on_a_folder_target_equals_plain_greedy(family):
    """A folder target with prompt lookup, a folder draft of the same family (on the target's
    kernels, as `--draft` loads it) and an EAGLE tree: plain greedy decoding's tokens."""
    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.drafters.ngram import NgramDrafter
    from specdec.engine import Engine
    from specdec.models.loader import load_model

    target = load_model(str(hf_folder(family)), quiet=True, with_tokenizer=False).model
    draft = load_model(str(hf_folder(family, 1)), quiet=True, with_tokenizer=False, pack=False).model
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (7, 12)]
    prompts[1] = prompts[1][:4] * 3
    sp = SamplingParams(max_new_tokens=20)
    want = [Engine(target, None, k=0, eos_ids=()).generate([p], sp)[0].tokens for p in prompts]
    with one_thread():
        for name, drafter in (("ngram", NgramDrafter()),
                              ("draft", DraftModelDrafter(draft, target_model=target)),
                              ("eagle_tree", random_eagle(target))):
            outs = Engine(target, drafter, k=4, eos_ids=(), fixed_k=True).generate(prompts, sp)
            assert [o.tokens for o in outs] == want, name


@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_bfloat16_verification_equals_one_at_a_time_bit_for_bit(family):
    """A folder in bfloat16 (attention and cache in float64): a chain and a tree verified in a
    ragged batch give each token the logits of decoding its path one token at a time, through the
    windows, the caps and the partial rotation."""
    from model_helpers import check_verification_equals_one_at_a_time

    from specdec.models.loader import load_model

    model = load_model(str(hf_folder(family)), dtype=torch.bfloat16, quiet=True, with_tokenizer=False).model
    assert model.attn_dtype == torch.float64
    check_verification_equals_one_at_a_time(model)


def test_an_eagle_head_initialised_from_a_family_layer_reads_it_as_a_llama_layer():
    """Phi-3's fused q/k/v and gate/up split, Gemma's norms as they multiply (1 + w): from a folder
    and from a GGUF file alike."""
    from safetensors.torch import load_file

    from specdec.models import families
    from specdec.models.loader import load_model

    for family in ("phi3", "gemma2"):
        d = hf_folder(family)
        sd = load_file(str(d / "model.safetensors"))
        cfg = load_model(str(d), quiet=True, with_tokenizer=False).model.cfg
        got = families.hf_llama_layer_state(cfg, sd, 2)
        p = "model.layers.2."
        if family == "phi3":
            qkv = sd[p + "self_attn.qkv_proj.weight"]
            assert torch.equal(torch.cat([got[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]), qkv)
            assert torch.equal(got[p + "mlp.gate_proj.weight"], sd[p + "mlp.gate_up_proj.weight"][:96])
            assert torch.equal(got[p + "post_attention_layernorm.weight"], sd[p + "post_attention_layernorm.weight"])
        else:  # (the norm before Gemma's MLP is its pre_feedforward_layernorm)
            assert torch.equal(got[p + "post_attention_layernorm.weight"], sd[p + "pre_feedforward_layernorm.weight"] + 1)
            assert torch.equal(got[p + "input_layernorm.weight"], sd[p + "input_layernorm.weight"] + 1)


def test_phi3_gguf_layer_state_is_the_dequantised_fused_tensors_split(gguf_dir):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from specdec.models.gguf_file import GGUFFile

    path = tiny(gguf_dir, "phi3", Q4_K)
    got = load(path).model.hf_layer_state(1)
    gf = GGUFFile(path)

    def deq(name):
        t = gf.tensors[name]
        return torch.from_numpy(np.array(dequantize(np.ascontiguousarray(gf.raw(name)),
                                                    GGMLQuantizationType(t.type_id)), dtype=np.float32))

    p = "model.layers.1."
    qkv, gate_up = deq("blk.1.attn_qkv.weight"), deq("blk.1.ffn_up.weight")
    assert torch.equal(torch.cat([got[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]), qkv)
    assert torch.equal(torch.cat([got[p + "mlp.gate_proj.weight"], got[p + "mlp.up_proj.weight"]]), gate_up)
    assert got[p + "self_attn.q_proj.weight"].shape == (4 * 64, 256)


# -- exactness under speculation, through the windows ---------------------------------------------
SPEC_STEMS = ["qwen3", "gemma3", "gemma2-caps", "phi3-longrope"]


@pytest.mark.parametrize("stem", SPEC_STEMS)
def test_a_verified_tokens_logits_are_its_logits_decoded_alone(gguf_dir, stem):
    """After ragged prompts longer than the window, 5 tokens verified in one call (a chain, and a
    tree whose nodes sit at their depths) get bit for bit the logits of decoding each alone, its
    path one token at a time: each token's window is its own position's."""
    from model_helpers import ancestor_mask, path_to

    m = load(tiny(gguf_dir, stem)).model
    prompts = [[5, 17, 99, 200, 3, 8, 260, 42, 9], [7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    new = [3, 8, 260, 42, 7]
    parents = [-1, 0, 0, 1, 2]  # node 0 the pending token; 1, 2 its children; 3 under 1, 4 under 2
    tree_mask = ancestor_mask(parents)
    depth = tree_mask.sum(-1) - 1

    def alone(prompt, path):
        cache = m.new_cache(1, 40)
        m(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache)
        out = None
        for i, tok in enumerate(path):
            out = m(torch.tensor([[tok]]), torch.tensor([[len(prompt) + i]]), cache)[0][0, 0]
        return out

    def prefilled():  # row b: prompt b prefilled alone, as the scheduler prefills a row that joins
        cache = m.new_cache(2, 40)
        for b, prompt in enumerate(prompts):
            one = m.new_cache(1, 40)
            m(torch.tensor([prompt]), torch.arange(len(prompt))[None], one)
            for layer in range(len(cache.k)):
                cache.k[layer][b, :, :len(prompt)] = one.k[layer][0, :, :len(prompt)]
                cache.v[layer][b, :, :len(prompt)] = one.v[layer][0, :, :len(prompt)]
        cache.lengths = torch.tensor([len(p) for p in prompts])
        return cache

    with one_thread():
        for mask in (None, tree_mask):
            cache = prefilled()
            pos = cache.lengths[:, None] + (torch.arange(5) if mask is None else depth)[None]
            am = None if mask is None else mask[None].expand(2, 5, 5)
            many, _ = m(torch.tensor([new, new]), pos, cache, attn_mask=am)
            for b, prompt in enumerate(prompts):
                for i in range(5):
                    path = new[: i + 1] if mask is None else [new[j] for j in path_to(parents, i)]
                    assert torch.equal(many[b, i], alone(prompt, path)), (stem, mask is not None, b, i)


@pytest.mark.parametrize("stem", SPEC_STEMS)
def test_the_fused_step_gives_the_numbers_of_the_step_op_by_op(gguf_dir, stem, monkeypatch):
    """rope_attend_scaled (q/k norms, rotation, cache write, attention in one call) against the same
    step made op by op (the kernels' per-head rms_norm, torch's rotation, attend_scaled): the same
    logits bit for bit, for chains, a tree and ragged rows through the windows."""
    from model_helpers import ancestor_mask, steps_both_ways

    from specdec.models import families

    m = load(tiny(gguf_dir, stem)).model

    def switch(on):
        monkeypatch.setattr(families, "FUSED_STEP", on)

    with one_thread():
        steps_both_ways(m, 11, ((1, None), (5, None), (4, ancestor_mask([-1, 0, 0, 1])), (1, None)), switch)


@pytest.mark.parametrize("stem", ["gemma3", "phi3-longrope"])
def test_a_kept_tree_path_decodes_on_as_the_sequence_decoded_alone(gguf_dir, stem):
    """keep_paths moves a tree's accepted nodes after the prefix; the windows of the tokens decoded
    next see them at their positions, bit for bit as if the path had been decoded token by token."""
    from model_helpers import ancestor_mask

    m = load(tiny(gguf_dir, stem)).model
    prompt, new, parents = [5, 17, 99, 200, 3, 8, 260, 42], [3, 8, 260, 42, 7], [-1, 0, 0, 2, 3]
    mask = ancestor_mask(parents)
    with one_thread():
        cache = m.new_cache(1, 40)
        m(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache)
        base = cache.lengths.clone()
        m(torch.tensor([new]), base[:, None] + (mask.sum(-1) - 1)[None], cache, attn_mask=mask[None])
        cache.keep_paths(base, [[2, 3, 4]])  # (node indices 1-based after the root: nodes 2, 3, 4)
        kept = [new[0], new[2], new[3], new[4]]
        nxt = [11, 12, 13]
        got = [m(torch.tensor([[t]]), cache.lengths[:, None].clone(), cache)[0][0, 0] for t in nxt]
        ref_cache = m.new_cache(1, 40)
        seq = prompt + kept
        m(torch.tensor([prompt]), torch.arange(len(prompt))[None], ref_cache)
        for i, t in enumerate(kept):
            m(torch.tensor([[t]]), torch.tensor([[len(prompt) + i]]), ref_cache)
        want = [m(torch.tensor([[t]]), torch.tensor([[len(seq) + i]]), ref_cache)[0][0, 0] for i, t in enumerate(nxt)]
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("stem", SPEC_STEMS + ["phi3"])
def test_greedy_speculation_equals_plain_greedy(gguf_dir, stem):
    """Prompt lookup, a draft model of the same family (another file), the target as its own
    draft, and an EAGLE tree, in a batch of 1 and 3 rows, chains and trees: the tokens of plain
    greedy decoding, through windows of a few tokens."""
    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.drafters.ngram import NgramDrafter
    from specdec.engine import Engine

    target = load(tiny(gguf_dir, stem, Q4_K)).model
    draft = load(tiny(gguf_dir, stem, Q8_0, seed=1, layers=2)).model
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 11, 9)]
    prompts[2] = prompts[2][:4] * 3  # repeats: prompt lookup proposes from the start
    sp = SamplingParams(max_new_tokens=20)
    want = [Engine(target, None, k=0, eos_ids=()).generate([p], sp)[0].tokens for p in prompts]
    drafters = {"ngram": lambda: NgramDrafter(),
                "draft": lambda: DraftModelDrafter(draft, target_model=target),
                "draft_self": lambda: DraftModelDrafter(target, target_model=target),
                "eagle_tree": lambda: random_eagle(target)}
    accepted = 0
    with one_thread():
        for name, make in drafters.items():
            for batch in ([prompts[0]], prompts):
                outs = Engine(target, make(), k=4, eos_ids=(), fixed_k=True).generate(batch, sp)
                assert [o.tokens for o in outs] == want[: len(batch)], name
                accepted += sum(o.stats.accepted for o in outs)
    assert accepted > 0  # (speculation happened: the target as its own draft is always right)


# -- EAGLE and Medusa heads trained on a family's target --------------------------------------------
@pytest.mark.parametrize("stem", ["gemma3", "phi3-longrope"])
def test_eagle_and_medusa_heads_train_on_a_family_target_and_draft_exactly(gguf_dir, tmp_path, stem):
    from specdec.drafters.eagle import EagleDrafter, load_eagle
    from specdec.drafters.medusa import MedusaDrafter, load_medusa
    from specdec.engine import Engine
    from specdec.models.loader import load_model
    from specdec.train.eagle import EagleTrainConfig, train_eagle
    from specdec.train.medusa import MedusaTrainConfig, train_medusa

    tg = load_model(str(tiny(gguf_dir, stem)), quiet=True, with_tokenizer=False)
    data = tmp_path / "data"
    data.mkdir()
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(0, VOCAB, (40,), generator=g).tolist(), 10, torch.randint(0, VOCAB, (30, 4), generator=g),
             torch.zeros(30, 4)) for _ in range(20)]
    torch.save(rows, data / "shard_0000.pt")
    train_eagle(tg, tmp_path / "eagle", EagleTrainConfig(steps=3, batch_rows=4, seq_len=16, head_vocab=40,
                                                         save_every=3), data=data, quiet=True)
    train_medusa(tg, tmp_path / "medusa", MedusaTrainConfig(num_heads=2, steps=3, batch_rows=4, seq_len=16,
                                                            head_vocab=40, tree_nodes=4, topk=2), data, quiet=True)
    prompt = rows[0][0][:12]
    sp = SamplingParams(max_new_tokens=16)
    want = Engine(tg.model, None, k=0, eos_ids=()).generate([prompt], sp)[0].tokens
    head, head_meta = load_eagle(tmp_path / "eagle", tg)
    heads, heads_meta = load_medusa(tmp_path / "medusa", tg)
    drafters = {"eagle tree": lambda: EagleDrafter(head, tg.model, head_meta["vocab_subset"], tree=True, depth=3,
                                                   width=2, nodes=5),
                "eagle chain": lambda: EagleDrafter(head, tg.model, head_meta["vocab_subset"], tree=False),
                "medusa tree": lambda: MedusaDrafter(heads, tg.model, heads_meta["vocab_subset"],
                                                     [tuple(x) for x in heads_meta["tree"]])}
    with one_thread():
        for name, make in drafters.items():
            [r] = Engine(tg.model, make(), k=3, eos_ids=(), fixed_k=True).generate([prompt], sp)
            assert r.tokens == want, name


# -- tokens and templates ---------------------------------------------------------------------------
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
                  "else m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# a template that opens or closes a thinking block as Qwen3's does: the reasoning of earlier
# answers dropped, an empty block when thinking is switched off
THINKING_TEMPLATE = (
    "{%- for m in messages %}{%- set content = m['content'] %}"
    "{%- if m['role'] == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}")


def test_gemmas_end_of_turn_stops_and_its_template_renders_as_transformers_renders_it(gguf_dir):
    from transformers import AutoTokenizer

    from specdec.text import encode_prompt

    path = tiny(gguf_dir, "gemma3", chat_template=GEMMA_TEMPLATE, specials=("<start_of_turn>", "<end_of_turn>"))
    lm = load(path, tokenizer=True)
    end = lm.tokenizer.encode("<end_of_turn>", add_special_tokens=False)
    assert len(end) == 1 and end[0] == VOCAB + 1 and end[0] in lm.eos_ids
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    msgs = [{"role": "user", "content": "the theater "}, {"role": "assistant", "content": "on the street"},
            {"role": "user", "content": "at 3"}]
    want = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert encode_prompt(lm.tokenizer, msgs, chat=True) == list(want)
    # a Qwen3 file's <|im_end|> (its end of turn) stops it too
    assert 268 in load(tiny(gguf_dir, "qwen3"), tokenizer=True).eos_ids


def test_a_thinking_template_renders_as_transformers_renders_it(gguf_dir):
    from transformers import AutoTokenizer

    path = tiny(gguf_dir, "qwen3", chat_template=THINKING_TEMPLATE)
    lm = load(path, tokenizer=True)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    msgs = [{"role": "user", "content": "the theater"},
            {"role": "assistant", "content": "<think>\nwhere is it</think>\n\non the street"},
            {"role": "user", "content": "at 3"}]
    text = lm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert "where is it" not in text and text.endswith("<|im_start|>assistant")


# -- one clear line each -------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,kw,match", [
    ("qwen3moe", {}, r"architecture 'qwen3moe' is not supported \(supported: llama, mistral3, qwen2, qwen3, gemma2, "
                     r"gemma3, phi3;"),
    ("gemma3", {"rope_scaling": {"type": "longrope", "factor": 4.0}},
     r"RoPE scaling 'longrope' \(gemma3\.rope\.scaling\.type\) is not supported"),
    ("qwen3", {"rotary_dim": 32}, r"rotary embeddings over 32 of 64 dimensions a head \(partial rotation\) are not "
                                  r"supported in qwen3 files"),
    ("phi3", {"meta": {"expert_count": 16}}, r"a mixture of experts \(phi3\.expert_count = 16\) is not supported"),
])
def test_an_unsupported_variant_is_one_line(tmp_path, monkeypatch, arch, kw, match):
    from specdec.models import gguf_file

    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, Q8_0, layers=1, **kw)

    def no_block_reads(self, t):
        raise AssertionError(f"read the blocks of {t.name} before refusing")

    monkeypatch.setattr(gguf_file.GGUFFile, "check_tensor", no_block_reads)
    with pytest.raises(SpecdecError, match=match) as e:
        load(path)
    assert "\n" not in str(e.value)


def test_a_folder_variant_the_native_model_does_not_compute_is_named(tmp_path):
    from transformers import Gemma3TextConfig

    from specdec.models.llama import native_support_problem

    cfg = Gemma3TextConfig(**COMMON, head_dim=32, use_bidirectional_attention=True)
    assert native_support_problem(cfg) == "bidirectional attention (an embedding model)"
    cfg = Gemma3TextConfig(**COMMON, head_dim=32, hidden_activation="gelu")
    assert native_support_problem(cfg) == "activation 'gelu' in a gemma3_text model"
