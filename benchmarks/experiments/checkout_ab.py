"""Two checkouts of specdec on the same prompts: `generate`'s decode tokens/s per method and
sampling mode, interleaved (a fresh process per checkout and repeat), medians of the repeats,
and whether the two checkouts commit the same tokens (greedy, and seeded sampling with
deterministic guesses, must). Prints one line per cell, then one JSON document.

What moving `generate` onto the server's scheduler changed (issue 32):

    git worktree add --detach /tmp/before d89eba5
    python benchmarks/experiments/checkout_ab.py /tmp/before . --repeats 3

Prompts: the first --per-category prompts of every dev-set category plus the first
--humaneval HumanEval prompts, each sent alone (batch 1) and all at once (--batched).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

RUN = r'''
import json, sys, time, torch
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
sys.path.insert(0, args["bench_dir"])
from devset import DEV_SET
from specdec.bench.tasks import load_humaneval, load_jsonl, select
from specdec.config import SpecConfig, build_engine
from specdec.models.loader import load_model
from specdec.text import encode_prompt
from specdec.types import SamplingParams
target = load_model(None, quiet=True)
tasks = select(load_jsonl(str(DEV_SET)), None, args["per_category"]) + load_humaneval()[: args["humaneval"]]
prompts = [encode_prompt(target.tokenizer, t.prompt, t.chat) for t in tasks]
out = {}
for method in args["methods"]:
    for sampling in args["samplings"]:
        params = SamplingParams(max_new_tokens=args["max_new_tokens"], **(
            {} if sampling == "greedy" else {"temperature": 0.7, "seed": 1}))
        engine = build_engine(SpecConfig(method=method), target)
        engine.generate([prompts[0]], SamplingParams(max_new_tokens=8))  # warm the kernels and caches
        tokens, seconds, texts = 0, 0.0, []
        batches = [prompts] if args["batched"] else [[p] for p in prompts]
        for batch in batches:
            t0 = time.perf_counter()
            results = engine.generate(batch, params)
            seconds += time.perf_counter() - t0
            tokens += sum(len(r.tokens) for r in results)
            texts += [r.tokens for r in results]
        out[f"{method} {sampling}"] = {"tok_s": tokens / seconds, "tokens": texts}
print(json.dumps(out))
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", help="the checkout to compare against (a git worktree)")
    ap.add_argument("new", help="the checkout under test")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default="none,ngram,auto")
    ap.add_argument("--samplings", default="greedy,t0.7", help="greedy and/or t0.7 (temperature 0.7, seed 1)")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--humaneval", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batched", action="store_true", help="send all prompts as one batch")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    trees = [os.path.abspath(args.old), os.path.abspath(args.new)]
    spec = {"threads": args.threads, "methods": args.methods.split(","), "samplings": args.samplings.split(","),
            "per_category": args.per_category, "humaneval": args.humaneval, "max_new_tokens": args.max_new_tokens,
            "batched": args.batched, "bench_dir": str(Path(__file__).resolve().parents[1])}
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    for _ in range(args.repeats):
        for tree in trees:
            env = dict(os.environ, PYTHONPATH=tree)
            done = subprocess.run([sys.executable, "-c", RUN, json.dumps(spec)], env=env, cwd="/tmp",
                                  capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"{tree}: {done.stderr.strip().splitlines()[-1]}")
            runs[tree].append(json.loads(done.stdout.strip().splitlines()[-1]))
    report = {}
    for cell in runs[trees[0]][0]:
        old = statistics.median(r[cell]["tok_s"] for r in runs[trees[0]])
        new = statistics.median(r[cell]["tok_s"] for r in runs[trees[1]])
        same = all(r[cell]["tokens"] == runs[trees[0]][0][cell]["tokens"] for t in trees for r in runs[t])
        report[cell] = {"old_tok_s": round(old, 1), "new_tok_s": round(new, 1), "ratio": round(new / old, 3),
                        "same_tokens": same}
        print(f"{cell:20s} old {old:7.1f}  new {new:7.1f} tok/s  new/old {new / old:5.2f}  same tokens: {same}")
    print(json.dumps({"args": vars(args), "cells": report}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
