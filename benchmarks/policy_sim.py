"""The cost model on a simulated machine: every method against plain decoding, with the clock
advanced only by modelled costs, so the figures do not depend on how loaded this machine is and a
machine you do not have (verification dear or cheap, a slow drafter) can be tried.

The real model decodes the real prompts (so every guess and every acceptance is real, and every
text is checked against plain decoding's), but `time.perf_counter` reads a simulated clock that
only the target's forwards and the drafters' work advance, by a cost profile in plain-step units:

- the target scoring A rows of T tokens costs `profile(A * T)` (a curve through measured points,
  t(1) = 1 step of `--step-ms`);
- the draft model's forward costs `--draft-ratio` of the target's at the same size;
- an EAGLE proposal costs `--eagle` steps plus `--catch-up` per committed token it reads first;
  a Medusa proposal `--medusa` steps.

Everything the cost model measures (step times, drafting times, timing the sources alone) is read
off that clock, so what it chooses is what it would choose on such a machine; the ratio of decode
rates is exact for the profile (no repeats needed). Each call is a fresh engine, as in
`method_grid.py`:

    python benchmarks/policy_sim.py --profile xeon-vnni --methods ngram,suffix,draft,eagle,medusa,auto
    python benchmarks/policy_sim.py --profile dear --batches 1,8 --samplings greedy,t0.8

Profiles (xeon-vnni, zen2-avx2, dear, cheap): t(T) / t(1) at T tokens scored, where each was
measured, in specdec/simclock.py (PROFILES).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from devset import add_prompt_options, dev_prompts
from harness import emit, table

from specdec.simclock import PROFILES, SimClock, charge, curve, simulated


def charge_sources(sources, clock: SimClock, step: float, args, target_cost) -> None:
    """Make each draft source's work advance the simulated clock (module docstring's costs)."""
    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.drafters.eagle import EagleDrafter
    from specdec.drafters.medusa import MedusaDrafter

    for d in sources:
        if isinstance(d, DraftModelDrafter) and not getattr(d.model, "_sim", False):
            charge(d.model, clock, lambda tokens: step * args.draft_ratio * target_cost(tokens))
            d.model._sim = True
        elif isinstance(d, EagleDrafter) and not getattr(d, "_sim", False):
            propose = d.propose

            def eagle_propose(ctx, max_tokens, d=d, propose=propose):
                behind = sum(d.lags(ctx.tokens))
                out = propose(ctx, max_tokens)
                if max_tokens > 0 and (ctx.want is None or any(ctx.want)):
                    clock.advance(step * (args.eagle + args.catch_up * behind))
                return out
            d.propose, d._sim = eagle_propose, True
        elif isinstance(d, MedusaDrafter) and not getattr(d, "_sim", False):
            propose = d.propose

            def medusa_propose(ctx, max_tokens, propose=propose):
                out = propose(ctx, max_tokens)
                if max_tokens > 0:
                    clock.advance(step * args.medusa)
                return out
            d.propose, d._sim = medusa_propose, True


def serve_levels(args, target, clock: SimClock, step: float, target_cost, methods: list[str], trace) -> int:
    """--serve: the server's scheduler (a ContinuousBatcher per method, as `specdec serve` builds it:
    requests with their own sampling settings, one long-lived cost model) answering levels of C
    requests sent at once, each level's prompts new to both; tokens per simulated second against
    `none`'s, and each answer checked against none's."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from serve_load import short_code_prompts

    from specdec.config import SpecConfig
    from specdec.core.request import Request
    from specdec.core.scheduler import ContinuousBatcher
    from specdec.methods import sources_for
    from specdec.drafters.suffix import forget_shared
    from specdec.text import render_chat
    from specdec.types import SamplingParams

    tok = target.tokenizer
    if args.serve_data == "code":
        texts = short_code_prompts()
    else:
        texts = [json.loads(line)["turns"][0] for line in open(args.data)]
        texts = [render_chat(tok, [{"role": "user", "content": t}]) for t in texts]
    enc = [ids for ids in (tok.encode(t) for t in texts) if len(ids) < 700]
    levels = [int(c) for c in args.serve.split(",")]
    params = SamplingParams(max_new_tokens=args.max_new_tokens) if args.samplings == "greedy" else \
        SamplingParams(max_new_tokens=args.max_new_tokens, temperature=float(args.samplings[1:]), seed=7)
    warm, fresh = enc[-8:], enc[:-8]

    def level(batcher, prompts) -> tuple[float, list[list[int]]]:
        done: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            batcher.submit(Request(list(p), params, lambda ids: None,
                                   lambda reason, stats, i=i: done.setdefault(i, []), id=str(i)))
        reqs = list(batcher.waiting.queue)
        t0 = clock()
        batcher.run(until=lambda: len(done) == len(prompts))
        return clock() - t0, [r.tokens for r in reqs]

    results: dict[str, dict[int, tuple[float, list]]] = {}
    for method in ["none"] + methods:
        forget_shared()
        cfg = SpecConfig(method=method, max_batch=max(32, max(levels)))
        sources, k = sources_for(cfg, target, True)  # as config.build_batcher, on the charged target
        batcher = ContinuousBatcher(target.model, target.eos_ids, sources, method=method, k_max=k or cfg.method_k(),
                                    max_batch=cfg.max_batch, max_context=cfg.max_context, thread=False)
        charge_sources(batcher.sources.drafters, clock, step, args, target_cost)
        batcher.log = trace
        batcher.warm_up()
        for p in warm[:4]:  # as serve_load warms a server: one at a time, then four at once
            level(batcher, [p])
        level(batcher, warm[4:])
        results[method], at = {}, 0
        for c in levels:  # (at least 8 requests a level: below 8 clients, rounds of c)
            took, out = 0.0, []
            for _ in range(-(-8 // c)):
                seconds, tokens = level(batcher, fresh[at:at + c])
                took, out, at = took + seconds, out + tokens, at + c
            results[method][c] = (took, out)
    rows = []
    for method in methods:
        for c in levels:
            (t_none, out_none), (t_m, out_m) = results["none"][c], results[method][c]
            tokens = sum(len(t) for t in out_m)
            rows.append({"method": method, "clients": c, "ratio": round(t_none / t_m, 3),
                         "equal": out_m == out_none, "tokens": tokens})
            print(f"  {method}, {c} clients: {t_none / t_m:.3f} of plain", flush=True)
    print(table(rows, ["method", "clients", "ratio", "equal", "tokens"]))
    emit({"benchmark": "policy_sim", "mode": "serve", "profile": args.profile, "data": args.serve_data,
          "costs": vars(args), "cells": rows, "worst": min((r["ratio"] for r in rows), default=None)})
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="xeon-vnni", choices=sorted(PROFILES))
    ap.add_argument("--step-ms", type=float, default=15.0, help="one plain step, ms. Default: 15")
    ap.add_argument("--draft-ratio", type=float, default=0.4, help="a draft-model forward / the target's. Default: 0.4")
    ap.add_argument("--eagle", type=float, default=0.5, help="an EAGLE proposal, plain steps. Default: 0.5")
    ap.add_argument("--catch-up", type=float, default=0.02, help="an EAGLE catch-up per token read, steps. Default: 0.02")
    ap.add_argument("--medusa", type=float, default=0.05, help="a Medusa proposal, plain steps. Default: 0.05")
    add_prompt_options(ap)
    ap.add_argument("--methods", default="ngram,suffix,draft,eagle,medusa,auto")
    ap.add_argument("--samplings", default="greedy", help="greedy and/or tT (temperature T, seeded)")
    ap.add_argument("--batches", default="1", help="batch sizes. Default: 1")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit", type=int, default=0, help="only the first N prompts (0: all)")
    ap.add_argument("--trace", action="store_true", help="print every step's choice and simulated time")
    ap.add_argument("--serve", default=None, metavar="LEVELS",
                    help="the server's scheduler instead of generate: levels of C requests sent at once, e.g. "
                         "1,8,16,32 (one --samplings setting)")
    ap.add_argument("--serve-data", default="code", choices=("code", "chat"),
                    help="with --serve: 'code' (short raw code completions, as serve_load.py --data code) or "
                         "'chat' (the --data file's first turns). Default: code")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specdec.config import SpecConfig, build_engine
    from specdec.drafters.suffix import forget_shared
    from specdec.metrics import summarize
    from specdec.models.loader import load_model
    from specdec.types import SamplingParams

    clock = SimClock()
    step = args.step_ms / 1e3
    target_cost = curve(PROFILES[args.profile])
    target = load_model(None, quiet=True)
    prompts = dev_prompts(target.tokenizer, args)
    prompts = prompts[:args.limit] if args.limit else prompts
    if args.trace:
        import logging

        logging.basicConfig(format="%(message)s")
        trace = logging.getLogger("policy_sim")
        trace.setLevel(logging.DEBUG)
    charge(target.model, clock, lambda tokens: step * target_cost(tokens))
    methods = [m.strip() for m in args.methods.split(",") if m.strip() and m.strip() != "none"]

    def engine(method: str):
        """A fresh engine whose drafters advance the simulated clock."""
        e = build_engine(SpecConfig(method=method), target)
        if args.trace:
            make = e._scheduler

            def traced(*a, make=make):
                scheduler = make(*a)
                scheduler.log = trace
                return scheduler
            e._scheduler = traced
        charge_sources(e.sources, clock, step, args, target_cost)
        return e

    if args.serve:
        with simulated(clock):
            return serve_levels(args, target, clock, step, target_cost, methods, trace if args.trace else None)
    real = time.perf_counter
    rows, cells = [], []
    with simulated(clock):
        for sampling in [s.strip() for s in args.samplings.split(",") if s.strip()]:
            params = SamplingParams(max_new_tokens=args.max_new_tokens) if sampling == "greedy" else \
                SamplingParams(max_new_tokens=args.max_new_tokens, temperature=float(sampling[1:]), seed=7)
            for batch in [int(b) for b in args.batches.split(",") if b.strip()]:
                items = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
                results = {}
                for method in ["none"] + methods:
                    t0 = real()
                    out = []
                    for item in items:
                        forget_shared()
                        out.append(engine(method).generate(item, params))
                    results[method] = out
                    if method != "none":
                        got, plain = (summarize([r for item in results[m] for r in item]) for m in (method, "none"))
                        print(f"  {sampling}, batch {batch}, {method}: {got['tokens_per_s'] / plain['tokens_per_s']:.3f}"
                              f" of plain ({real() - t0:.0f} s)", flush=True)
                plain = summarize([r for item in results["none"] for r in item])
                for method in methods:
                    got = summarize([r for item in results[method] for r in item])
                    equal = all([r.tokens for r in a] == [r.tokens for r in b]
                                for a, b in zip(results[method], results["none"]))
                    cell = {"method": method, "sampling": sampling, "batch": batch,
                            "ratio": round(got["tokens_per_s"] / plain["tokens_per_s"], 3), "equal": equal,
                            "row_steps_without_guesses": got["plain_steps"],
                            "sources": got["sources"]}
                    cells.append(cell)
                    rows.append({**cell, "declined": ", ".join(f"{k} {v}" for k, v in sorted(got["plain_steps"].items())),
                                 "accepted": ", ".join(f"{k} {v['accepted']}/{v['proposed']}"
                                                       for k, v in sorted(got["sources"].items()))})
    print(table(rows, ["method", "sampling", "batch", "ratio", "equal", "declined", "accepted"]))
    emit({"benchmark": "policy_sim", "profile": args.profile, "costs": vars(args), "prompts": len(prompts),
          "cells": cells, "worst": min((c["ratio"] for c in cells), default=None)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
