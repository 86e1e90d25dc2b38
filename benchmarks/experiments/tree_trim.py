"""`auto` with its EAGLE trees cut to the nodes worth verifying (the default) against the same
drafter verifying whole trees, and how well the head's path probabilities predict acceptance.

`LookupEagleDrafter` keeps, per tree, only the head's nodes whose learnt odds
of being accepted (by their path probability) raise the expected committed tokens per unit of
step time, and stops expanding once no frontier node could be kept. This benchmark runs, per
prompt and interleaved, plain decoding, auto with trimming ("trim") and auto without ("whole"),
drafters kept across requests, greedy, batch 1, whole `generate` calls timed; every text is
checked equal to plain decoding. `--gate off` makes every row without a preferred lookup draft
a tree (the gate otherwise keeps trees off where they do not pay, as on 2-core CPUs), which
shows what trimming does to a tree step. The whole-tree variant's nodes give the calibration
table: the share of nodes accepted per bin of the head's path probability (all of them are
verified there, so the table is unbiased).

    python benchmarks/experiments/tree_trim.py --per-category 1 --humaneval 4 --repeats 2 --gate off --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

DEFAULT_DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench" / "dev.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="Spec-Bench style JSONL. Default: the shared dev set")
    ap.add_argument("--per-category", type=int, default=1, help="prompts per category of --data (0: none). Default: 1")
    ap.add_argument("--humaneval", type=int, default=4, help="first N HumanEval prompts. Default: 4")
    ap.add_argument("--gate", choices=("on", "off"), default="off",
                    help="on: auto's gate decides when trees pay (the default drafter); off: a tree for every row "
                         "without a preferred lookup. Default: off")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specdec.adaptive import NodeOdds
    from specdec.bench.runner import category_speedups
    from specdec.bench.tasks import load_humaneval, load_jsonl, select
    from specdec.config import SpecConfig, build_engine
    from specdec.models.loader import load_model
    from specdec.text import encode_prompt
    from specdec.types import SamplingParams

    target = load_model(None, quiet=True)
    engines = {v: build_engine(SpecConfig(method=m), target) for v, m in (("none", "none"), ("trim", "auto"), ("whole", "auto"))}
    if not hasattr(engines["trim"].drafter, "trim"):
        ap.error("the default target's auto drafter has no EAGLE head here")
    engines["whole"].drafter.trim = False
    for v in ("trim", "whole"):
        engines[v].drafter.gate = args.gate == "on"
    nodes = []  # (path probability, accepted) of every verified node of the whole trees
    whole = engines["whole"].drafter
    commit = whole.commit

    def observed(num_accepted, paths=None):
        if paths is not None:
            for b, probs in whole._node_p.items():
                nodes.extend((p, j in set(paths[b])) for j, p in enumerate(probs, start=1))
        return commit(num_accepted, paths)

    whole.commit = observed
    tasks = select(load_jsonl(args.data), None, args.per_category) if args.per_category > 0 else []
    tasks += load_humaneval()[: args.humaneval]
    if not tasks:
        ap.error("no prompts: raise --per-category or --humaneval")
    encoded = [encode_prompt(target.tokenizer, t.prompt, t.chat) for t in tasks]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    times: dict[str, dict[int, list[float]]] = {v: {} for v in engines}
    equal = {v: 0 for v in engines}
    for rep in range(args.repeats):
        for i, ids in enumerate(encoded):
            order = ["none", "trim", "whole"] if (i + rep) % 2 == 0 else ["none", "whole", "trim"]
            plain = None
            for v in order:
                t0 = time.perf_counter()
                [r] = engines[v].generate([ids], params)
                times[v].setdefault(i, []).append(time.perf_counter() - t0)
                if v == "none":
                    plain = r.tokens
                equal[v] += r.tokens == plain
    table = category_speedups([t.category for t in tasks], times, "none", ["trim", "whole"])
    print(f"threads {args.threads}; {len(tasks)} prompts, {args.repeats} repeats; gate {args.gate}; "
          "speedup over none (end to end)")
    print(f"{'category':16}{'trim':>10}{'whole':>10}")
    for c in table:
        print(f"{c:16}{table[c]['trim']:10.2f}{table[c]['whole']:10.2f}")
    drafters = {}
    for v in ("trim", "whole"):
        d = engines[v].drafter
        drafters[v] = {"tree_rows": d.rows_drafted["eagle"], "lookup_rows": d.rows_drafted["lookup"],
                       "nodes": round(d.nodes, 2), "gain": round(d.gain, 3),
                       "c": None if d.cost() is None else round(d.cost(), 3), "r": round(d.ngram.policy.r, 3)}
        print(f"{v}: " + ", ".join(f"{k} {val}" for k, val in drafters[v].items()))
    lows, highs = (0.0,) + NodeOdds.EDGES, NodeOdds.EDGES + (1.0 + 1e-9,)
    calibration = []
    print("whole trees: accepted share by the head's path probability")
    for lo, hi in zip(lows, highs):
        sel = [(p, a) for p, a in nodes if lo <= p < hi]
        if sel:
            row = {"p_low": lo, "p_high": min(hi, 1.0), "nodes": len(sel),
                   "mean_p": round(statistics.fmean(p for p, _ in sel), 3),
                   "accepted": round(sum(a for _, a in sel) / len(sel), 3)}
            calibration.append(row)
            print(f"  p in [{lo:.2f}, {min(hi, 1.0):.2f}): {len(sel):5d} nodes, mean p {row['mean_p']:.3f}, "
                  f"accepted {row['accepted']:.3f}")
    runs = len(tasks) * args.repeats
    print("greedy equal to none: " + ", ".join(f"{v} {equal[v]}/{runs}" for v in ("trim", "whole")))
    print(json.dumps({"benchmark": "tree_trim", "threads": args.threads, "gate": args.gate, "prompts": len(tasks),
                      "repeats": args.repeats, "max_new_tokens": args.max_new_tokens, "speedup": table,
                      "drafters": drafters, "calibration": calibration,
                      "greedy_equal": {v: equal[v] for v in ("trim", "whole")}, "runs": runs}))
    return 0 if all(equal[v] == runs for v in ("trim", "whole")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
