"""One `decode_layer` call a layer against the same kernel calls made from Python (models/llama.py,
DECODE_LAYER_OP), in one process on the default model: each prompt generated with the switch on
and off in turn (the order flipping every repeat), greedy; decode tokens/s per method, medians,
and the ratio. The texts must be equal (the same numbers): a difference stops the run.

    python benchmarks/decode_layer_ab.py --threads 2 --repeats 8
    python benchmarks/decode_layer_ab.py --threads 1 --methods none
"""

from __future__ import annotations

import argparse
import statistics

PROMPTS = ["# Python utilities for strings\ndef reverse_words(s):", "def quicksort(arr):",
           "class Stack:\n    def __init__(self):"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--methods", default="none,auto")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()

    from specdec import threads
    from specdec.config import SpecConfig, build_engine, load_target
    from specdec.models import llama
    from specdec.types import SamplingParams

    threads.start(args.threads)
    methods = [m for m in args.methods.split(",") if m]
    target = load_target(SpecConfig(threads=args.threads), quiet=True)
    engines = {m: build_engine(SpecConfig(method=m, threads=args.threads), target) for m in methods}
    ids = [target.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    rates = {(m, on): [] for m in methods for on in (True, False)}
    texts = {}
    for engine in engines.values():  # (unmeasured: a fresh engine's first calls time its drafters, learn)
        for x in ids:
            engine.generate([x], params)
    for rep in range(args.repeats):
        for m, engine in engines.items():
            for on in ((True, False) if rep % 2 == 0 else (False, True)):
                llama.DECODE_LAYER_OP = on
                for x in ids:
                    [r] = engine.generate([x], params)
                    rates[(m, on)].append(r.stats.new_tokens / r.stats.decode_s)
                    if texts.setdefault((m, tuple(x)), r.tokens) != r.tokens:
                        raise SystemExit(f"{m}: the text differs with DECODE_LAYER_OP={on}")
    llama.DECODE_LAYER_OP = True
    for m in methods:
        one, calls = statistics.median(rates[(m, True)]), statistics.median(rates[(m, False)])
        print(f"{m}: decode tokens/s, one call a layer {one:.1f}, Python calls {calls:.1f}: {one / calls:.3f}x")


if __name__ == "__main__":
    main()
