"""A batch decoded together (`Engine.generate`) priced as a closed batch, by what brings its end
closer (the default: `BatchGuard.progress`, `LoadPolicy.closed`), against the same engine priced
as the server's open batches (every row's tokens), beside plain decoding, interleaved: a fresh
engine per call (nothing learnt, the process's suffix cache emptied), the dev set's prompts (one
per category) and HumanEval's cut into batches of `--batch` rows. Reports each variant's ratio of
decode rates to plain decoding's (median over the repeats, and `best_of`: each batch's fastest
repeat for every variant alike) and how its steps went (drafted, or plain and why); every text is
checked equal to plain decoding's (greedy, or seeded sampling with deterministic guesses).

    python benchmarks/closed_batch_ab.py --methods auto --batch 8 --samplings greedy,t0.8 --repeats 10 --threads 2
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from devset import add_prompt_options, dev_prompts
from harness import emit, interleaved, machine, median, table
from method_grid import best_of_ratio


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_options(ap)
    ap.add_argument("--methods", default="auto", help="methods to price both ways. Default: auto")
    ap.add_argument("--batch", type=int, default=8, help="rows a batch. Default: 8")
    ap.add_argument("--samplings", default="greedy", help="greedy and/or tT (temperature T, seeded)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import specdec.core.proposal as proposal
    from specdec.config import SpecConfig, build_engine
    from specdec.drafters.suffix import forget_shared
    from specdec.metrics import summarize
    from specdec.models.loader import load_model
    from specdec.types import SamplingParams

    target = load_model(None, quiet=True)
    prompts = dev_prompts(target.tokenizer, args)
    items = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
    steps: dict[str, Counter] = {}
    current = [""]
    plan = proposal.Sources.plan

    def counted_plan(self, rows, *a, **kw):  # each step's outcome: drafted, or plain and why
        out = plan(self, rows, *a, **kw)
        steps.setdefault(current[0], Counter())[out.reason or "drafted"] += 1
        return out

    proposal.Sources.plan = counted_plan

    def engine(method: str, closed: bool):
        built = build_engine(SpecConfig(method=method), target)
        if built.guard is not None:
            built.guard.closed = closed
        if built.policy is not None:
            built.policy.closed = closed
        return built

    rows, cells = [], []
    for sampling in [s.strip() for s in args.samplings.split(",") if s.strip()]:
        params = SamplingParams(max_new_tokens=args.max_new_tokens) if sampling == "greedy" else \
            SamplingParams(max_new_tokens=args.max_new_tokens, temperature=float(sampling[1:]), seed=7)
        names = {"none": ("none", True)}
        for m in [m.strip() for m in args.methods.split(",") if m.strip() and m.strip() != "none"]:
            names[f"{m} closed"], names[f"{m} open"] = (m, True), (m, False)

        def call(name):
            def run(item):
                current[0] = f"{sampling} {name}"
                forget_shared()
                return engine(*names[name]).generate(item, params)
            return run

        print(f"{sampling}: {len(items)} batches of up to {args.batch} x {len(names)} variants x {args.repeats}",
              flush=True)
        raw = interleaved({name: call(name) for name in names}, items, args.repeats)

        def rate(name, rep):  # decode tokens/s of one repeat over every batch, as method_grid takes it
            return summarize([r for i in raw[name] for r in raw[name][i][rep]])["tokens_per_s"]

        for name in names:
            if name == "none":
                continue
            equal = all([r.tokens for r in raw[name][i][rep]] == [r.tokens for r in raw["none"][i][rep]]
                        for i in raw[name] for rep in range(args.repeats))
            cell = {"variant": name, "sampling": sampling, "batch": args.batch,
                    "ratio": round(median(rate(name, r) / rate("none", r) for r in range(args.repeats)), 3),
                    "best_of": round(best_of_ratio(raw[name], raw["none"], args.repeats)[0], 3), "equal": equal,
                    "steps": dict(steps.get(f"{sampling} {name}", {}))}
            cells.append(cell)
            rows.append({**cell, "steps": ", ".join(f"{k} {v}" for k, v in sorted(cell["steps"].items()))})
    print(table(rows, ["variant", "sampling", "batch", "ratio", "best_of", "equal", "steps"]))
    emit({"benchmark": "closed_batch_ab", "machine": machine(args.threads), "prompts": len(prompts),
          "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "cells": cells})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
