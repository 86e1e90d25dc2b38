"""The default method against plain decoding, cell by cell: `auto` / `none` time per category,
greedy and sampled, short and long answers, one request at a time and batched.

What a user gets from `specdec generate` calls: each auto request starts from what the previous
one of the same sampling mode learned (as learned.json carries it between calls, greedy and
sampled runs apart; "saved"), or from nothing with --how fresh (`--fresh`, a first call). Per repeat and cell, plain decoding and auto run
interleaved on the same prompts; time is the whole `generate` call (prefill included, the
drafter's construction not). Batch 1 sends a category's prompts one by one; batched sends
them as one batch. A cell's ratio is auto's tokens per second / none's (>= 1: auto is faster),
from the medians over repeats of each cell's generated tokens / summed times; its paired ratio is
the median of the repeats' own ratios (each repeat runs both next to each other, so the machine's
drift between repeats cancels). Every cell also
checks that auto's tokens equal plain decoding's (the sampled cells are seeded, and auto's
guesses are deterministic: it commits plain sampling's text). Prints the table, then one JSON
document as the last line.

    python benchmarks/auto_vs_none.py --per-category 2 --humaneval 2 --repeats 3 --threads 2
    python benchmarks/auto_vs_none.py --categories qa,writing --lengths 32 --samplings greedy --batching 1
    python benchmarks/auto_vs_none.py --model ~/.cache/specdec/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --draft ~/.cache/specdec/models/qwen2.5-coder-0.5b-instruct.gguf --lengths 96 --batching 1  # auto --draft
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from devset import DEV_SET

DEFAULT_DATA = DEV_SET


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="Spec-Bench style JSONL. Default: the shared dev set")
    ap.add_argument("--categories", default=None, help="comma-separated categories of --data. Default: all")
    ap.add_argument("--per-category", type=int, default=2, help="prompts per category. Default: 2")
    ap.add_argument("--humaneval", type=int, default=2, help="first N HumanEval prompts (0: none). Default: 2")
    ap.add_argument("--lengths", default="32,256", help="comma-separated --max-new-tokens. Default: 32,256")
    ap.add_argument("--samplings", default="greedy,t0.7", help="greedy and/or t0.7 (temperature 0.7, seed 1)")
    ap.add_argument("--batching", default="1,all", help="1 (one prompt at a time) and/or all (a category at once)")
    ap.add_argument("--how", default="saved", choices=("saved", "fresh"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="target: a .gguf file or model folder. Default: the embedded model")
    ap.add_argument("--draft", default=None,
                    help="a draft model for auto (auto --draft: prompt lookup beside it), loaded once. "
                         "Default: auto's own choice for the target")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specdec.bench.tasks import load_humaneval, load_jsonl, select
    from specdec.config import SpecConfig, build_engine
    from specdec.models.loader import load_model
    from specdec.text import encode_prompt
    from specdec.types import SamplingParams

    target = load_model(args.model, quiet=True)
    auto_config = SpecConfig(method="auto")
    draft_lm = None
    if args.draft:  # loaded once, not per request (a CLI call would load it each time)
        draft_lm = load_model(args.draft, dtype=target.model.dtype, quiet=True, pack=False)

    def auto_engine():
        if draft_lm is None:
            return build_engine(auto_config, target)
        from specdec.drafters.ngram import NgramDrafter
        from specdec.engine import Engine
        from specdec.methods import draft_source

        sources = [NgramDrafter(), draft_source(target, draft_lm, lazy=True)]
        return Engine(target.model, sources, k=max(auto_config.method_k(), 1), eos_ids=target.eos_ids)

    cats = args.categories.split(",") if args.categories else None
    tasks = select(load_jsonl(args.data), cats, args.per_category) if args.per_category > 0 else []
    tasks += load_humaneval()[: args.humaneval]
    groups: dict[str, list[list[int]]] = {}
    for t in tasks:
        groups.setdefault(t.category, []).append(encode_prompt(target.tokenizer, t.prompt, t.chat))
    samplings = {"greedy": {}, "t0.7": {"temperature": 0.7, "seed": 1}}
    cells = [(c, s, n, b) for c in groups for s in args.samplings.split(",") for n in map(int, args.lengths.split(","))
             for b in args.batching.split(",")]
    plain = build_engine(SpecConfig(method="none"), target)
    saved = {}  # per sampling mode: what its last auto request learned (JSON, as on disk)
    times = {(cell, m): [] for cell in cells for m in ("none", "auto")}
    rates = {(cell, m): [] for cell in cells for m in ("none", "auto")}
    unequal = []
    for _ in range(args.repeats):
        for cell in cells:
            cat, samp, n, batching = cell
            params = SamplingParams(max_new_tokens=n, **samplings[samp])
            batches = [[p] for p in groups[cat]] if batching == "1" else [groups[cat]]
            plain_tokens = []  # per batch: plain decoding's tokens, the oracle for auto's greedy output
            for method in ("none", "auto"):
                total, tokens = 0.0, 0
                for b, batch in enumerate(batches):
                    eng = plain if method == "none" else auto_engine()
                    t0 = time.perf_counter()
                    if method == "auto" and args.how == "saved" and samp in saved:
                        eng.relearn(json.loads(saved[samp]))  # timed: a CLI call reads the file too
                    out = eng.generate(batch, params)
                    total += time.perf_counter() - t0
                    tokens += sum(len(r.tokens) for r in out)
                    if method == "auto":
                        if args.how == "saved":
                            saved[samp] = json.dumps(eng.learned())
                        if [r.tokens for r in out] != plain_tokens[b]:
                            unequal.append(cell)
                    else:
                        plain_tokens.append([r.tokens for r in out])
                times[(cell, method)].append(total)
                rates[(cell, method)].append(tokens / total)
            print(f"{cat} {samp} {n} batch {batching}: none {rates[(cell, 'none')][-1]:.1f} tok/s, "
                  f"auto {rates[(cell, 'auto')][-1]:.1f} tok/s", file=sys.stderr, flush=True)
    print(f"auto vs none ({args.how}), threads {args.threads}, medians of {args.repeats}; "
          "ratio = auto tokens/s / none tokens/s; paired = the median of each repeat's ratio (auto and none "
          "ran next to each other, so the machine's drift between repeats cancels)")
    print(f"{'category':16} {'sampling':8} {'tokens':>6} {'batch':>5} {'none t/s':>8} {'auto t/s':>8} {'ratio':>6} "
          f"{'paired':>6}")
    doc = []
    for cell in cells:
        rn, ra = statistics.median(rates[(cell, 'none')]), statistics.median(rates[(cell, 'auto')])
        paired = statistics.median(a / b for a, b in zip(rates[(cell, 'auto')], rates[(cell, 'none')]))
        cat, samp, n, batching = cell
        print(f"{cat:16} {samp:8} {n:6d} {batching:>5} {rn:8.1f} {ra:8.1f} {ra / rn:6.2f} {paired:6.2f}")
        doc.append({"category": cat, "sampling": samp, "max_new_tokens": n, "batch": batching,
                    "none_s": times[(cell, 'none')], "auto_s": times[(cell, 'auto')],
                    "none_tok_s": rates[(cell, 'none')], "auto_tok_s": rates[(cell, 'auto')], "ratio": ra / rn,
                    "paired": paired})
    for key in ("ratio", "paired"):
        ratios = [d[key] for d in doc]
        print(f"cells {len(doc)} ({key}): min {min(ratios):.2f}, median {statistics.median(ratios):.2f}; "
              f"below 0.97: {sum(r < 0.97 for r in ratios)}")
    print(f"unequal to plain decoding: {len(unequal)}")
    print(json.dumps({"benchmark": "auto_vs_none", "args": vars(args), "cells": doc, "unequal": [list(c) for c in unequal]}))
    return 1 if unequal else 0


if __name__ == "__main__":
    raise SystemExit(main())
