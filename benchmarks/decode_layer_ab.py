"""A decoding step's kernel calls made from C++ against the same calls made from Python
(models/llama.py), in one process: `--switch layer` (default) one `decode_layer` call a layer
against the Python calls (DECODE_LAYER_OP; Qwen2-family files took the Python calls before
decode_layer added their q/k/v bias), `--switch layers` one `decode_layers` call a step against
one `decode_layer` call a layer (DECODE_LAYERS_OP). Each prompt generated with the switch on and
off in turn (the order flipping every repeat), greedy; decode tokens/s per method, medians, and
the ratio. The texts must be equal (the same numbers): a difference stops the run.

    python benchmarks/decode_layer_ab.py --threads 2 --repeats 8
    python benchmarks/decode_layer_ab.py --threads 1 --methods none
    python benchmarks/decode_layer_ab.py --switch layers --threads 2 --repeats 6
    python benchmarks/decode_layer_ab.py --model ~/.cache/specdec/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --methods none --max-new-tokens 48 --repeats 3
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
    ap.add_argument("--switch", choices=["layer", "layers"], default="layer",
                    help="layer: decode_layer against the Python calls; layers: decode_layers against a "
                         "decode_layer call a layer. Default: layer")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    args = ap.parse_args()
    flag = {"layer": "DECODE_LAYER_OP", "layers": "DECODE_LAYERS_OP"}[args.switch]
    names = {"layer": ("one call a layer", "Python calls"), "layers": ("one call a step", "one call a layer")}[args.switch]

    from specdec import threads
    from specdec.config import SpecConfig, build_engine, load_target
    from specdec.models import llama
    from specdec.types import SamplingParams

    threads.start(args.threads)
    methods = [m for m in args.methods.split(",") if m]
    target = load_target(SpecConfig(threads=args.threads, **({"model": args.model} if args.model else {})), quiet=True)
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
                setattr(llama, flag, on)
                for x in ids:
                    [r] = engine.generate([x], params)
                    rates[(m, on)].append(r.stats.new_tokens / r.stats.decode_s)
                    if texts.setdefault((m, tuple(x)), r.tokens) != r.tokens:
                        raise SystemExit(f"{m}: the text differs with {flag}={on}")
    setattr(llama, flag, True)
    for m in methods:
        one, calls = statistics.median(rates[(m, True)]), statistics.median(rates[(m, False)])
        print(f"{m}: decode tokens/s, {names[0]} {one:.1f}, {names[1]} {calls:.1f}: {one / calls:.3f}x")


if __name__ == "__main__":
    main()
