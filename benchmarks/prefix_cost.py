"""What a prefill costs with and without the prefix cache (specdec/prefix_cache.py), per prompt
length: the one-call prefill (what specdec ran before the cache, and still runs for models without
the row-stable kernels), the chunked prefill every prompt gets on those kernels (chunks of 64
tokens: the price of exactness where nothing is cached), and a prompt whose first `--shared`
fraction comes from the cache. Variants interleaved over the lengths and repeats, medians
(benchmarks/harness.py); the prompts are an agentic trace's first prompt repeated to length.

    python benchmarks/prefix_cost.py --lengths 128,330,700,1000,1500,2000 --repeats 3 --threads 1 --chunked-max 2048

Prints a table and, as the last line, one JSON document.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from harness import emit, interleaved, machine, median, spread, table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf or folder (default: the default model)")
    ap.add_argument("--lengths", default="128,330,700,1000,1500,2000")
    ap.add_argument("--shared", type=float, default=0.8, help="the cached fraction of the warm prompt. Default: 0.8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunked-max", type=int, default=None,
                    help="prompt tokens prefilled in chunks (and cached), the rest in one call. Default: "
                         "prefix_cache.CHUNKED_MAX")
    args = ap.parse_args()

    import torch

    from specdec.models.loader import load_model
    from specdec import prefix_cache
    from specdec.prefix_cache import BLOCK, PrefixCache, chunks_exact, prefill
    from specdec.text import encode_prompt

    if args.chunked_max is not None:
        prefix_cache.CHUNKED_MAX = args.chunked_max

    torch.set_num_threads(args.threads)
    lm = load_model(args.model, quiet=True)
    model = lm.model
    if not chunks_exact(model):
        raise SystemExit(f"{lm.name} cannot prefill in exact chunks (no row-stable kernels): nothing to measure")
    first = json.loads((HERE / "data" / "agentic" / "sql-shots.jsonl").read_text().splitlines()[0])
    ids = encode_prompt(lm.tokenizer, first["messages"], None, None)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    prompts = [(ids * (n // len(ids) + 1))[:n] for n in lengths]

    def timed(fn, prepare=lambda prompt: None):
        def run(prompt):
            ready = prepare(prompt)  # (outside the timing)
            cache = model.new_cache(1, len(prompt) + 1)
            with torch.inference_mode():
                t0 = time.perf_counter()
                fn(prompt, cache, ready)
                return time.perf_counter() - t0
        return run

    def one_call(prompt, cache, _):
        last = torch.tensor([[len(prompt) - 1]])
        model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache, logits_at=last)

    def other_prompt_cached(prompt):
        """A cache holding another prompt that shares the first `--shared` of this one."""
        store = PrefixCache(1024)
        shared = int(len(prompt) * args.shared) // BLOCK * BLOCK
        other = prompt[:shared] + [t + 1 for t in prompt[shared:]]
        with torch.inference_mode():
            prefill(model, other, model.new_cache(1, len(other) + 1), store)
        return store

    variants = {"one call": timed(one_call),
                "chunked, cold": timed(lambda p, c, _: prefill(model, p, c, None)),
                f"chunked, {args.shared:.0%} cached": timed(lambda p, c, store: prefill(model, p, c, store),
                                                            other_prompt_cached)}
    for p in prompts:  # (one-off costs: kernels, buffers)
        for v in variants.values():
            v(p)
    out = interleaved(variants, prompts, args.repeats)
    rows, report = [], {"machine": machine(args.threads), "model": lm.name, "chunked_max": prefix_cache.CHUNKED_MAX,
                        "lengths": {}}
    for i, n in enumerate(lengths):
        med = {name: median(out[name][i]) for name in variants}
        row = {"tokens": n, "one call, ms": med["one call"] * 1e3}
        for name in list(variants)[1:]:
            row[f"{name} / one call"] = med[name] / med["one call"]
        row["spread"] = max(spread(out[name][i]) for name in variants)
        rows.append(row)
        report["lengths"][n] = {name: med[name] for name in variants}
    print(table(rows, list(rows[0])))
    emit(report)


if __name__ == "__main__":
    main()
