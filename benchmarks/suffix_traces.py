"""Agent-like traces decoded in order, one request at a time: `suffix` and `auto` against plain
decoding, tokens/s over each whole trace (issue 57's goal: >= 2x on agent-like traces).

The traces are benchmarks/data/agentic/<trace>.jsonl (`agentic_traces.py write`): related
requests whose answers repeat each other. Each method decodes a whole trace as one block, its
requests in order (so later requests draft from earlier answers, as a server's would), starting
from an empty suffix cache; blocks alternate in order over the repeats (none, suffix, auto, then
auto, suffix, none, ...) and each method's median over repeats is reported. Greedy; every
method's answers must equal plain decoding's (checked). Through the Python API, whose scheduler
is the one `specdec serve` runs.

    python benchmarks/suffix_traces.py --traces sql,extract,report,tools --requests 20 --repeats 2 --threads 1
    python benchmarks/suffix_traces.py --sim xeon-vnni --traces sql,report,tools --requests 12

`--sim PROFILE` runs on a simulated clock (specdec/simclock.py: only the target's forwards advance
it, by the profile's cost curve), so the ratios do not depend on the machine's load and one repeat
is exact; what the wall clock adds beyond it is the per-step work in Python. Per method it also
prints the tokens per target forward and the guesses verified per step.

Prints a table and, as the last line, one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from harness import emit, machine, table  # noqa: E402


def trace(name: str, limit: int) -> list[dict]:
    lines = (HERE / "data" / "agentic" / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line][:limit]


def run_block(spec, requests: list[dict], max_tokens: int) -> tuple[float, int, list[list[int]], dict]:
    """(seconds, tokens, each answer's ids, step counts) of one method over a whole trace, from an
    empty cache."""
    from specdec.drafters.suffix import forget_shared

    forget_shared()
    seconds, tokens, answers = 0.0, 0, []
    steps = {"steps": 0, "nodes": 0, "accepted": 0, "plain": 0}
    schedulers = []
    make = spec.engine._scheduler
    spec.engine._scheduler = lambda *a: schedulers.append(make(*a)) or schedulers[-1]
    try:
        for r in requests:
            t0 = time.perf_counter()
            out = spec.generate(r["messages"], max_new_tokens=max_tokens, temperature=0.0)
            seconds += time.perf_counter() - t0
            tokens += len(out.token_ids)
            answers.append(list(out.token_ids))
    finally:
        spec.engine._scheduler = make
    for s in schedulers:
        t = s.totals
        steps["steps"] += t.steps
        steps["nodes"] += t.proposed
        steps["accepted"] += t.accepted
        steps["plain"] += sum(t.plain_steps.values())
    return seconds, tokens, answers, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default="sql,extract,report,tools")
    ap.add_argument("--methods", default="suffix,auto")
    ap.add_argument("--model", default=None, help="a .gguf or folder (default: the default model)")
    ap.add_argument("--requests", type=int, default=20, help="the first N requests of each trace")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sim", default=None, metavar="PROFILE",
                    help="a simulated clock with this cost profile (specdec/simclock.py PROFILES)")
    ap.add_argument("--step-ms", type=float, default=15.0, help="with --sim: one plain step, ms. Default: 15")
    args = ap.parse_args()
    import contextlib

    import specdec
    from specdec.simclock import PROFILES, SimClock, charge, curve, simulated

    methods = ["none"] + [m for m in args.methods.split(",") if m and m != "none"]
    specs = {m: specdec.load(args.model, method=m, threads=args.threads) for m in methods}
    clock = contextlib.nullcontext()
    if args.sim:
        sim, cost = SimClock(), curve(PROFILES[args.sim])
        for spec in specs.values():  # (the methods share one target model: charged once)
            if not getattr(spec.target.model, "_sim", False):
                charge(spec.target.model, sim, lambda tokens: args.step_ms / 1e3 * cost(tokens))
                spec.target.model._sim = True
        clock = simulated(sim)
    with clock:
        run(args, methods, specs)


def run(args, methods, specs) -> None:
    rows, report = [], {"machine": machine(args.threads), "simulated": args.sim, "traces": {}}
    for name in [t for t in args.traces.split(",") if t]:
        requests = trace(name, args.requests)
        rates = {m: [] for m in methods}
        exact = {m: True for m in methods}
        plain_answers, counts = None, {}
        for rep in range(args.repeats):
            for m in (methods if rep % 2 == 0 else methods[::-1]):
                seconds, tokens, answers, counts[m] = run_block(specs[m], requests, args.max_tokens)
                rates[m].append(tokens / seconds)
                if m == "none":
                    plain_answers = answers if plain_answers is None else plain_answers
                else:
                    exact[m] = exact[m] and (plain_answers is None or answers == plain_answers)
        med = {m: statistics.median(v) for m, v in rates.items()}
        row = {"trace": name, "plain tok/s": med["none"]}
        for m in methods[1:]:
            row[f"{m} / plain"] = f"{med[m] / med['none']:.2f}x" + ("" if exact[m] else " (differs!)")
        rows.append(row)
        report["traces"][name] = {"tokens_per_s": med, "ratio": {m: med[m] / med["none"] for m in methods[1:]},
                                  "exact": exact, "requests": len(requests), "steps": counts}
        print(f"{name}: " + ", ".join(f"{m} {med[m]:.1f} tok/s" for m in methods), flush=True)
        for m in methods[1:]:
            c = counts[m]
            n = max(c["steps"], 1)
            print(f"  {m}: {(c['accepted'] + c['steps']) / n:.2f} tokens per step, {c['nodes'] / n:.2f} guesses "
                  f"verified per step, {c['plain'] / n:.0%} of steps plain", flush=True)
    print(table(rows, ["trace", "plain tok/s"] + [f"{m} / plain" for m in methods[1:]]))
    emit(report)


if __name__ == "__main__":
    main()
