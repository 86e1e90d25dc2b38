"""Peer engines for `specdec bench`: the same prompts through other people's decoders.

* transformers `generate` on the same fp32 weights: plain (`hf`), its prompt-lookup
  decoding (`hf-lookup`, `prompt_lookup_num_tokens=k`), and assisted generation with the
  same draft model specdec uses (`hf-assist`, `assistant_model=`, transformers' own
  schedule for the number of assistant tokens).
* llama.cpp through llama-cpp-python on the model's GGUF file: plain (`llamacpp`) and its
  prompt-lookup drafter (`llamacpp-lookup`, `LlamaPromptLookupDecoding(num_pred_tokens=k)`).
  Both engines read the same file's blocks with 8-bit activations, but round and sum in their
  own ways, so greedy texts may part after a near-tie; the report says how far they agree.

Each peer is a `Peer` with `generate(ids, params) -> list[int]` (new token ids, EOS
included if it was produced). A peer that cannot be built (package missing, no GGUF file)
carries `error` and is reported as skipped; one that fails mid-run is reported as failed
with the error. This module knows nothing about tables or categories.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PEERS = ("hf", "hf-lookup", "hf-assist", "llamacpp", "llamacpp-lookup")


class Peer:
    kind = "peer"

    def __init__(self, name: str, error: str | None = None) -> None:
        self.name = name
        self.error = error  # set when the peer cannot run at all (skipped)

    def generate(self, ids: list[int], params) -> list[int]:
        raise NotImplementedError


class HFPeer(Peer):
    """transformers `generate` with the given extra keyword arguments."""

    def __init__(self, name: str, model, eos_ids, extra: dict | None = None) -> None:
        super().__init__(name)
        self.model = model
        self.eos_ids = list(eos_ids)
        self.extra = extra or {}

    def generate(self, ids, params):
        import torch

        kw = dict(max_new_tokens=params.max_new_tokens, eos_token_id=self.eos_ids or None,
                  pad_token_id=self.eos_ids[0] if self.eos_ids else 0)
        if params.greedy:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kw.update(do_sample=True, temperature=params.temperature, top_p=params.top_p,
                      top_k=params.top_k or None, min_p=params.min_p or None)
            if params.seed is not None:
                torch.manual_seed(params.seed)
        inp = torch.tensor([ids], dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(inp, attention_mask=torch.ones_like(inp), **kw, **self.extra)
        return out[0, len(ids):].tolist()


class LlamaCppPeer(Peer):
    """llama-cpp-python's `Llama.generate` over token ids (optionally with prompt lookup)."""

    def __init__(self, name: str, gguf: Path, threads: int, n_ctx: int, lookup_k: int | None, eos_ids) -> None:
        super().__init__(name)
        from llama_cpp import Llama

        draft = None
        if lookup_k:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_k)
        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         verbose=False, draft_model=draft, logits_all=draft is not None)
        self.eos_ids = set(int(e) for e in eos_ids) | {int(self.llm.token_eos())}

    def generate(self, ids, params):
        self.llm.reset()
        out: list[int] = []
        kw = dict(top_k=1, temp=0.0) if params.greedy else dict(
            temp=params.temperature, top_p=params.top_p, top_k=params.top_k or 0, min_p=params.min_p or 0.0)
        if not params.greedy and params.seed is not None:
            self.llm.set_seed(params.seed)
        for tok in self.llm.generate(ids, reset=True, **kw):
            out.append(int(tok))
            if tok in self.eos_ids or len(out) >= params.max_new_tokens:
                break
        return out


def build_peers(names: list[str], target, draft_dir: Path | None, k: int, threads: int, n_ctx: int) -> list[Peer]:
    """Build the requested peers; a peer that cannot be built is returned with `error` set."""
    out: list[Peer] = []
    hf_model = None
    for name in names:
        if name.startswith("hf"):
            try:
                if hf_model is None:
                    hf_model = _hf_model(target.path)
                if name == "hf":
                    out.append(HFPeer(name, hf_model, target.eos_ids))
                elif name == "hf-lookup":
                    out.append(HFPeer(name, hf_model, target.eos_ids, {"prompt_lookup_num_tokens": k}))
                else:
                    if draft_dir is None:
                        out.append(Peer(name, "no draft model for this target: pass --draft PATH"))
                        continue
                    out.append(HFPeer(name, hf_model, target.eos_ids, {"assistant_model": _hf_model(draft_dir)}))
            except Exception as e:  # a peer that cannot load must not stop the benchmark
                out.append(Peer(name, f"transformers could not load the model: {type(e).__name__}: {e}"))
        else:
            if importlib.util.find_spec("llama_cpp") is None:
                out.append(Peer(name, "llama-cpp-python is not installed (pip install -e '.[peers]'; it compiles "
                                      "llama.cpp, about 5 minutes on two cores)"))
                continue
            gguf = getattr(target, "gguf", None)
            if gguf is None:
                out.append(Peer(name, "the target was not loaded from a GGUF file, so llama.cpp has nothing to run"))
                continue
            try:
                out.append(LlamaCppPeer(name, Path(gguf), threads, n_ctx, k if name == "llamacpp-lookup" else None,
                                        target.eos_ids))
            except Exception as e:
                out.append(Peer(name, f"llama.cpp could not load {gguf}: {type(e).__name__}: {e}"))
    return out


def _hf_model(path):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    p = Path(path)
    if p.is_file():  # a GGUF file (the native model reads it in place): transformers' own GGUF loading
        m = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    else:
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    m.generation_config.pad_token_id = m.generation_config.pad_token_id or 0
    return m
