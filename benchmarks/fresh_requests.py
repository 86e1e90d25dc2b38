"""Speculative methods when every request starts afresh (one `specdec generate` call per prompt)
against the same methods with one drafter serving every request (a server, `--prompts-file`).

The adaptive methods learn as they go: prompt lookup its per-position acceptance and the cost
of a verified token, `auto` also the EAGLE head's drafting time and accepted tokens. A process
that answers one prompt pays for that learning on every request; one that answers many pays
once. This benchmark measures the difference on the default model, greedy, batch 1: per
prompt, plain decoding, then each method with a drafter built for that request ("fresh"),
with a drafter built for that request that starts from what the previous request's drafter
learned ("saved": what `specdec generate` does by default since learned.py, here without the
file), and with one drafter kept across all requests ("reused"), interleaved, every request's
text checked equal to plain decoding. Time per request is the whole `generate` call (the drafter's set-up for
the request, prefill and decode); the drafter's construction (loading a head, a CLI call's
start-up) is not timed. Reported per category as speedup over plain decoding (the sum of median
times), and one JSON document as the last line.

    python benchmarks/fresh_requests.py --per-category 2 --humaneval 4 --repeats 2 --methods ngram,auto --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from devset import DEV_SET

DEFAULT_DATA = DEV_SET


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="Spec-Bench style JSONL. Default: the shared dev set")
    ap.add_argument("--categories", default=None, help="comma-separated categories of --data. Default: all")
    ap.add_argument("--per-category", type=int, default=2, help="prompts per category (0: none). Default: 2")
    ap.add_argument("--humaneval", type=int, default=4, help="first N HumanEval prompts. Default: 4")
    ap.add_argument("--methods", default="ngram,auto", help="comma-separated specdec methods. Default: ngram,auto")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default="fresh,saved,reused",
                    help="comma-separated: fresh, saved, reused (see above). Default: all three")
    args = ap.parse_args()
    hows = [h.strip() for h in args.variants.split(",") if h.strip()]
    if not hows or set(hows) - {"fresh", "saved", "reused"}:
        ap.error(f"--variants: choose from fresh, saved, reused (got {args.variants!r})")
    torch.set_num_threads(args.threads)

    from specdec.bench.runner import category_speedups
    from specdec.bench.tasks import load_humaneval, load_jsonl, select
    from specdec.config import SpecConfig, build_engine
    from specdec.models.loader import load_model
    from specdec.text import encode_prompt
    from specdec.types import SamplingParams

    methods = [m.strip() for m in args.methods.split(",") if m.strip() and m.strip() != "none"]
    if not methods:
        ap.error("--methods: name at least one method besides none")
    target = load_model(None, quiet=True)
    reused = {m: build_engine(SpecConfig(method=m), target) for m in methods}
    cats = args.categories.split(",") if args.categories else None
    tasks = (select(load_jsonl(args.data), cats, args.per_category) if args.per_category > 0 else [])
    tasks += load_humaneval()[: args.humaneval]
    if not tasks:
        ap.error("no prompts: raise --per-category or --humaneval")
    encoded = [encode_prompt(target.tokenizer, t.prompt, t.chat) for t in tasks]
    variants = ["none"] + [f"{m}:{how}" for m in methods for how in hows]
    saved = {m: None for m in methods}  # what the last "saved" request's engine learned (JSON, as on disk)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    times: dict[str, dict[int, list[float]]] = {v: {} for v in variants}
    equal = {v: 0 for v in variants}
    for _ in range(args.repeats):
        for i, ids in enumerate(encoded):
            plain = None
            for v in variants:
                method, _, how = v.partition(":")
                eng = build_engine(SpecConfig(method=method), target) if how != "reused" else reused[method]
                t0 = time.perf_counter()
                if how == "saved" and saved[method] is not None:
                    eng.relearn(json.loads(saved[method]))  # timed: a CLI call reads the file too
                [r] = eng.generate([ids], params)
                times[v].setdefault(i, []).append(time.perf_counter() - t0)
                if how == "saved":
                    saved[method] = json.dumps(eng.learned())
                if v == "none":
                    plain = r.tokens
                equal[v] += r.tokens == plain
    table = category_speedups([t.category for t in tasks], times, "none", variants[1:])
    print(f"threads {args.threads}; {len(tasks)} prompts, {args.repeats} repeats; speedup over none (end to end)")
    print(f"{'category':16}" + "".join(f"{v:>14}" for v in variants[1:]))
    for c in table:
        print(f"{c:16}" + "".join(f"{table[c][v]:14.2f}" for v in variants[1:]))
    runs = len(tasks) * args.repeats
    print("greedy equal to none: " + ", ".join(f"{v} {equal[v]}/{runs}" for v in variants[1:]))
    print(json.dumps({"benchmark": "fresh_requests", "threads": args.threads, "prompts": len(tasks),
                      "repeats": args.repeats, "max_new_tokens": args.max_new_tokens, "speedup": table,
                      "greedy_equal": {v: equal[v] for v in variants[1:]}, "runs": runs}))
    return 0 if all(equal[v] == runs for v in variants[1:]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
