"""Every method against plain decoding, cell by cell: methods x greedy / sampled x batch 1 / 8 x a
fresh engine / a warm one, on the dev set and HumanEval, the ratio of decode rates (tokens over
decode seconds), each cell interleaved with plain runs of its own (no other method's drafter
runs between a cell's calls).

A fresh engine is built for every call (its sources new, nothing learned: what a new `specdec
generate` process starts from, its first timings included); a warm one is kept across every call
of its cell, after one untimed pass over the prompts. Sampled cells are seeded: every method's text
must equal plain sampling's with the seed (deterministic guesses under the cost model), as every
greedy text must equal plain greedy text; a cell that differs is marked. Each cell also counts the
row-steps decoded without guesses and why (RequestStats.plain_steps: the cost model declining,
the guard, nothing to guess).

    python benchmarks/method_grid.py --methods ngram,draft,eagle,medusa,auto --per-category 1 --humaneval 4 \\
        --max-new-tokens 128 --repeats 2 --threads 2

The last line is one JSON document; `resolution` is the spread of a cell's repeats (half their
range over the median): a ratio closer to 1 than that is within the noise. `best_of` takes each
item's fastest repeat for the method and for plain decoding alike (a preempted call only ever runs
slower) and is the steadier figure on a shared machine; its resolution is half the range of the
same ratio with each repeat left out in turn. Two runs of the same grid differ by more than that
(+-4% on a shared 2-core machine): `--runs N` runs the whole grid N times in turn and reports each
cell's median over the runs with its `run_spread`.
"""

from __future__ import annotations

import argparse

import torch
from devset import add_prompt_options, dev_prompts
from harness import emit, interleaved, machine, median, spread, table


