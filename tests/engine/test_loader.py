"""Model loading: clear errors for bad inputs, native vs adapter choice, the default model."""

from __future__ import annotations

import os
import time

import pytest
import torch

from model_helpers import TOL, build_hf, randomize_
from specdec.models.loader import load_model
from specdec.types import SamplingParams, SpecdecError


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    d = tmp_path / "specdec-cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(d))
    return d


# -- errors ---------------------------------------------------------------------------------
def test_nonexistent_path(tmp_cache):
    with pytest.raises(SpecdecError, match="/nonexistent/path"):
        load_model("/nonexistent/path", quiet=True)


def test_random_bytes_gguf_is_not_gguf(tmp_path, tmp_cache):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"\x89RND" + os.urandom(4092))  # random bytes, certainly not the GGUF magic
    with pytest.raises(SpecdecError, match="not a GGUF"):
        load_model(str(f), quiet=True)


def test_garbage_after_gguf_magic(tmp_path, tmp_cache):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(SpecdecError, match="truncated or its GGUF header is corrupt") as e:
        load_model(str(f), quiet=True)
    assert "\n" not in str(e.value)
    assert not list(tmp_cache.rglob("*"))  # nothing written (the file is read in place)


def test_dir_without_config(tmp_path, tmp_cache):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecdecError, match="config.json"):
        load_model(str(tmp_path / "empty"), quiet=True)


def test_dir_without_weights(tmp_path, tmp_cache):
    hf = build_hf("llama")
    hf.config.save_pretrained(str(tmp_path / "m"))
    with pytest.raises(SpecdecError, match="no weights"):
        load_model(str(tmp_path / "m"), quiet=True)


def test_hub_id_offline_says_model_flag(tmp_path, tmp_cache, monkeypatch):
    monkeypatch.chdir(tmp_path)  # so "nobody/does-not-exist" is not a relative folder
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    from huggingface_hub import constants

    # the hub library reads the env var at import; make the running process offline too
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(SpecdecError, match="--model"):
        load_model("nobody/does-not-exist", quiet=True)


# -- HF directories ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "llama_tied", "qwen2"])
def test_llama_dir_loads_native(tmp_path, tmp_cache, family):
    hf = build_hf(family, seed=3)
    hf.save_pretrained(str(tmp_path / "m"))
    lm = load_model(str(tmp_path / "m"), quiet=True)
    assert lm.backend == "native"
    toks = torch.randint(0, hf.config.vocab_size, (1, 15), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(input_ids=toks, use_cache=False).logits
    logits, _ = lm.model(toks, torch.arange(15)[None], lm.model.new_cache(1, 32))
    assert (logits - ref).abs().max().item() <= TOL


def test_safetensors_are_read_one_tensor_at_a_time_as_safetensors_reads_them(tmp_path):
    """The loader's own reader (each tensor read when asked for, so a model's weights do not all
    sit in memory beside its parameters) gives what safetensors' load_file gives, every dtype a
    checkpoint holds; a truncated file is a clear error, not garbage weights."""
    from safetensors.torch import load_file, save_file

    from specdec.models.loader import _read_state_dict

    g = torch.Generator().manual_seed(4)
    tensors = {"a": torch.randn(3, 5, generator=g), "b.half": torch.randn(7, generator=g).half(),
               "c": torch.randn(2, 2, generator=g).bfloat16(), "d": torch.arange(6).view(2, 3),
               "e": torch.tensor(1.5), "f": torch.zeros(0, 4), "g": torch.tensor([True, False])}
    save_file(dict(list(tensors.items())[:4]), str(tmp_path / "model-1.safetensors"), metadata={"format": "pt"})
    save_file(dict(list(tensors.items())[4:]), str(tmp_path / "model-2.safetensors"))
    lazy = _read_state_dict(tmp_path)
    ref = {**load_file(str(tmp_path / "model-1.safetensors")), **load_file(str(tmp_path / "model-2.safetensors"))}
    assert sorted(lazy) == sorted(ref) == sorted(tensors)
    for k, v in ref.items():
        assert lazy[k].dtype == v.dtype and lazy[k].shape == v.shape and torch.equal(lazy[k], v), k
    f = tmp_path / "model-1.safetensors"
    f.write_bytes(f.read_bytes()[:-8])
    with pytest.raises(SpecdecError, match="truncated"):
        [_read_state_dict(tmp_path)[k] for k in ("a", "b.half", "c", "d")]  # the file's last tensor is cut


@pytest.fixture
def gpt2_dir(tmp_path, tmp_cache):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                     bos_token_id=99, eos_token_id=99)
    hf = randomize_(GPT2LMHeadModel(cfg), seed=1).eval()
    hf.save_pretrained(str(tmp_path / "gpt2"))
    return hf, tmp_path / "gpt2"


