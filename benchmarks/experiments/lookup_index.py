"""What prompt lookup costs a decoding step: the scan of the whole context (`lookup_match`)
against the incremental n-gram index the drafter uses (`SuffixIndex`), on the same token lists.

Per context length L: a random list of L tokens (70% drawn from the full 49k vocabulary, 30%
from 300 common ids, so that short n-grams repeat as in text), then 128 steps that each append
2 tokens and look up a continuation of up to 8 (n = 4..1). Reports microseconds per step for
both, and the index's first call (indexing the whole prompt). Python only; no model.

    python benchmarks/experiments/lookup_index.py --lengths 200,600,1500
"""

from __future__ import annotations

import argparse
import json
import random
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="200,600,1500", help="comma-separated context lengths. Default: 200,600,1500")
    ap.add_argument("--steps", type=int, default=128, help="steps per context. Default: 128")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    if not lengths or min(lengths) < 2 or args.steps < 1:
        ap.error("--lengths: positive lengths of 2 or more; --steps >= 1")

    from specdec.drafters.ngram import SuffixIndex, lookup_match

    rng = random.Random(args.seed)
    out = {}
    for L in lengths:
        base = [rng.randrange(49152) if rng.random() < 0.7 else rng.randrange(300) for _ in range(L)]
        new = [rng.randrange(300) for _ in range(2 * args.steps)]
        toks = list(base)
        t0 = time.perf_counter()
        for i in range(args.steps):
            toks += new[2 * i : 2 * i + 2]
            want = lookup_match(toks, 8, 1, 4)
        scan = (time.perf_counter() - t0) / args.steps
        idx, toks = SuffixIndex(1, 4), list(base)
        t0 = time.perf_counter()
        idx.match(toks, 8)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(args.steps):
            toks += new[2 * i : 2 * i + 2]
            got = idx.match(toks, 8)
        index = (time.perf_counter() - t0) / args.steps
        if got != want:
            raise SystemExit(f"context {L}: the index answered {got}, the scan {want}")
        out[L] = {"scan_us": round(scan * 1e6, 1), "index_us": round(index * 1e6, 1), "index_first_ms": round(first * 1e3, 2)}
        print(f"context {L}: scan {scan * 1e6:.0f} us/step, index {index * 1e6:.1f} us/step "
              f"(first call {first * 1e3:.2f} ms)")
    print(json.dumps({"benchmark": "lookup_index", "steps": args.steps, "per_length": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
