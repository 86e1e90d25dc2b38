"""Agent-like traces decoded in order, one request at a time: `suffix` and `auto` against plain
decoding, tokens/s over each whole trace (issue 57's goal: >= 2x on agent-like traces).

The traces are benchmarks/data/agentic/<trace>.jsonl (`agentic_traces.py write`): related
requests whose answers repeat each other. Each method decodes a whole trace as one block, its
requests in order (so later requests draft from earlier answers, as a server's would), starting
from an empty suffix cache; blocks alternate in order over the repeats (none, suffix, auto, then
auto, suffix, none, ...) and each method's median over repeats is reported. Greedy, but for the
`samples` trace (best-of-n: one prompt sampled 8 times at temperature 0.8, seeds 0..7, one after
another, so later samples draft from earlier ones); every method's answers must equal plain
decoding's (checked: seeded sampling with deterministic guesses commits plain sampling's text).
The trace `spec-bench` is the opposite case: first turns of the Spec-Bench dev set spread over its
categories, where nothing repeats across requests (issue 57: never below 0.97x plain there).
Through the Python API, whose scheduler is the one `specdec serve` runs. Besides tokens/s over the
whole trace (prefills included: the goal's figure), "decoding" is the ratio of decoding alone
(tokens after each request's first / its seconds after the prefill): what speculation changes.

    python benchmarks/suffix_traces.py --traces sql,extract,report,tools --requests 20 --repeats 2 --threads 1
    python benchmarks/suffix_traces.py --sim xeon-vnni --traces sql,report,tools --requests 12

`--serve` sends each trace through HTTP instead: one `specdec serve` process per method and
block (a fresh one, so every block starts from an empty suffix cache), one client sending the
requests in order to /v1/chat/completions, each awaited before the next; tokens/s over the whole
trace as the client sees it (completion tokens from `usage` / wall seconds, HTTP included).

`--sim PROFILE` runs on a simulated clock (specdec/simclock.py: only the target's forwards advance
it, by the profile's cost curve), so the ratios do not depend on the machine's load and one repeat
is exact; what the wall clock adds beyond it is the per-step work in Python. Through the API, each
method's tokens per step, guesses verified per step and share of plain steps (its last block) are
printed too.

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


SAMPLES, SAMPLE_TEMPERATURE = 8, 0.8  # the `samples` trace: best-of-n (agentic_traces.py's SAMPLES)


def trace(name: str, limit: int) -> list[dict]:
    """The first `limit` requests of a trace, each with its sampling settings: greedy, but for
    `samples`, whose one prompt is sampled SAMPLES times (seeds 0, 1, ...) at temperature 0.8."""
    if name == "spec-bench":  # unrelated requests: first turns spread evenly over the dev set's categories
        from devset import DEV_SET

        rows = [json.loads(line) for line in DEV_SET.read_text(encoding="utf-8").splitlines() if line.strip()]
        rows = rows[::max(1, len(rows) // limit)][:limit]
        return [{"messages": [{"role": "user", "content": r["turns"][0]}], "sampling": {"temperature": 0.0}}
                for r in rows]
    lines = (HERE / "data" / "agentic" / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines if line]
    if name == "samples":
        return [{**rows[0], "sampling": {"temperature": SAMPLE_TEMPERATURE, "seed": s}} for s in range(SAMPLES)][:limit]
    return [{**r, "sampling": {"temperature": 0.0}} for r in rows[:limit]]


def run_block(spec, requests: list[dict], max_tokens: int) -> tuple[float, int, list[list[int]], dict]:
    """(seconds, tokens, each answer's ids, step counts) of one method over a whole trace, from an
    empty cache."""
    from specdec.drafters.suffix import forget_shared

    forget_shared()
    if spec.engine.prefix_cache is not None:  # (every block starts from an empty prefix cache too)
        spec.engine.prefix_cache.clear()
    seconds, tokens, answers = 0.0, 0, []
    steps = {"steps": 0, "nodes": 0, "accepted": 0, "plain": 0, "decode_s": 0.0, "decoded": 0, "prefill_s": 0.0,
             "prompt_tokens": 0, "cached_tokens": 0}
    schedulers = []
    make = spec.engine._scheduler
    spec.engine._scheduler = lambda *a: schedulers.append(make(*a)) or schedulers[-1]
    try:
        for r in requests:
            t0 = time.perf_counter()
            out = spec.generate(r["messages"], max_new_tokens=max_tokens, **r["sampling"])
            seconds += time.perf_counter() - t0
            tokens += len(out.token_ids)
            answers.append(list(out.token_ids))
            steps["decode_s"] += out.stats.decode_s
            steps["decoded"] += max(len(out.token_ids) - 1, 0)  # (the first token comes with the prefill)
            steps["prefill_s"] += out.stats.prefill_s
            steps["prompt_tokens"] += out.stats.prompt_tokens
            steps["cached_tokens"] += out.stats.cached_tokens
    finally:
        spec.engine._scheduler = make
    for s in schedulers:
        t = s.totals
        steps["steps"] += t.steps
        steps["nodes"] += t.proposed
        steps["accepted"] += t.accepted
        steps["plain"] += sum(t.plain_steps.values())
    return seconds, tokens, answers, steps


#: method -> serve_load.py's setting (a server process with that --method, load-aware)
SERVE_SETTINGS = {"none": "off", "suffix": "adaptive-suffix", "auto": "adaptive"}


def serve_block(method: str, requests: list[dict], max_tokens: int, args) -> tuple[float, int, list[str], dict]:
    """(seconds, tokens, each answer's text, {}) of one method over a whole trace sent over HTTP to
    a fresh `specdec serve` (an empty suffix cache), one request at a time."""
    import urllib.request

    from serve_load import start
    from specdec.methods import TABLE

    setting = SERVE_SETTINGS[method]
    opts = argparse.Namespace(k=TABLE[method].k or 1, max_batch=1, threads=args.threads, step_log=None,
                              model=args.model)
    proc, url = start(setting, opts)
    seconds, tokens, answers = 0.0, 0, []
    try:
        for r in requests:
            body = json.dumps({"model": "m", "messages": r["messages"], "max_tokens": max_tokens,
                               **r["sampling"]}).encode()
            req = urllib.request.Request(url + "/chat/completions", body, {"Content-Type": "application/json"})
            t0 = time.perf_counter()
            with urllib.request.urlopen(req, timeout=600) as resp:
                out = json.loads(resp.read())
            seconds += time.perf_counter() - t0
            tokens += out["usage"]["completion_tokens"]
            answers.append(out["choices"][0]["message"]["content"])
    finally:
        proc.terminate()
        proc.wait(30)
    return seconds, tokens, answers, {}


def load_variant(model, text: str, threads: int, prefix_cache_mb: float):
    """A Speculator for a method or a variant such as `auto:k=16` or `suffix:prefix_cache_mb=0`
    (methods.variant_config's options: SpecConfig fields)."""
    import specdec
    from specdec.config import SpecConfig
    from specdec.methods import variant_config

    config = variant_config(SpecConfig(model=model, threads=threads, prefix_cache_mb=prefix_cache_mb), text, {})
    return specdec.load(config=config)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default="sql,extract,report,tools")
    ap.add_argument("--methods", default="suffix,auto", help="methods or variants (auto:k=16). Default: suffix,auto")
    ap.add_argument("--model", default=None, help="a .gguf or folder (default: the default model)")
    ap.add_argument("--requests", type=int, default=20, help="the first N requests of each trace")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sim", default=None, metavar="PROFILE",
                    help="a simulated clock with this cost profile (specdec/simclock.py PROFILES)")
    ap.add_argument("--step-ms", type=float, default=15.0, help="with --sim: one plain step, ms. Default: 15")
    ap.add_argument("--serve", action="store_true", help="through `specdec serve` processes over HTTP")
    ap.add_argument("--prefix-cache-mb", type=float, default=256,
                    help="the prefix cache of every method (plain's too) unless a variant sets its own "
                         "(suffix:prefix_cache_mb=0); 0: none. Default: 256 (the CLI's)")
    args = ap.parse_args()
    import contextlib

    from specdec.simclock import PROFILES, SimClock, charge, curve, simulated

    methods = ["none"] + [m for m in args.methods.split(",") if m and m != "none"]
    if args.serve:
        if args.sim:
            raise SystemExit("--serve and --sim do not go together (a server's clock is its own)")
        if set(methods) - set(SERVE_SETTINGS) or args.prefix_cache_mb != 256:
            raise SystemExit(f"--serve runs the methods {', '.join(SERVE_SETTINGS)} (with the servers' default prefix "
                             f"cache); got {args.methods}")
        run(args, methods, None)
        return
    specs = {m: load_variant(args.model, m, args.threads, args.prefix_cache_mb) for m in methods}
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
    rows, report = [], {"machine": machine(args.threads), "simulated": args.sim, "http": args.serve, "traces": {}}
    for name in [t for t in args.traces.split(",") if t]:
        requests = trace(name, args.requests)
        rates = {m: [] for m in methods}
        decode_rates = {m: [] for m in methods}
        exact = {m: True for m in methods}
        plain_answers, counts = None, {}
        for rep in range(args.repeats):
            for m in (methods if rep % 2 == 0 else methods[::-1]):
                if specs is None:
                    seconds, tokens, answers, counts[m] = serve_block(m, requests, args.max_tokens, args)
                else:
                    seconds, tokens, answers, counts[m] = run_block(specs[m], requests, args.max_tokens)
                rates[m].append(tokens / seconds)
                if counts[m].get("decode_s"):
                    decode_rates[m].append(counts[m]["decoded"] / counts[m]["decode_s"])
                if m == "none":
                    plain_answers = answers if plain_answers is None else plain_answers
                else:
                    exact[m] = exact[m] and (plain_answers is None or answers == plain_answers)
        med = {m: statistics.median(v) for m, v in rates.items()}
        row = {"trace": name, "plain tok/s": med["none"]}
        decode = {m: statistics.median(v) for m, v in decode_rates.items() if v}
        for m in methods[1:]:
            row[f"{m} / plain"] = f"{med[m] / med['none']:.2f}x" + ("" if exact[m] else " (differs!)")
            if m in decode and "none" in decode:
                row[f"{m}, decoding"] = f"{decode[m] / decode['none']:.2f}x"
        rows.append(row)
        report["traces"][name] = {"tokens_per_s": med, "ratio": {m: med[m] / med["none"] for m in methods[1:]},
                                  "exact": exact, "requests": len(requests), "steps": counts,
                                  "decode_tokens_per_s": decode}
        print(f"{name}: " + ", ".join(f"{m} {med[m]:.1f} tok/s" for m in methods), flush=True)
        for m in methods if specs is not None else []:
            c = counts[m]
            n = max(c["steps"], 1)
            print(f"  {m}: {(c['accepted'] + c['steps']) / n:.2f} tokens per step, {c['nodes'] / n:.2f} guesses "
                  f"verified per step, {c['plain'] / n:.0%} of steps plain; prefills {c['prefill_s']:.1f} s "
                  f"({c['cached_tokens'] / max(c['prompt_tokens'], 1):.0%} of prompt tokens cached)", flush=True)
    columns = [f"{m} / plain" for m in methods[1:]]
    if specs is not None:
        columns += [f"{m}, decoding" for m in methods[1:]]
    print(table(rows, ["trace", "plain tok/s"] + columns))
    emit(report)


if __name__ == "__main__":
    main()