def test_gpt2_dir_uses_adapter(gpt2_dir):
    hf, d = gpt2_dir
    lm = load_model(str(d), quiet=True)
    assert lm.backend == "transformers-adapter"
    assert lm.model.vocab_size == 100 and lm.model.max_context == 64
    toks = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        ref = hf(input_ids=toks, use_cache=False).logits
    cache = lm.model.new_cache(1, 32)
    logits, _ = lm.model(toks[:, :4], torch.arange(4)[None], cache)
    assert (logits - ref[:, :4]).abs().max().item() <= TOL
    logits, _ = lm.model(toks[:, 4:], torch.tensor([[4]]), cache)
    assert (logits - ref[:, 4:]).abs().max().item() <= TOL
    with pytest.raises(SpecdecError):
        lm.model.new_cache(2, 32)  # one row per cache


def test_gpt2_adapter_truncate_then_refeed(gpt2_dir):
    hf, d = gpt2_dir
    lm = load_model(str(d), quiet=True)
    toks = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    with torch.no_grad():
        ref = hf(input_ids=toks, use_cache=False).logits
    cache = lm.model.new_cache(1, 32)
    lm.model(torch.tensor([[1, 2, 3, 9, 9]]), torch.arange(5)[None], cache)
    cache.truncate(3)  # drop the two wrong tokens
    assert cache.lengths.tolist() == [3]
    logits, _ = lm.model(toks[:, 3:], torch.arange(3, 7)[None], cache)
    assert (logits - ref[:, 3:]).abs().max().item() <= TOL


def test_gpt2_engine_matches_hf_greedy(gpt2_dir):
    from specdec.engine import Engine

    hf, d = gpt2_dir
    lm = load_model(str(d), quiet=True)
    prompt = [1, 2, 3]
    out = Engine(lm.model, eos_ids=()).generate([prompt], SamplingParams(max_new_tokens=10))[0].tokens
    ref = hf.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, 3, dtype=torch.long), max_new_tokens=10,
        min_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0,
    )[0, 3:].tolist()
    assert len(ref) == 10
    assert out == ref
    # rows of a batch run one by one through the adapter and give the same tokens
    outs = Engine(lm.model, eos_ids=()).generate([prompt, [5, 6, 7, 8]], SamplingParams(max_new_tokens=10))
    assert outs[0].tokens == ref and len(outs[1].tokens) == 10


# -- the default model ------------------------------------------------------------------------
@pytest.mark.default_model
def test_default_model_second_load_is_fast(default_model):
    t0 = time.perf_counter()
    lm = load_model(quiet=True)
    assert time.perf_counter() - t0 < 5.0
    assert lm.backend == "native"
    assert lm.tokenizer is not None and lm.tokenizer.eos_token_id is not None
    assert lm.tokenizer.eos_token_id in lm.eos_ids
    assert lm.tokenizer.chat_template is not None
    assert lm.model.vocab_size == 49152 and lm.model.cfg.num_layers == 30


