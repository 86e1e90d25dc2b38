"""Batched decoding: `specdec generate`'s engine with B prompts decoded together, per method.

For each batch size B, the first B prompts (first turns of Spec-Bench dev, one per category in
file order, chat template) are decoded as one batch, greedy, --max-new-tokens each, by every
method (the default target's `auto` is prompt lookup + the EAGLE tree), interleaved per repeat
(the order flips every other repeat). Reports generated tokens per second of decoding (median
over repeats), the speedup over `none`, τ (tokens per target forward, mean over rows) and
whether every row's tokens equal `none`'s. The last line is one JSON document.

    python benchmarks/batch_generate.py --batch 1,4,8 --methods none,ngram,auto --repeats 3 --threads 2

To compare two versions of specdec on the same machine, run this file from each checkout
(e.g. `git worktree add /tmp/old <commit>` and `PYTHONPATH=/tmp/old python benchmarks/batch_generate.py`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from devset import DEV_SET

DEFAULT_DATA = DEV_SET


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="Spec-Bench JSONL")
    ap.add_argument("--batch", default="1,4,8", help="comma-separated batch sizes. Default: 1,4,8")
    ap.add_argument("--methods", default="none,ngram,auto", help="comma-separated methods ('none' is added)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import specdec
    from specdec.bench.tasks import load_jsonl, select
    from specdec.config import SpecConfig, build_engine
    from specdec.models.loader import load_model
    from specdec.text import encode_prompt
    from specdec.types import SamplingParams

    sizes = [int(b) for b in args.batch.split(",")]
    methods = ["none"] + [m for m in args.methods.split(",") if m and m != "none"]
    target = load_model(None, quiet=True)
    tasks = select(load_jsonl(args.data), None, 1)
    if max(sizes) > len(tasks):
        raise SystemExit(f"--batch {max(sizes)} needs {max(sizes)} prompts; {args.data} gives {len(tasks)} (one per category)")
    enc = [encode_prompt(target.tokenizer, t.prompt, t.chat) for t in tasks]
    engines = {}
    for m in methods:
        eng = build_engine(SpecConfig(method=m), target)
        engines[m] = eng
        eng.generate(enc[:1], SamplingParams(max_new_tokens=8))  # warm up (packing, first-call costs)
    print(f"specdec from {Path(specdec.__file__).parent}; threads {torch.get_num_threads()}")
    rows = {}
    for B in sizes:
        rate = {m: [] for m in methods}
        tau, tokens = {}, {}
        for rep in range(args.repeats):
            for m in (methods if rep % 2 == 0 else methods[::-1]):
                t0 = time.perf_counter()
                res = engines[m].generate(enc[:B], SamplingParams(max_new_tokens=args.max_new_tokens))
                dt = time.perf_counter() - t0
                rate[m].append(sum(len(r.tokens) for r in res) / dt)
                tau[m] = statistics.mean(len(r.tokens) / max(r.stats.target_forwards, 1) for r in res)
                tokens[m] = [r.tokens for r in res]
        base = statistics.median(rate["none"])
        rows[B] = {m: {"tok_s": statistics.median(rate[m]), "speedup": statistics.median(rate[m]) / base,
                       "tau": tau[m], "greedy_equal": tokens[m] == tokens["none"]} for m in methods}
        for m, r in rows[B].items():
            print(f"B={B:<3} {m:<8} {r['tok_s']:7.1f} tok/s  x{r['speedup']:.2f}  τ {r['tau']:.2f}  "
                  f"greedy equal: {r['greedy_equal']}", flush=True)
    print(json.dumps({"benchmark": "batch_generate", "specdec": str(Path(specdec.__file__).parent),
                      "threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
                      "repeats": args.repeats, "results": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
