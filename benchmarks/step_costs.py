"""Where a method's decoding steps spend their time, beside plain decoding's, step by step: each
prompt decoded by a fresh engine of each variant in turn (`harness.interleaved`), every step's
time split into planning (offers, pricing, drafting), the step itself (`run_step`: the target's
forward, verification, commit) and the target's forward alone. Printed per variant: the decode
rate against the first variant's, plain steps by how many steps after the last drafting one they
came and by their position in the answer (a prefill's and a drafter's after-effects on the
target's steps: docs/benchmarks.md "Settling steps and what drafting leaves behind"), drafted
steps by guesses verified with the tokens they committed, and why plain steps were plain.

    python benchmarks/step_costs.py --methods none,draft --per-category 1 --humaneval 2 --max-new-tokens 64 \\
        --repeats 2 --threads 2

A variant is a method (`specdec.methods`; `none` for plain decoding), the first the reference.
`--warm` keeps one engine per variant across the prompts instead (after one untimed pass).
"""

from __future__ import annotations

import argparse
import collections
import logging
import re
import time

import torch
from devset import add_prompt_options, dev_prompts
from harness import emit, interleaved, machine, median

#: the scheduler's debug line for a step (ContinuousBatcher._record)
STEP_LINE = re.compile(r"step: batch (\d+), draft cap (\d+), guesses (\d+), accepted (\d+), ([\d.]+) ms"
                       r"(?: \(plain: (\w+)\))?")
#: plain steps this many or more steps after the last drafting one are pooled
FAR = 9
#: positions in the answer are pooled by this many steps
BLOCK = 8


class Timers(logging.Handler):
    """The scheduler's step lines, and per step the planning, `run_step` and forward seconds."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.plan: list[float] = []
        self.run: list[float] = []
        self.forward: list[float] = []
        self.in_step = False

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def take(self) -> list[dict]:
        """The steps since the last call, as dicts; cleared."""
        steps = []
        for line in self.lines:
            m = STEP_LINE.search(line)
            if m is None:
                continue
            i = len(steps)
            steps.append({"guesses": int(m[3]), "accepted": int(m[4]), "ms": float(m[5]), "reason": m[6] or "",
                          "plan_ms": 1e3 * self.plan[i], "run_ms": 1e3 * self.run[i],
                          "forward_ms": 1e3 * self.forward[i]})
        self.lines, self.plan, self.run, self.forward = [], [], [], []
        return steps


def instrument(target, timers: Timers):
    """Time every step's planning, `run_step` and the target's forward inside it, and send the
    scheduler's step lines to `timers`; returns a function that undoes it."""
    from specdec.core import proposal, scheduler
    from specdec.engine import Engine

    log = logging.getLogger("specdec.step_costs")
    log.addHandler(timers)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    make_scheduler, plan, run_step = Engine._scheduler, proposal.Sources.plan, scheduler.run_step
    cls = type(target.model)
    forward = cls.__call__

    def logged_scheduler(self, *a, **kw):
        s = make_scheduler(self, *a, **kw)
        s.log = log
        return s

    def timed_plan(self, *a, **kw):
        t0 = time.perf_counter()
        out = plan(self, *a, **kw)
        timers.plan.append(time.perf_counter() - t0)
        return out

    def timed_step(*a, **kw):
        t0 = time.perf_counter()
        timers.in_step = True
        try:
            out = run_step(*a, **kw)
        finally:
            timers.in_step = False
        timers.run.append(time.perf_counter() - t0)
        return out

    def timed_forward(model, *a, **kw):  # the target's forward in a step (a draft model may share the class)
        if model is not target.model or not timers.in_step:
            return forward(model, *a, **kw)
        t0 = time.perf_counter()
        out = forward(model, *a, **kw)
        timers.forward.append(time.perf_counter() - t0)
        return out

    Engine._scheduler, proposal.Sources.plan, scheduler.run_step = logged_scheduler, timed_plan, timed_step
    cls.__call__ = timed_forward

    def undo() -> None:
        Engine._scheduler, proposal.Sources.plan, scheduler.run_step = make_scheduler, plan, run_step
        cls.__call__ = forward
        log.removeHandler(timers)
    return undo


