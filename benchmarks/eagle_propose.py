"""EAGLE drafting cost: the time of one proposal (catch-up + dynamic tree) next to the target's
verification step, with the head packed in fp32 and in bf16, same run.

The shipped head (or --head) drafts for the default model on the first turns of Spec-Bench
dev prompts (chat template), greedy, --max-new-tokens each; the two packings alternate per
repeat so machine drift hits both alike. Reports the median proposal time, the median
verification time per step and τ for each packing, and one JSON document as the last line.
On a CPU without bf16 units (no AVX-512 BF16 / AMX) both rows are fp32.

    python benchmarks/eagle_propose.py --prompts 4 --max-new-tokens 128 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "spec_bench" / "dev.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", default=None, help="EAGLE head folder. Default: the one shipped for the default model")
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="Spec-Bench style JSONL. Default: the shared dev set")
    ap.add_argument("--prompts", type=int, default=4, help="prompts (one per category, in file order). Default: 4")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specdec.drafters import REGISTRY
    from specdec.drafters.eagle import default_eagle_for
    from specdec.engine import Engine
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

    def make(packing: str):
        os.environ["SPECDEC_DRAFT_FP32"] = "1" if packing == "fp32" else "0"
        d = REGISTRY["eagle"](target=target, draft=head, tree=True, depth=4, width=2, nodes=5)
        times: list[float] = []
        inner = d.propose

        def timed(ctx, k):
            t0 = time.perf_counter()
            out = inner(ctx, k)
            times.append(time.perf_counter() - t0)
            return out

        d.propose = timed
        return Engine(target.model, d, k=4, eos_ids=target.eos_ids), d, times

    packings = ["fp32", "bf16"]
    engines = {p: make(p) for p in packings}
    results = {p: {"propose_ms": [], "verify_ms": [], "tau": []} for p in packings}
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    for _ in range(args.repeats):
        for p in packings:
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
    summary = {p: {k: round(statistics.median(v), 3) for k, v in results[p].items()} for p in packings}
    summary["bf16_units"] = engines["bf16"][1].pack_dtype == torch.bfloat16
    print(f"{'packing':8} {'propose ms':>11} {'verify ms':>10} {'tau':>6}")
    for p in packings:
        s = summary[p]
        print(f"{p:8} {s['propose_ms']:11.2f} {s['verify_ms']:10.2f} {s['tau']:6.2f}")
    print(json.dumps({"benchmark": "eagle_propose", "threads": args.threads, "prompts": len(rows),
                      "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, **summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
