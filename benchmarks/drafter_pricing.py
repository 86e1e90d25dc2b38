"""What the cost model predicted for an on-demand drafter's steps against what they took: fresh
engines (one per prompt, nothing learnt, as a new `specdec generate` process starts), one row.

For every step the cost model chose to draft (probes apart) it records the step's predicted time
in plain steps (verification at the fit's price, drafting, the aftermath charged to the source)
and its predicted committed tokens, then measures the step against the median of the same
engine's plain steps that no drafting step preceded within 4 (its drafting and verification
apart) and the 4 plain steps after it (the aftermath: their time beyond that median). A drafted
step pays where committed tokens / (its time + aftermath) > 1; the cost model decides well where
its predictions match what was measured. Per engine, a line of its first 80 steps: `D` drafted,
`P` probed, `.` plain.

    python benchmarks/drafter_pricing.py --method draft --temperature 0.8 --max-new-tokens 128 --threads 2
"""

from __future__ import annotations

import argparse
import statistics

import torch
from devset import add_prompt_options, dev_prompts
from harness import emit, machine

AFTER = 4  # plain steps after a drafting one counted as its aftermath (policy.load.AFTER_STEPS)
SKIP = 8  # the first steps of a request (settling: slower, not fitted)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="draft", help="an on-demand drafter's method (draft, eagle, medusa). Default: draft")
    ap.add_argument("--temperature", type=float, default=0.8, help="0: greedy. Default: 0.8 (seeded)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="a .gguf or folder (default: the default model)")
    add_prompt_options(ap, per_category=1, humaneval=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specdec.config import SpecConfig, build_engine
    from specdec.core import scheduler
    from specdec.models.loader import load_model
    from specdec.policy import load as policy_load
    from specdec.types import SamplingParams

    target = load_model(args.model, quiet=True)
    prompts = dev_prompts(target.tokenizer, args)
    params = SamplingParams(max_new_tokens=args.max_new_tokens) if args.temperature == 0 else \
        SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=7)

    choose, record = policy_load.LoadPolicy.choose, scheduler.ContinuousBatcher._record
    chosen: dict = {}
    engines: list[list] = []

    def spy_choose(self, quotes, step, room, fixed=False):
        choice = choose(self, quotes, step, room, fixed)
        picked = next((s for s in choice.source if s is not None and not quotes[s].stats.known), None)
        chosen["step"] = None
        if choice.k > 0 and picked is not None:
            stats = quotes[picked].stats
            plain = self._priced(1, 0)
            drafting = self._drafting(quotes[picked], 1, 1, choice.k)
            after = max(stats.aftermath, 0.0)
            chosen["step"] = dict(probe=choice.probe, verify=self._priced(1, choice.k) / plain,
                                  drafting=(drafting - after) / plain, after=after / plain,
                                  tokens=stats.value(choice.k, self.k_max))
        return choice

    def spy_record(self, plan, draft, accepted, dt):
        engines[-1].append((chosen.pop("step", None), dt, plan.t_draft, 1 + sum(accepted)))
        return record(self, plan, draft, accepted, dt)

    policy_load.LoadPolicy.choose = spy_choose
    scheduler.ContinuousBatcher._record = spy_record
    for prompt in prompts:
        engines.append([])
        build_engine(SpecConfig(method=args.method), target).generate([prompt], params)

    keys = ("verify", "drafting", "after", "tokens")
    predicted = {k: [] for k in keys}
    measured = {k: [] for k in keys}
    marks = []
    for steps in engines:
        marks.append("".join("." if s[0] is None else "P" if s[0]["probe"] else "D" for s in steps[:80]))
        steps = steps[SKIP:]
        plain = [dt for j, (info, dt, _, _) in enumerate(steps)
                 if info is None and all(steps[m][0] is None for m in range(max(0, j - AFTER), j))]
        if len(plain) < 4:
            continue
        base = statistics.median(plain)
        for j, (info, dt, t_draft, committed) in enumerate(steps):
            if info is None or info["probe"]:
                continue
            after = [s for s in steps[j + 1 : j + 1 + AFTER] if s[0] is None]
            for k in keys:
                predicted[k].append(info[k])
            measured["verify"].append((dt - t_draft) / base)
            measured["drafting"].append(t_draft / base)
            measured["after"].append(sum(s[1] / base - 1.0 for s in after))
            measured["tokens"].append(committed)

    n = len(predicted["tokens"])
    rows = {k: (statistics.mean(predicted[k]), statistics.mean(measured[k])) if n else (0.0, 0.0) for k in keys}
    cost_p = sum(rows[k][0] for k in ("verify", "drafting", "after"))
    cost_m = sum(rows[k][1] for k in ("verify", "drafting", "after"))
    print(f"{args.method}, t {args.temperature}: {n} drafted steps over {len(engines)} fresh engines")
    print("                 predicted  measured   (plain steps; tokens: committed a step)")
    for k in keys:
        print(f"  {k:<14} {rows[k][0]:>9.3f} {rows[k][1]:>9.3f}")
    if n:
        print(f"  rate           {rows['tokens'][0] / cost_p:>9.3f} {rows['tokens'][1] / cost_m:>9.3f}   (tokens / step time)")
    for i, line in enumerate(marks):
        print(f"  {i:>2} {line}")
    emit({"benchmark": "drafter_pricing", "machine": machine(args.threads), "method": args.method,
          "temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "drafted_steps": n,
          "predicted": {k: round(v[0], 4) for k, v in rows.items()},
          "measured": {k: round(v[1], 4) for k, v in rows.items()}})


if __name__ == "__main__":
    main()