def best_of_ratio(spec: dict, plain: dict, repeats: int) -> tuple[float, float]:
    """(ratio, resolution) of decode rates with each item's decode time taken as its fastest repeat,
    for the method and for plain decoding alike: a call another process preempted on this shared
    machine only ever makes a repeat slower, so the fastest of an item's repeats is the least
    disturbed figure of it (as timeit takes the minimum). The resolution is half the range of the
    same ratio with each repeat left out in turn, over the ratio."""
    from specdec.metrics import summarize

    def rate(by_item, reps):
        tokens = seconds = 0.0
        for runs in by_item.values():
            stats = [summarize(runs[r]) for r in reps]
            tokens += stats[0]["new_tokens"]
            seconds += min(s["decode_s"] for s in stats)
        return tokens / seconds if seconds else 0.0

    def ratio(reps):
        base = rate(plain, reps)
        return rate(spec, reps) / base if base else 0.0

    whole = ratio(range(repeats))
    if repeats < 3:
        return whole, float("nan")
    left_out = [ratio([r for r in range(repeats) if r != out]) for out in range(repeats)]
    return whole, (max(left_out) - min(left_out)) / 2 / whole if whole else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_options(ap, humaneval=4)
    ap.add_argument("--methods", default="ngram,draft,eagle,medusa,auto")
    ap.add_argument("--samplings", default="greedy,t0.8", help="greedy and/or tT (temperature T, seeded)")
    ap.add_argument("--batches", default="1,8", help="batch sizes. Default: 1,8")
    ap.add_argument("--states", default="fresh,warm", help="fresh and/or warm engines. Default: both")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--runs", type=int, default=1,
                    help="run the whole grid this many times, one after another, and report each cell's median "
                         "over the runs with `run_spread` (half the range of its best_of figures over their "
                         "median): what separates two runs, which a run's own resolutions understate. Default: 1")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specdec.config import SpecConfig, build_engine
    from specdec.drafters.suffix import forget_shared
    from specdec.metrics import summarize
    from specdec.models.loader import load_model
    from specdec.types import SamplingParams

    target = load_model(None, quiet=True)
    prompts = dev_prompts(target.tokenizer, args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip() and m.strip() != "none"]
    states = [s.strip() for s in args.states.split(",") if s.strip()]
    per_run: dict[tuple, list[dict]] = {}
    for run_no in range(args.runs):
        for sampling in [s.strip() for s in args.samplings.split(",") if s.strip()]:
            params = SamplingParams(max_new_tokens=args.max_new_tokens) if sampling == "greedy" else \
                SamplingParams(max_new_tokens=args.max_new_tokens, temperature=float(sampling[1:]), seed=7)
            for batch in [int(b) for b in args.batches.split(",") if b.strip()]:
                items = [prompts[i:i + batch] for i in range(0, len(prompts), batch)] if batch > 1 else [[p] for p in prompts]

                def run(engine_for):
                    def call(item):
                        forget_shared()  # no suffix drafts from these prompts' earlier answers
                        return engine_for().generate(item, params)
                    return call

                # each method against plain runs of its own, interleaved: no other method's drafter runs
                # between them (a draft model's or head's forwards take the target's weights out of the
                # caches, and slowed the next call of whatever ran after them by 2-3%)
                for m, state in [(m, s) for m in methods for s in states]:
                    name = f"{m} {state}"
                    if state == "warm":
                        engine = build_engine(SpecConfig(method=m), target)
                        for item in items:  # one untimed pass: what a process that decoded before has learnt
                            engine.generate(item, params)
                        spec = run(lambda engine=engine: engine)
                    else:
                        spec = run(lambda m=m: build_engine(SpecConfig(method=m), target))
                    variants = {"none": run(lambda: build_engine(SpecConfig(method="none"), target)), name: spec}
                    print(f"{f'run {run_no + 1}, ' if args.runs > 1 else ''}{sampling}, batch {batch}, {name}: "
                          f"{len(items)} items x 2 variants x {args.repeats}", flush=True)
                    raw = interleaved(variants, items, args.repeats)
                    plain, by_item = raw["none"], raw[name]
                    ratios, equal, declined = [], True, {}
                    for rep in range(args.repeats):
                        spec_s = summarize([r for i in by_item for r in by_item[i][rep]])
                        none_s = summarize([r for i in plain for r in plain[i][rep]])
                        ratios.append(spec_s["tokens_per_s"] / none_s["tokens_per_s"] if none_s["tokens_per_s"] else 0.0)
                        for i in by_item:
                            equal &= [r.tokens for r in by_item[i][rep]] == [r.tokens for r in plain[i][rep]]
                        for why, n in spec_s["plain_steps"].items():
                            declined[why] = declined.get(why, 0) + n
                    best = best_of_ratio(by_item, plain, args.repeats)
                    cell = {"method": name.split()[0], "state": name.split()[1], "sampling": sampling, "batch": batch,
                            "ratio": round(median(ratios), 3), "resolution": round(spread(ratios), 3),
                            "best_of": round(best[0], 3), "best_of_resolution": round(best[1], 3),
                            "equal": equal, "row_steps_without_guesses": declined}
                    per_run.setdefault((cell["method"], cell["state"], sampling, batch), []).append(cell)
    cells, rows = [], []
    for runs in per_run.values():
        cell = dict(runs[0])
        if len(runs) > 1:
            declined: dict = {}
            for c in runs:
                for why, n in c["row_steps_without_guesses"].items():
                    declined[why] = declined.get(why, 0) + n
            figures = ("ratio", "resolution", "best_of", "best_of_resolution")  # (each a median over the runs)
            cell.update(**{k: round(median(c[k] for c in runs), 3) for k in figures},
                        run_spread=round(spread([c["best_of"] for c in runs]), 3),
                        runs=[{k: c[k] for k in figures} for c in runs],
                        equal=all(c["equal"] for c in runs), row_steps_without_guesses=declined)
        cells.append(cell)
        rows.append({**cell, "declined": ", ".join(f"{k} {v}" for k, v in sorted(cell["row_steps_without_guesses"].items()))})
    print(table(rows, ["method", "state", "sampling", "batch", "ratio", "resolution", "best_of", "best_of_resolution"]
                + (["run_spread"] if args.runs > 1 else []) + ["equal", "declined"]))
    worst = min((c["ratio"] for c in cells), default=None)
    emit({"benchmark": "method_grid", "machine": machine(args.threads), "prompts": len(prompts),
          "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "runs": args.runs, "cells": cells,
          "worst": worst})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
