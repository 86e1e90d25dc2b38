"""Greedy τ (tokens per target forward) of EAGLE heads on the same prompts.

Greedy drafting and verification do not depend on timing, so τ is deterministic: heads
compare exactly even across runs and machines (as long as the numerics match). The tree
shape is `generate --method eagle`'s default unless given.

    python benchmarks/eagle_tau.py HEAD_DIR [HEAD_DIR ...] --per-category 2 --humaneval 6

Prints one line per head (τ on the Spec-Bench dev prompts, on HumanEval, overall) and, as
the last line, one JSON document.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from devset import DEV_SET

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = DEV_SET


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("heads", nargs="+", help="EAGLE head folders")
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="Spec-Bench JSONL")
    ap.add_argument("--per-category", type=int, default=2, help="prompts per category of --data. Default: 2")
    ap.add_argument("--humaneval", type=int, default=6, help="HumanEval prompts (completion). Default: 6")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tree-depth", type=int, default=4)
    ap.add_argument("--tree-width", type=int, default=2)
    ap.add_argument("--tree-nodes", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specdec.bench.tasks import dev_and_humaneval
    from specdec.drafters.eagle import EagleDrafter, load_eagle
    from specdec.engine import Engine
    from specdec.models.loader import load_model
    from specdec.types import SamplingParams

    target = load_model(None, quiet=True)
    encoded = dev_and_humaneval(target.tokenizer, args.data, args.per_category, args.humaneval)
    out = {}
    for head in args.heads:
        h, meta = load_eagle(head, target)
        # whole trees every step: tau depends on the head alone, not on timing
        d = EagleDrafter(h, target.model, meta.get("vocab_subset"), depth=args.tree_depth, width=args.tree_width,
                         nodes=args.tree_nodes, trim=False)
        engine = Engine(target.model, d, k=args.tree_depth, eos_ids=target.eos_ids, fixed_k=True)
        sums: dict[str, list[int]] = {}
        for group, ids in encoded:
            [r] = engine.generate([ids], SamplingParams(max_new_tokens=args.max_new_tokens))
            s = sums.setdefault(group, [0, 0])
            s[0] += r.stats.new_tokens
            s[1] += r.stats.target_forwards
        tau = {g: s[0] / s[1] for g, s in sums.items()}
        tau["all"] = sum(s[0] for s in sums.values()) / sum(s[1] for s in sums.values())
        out[head] = tau
        print(head, " ".join(f"{g} {v:.3f}" for g, v in tau.items()), flush=True)
    print(json.dumps({"benchmark": "eagle_tau", "prompts": len(encoded), "max_new_tokens": args.max_new_tokens,
                      "tree": [args.tree_depth, args.tree_width, args.tree_nodes], "tau": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