def profile(runs: list[list[dict]]) -> dict:
    """One variant's steps over all its calls: plain steps by steps since the last drafting one
    (-1: none yet in that call; FAR: that many or more) and by position, drafted steps by guesses."""
    since: dict[int, list[dict]] = collections.defaultdict(list)
    position: dict[int, list[float]] = collections.defaultdict(list)
    drafted: dict[int, list[dict]] = collections.defaultdict(list)
    reasons: collections.Counter = collections.Counter()
    for steps in runs:
        last = None
        for j, s in enumerate(steps):
            if s["guesses"]:
                drafted[s["guesses"]].append(s)
                last = j
                continue
            reasons[s["reason"] or "plain"] += 1
            since[-1 if last is None else min(j - last, FAR)].append(s)
            position[j // BLOCK].append(s["ms"])

    def med(rows, key):
        return round(median(r[key] for r in rows), 2)
    return {
        "plain_after_drafting": {k: {"n": len(v), "ms": med(v, "ms"), "plan_ms": med(v, "plan_ms"),
                                     "forward_ms": med(v, "forward_ms")} for k, v in sorted(since.items())},
        "plain_by_position": {k * BLOCK: round(median(v), 2) for k, v in sorted(position.items())},
        "drafted": {k: {"n": len(v), "ms": med(v, "ms"), "forward_ms": med(v, "forward_ms"),
                        "tokens": round(sum(1 + s["accepted"] for s in v) / len(v), 2)} for k, v in sorted(drafted.items())},
        "plain_reasons": dict(reasons),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_options(ap)
    ap.add_argument("--methods", default="none,draft", help="variants, the first the reference. Default: none,draft")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="seeded (7) where above 0. Default: greedy")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warm", action="store_true", help="one engine per variant, kept across prompts")
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
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            seed=7 if args.temperature > 0 else None)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    timers = Timers()
    undo = instrument(target, timers)
    try:
        def variant(method: str):
            kept = build_engine(SpecConfig(method=method), target) if args.warm else None
            if kept is not None:
                for p in prompts:  # one untimed pass: what a process that decoded before has learnt
                    kept.generate([p], params)
                timers.take()

            def call(prompt):
                forget_shared()  # no suffix drafts from these prompts' earlier answers
                engine = kept or build_engine(SpecConfig(method=method), target)
                timers.take()
                res = engine.generate([prompt], params)
                return summarize(res), [r.tokens for r in res], timers.take()
            return call

        raw = interleaved({m: variant(m) for m in methods}, prompts, args.repeats)
    finally:
        undo()

    def rate(method: str, rep: int) -> float:
        runs = [raw[method][i][rep][0] for i in range(len(prompts))]
        return sum(s["new_tokens"] for s in runs) / sum(s["decode_s"] for s in runs)

    base = methods[0]
    out = {"benchmark": "step_costs", "machine": machine(args.threads), "prompts": len(prompts),
           "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "warm": args.warm, "variants": {}}
    for m in methods:
        ratios = [rate(m, rep) / rate(base, rep) for rep in range(args.repeats)]
        equal = all(raw[m][i][rep][1] == raw[base][i][rep][1] for i in range(len(prompts)) for rep in range(args.repeats))
        prof = profile([raw[m][i][rep][2] for i in range(len(prompts)) for rep in range(args.repeats)])
        # a call's decode time that no step accounts for (its sources joining the row, a first
        # proposal's set-up, the end of the call): a fixed cost per call where steps look alike
        calls = [raw[m][i][rep] for i in range(len(prompts)) for rep in range(args.repeats)]
        outside = median(1e3 * stats["decode_s"] - sum(st["ms"] for st in steps) for stats, _, steps in calls)
        prof["outside_steps_ms"] = round(outside, 2)
        out["variants"][m] = {"ratio": round(median(ratios), 3), "per_repeat": [round(r, 3) for r in ratios],
                              "equal": equal, **prof}
        print(f"{m}: {median(ratios):.3f} of {base}'s decode rate (repeats {', '.join(f'{r:.3f}' for r in ratios)}), "
              f"text {'equal' if equal else 'DIFFERS'}; plain steps {prof['plain_reasons']}; "
              f"{prof['outside_steps_ms']} ms of a call's decode time outside its steps (median)")
        print("  plain steps, ms by steps since the last drafting one (-1: none yet): "
              + ", ".join(f"{k}: {v['ms']} (forward {v['forward_ms']}, n {v['n']})" for k, v in prof["plain_after_drafting"].items()))
        print("  plain steps, ms by position: " + ", ".join(f"{k}+: {v}" for k, v in prof["plain_by_position"].items()))
        if prof["drafted"]:
            print("  drafted steps by guesses: " + ", ".join(f"{k}: {v['ms']} ms, {v['tokens']} tokens (n {v['n']})"
                                                             for k, v in prof["drafted"].items()))
    emit(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
