"""How often draft models guess the target's next greedy token, per category, and what a guess costs.

The speedup a draft model can give is bounded by how often its top guess is the target's greedy
token (the acceptance rate of greedy speculation, position by position) and by its cost per guess
next to a target step. This measures both, teacher-forced, for one or more draft folders:

1. the target (the default model, on the kernels `--weights` picks) decodes each prompt greedily
   (`--per-category` prompts of each Spec-Bench dev category, as chat, and the first HumanEval
   prompts as raw completions, as `specdec bench` renders them);
2. each draft reads prompt + continuation in one forward (on the target's kernels, as the CLI runs
   it) and its subset head's argmax at every continuation position is compared with the token the
   target chose there;
3. one-token steps of the target and of each draft after a 200-token context are timed in the same
   process, interleaved (with --packed also each draft as it ran before it moved to the kernels).

    python benchmarks/draft_agreement.py --drafts default,/path/to/other --per-category 4 --humaneval 16 --packed --threads 2

Prints a table (agreement per category per draft; step times) and, as the last line, one JSON
document. Agreement here is top-1 at every position; speculation's acceptance also depends on the
positions before (a chain stops at the first miss), so tau ~ 1 / (1 - agreement) at best.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from devset import DEV_SET

DEV = DEV_SET


def step_ms(fn, n: int = 30) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafts", default="default", help="draft folders, comma-separated ('default': the shipped "
                                                         "draft). Default: default")
    ap.add_argument("--data", default=str(DEV), help=f"Spec-Bench-style JSONL. Default: {DEV}")
    ap.add_argument("--per-category", type=int, default=4, help="dev prompts per category. Default: 4")
    ap.add_argument("--humaneval", type=int, default=16, help="first N HumanEval prompts (0: none). Default: 16")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="Default: 128")
    ap.add_argument("--weights", default="auto", help="the target's --weights. Default: auto")
    ap.add_argument("--packed", action="store_true",
                    help="also time each draft as it ran before it moved to the kernels (its projections and "
                         "subset head prepacked for oneDNN, bf16 where the CPU has it)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specdec.bench.tasks import load_humaneval, load_jsonl, select
    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.engine import Engine
    from specdec.models.loader import default_draft_for, load_model
    from specdec.text import encode_prompt
    from specdec.types import SamplingParams

    target = load_model(None, quiet=True, weights=args.weights)
    tok = target.tokenizer
    tasks = select(load_jsonl(args.data), None, args.per_category) if args.per_category else []
    if args.humaneval:
        tasks += load_humaneval()[: args.humaneval]
    names = [d.strip() for d in args.drafts.split(",") if d.strip()]
    drafters, packed = {}, {}
    for name in names:
        path = str(default_draft_for(target)) if name == "default" else name
        d = load_model(path, quiet=True, pack=False)
        meta = d.draft_meta or {}
        drafters[name] = DraftModelDrafter(d.model, target.model.vocab_size, meta.get("vocab_subset"),
                                           target_model=target.model)
        if args.packed:
            packed[name] = DraftModelDrafter(load_model(path, quiet=True).model, target.model.vocab_size,
                                             meta.get("vocab_subset"))

    engine = Engine(target.model, None, eos_ids=target.eos_ids)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    hits = {n: {} for n in names}
    counts: dict[str, int] = {}
    for task in tasks:
        ids = encode_prompt(tok, task.prompt, task.chat)
        gen = list(engine.generate([ids], params)[0].tokens)
        if not gen:
            continue
        full = ids + gen
        counts[task.category] = counts.get(task.category, 0) + len(gen)
        for name, dr in drafters.items():
            cache = dr.model.new_cache(1, len(full) + 8)
            _, hidden = dr.model(torch.tensor([full]), torch.arange(len(full))[None], cache,
                                 logits_at=torch.empty(1, 0, dtype=torch.long))
            h = hidden[0, len(ids) - 1 : len(full) - 1].contiguous()  # the positions that predict gen
            if dr.subset is not None:
                scores = dr._head(h)
                guess = dr.subset[scores.argmax(-1)]
            else:
                guess = dr.model._logits(h[None], None)[0].argmax(-1)
            hit = int((guess == torch.tensor(gen)).sum())
            hits[name][task.category] = hits[name].get(task.category, 0) + hit

    # one-token steps after a 200-token context, target and drafts interleaved
    ctx = torch.randint(100, 20000, (1, 200))
    timed = drafters | {f"{n} (packed)": dr for n, dr in packed.items()}
    times = {"target": []} | {n: [] for n in timed}
    for _ in range(3):
        c = target.model.new_cache(1, 512)
        target.model(ctx, torch.arange(200)[None], c, logits_at=torch.tensor([[199]]))
        pos = [200]

        def tstep():
            target.model(torch.tensor([[5]]), torch.tensor([pos]), c, logits_at=torch.tensor([[0]]))
            pos[0] += 1

        times["target"].append(step_ms(tstep))
        for name, dr in timed.items():
            dr.begin([ctx[0].tolist()], params, 512)
            dr._feed([ctx[0].tolist()])
            times[name].append(step_ms(lambda: dr._feed([[5]])))
    ms = {k: statistics.median(v) for k, v in times.items()}

    cats = sorted(counts)
    print(f"{'category':16} {'tokens':>7} " + " ".join(f"{n[-24:]:>24}" for n in names))
    for c in cats + ["all"]:
        n_tok = counts[c] if c != "all" else sum(counts.values())
        row = []
        for n in names:
            h = hits[n].get(c, 0) if c != "all" else sum(hits[n].values())
            row.append(f"{h / max(n_tok, 1):24.3f}")
        print(f"{c:16} {n_tok:7d} " + " ".join(row))
    print(f"one-token step after 200 tokens: target {ms['target']:.3f} ms; "
          + "; ".join(f"{n} {ms[n]:.3f} ms ({ms[n] / ms['target']:.3f} of a target step)" for n in timed))
    print(json.dumps({"benchmark": "draft_agreement", "threads": args.threads, "weights": target.weights,
                      "tokens": counts, "agreement": {n: {c: hits[n].get(c, 0) / counts[c] for c in cats} | {
                          "all": sum(hits[n].values()) / max(sum(counts.values()), 1)} for n in names},
                      "step_ms": ms}))


if __name__ == "__main__":
    main()
