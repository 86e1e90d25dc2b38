"""Seeded sampled requests: lookups cut by a per-request clockless policy vs proposed whole.

A seeded sample (`--seed` with `--temperature > 0`) must not draft by measured times (the
same seed must give the same text), so until 2026-12-01 its lookups went out whole, up to
k guesses, however rarely they held. Now a policy of its own, started afresh per request,
learns acceptance from that request and prices a guess at a fixed cost
(`NgramDrafter(seeded_cut=True)`, the default). This runs plain decoding, the old rule
(`seeded_cut=False`) and the new one on the same prompts, interleaved per prompt (the
order flips every other prompt), each prompt with its own seed, and prints decode tokens/s,
the speedup over plain decoding and τ for each. Each sample differs between the rules
(another proposal length draws other random numbers), so compare totals over many prompts.

    python benchmarks/seeded_lookup.py --method ngram --threads 2
    python benchmarks/seeded_lookup.py --method auto --threads 2
"""

from __future__ import annotations

import argparse
import json

import torch
from devset import DEV_SET

DEFAULT_DATA = DEV_SET


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", choices=["ngram", "auto"], default="ngram",
                    help="ngram: prompt lookup alone; auto: lookup + the shipped EAGLE head. Default: ngram")
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="Spec-Bench JSONL")
    ap.add_argument("--per-category", type=int, default=1, help="prompts per category of --data. Default: 1")
    ap.add_argument("--humaneval", type=int, default=3, help="HumanEval prompts (completion). Default: 3")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=2, help="passes over the prompts (seeds stay the same). Default: 2")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    if args.temperature <= 0:
        ap.error("--temperature must be > 0 (a seeded greedy request is not a sample)")
    torch.set_num_threads(args.threads)

    from specdec.bench.tasks import dev_and_humaneval
    from specdec.drafters.hybrid import lookup_eagle_for
    from specdec.drafters.ngram import NgramDrafter
    from specdec.engine import Engine
    from specdec.models.loader import load_model
    from specdec.types import SamplingParams

    lm = load_model(None, quiet=True)
    prompts = [ids for _, ids in dev_and_humaneval(lm.tokenizer, args.data, args.per_category, args.humaneval)]

    def drafter(cut: bool):
        if args.method == "ngram":
            return NgramDrafter(seeded_cut=cut)
        d = lookup_eagle_for(lm)
        d.ngram.seeded_cut = cut
        return d

    engines = {"none": Engine(lm.model, None, k=0, eos_ids=lm.eos_ids),
               "whole": Engine(lm.model, drafter(False), k=8, eos_ids=lm.eos_ids),
               "cut": Engine(lm.model, drafter(True), k=8, eos_ids=lm.eos_ids)}
    totals = {name: [0.0, 0, 0] for name in engines}  # decode seconds, tokens, target forwards
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=100 + i)
            order = list(engines) if (i + rep) % 2 == 0 else list(engines)[::-1]
            for name in order:
                [res] = engines[name].generate([ids], params)
                t = totals[name]
                t[0] += res.stats.decode_s
                t[1] += len(res.tokens)
                t[2] += res.stats.target_forwards
        print(f"pass {rep + 1}/{args.repeats} done", flush=True)
    base = totals["none"][1] / totals["none"][0]
    out = {}
    for name, (secs, toks, fwd) in totals.items():
        rate = toks / secs
        out[name] = {"tokens_per_s": round(rate, 2), "speedup": round(rate / base, 3), "tau": round(toks / fwd, 3)}
        print(f"{name:6s} {rate:6.1f} tok/s  {rate / base:5.2f}x  tau {toks / fwd:.2f}")
    print(json.dumps({"benchmark": "seeded_lookup", "method": args.method, "prompts": len(prompts),
                      "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                      "repeats": args.repeats, "threads": args.threads, "results": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
