"""EAGLE drafting cost: the time of one proposal (catch-up + dynamic tree) next to the target's
verification step, for several ways of running the head, same run.

The shipped head (or --head) drafts for the default model on the first turns of Spec-Bench
dev prompts (chat template), greedy, --max-new-tokens each, a tree at every step (a fixed k: the
cost model, which declines the shipped head's trees on most CPUs, is off); the variants alternate per repeat so
machine drift hits them alike. Reports the median proposal time, the mean verification time
per step and τ for each, and one JSON document as the last line. Variants:
  kernels  the default: where the target's steps run on the row-stable kernels, the head's short
           steps take the kernels' norms and fused attention (EagleDrafter._kernel_step), its
           Q8_0 copies on 8-bit activations where the target's GGUF products are
  float    the kernels, with the head's Q8_0 copies on the float path (q8_0_linear, as before
           kernel_glue.drafting_act8)
  torch    the same projections, but torch's norms, rotation and SDPA for the head's attention
  onednn   the head packed for oneDNN (bf16 where the CPU has bf16 units, else fp32) with torch's
           norms and attention: what runs where the target's steps are not on the row-stable
           kernels (a CPU without AVX2)

    python benchmarks/eagle_propose.py --prompts 4 --max-new-tokens 128 --repeats 3 --variants kernels,torch
    python benchmarks/eagle_propose.py --prompts 4 --max-new-tokens 64 --repeats 5 --variants kernels,float
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from devset import DEV_SET

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = DEV_SET


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", default=None, help="EAGLE head folder. Default: the one shipped for the default model")
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="Spec-Bench style JSONL. Default: the shared dev set")
    ap.add_argument("--prompts", type=int, default=4, help="prompts (one per category, in file order). Default: 4")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default="kernels,torch",
                    help="comma-separated: kernels, float, torch, onednn (see above). Default: kernels,torch")
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or set(variants) - {"kernels", "float", "torch", "onednn"}:
        ap.error(f"--variants: choose from kernels, float, torch, onednn (got {args.variants!r})")
    torch.set_num_threads(args.threads)

    from specdec.drafters.eagle import EagleDrafter, default_eagle_for, load_eagle
    from specdec.engine import Engine
    from specdec.models.llama import cpu_has_bf16
    from specdec.models.loader import load_model
    from specdec.text import encode_prompt
    from specdec.types import SamplingParams

    target = load_model(None, quiet=True)
    head = args.head or default_eagle_for(target)
    rows, seen = [], set()
    for line in Path(args.data).read_text().splitlines():
        r = json.loads(line)
        if r.get("category") not in seen:
            seen.add(r.get("category"))
            rows.append(encode_prompt(target.tokenizer, r["turns"][0], None))
        if len(rows) >= args.prompts:
            break

    from specdec.models import kernel_glue

    def make(variant: str):
        rowstable, act8 = target.model.rowstable, kernel_glue.drafting_act8
        if variant == "float":
            kernel_glue.drafting_act8 = lambda ops: False  # (while the drafter is built: its copies on the float path)
        if variant == "onednn":
            if rowstable is None:
                raise SystemExit("--variants onednn: the target's steps are not on the row-stable AVX2 kernels here")
            target.model.rowstable = None  # (hidden while the drafter is built: it then packs for oneDNN)
        try:
            h, meta = load_eagle(head, target)
            d = EagleDrafter(h, target.model, meta.get("vocab_subset"), depth=4, width=2, nodes=5, trim=False)
        finally:
            target.model.rowstable, kernel_glue.drafting_act8 = rowstable, act8
        if variant in ("kernels", "float") and d.kops is None:
            raise SystemExit("the head's steps are not on the kernels here (the row-stable kernels cannot run?)")
        if variant == "torch":
            d.kops = None
        times: list[float] = []
        inner = d.propose

        def timed(ctx, k):
            t0 = time.perf_counter()
            out = inner(ctx, k)
            times.append(time.perf_counter() - t0)
            return out

        d.propose = timed
        eng = Engine(target.model, d, k=4, eos_ids=target.eos_ids, fixed_k=True)  # a tree at every step
        return eng, d, times

    engines = {v: make(v) for v in variants}
    results = {p: {"propose_ms": [], "verify_ms": [], "tau": []} for p in variants}
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    for _ in range(args.repeats):
        for p in variants:
            eng, d, times = engines[p]
            times.clear()
            steps = verify = new = 0
            for ids in rows:
                [r] = eng.generate([ids], params)
                steps += r.stats.target_forwards
                verify += r.stats.verify_s
                new += r.stats.new_tokens
            results[p]["propose_ms"].append(statistics.median(times) * 1e3)
            results[p]["verify_ms"].append(verify / steps * 1e3)
            results[p]["tau"].append(new / steps)
    summary = {p: {k: round(statistics.median(v), 3) for k, v in results[p].items()} for p in variants}
    summary["bf16_units"] = cpu_has_bf16()  # (without them the onednn variant packs in fp32)
    print(f"{'variant':8} {'propose ms':>11} {'verify ms':>10} {'tau':>6}")
    for p in variants:
        s = summary[p]
        print(f"{p:8} {s['propose_ms']:11.2f} {s['verify_ms']:10.2f} {s['tau']:6.2f}")
    print(json.dumps({"benchmark": "eagle_propose", "threads": args.threads, "prompts": len(rows),
                      "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, **summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
