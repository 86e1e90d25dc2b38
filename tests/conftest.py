"""Fixtures and hooks for the whole suite: tiny model pairs (tests/model_helpers.py builds
them), the default model and its transformers twin, one torch thread per module, and the
batch guard bypassed unless a test is marked `real_guard`. Shared functions live in the helper
modules beside this file (helpers.py, model_helpers.py, server_helpers.py, gguf_helpers.py,
oracle.py, tiny_gguf.py, gguf_random.py, fake_peers.py, suffix_reference.py), which the test
folders (unit, engine, server, e2e) import by name: tests/ is on sys.path through this file."""

from __future__ import annotations

import os

import pytest
import torch

from model_helpers import FAMILIES, Pair, get_pair

# What `specdec generate` learned in earlier runs (specdec/learned.py) must not carry from one
# test to the next, nor from the user's own runs: off for the whole suite (its subprocesses too);
# tests/unit/test_learned.py points it at a file of its own.
os.environ["SPECDEC_LEARNED"] = "0"


@pytest.fixture(params=FAMILIES)
def pair(request) -> Pair:
    return get_pair(request.param)


@pytest.fixture
def llama_pair() -> Pair:
    return get_pair("llama")


@pytest.fixture
def qwen_pair() -> Pair:
    return get_pair("qwen2")


@pytest.fixture(scope="module")
def one_thread_per_module():
    """One intra-op torch thread for a whole test module (oracle.one_thread): the models are tiny."""
    from oracle import one_thread

    with one_thread():
        yield


@pytest.fixture(scope="session")
def default_model():
    """The embedded SmolLM2-135M default, computed from its GGUF file in place."""
    from specdec.models.loader import load_model

    return load_model(quiet=True)


@pytest.fixture(scope="session")
def default_model_float_path():
    """The default model on the float path (SPECDEC_GGUF_ACT8=0): its projections and head the
    float32 products of the file's dequantised weights, as transformers computes them."""
    from specdec.models.loader import load_model

    before = os.environ.get("SPECDEC_GGUF_ACT8")
    os.environ["SPECDEC_GGUF_ACT8"] = "0"
    try:
        return load_model(quiet=True)
    finally:
        if before is None:
            del os.environ["SPECDEC_GGUF_ACT8"]
        else:
            os.environ["SPECDEC_GGUF_ACT8"] = before


@pytest.fixture(scope="session")
def default_hf_folder(default_model, tmp_path_factory):
    """The default model as a Hugging Face folder without weights: config.json as transformers
    reads it from the GGUF file, and the tokenizer folder specdec converted from the file's
    metadata (what tokenizer and config tests compare against transformers)."""
    import shutil
    from pathlib import Path

    from transformers import AutoConfig

    from specdec.models.gguf_file import GGUFFile
    from specdec.models.loader import cache_root
    from specdec.models.tokenizer import tokenizer_folder

    gguf = Path(default_model.gguf)
    folder = tmp_path_factory.mktemp("default-hf")
    for f in tokenizer_folder(GGUFFile(gguf), cache_root() / "tokenizers").iterdir():
        shutil.copy(f, folder / f.name)
    AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def default_hf_model(default_model):
    """transformers' own float32 model of the default GGUF file (its GGUF reader dequantises it)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    gguf = Path(default_model.gguf)
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.fixture(autouse=True)
def _batches_always_speculate(request, monkeypatch):
    """Exactness tests run batches through the speculative path on every step: the engine's
    BatchGuard (which falls back to plain steps where speculation does not pay, as it does
    not on these tiny models) is bypassed unless a test is marked `real_guard`."""
    if request.node.get_closest_marker("real_guard") is None:
        from specdec.policy import BatchGuard

        monkeypatch.setattr(BatchGuard, "speculate", lambda self, rows: True)
