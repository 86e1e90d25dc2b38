"""What one forward of the native target costs: a prefill of L prompt tokens, and a step
that scores T new tokens (a chain: 1 = plain decoding, 2..9 = verifying 1..8 guesses) after
S tokens of context. The numbers behind "is one more guessed token worth it" at short and
long contexts, and a way to compare two checkouts of the model code:

    python benchmarks/forward_costs.py --threads 2
    PYTHONPATH=/path/to/other/checkout python benchmarks/forward_costs.py --threads 2
    python benchmarks/forward_costs.py --prefill 10 --tokens 1,2,3,5 --repeats 30 --pad 1,4 --threads 2
    python benchmarks/forward_costs.py --prefill 60 --context 200 --tokens 1 --after-prefill 16 --repeats 8 --threads 2

Variants are interleaved, each timed step after --warm (default 2) untimed steps of the same
variant: a step right after another variant's starts with that variant's data in the caches,
which makes short steps look dearer than in a decoding loop. `--pad 1,4` times every step twice,
interleaved, with the prepacked projections' row padding off (1) and at 4 rows
(`llama.MIN_PACKED_ROWS`, in checkouts that have it): the A/B behind that default.

Default model (as `generate` runs it), batch 1, random token ids (the cost
does not depend on which tokens), median of --repeats timed calls after a warm-up. A step is
timed with the LM head over every new token, as verification runs it; the cache is rolled
back after each call so every call sees the same context. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=_ints, default=[300, 800, 1500], help="prompt lengths. Default: 300,800,1500")
    ap.add_argument("--context", type=_ints, default=[200, 1500], help="context lengths for steps. Default: 200,1500")
    ap.add_argument("--tokens", type=_ints, default=[1, 2, 5, 9], help="new tokens per step. Default: 1,2,5,9")
    ap.add_argument("--repeats", type=int, default=15, help="timed calls per cell (prefills: a third). Default: 15")
    ap.add_argument("--pad", type=_ints, default=None,
                    help="row paddings to compare, interleaved (e.g. 1,4; 1 = none). Default: the model's own")
    ap.add_argument("--warm", type=int, default=2,
                    help="untimed steps of the same variant before each timed one (as in a decoding loop; 0: "
                         "each timed step right after another variant's). Default: 2")
    ap.add_argument("--after-prefill", type=int, default=0, metavar="N",
                    help="also time each of the N one-token steps right after a prefill of the first --prefill "
                         "length, against the same steps after that many one-token steps instead (how long a "
                         "prefill slows the steps after it; the cost model's SETTLE_STEPS). Default: 0 (not run)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import specdec
    from specdec.models import llama
    from specdec.models.loader import load_model

    if args.pad and not hasattr(llama, "MIN_PACKED_ROWS"):
        raise SystemExit("this checkout's model has no row padding (llama.MIN_PACKED_ROWS); drop --pad")
    # variants timed side by side: {label: (model, padding)}
    model = load_model(None, quiet=True).model
    variants = {pad: (model, pad) for pad in (args.pad or [getattr(llama, "MIN_PACKED_ROWS", 1)])}
    pads = list(variants)
    model = next(iter(variants.values()))[0]
    need = max(max(args.prefill), max(args.context) + max(args.tokens)) + 1
    if need > model.max_context:
        raise SystemExit(f"lengths up to {need} tokens do not fit the model's context of {model.max_context}")
    gen = torch.Generator().manual_seed(0)
    vocab = model.vocab_size

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, vocab, (1, n), generator=gen)

    def median_ms(make, n: int, warm: int = 0) -> dict:
        """{variant: median ms} of make(model)(), the variants interleaved (order flipped every other
        round); each timed call after `warm` untimed ones of the same variant, as in a decoding
        loop, where a step follows a step of the same model (not another copy's, whose weights
        would fill the caches)."""
        fns = {v: make(m) for v, (m, _) in variants.items()}
        times: dict = {v: [] for v in variants}
        for v, fn in fns.items():
            fn()
        for i in range(n):
            for v in pads if i % 2 == 0 else pads[::-1]:
                if args.pad:
                    llama.MIN_PACKED_ROWS = variants[v][1]
                for _ in range(warm):
                    fns[v]()
                t0 = time.perf_counter()
                fns[v]()
                times[v].append(time.perf_counter() - t0)
        return {v: round(statistics.median(ts) * 1e3, 2) for v, ts in times.items()}

    prefill = {}
    for L in args.prefill:
        toks, pos, last = ids(L), torch.arange(L)[None], torch.tensor([[L - 1]])
        prefill[L] = median_ms(lambda m: lambda: m(toks, pos, m.new_cache(1, L + 1), logits_at=last),
                               max(3, args.repeats // 3))
    steps = {}
    for S in args.context:
        ctx = ids(S)
        caches = {}
        for v, (m, _) in variants.items():
            caches[id(m)] = c = m.new_cache(1, S + max(args.tokens) + 1)
            m(ctx, torch.arange(S)[None], c, logits_at=torch.tensor([[S - 1]]))
        for T in args.tokens:
            toks, pos = ids(T), torch.arange(S, S + T)[None]

            def make_step(m):
                cache = caches[id(m)]

                def step():
                    m(toks, pos, cache)
                    cache.truncate(S)
                return step

            steps[(S, T)] = median_ms(make_step, args.repeats, args.warm)

    settling = {}
    if args.after_prefill:
        L, N = args.prefill[0], args.after_prefill
        if L + N + 1 > model.max_context:
            raise SystemExit(f"--after-prefill: {L + N + 1} tokens do not fit the model's context of {model.max_context}")

        def after(one_call: bool) -> list[float]:
            """Seconds of each of N one-token steps after L tokens read in one call or one at a time."""
            cache, prompt, nxt = model.new_cache(1, L + N + 1), ids(L), ids(N)
            if one_call:
                model(prompt, torch.arange(L)[None], cache, logits_at=torch.tensor([[L - 1]]))
            else:
                for i in range(L):
                    model(prompt[:, i:i + 1], torch.tensor([[i]]), cache)
            out = []
            for j in range(N):
                t0 = time.perf_counter()
                model(nxt[:, j:j + 1], torch.tensor([[L + j]]), cache)
                out.append(time.perf_counter() - t0)
            return out

        runs: dict[bool, list[list[float]]] = {True: [], False: []}
        for i in range(args.repeats):
            for one_call in ((True, False) if i % 2 == 0 else (False, True)):
                runs[one_call].append(after(one_call))
        settling = {("in one call" if k else "one token at a time"): [round(statistics.median(r[j] for r in v) * 1e3, 2)
                                                             for j in range(N)] for k, v in runs.items()}

    print(f"specdec from {specdec.__file__}; threads {args.threads}; median ms")
    for pad in pads:
        if args.pad:
            print(f"-- projections padded to {pad} rows" if pad > 1 else "-- no row padding")
        print("prefill: " + ", ".join(f"{L} tokens {ms[pad]} ms ({L / ms[pad] * 1e3:.0f} tok/s)"
                                      for L, ms in prefill.items()))
        for S in args.context:
            one = steps[(S, 1)][pad] if (S, 1) in steps else None
            cells = [f"T={T} {steps[(S, T)][pad]} ms" + (f" ({steps[(S, T)][pad] / one:.2f}x)" if one else "")
                     for T in args.tokens]
            print(f"step after {S} tokens: " + ", ".join(cells))
    for how, ms in settling.items():
        print(f"one-token steps 1..{len(ms)} after {args.prefill[0]} tokens read {how}: "
              + ", ".join(str(x) for x in ms))
    print(json.dumps({"benchmark": "forward_costs", "threads": args.threads, "warm": args.warm, "torch": torch.__version__,
                      "after_prefill_ms": settling,
                      "prefill_ms": {L: v if len(pads) > 1 else v[pads[0]] for L, v in prefill.items()},
                      "step_ms": {f"{S}x{T}": v if len(pads) > 1 else v[pads[0]] for (S, T), v in steps.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
