"""The default model's plain greedy decoding, one code tree against another, interleaved.

Each repeat runs, for every tree given, a fresh process (`--child`) that loads the default model
with that tree's specdec (PYTHONPATH), decodes every prompt greedily for --max-new-tokens tokens
(EOS ignored) with --threads threads, and reports its load time, tokens/s per prompt and the
tokens. Trees alternate within each repeat so machine drift hits both alike; medians over the
repeats are reported, and whether the trees' greedy tokens agree.

    python benchmarks/gguf_default_ab.py --trees /work/main /work/wt/realmodels --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

PROMPTS = [
    "def quicksort(arr):",
    "Write a short poem about the sea.",
    "import numpy as np\n\ndef moving_average(x, n):",
    "The three most important things to know about photosynthesis are",
]


def child(max_new: int, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    from specdec.engine import Engine
    from specdec.models.loader import load_model
    from specdec.types import SamplingParams

    t0 = time.perf_counter()
    lm = load_model(quiet=True)
    load_s = time.perf_counter() - t0
    sp = SamplingParams(max_new_tokens=max_new)
    eng = Engine(lm.model, None, k=0, eos_ids=())
    eng.generate([lm.tokenizer.encode("warm up")], SamplingParams(max_new_tokens=8))
    rates, toks = [], []
    for p in PROMPTS:
        ids = lm.tokenizer.encode(p)
        t = time.perf_counter()
        [r] = eng.generate([ids], sp)
        rates.append(len(r.tokens) / (time.perf_counter() - t))
        toks.append(r.tokens)
    print(json.dumps({"load_s": load_s, "tok_s": rates, "tokens": toks, "weights": lm.weights}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", default=[], help="repository roots to compare")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.max_new_tokens, a.threads)
    if not a.trees:
        ap.error("--trees: give one or more repository roots")
    runs: dict[str, list[dict]] = {t: [] for t in a.trees}
    for _ in range(a.repeats):
        for tree in a.trees:
            env = dict(os.environ, PYTHONPATH=tree)
            out = subprocess.run([sys.executable, __file__, "--child", "--max-new-tokens", str(a.max_new_tokens),
                                  "--threads", str(a.threads)], env=env, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{tree}: {out.stderr.strip()[-800:]}")
            runs[tree].append(json.loads(out.stdout.strip().splitlines()[-1]))
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    print(f"CPU: {cpu}; threads {a.threads}; {len(PROMPTS)} prompts x {a.max_new_tokens} tokens; "
          f"{a.repeats} repeats (medians)")
    print(f"{'tree':40s} {'load s':>8s} {'tok/s':>8s}  weights")
    ref = runs[a.trees[0]][0]["tokens"]
    summary = {}
    for tree, rs in runs.items():
        load = statistics.median(r["load_s"] for r in rs)
        rate = statistics.median(statistics.median(r["tok_s"]) for r in rs)
        same = all(r["tokens"] == ref for r in rs)
        summary[tree] = {"load_s": load, "tok_s": rate, "tokens_equal_first_tree": same}
        print(f"{tree:40s} {load:8.2f} {rate:8.2f}  {rs[0]['weights']}  tokens equal to {a.trees[0]}'s: {same}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
