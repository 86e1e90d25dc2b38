"""Where a step of `generate --method auto` spends its time: step wall times (score + verify +
commit, from one proposal's hand-over to the next proposal) by kind (a tree step or a chain
step) and by the number of verified nodes, plus the drafter's own cost model at the end
(t_step, the head's drafting time, r per verified token, the tree's gain, its mean size).

    python benchmarks/auto_step_costs.py --humaneval 6 --threads 2

One run, greedy, 128 new tokens per prompt; medians per node count.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from devset import DEV_SET

DEFAULT_DATA = DEV_SET


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="Spec-Bench JSONL")
    ap.add_argument("--per-category", type=int, default=0, help="dev prompts per category. Default: 0")
    ap.add_argument("--humaneval", type=int, default=6, help="HumanEval prompts. Default: 6")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specdec.bench.tasks import dev_and_humaneval
    from specdec.config import SpecConfig, build_engine
    from specdec.drafters import hybrid
    from specdec.models.loader import load_model
    from specdec.types import SamplingParams

    target = load_model(None, quiet=True)
    prompts = dev_and_humaneval(target.tokenizer, args.data, max(args.per_category, 1), args.humaneval)
    if args.per_category <= 0:
        prompts = [p for p in prompts if p[0] == "humaneval"]
    engine = build_engine(SpecConfig(method="auto"), target)
    drafter = engine.drafter
    steps: dict[str, dict[int, list[float]]] = {"tree": {}, "chain": {}}
    last = {"kind": None, "nodes": 0, "end": None}
    propose, assemble = hybrid.LookupEagleDrafter.propose, hybrid.LookupEagleDrafter.assemble

    def timed_propose(self, ctx, max_tokens):
        if last["end"] is not None and last["kind"]:
            steps[last["kind"]].setdefault(last["nodes"], []).append(time.perf_counter() - last["end"])
        return propose(self, ctx, max_tokens)

    def noted_assemble(self, ctx, looked, tree_rows, max_tokens, max_nodes=None):
        draft = assemble(self, ctx, looked, tree_rows, max_tokens, max_nodes)
        last.update(kind="tree" if any(tree_rows) else "chain", nodes=int(draft.counts.max()),
                    end=time.perf_counter())
        return draft

    hybrid.LookupEagleDrafter.propose = timed_propose
    hybrid.LookupEagleDrafter.assemble = noted_assemble
    for _, ids in prompts:
        last["end"] = None  # a prefill is not a step
        engine.generate([ids], SamplingParams(max_new_tokens=args.max_new_tokens))
    print(f"threads {args.threads}; {len(prompts)} prompts; step ms (count, median) by verified nodes")
    for kind, by in steps.items():
        print(kind, {n: (len(ts), round(statistics.median(ts) * 1e3, 1)) for n, ts in sorted(by.items())})
    print(f"cost model: t_step {drafter.t_step * 1e3:.1f} ms, head drafting {drafter.t_draft * 1e3:.1f} ms, "
          f"r {drafter.ngram.policy.r:.3f}, tree gain {drafter.gain:.2f}, mean nodes {drafter.nodes:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
