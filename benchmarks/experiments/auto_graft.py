"""auto with and without the lookup graft, and EAGLE tree shapes, on the same prompts.

Each configuration runs every prompt (greedy, batch 1, decode time only), interleaved per
prompt (the order flips every other prompt), one run each; prints tokens/s, the speedup
over `none` and τ per prompt set (Spec-Bench dev, HumanEval) and overall.

    python benchmarks/experiments/auto_graft.py none auto:g=0 auto:g=6 eagle:d=4:n=5 eagle:d=5:n=7 eagle:d=6:w=3:n=10

A configuration is `none`, `auto[:g=G][:d=D][:w=W][:n=N][:k=K]` (prompt lookup + the shipped
EAGLE head; G lookup nodes grafted onto a tree row's tree, 0 = off; tree depth / width /
nodes; lookup length cap K) or `eagle[:d=D][:w=W][:n=N]` (the head's tree alone).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

DEFAULT_DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench" / "dev.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="+", help="configurations (see above); `none` is added if missing")
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="Spec-Bench JSONL")
    ap.add_argument("--per-category", type=int, default=2, help="prompts per category of --data. Default: 2")
    ap.add_argument("--humaneval", type=int, default=8, help="HumanEval prompts (completion). Default: 8")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specdec.bench.tasks import dev_and_humaneval
    from specdec.drafters import REGISTRY
    from specdec.drafters.eagle import DEFAULT_EAGLE_DIR
    from specdec.engine import Engine
    from specdec.models.loader import load_model
    from specdec.types import SamplingParams

    target = load_model(None, quiet=True)
    enc = dev_and_humaneval(target.tokenizer, args.data, args.per_category, args.humaneval)

    def make(name: str) -> Engine:
        if name == "none":
            return Engine(target.model, eos_ids=target.eos_ids)
        kind, *opts = name.split(":")
        o = dict(x.split("=") for x in opts)
        d, w, n = int(o.get("d", 4)), int(o.get("w", 2)), int(o.get("n", 5))
        if kind == "auto":
            dr = REGISTRY["lookup-eagle"](target=target, draft=DEFAULT_EAGLE_DIR, depth=d, width=w, nodes=n)
            g = int(o.get("g", dr.graft))
            dr.graft, dr.max_nodes = g, dr.eagle.max_nodes + g
            if "l" in o:  # a lookup alone only when at least L long (no value comparison)
                L = int(o["l"])
                dr.prefer_lookup = lambda looked, fixed: [len(x) >= L for x in looked]
            return Engine(target.model, dr, k=int(o.get("k", 8)), eos_ids=target.eos_ids)
        if kind == "eagle":
            dr = REGISTRY["eagle"](target=target, draft=DEFAULT_EAGLE_DIR, tree=True, depth=d, width=w, nodes=n)
            return Engine(target.model, dr, k=d, eos_ids=target.eos_ids)
        raise SystemExit(f"unknown configuration {name!r}")

    names = args.configs if "none" in args.configs else ["none"] + args.configs
    res = {n: {"dev": [0, 0.0, 0], "humaneval": [0, 0.0, 0]} for n in names}
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    for i, (cat, e) in enumerate(enc):
        for n in names if i % 2 == 0 else names[::-1]:
            [r] = make(n).generate([e], params)
            a = res[n][cat]
            a[0] += len(r.tokens) - 1  # decode time covers the tokens after the first
            a[1] += r.stats.decode_s
            a[2] += r.stats.target_forwards
        print(f"prompt {i + 1}/{len(enc)}", file=sys.stderr, flush=True)
    sets = [c for c in ("dev", "humaneval") if res["none"][c][1] > 0]  # (--per-category 0: no dev prompts)
    base = {c: res["none"][c][0] / res["none"][c][1] for c in sets}
    base_all = sum(res["none"][c][0] for c in base) / sum(res["none"][c][1] for c in base)
    print(f"threads {args.threads}; {len(enc)} prompts, {args.max_new_tokens} new tokens, greedy, decode only")
    for n in names:
        cells = []
        for c in sets:
            t, s, f = res[n][c]
            cells.append(f"{c} {t / s:6.1f} tok/s x{t / s / base[c]:.2f} tau {t / max(f, 1):.2f}")
        T, S = sum(res[n][c][0] for c in base), sum(res[n][c][1] for c in base)
        print(f"{n:22s} " + " | ".join(cells) + f" | all x{T / S / base_all:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
