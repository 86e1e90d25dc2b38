"""Where a step of `generate --method auto` spends its time: the target's step (score, verify,
commit) by kind (a tree step or a chain step) and by the number of guesses it verified, plus
what the cost model learnt at the end (a plain step's time, r per verified guess, the head's
drafting time, the tree's gain and mean size).

    python benchmarks/auto_step_costs.py --humaneval 6 --threads 2

One run, greedy, 128 new tokens per prompt; medians per guess count.
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
    from specdec.core import scheduler
    from specdec.models.loader import load_model
    from specdec.types import SamplingParams

    target = load_model(None, quiet=True)
    prompts = dev_and_humaneval(target.tokenizer, args.data, max(args.per_category, 1), args.humaneval)
    if args.per_category <= 0:
        prompts = [p for p in prompts if p[0] == "humaneval"]
    engine = build_engine(SpecConfig(method="auto"), target)
    steps: dict[str, dict[int, list[float]]] = {"tree": {}, "chain": {}}
    run_step = scheduler.run_step

    def timed_step(model, cache, pending, draft, *a, **kw):
        t0 = time.perf_counter()
        res = run_step(model, cache, pending, draft, *a, **kw)
        kind = "tree" if draft.parents is not None else "chain"
        steps[kind].setdefault(int(draft.counts.max()) if draft.counts.numel() else 0, []).append(
            time.perf_counter() - t0)
        return res

    scheduler.run_step = timed_step
    for _, ids in prompts:
        engine.generate([ids], SamplingParams(max_new_tokens=args.max_new_tokens))
    print(f"threads {args.threads}; {len(prompts)} prompts; step ms (count, median) by guesses verified")
    for kind, by in steps.items():
        print(kind, {n: (len(ts), round(statistics.median(ts) * 1e3, 1)) for n, ts in sorted(by.items())})
    policy = engine.policy
    head = policy.sources.get("eagle")
    plain = policy.steps.plain_step(1)
    print(f"cost model: plain step {plain * 1e3 if plain else float('nan'):.1f} ms, r {policy.guess_steps(1):.3f}"
          + (f", head drafting {head.draft_seconds(1) * 1e3:.1f} ms, tree gain {head.gain:.2f}, "
             f"mean nodes {head.nodes or 0:.1f}" if head is not None else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
