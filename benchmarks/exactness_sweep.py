"""Greedy exactness over many prompts: every method's text against plain decoding, token for token.

The test suite checks exactness on tiny models and a few prompts of the default model; a
mismatch that needs a near-tie between two tokens shows up only over many prompts. This sweep
runs the first turn of every prompt of a Spec-Bench style file (and HumanEval prompts, as raw
completions) through plain decoding and each method, at each batch size (batches of
consecutive prompts), greedy, on the default model, and reports every row whose tokens differ
from plain decoding of the same batch. Each method's engine is kept across prompts, as a
server or `--prompts-file` keeps it, so its adaptive choices (lookup lengths, trees, cuts) vary
as they do in use. Not a timing benchmark: run it beside other work if need be.

    python benchmarks/exactness_sweep.py --max-new-tokens 96 --methods ngram,auto,draft

Prints one line per mismatch and a summary, and as the last line one JSON document; exits 1 if
any row differed.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from devset import DEV_SET

DEFAULT_DATA = DEV_SET


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="Spec-Bench style JSONL. Default: the shared dev set")
    ap.add_argument("--humaneval", type=int, default=164, help="first N HumanEval prompts (0: none). Default: all 164")
    ap.add_argument("--stride", type=int, default=1, help="every N-th prompt only (a quicker sample). Default: 1")
    ap.add_argument("--methods", default="ngram,auto,draft", help="comma-separated specdec methods. Default: ngram,auto,draft")
    ap.add_argument("--batch", default="1,4", help="comma-separated batch sizes. Default: 1,4")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="Default: float32")
    ap.add_argument("--weights", choices=("auto", "int16", "int8", "blocks", "fp32"), default="auto",
                    help="the default model's weights (see specdec generate --help). Default: auto")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specdec.bench.tasks import load_humaneval, load_jsonl
    from specdec.config import SpecConfig, build_engine
    from specdec.models.loader import load_model
    from specdec.text import encode_prompt
    from specdec.types import SamplingParams

    methods = [m.strip() for m in args.methods.split(",") if m.strip() and m.strip() != "none"]
    batches = [int(b) for b in args.batch.split(",") if b.strip()]
    if not methods or not batches or min(batches) < 1:
        ap.error("name at least one method besides none and batch sizes >= 1")
    if args.stride < 1:
        ap.error("--stride must be >= 1")
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    target = load_model(None, dtype=dtype, quiet=True, weights=args.weights)
    tasks = (load_jsonl(args.data) if args.data else []) + (load_humaneval()[: args.humaneval] if args.humaneval else [])
    tasks = tasks[:: args.stride]
    encoded = [encode_prompt(target.tokenizer, t.prompt, t.chat) for t in tasks]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    engines = {m: build_engine(SpecConfig(method=m, dtype=args.dtype, weights=args.weights), target)
               for m in ["none", *methods]}
    differ = {f"{m}@{b}": [] for b in batches for m in methods}
    t0 = time.time()
    for B in batches:
        for s in range(0, len(encoded), B):
            group = encoded[s : s + B]
            plain = [r.tokens for r in engines["none"].generate(group, params)]
            for m in methods:
                for j, r in enumerate(engines[m].generate(group, params)):
                    if r.tokens != plain[j]:
                        at = next((i for i, (a, b) in enumerate(zip(r.tokens, plain[j])) if a != b),
                                  min(len(r.tokens), len(plain[j])))
                        differ[f"{m}@{B}"].append(s + j)
                        print(f"DIFFERS: {m}, batch {B}, prompt {s + j} ({tasks[s + j].category}, "
                              f"{len(group[j])} tokens), from token {at}", flush=True)
            print(f"batch {B}: {min(s + B, len(encoded))}/{len(encoded)} prompts, {time.time() - t0:.0f} s", flush=True)
    rows = len(encoded)
    print("greedy equal to plain decoding: " + ", ".join(f"{k} {rows - len(v)}/{rows}" for k, v in differ.items()))
    print(json.dumps({"benchmark": "exactness_sweep", "prompts": rows, "max_new_tokens": args.max_new_tokens,
                      "threads": args.threads, "dtype": args.dtype, "weights": args.weights, "differ": differ,
                      "equal": {k: rows - len(v) for k, v in differ.items()}}))
    return 1 if any(differ.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
