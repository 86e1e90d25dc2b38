"""How often each `--weights` choice gives the fp32 model's greedy text.

The GGUF's blocks can be multiplied with float32 activations (`blocks`), or as integer dot
products after rounding the activations to ~15 bits (`int16`, the default where the CPU has
VNNI) or to 8 bits (`int8`, llama.cpp's arithmetic). Each is exact for speculation (greedy
speculative text equals plain greedy text on the same weights), but they compute slightly
different functions; this counts, over Spec-Bench dev prompts (the first N of each category,
as chat), how many plain greedy continuations equal the dequantised fp32 copy's token for
token, and how many tokens they share before they part:

    python benchmarks/weights_agreement.py --per-category 4 --max-new-tokens 128 --threads 2

Prints a line per choice and one JSON line. Plain decoding only (no drafter), batch 1.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from devset import DEV_SET

DEV = DEV_SET


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DEV), help=f"Spec-Bench-style JSONL. Default: {DEV}")
    ap.add_argument("--per-category", type=int, default=4, help="prompts per category. Default: 4")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="Default: 128")
    ap.add_argument("--weights", default="int16,int8,blocks",
                    help="choices to compare with fp32, comma-separated. Default: int16,int8,blocks")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specdec.engine import Engine
    from specdec.models.loader import load_model
    from specdec.types import SamplingParams

    data = Path(args.data)
    if not data.is_file():
        raise SystemExit(f"no prompts at {data}: pass --data FILE.jsonl (Spec-Bench format: category, turns)")
    by_cat: dict[str, list[str]] = {}
    for line in data.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            text = (row.get("turns") or [row.get("prompt", "")])[0]
            by_cat.setdefault(row.get("category", "all"), []).append(text)
    prompts = [t for c in sorted(by_cat) for t in by_cat[c][: args.per_category]]
    choices = [w.strip() for w in args.weights.split(",") if w.strip()]
    sp = SamplingParams(max_new_tokens=args.max_new_tokens)
    outs, secs = {}, {}
    for w in ["fp32", *choices]:
        lm = load_model(quiet=True, weights=w)
        eng = Engine(lm.model, None, k=0)
        t0 = time.perf_counter()
        res = []
        for text in prompts:
            ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   tokenize=True)
            if not isinstance(ids, list):
                ids = ids["input_ids"]
            res.append(eng.generate([ids], sp)[0].tokens)
        outs[w], secs[w] = res, time.perf_counter() - t0
        print(f"{w:>7}: {lm.weights}; {len(prompts)} prompts in {secs[w]:.1f} s", flush=True)
        del lm, eng
    report = {"benchmark": "weights_agreement", "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "threads": args.threads, "choices": {}}
    for w in choices:
        common = []
        for a, b in zip(outs[w], outs["fp32"]):
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            common.append(n)
        equal = sum(a == b for a, b in zip(outs[w], outs["fp32"]))
        report["choices"][w] = {"equal": equal, "mean_common_prefix": sum(common) / len(common)}
        print(f"{w:>7}: greedy text equal to fp32's on {equal}/{len(prompts)} prompts; "
              f"{sum(common) / len(common):.1f} tokens in common on average")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