@pytest.mark.default_model
def test_default_model_keeps_no_fp32_copies(default_model):
    """The default model computes from its GGUF file's bytes: no projection holds a float weight,
    the products read views of the file's memory map, and a forward builds no float embedding
    table (only drafters that read it ask for one); the model still computes."""
    lm = default_model
    m = lm.model
    assert lm.gguf is not None and getattr(m, "gguf_native", False)
    lins = [lin for blk in m.layers for lin in (blk.wqkv, blk.wo, blk.w_gate_up, blk.w_down)] + [m.head]
    assert all(lin.weight is None and lin.packed is None for lin in lins)
    fresh = load_model(quiet=True).model
    logits, _ = fresh(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], fresh.new_cache(1, 8))
    assert torch.isfinite(logits).all() and logits.shape == (1, 3, 49152)
    assert fresh.embed._weight is None
    mapped = fresh.gguf.bytes
    lo, hi = mapped.ctypes.data, mapped.ctypes.data + mapped.nbytes
    lins = [lin for blk in fresh.layers for lin in (blk.wqkv, blk.wo, blk.w_gate_up, blk.w_down)] + [fresh.head]
    assert all(lo <= p[0].data_ptr() < hi for lin in lins for p in lin.parts)


@pytest.mark.default_model
def test_the_eagle_drafter_reads_embedding_and_head_rows_without_a_float_table(default_model):
    """auto's EAGLE drafter on a GGUF target (the default model) builds no float32 table of the
    whole vocabulary (113 MB here, ~0.9 GB for a 1.5B Qwen): it looks tokens up through the
    target's embedding and reads its vocabulary subset's head rows alone, with the numbers of the
    whole table's rows (the oracle: lm_head_weight(), built after the check)."""
    from specdec.config import SpecConfig
    from specdec.methods import sources_for

    lm = load_model(quiet=True)
    d = next(s for s in sources_for(SpecConfig(), lm)[0] if s.label == "eagle")
    assert lm.model.embed._weight is None
    table = lm.model.lm_head_weight()  # (tied: the embedding table)
    assert d.subset is not None and torch.equal(d.W, table[d.subset])
    ids = torch.tensor([[0, 17, 49151], [5, 5, 300]])
    assert torch.equal(d.embed(ids), table[ids])


@pytest.mark.default_model
def test_default_model_named_by_its_path_is_the_default(default_model):
    """--model pointing at the default's own GGUF gets the default's shipped drafters (auto's
    EAGLE head, the draft), as when --model is left out; and in bfloat16 the shipped heads
    still recognise it (their recorded hash rounds the LM head to bfloat16)."""
    from specdec.drafters.eagle import default_eagle_for, load_eagle
    from specdec.drafters.medusa import default_medusa_for, load_medusa
    from specdec.models.loader import default_draft_for, default_model_path

    lm = load_model(str(default_model_path()), quiet=True)
    assert lm.source == "default" and default_eagle_for(lm) is not None and default_draft_for(lm) is not None
    bf = load_model(None, dtype=torch.bfloat16, quiet=True)
    load_eagle(default_eagle_for(bf), bf)  # no "trained for another target" error
    load_medusa(default_medusa_for(bf), bf)
    # and auto drafts with the head on the bf16 target (its fp32 rotary table promoted q/k, and
    # writing them into the bf16 cache failed before)
    from specdec.config import SpecConfig
    from specdec.engine import Engine
    from specdec.methods import sources_for
    from specdec.types import SamplingParams

    ids = bf.tokenizer.encode("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n")
    engine = Engine(bf.model, sources_for(SpecConfig(), bf)[0], k=8, eos_ids=())
    engine.policy.eager = True  # every source drafts every other step
    [r] = engine.generate([ids], SamplingParams(max_new_tokens=24))
    assert len(r.tokens) == 24 and r.stats.proposed > 0 and r.stats.sources.get("eagle", [0])[0] > 0
