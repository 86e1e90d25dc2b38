"""Replay prompt lookup against recorded greedy outputs: cheap, many prompts per category.

Greedy speculative decoding commits exactly the target's greedy output, so how a lookup
policy would do on a prompt depends only on that output: at each step the policy proposes
guesses from the committed context, the accepted count is the length of their agreement
with the recorded continuation, and the step costs 1 + r * (guesses) target steps (r: the
cost of one more verified token relative to a plain step; measured with `--measure-r` as
the median slope of the default model's forward time over 1..9 tokens at the prompts'
context length, or given). The replayed decode speedup is tokens / cost; it leaves out
drafting time (~0.3% for lookup) and per-step overhead, and it matches measured decode
speedups within a few percent on the prompts both were run on.

    python benchmarks/experiments/ngram_replay.py --categories summarization,rag --per-category 20 --max-new-tokens 192

Prints a table and, as the last line, one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "spec_bench" / "dev.jsonl"


def measure_r(model, ctx: int) -> float:
    """Relative cost of one more scored token at context `ctx`."""
    cache = model.new_cache(1, ctx + 16)
    model(torch.randint(0, 1000, (1, ctx)), torch.arange(ctx)[None], cache, logits_at=torch.tensor([[ctx - 1]]))
    times = {}
    for T in (1, 5, 9):
        ts = []
        for _ in range(7):
            t0 = time.perf_counter()
            model(torch.randint(0, 1000, (1, T)), torch.arange(ctx, ctx + T)[None], cache)
            ts.append(time.perf_counter() - t0)
            cache.truncate(torch.tensor([ctx]))
        times[T] = statistics.median(ts)
    return statistics.median([(times[T] - times[1]) / (T - 1) / times[1] for T in (5, 9)])


def replay(adaptive: bool, prompt: list[int], out: list[int], k: int, r: float) -> tuple[int, float]:
    """Prompt lookup over a recorded greedy output, through the scheduler's proposal path without a
    model: each step the lookup offers, the cost model (adaptive) or a fixed k chooses, the guesses
    that match the output hold, and the step costs 1 + r * guesses plain steps. Returns (tokens
    committed, cost in plain steps)."""
    from specdec.core.proposal import Sources
    from specdec.drafters.base import RowInfo
    from specdec.drafters.ngram import NgramDrafter
    from specdec.policy import LoadPolicy
    from specdec.types import SamplingParams

    class Row:
        spec_k, sources, feats, params, generator = None, None, {}, SamplingParams(), None

    policy = LoadPolicy(k, adaptive=adaptive)
    sources = Sources([NgramDrafter(1, 4 if adaptive else 3)], policy, k, None, k)
    row = Row()
    row.context = prompt + out[:1]
    sources.join(RowInfo(row.context, row.params, len(prompt) + len(out) + k + 2))
    m, tokens, cost, step = 1, 1, 1.0, 0
    while m < len(out):
        g = sources.plan([row], step, [len(out) - m], None).guesses[0]
        a = 0
        while a < len(g) and m + a < len(out) and g[a] == out[m + a]:
            a += 1
        policy.observe_step(1, len(g), 1 + r * len(g))  # the replay's clock: the cost model, not wall time
        cost += 1 + r * len(g)
        n = min(a + 1, len(out) - m)
        row.context, m, tokens, step = row.context + out[m : m + n], m + n, tokens + n, step + 1
    return tokens, cost


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--categories", default="summarization,rag")
    ap.add_argument("--per-category", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("-k", type=int, default=8)
    ap.add_argument("--r", type=float, default=None, help="cost of one more verified token (default: measure it)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specdec.bench.tasks import load_jsonl, select
    from specdec.drafters.ngram import NgramDrafter
    from specdec.engine import Engine
    from specdec.models.loader import load_model
    from specdec.text import encode_prompt
    from specdec.types import SamplingParams

    lm = load_model(quiet=True)
    tasks = select(load_jsonl(args.data), args.categories.split(","), args.per_category)
    enc = [encode_prompt(lm.tokenizer, t.prompt, t.chat) for t in tasks]
    r = args.r if args.r is not None else measure_r(lm.model, int(statistics.median(len(e) for e in enc)))
    eng = Engine(lm.model, NgramDrafter(), k=args.k, eos_ids=lm.eos_ids)  # fast way to get greedy outputs
    per = defaultdict(lambda: {"fixed": [0, 0.0], "adaptive": [0, 0.0]})
    for i, (t, ids) in enumerate(zip(tasks, enc)):
        [res] = eng.generate([ids], SamplingParams(max_new_tokens=args.max_new_tokens))
        for name in ("fixed", "adaptive"):
            tok, cost = replay(name == "adaptive", ids, res.tokens, 4 if name == "fixed" else args.k, r)
            per[t.category][name][0] += tok
            per[t.category][name][1] += cost
        print(f"{i + 1}/{len(tasks)} {t.category}", file=sys.stderr)
    table = {c: {n: v[0] / v[1] for n, v in d.items()} for c, d in per.items()}
    print(f"r = {r:.3f} (cost of one more verified token / one plain step)")
    print(f"{'category':<16}{'fixed k=4, n 1-3':>18}{'adaptive k=' + str(args.k):>16}")
    for c, v in table.items():
        print(f"{c:<16}{v['fixed']:>17.2f}x{v['adaptive']:>15.2f}x")
    print(json.dumps({"benchmark": "ngram_replay", "r": r, "per_category": args.per_category,
                      "max_new_tokens": args.max_new_tokens, "k": args.k, "decode_speedup": table}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
