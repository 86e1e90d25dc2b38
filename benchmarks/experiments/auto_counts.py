"""Methods against plain decoding counted rather than timed: CPU seconds of this process per
generated token (prefill included; one thread by default, which another process's preemption
does not stretch), target forwards, guesses proposed and accepted, per method, over the first
PER prompts of each category; each adaptive method starts from what its previous request
learned, as `generate` calls do (a fresh engine that relearns it; with `--draft`, one engine per
method for all requests, as `specdec bench` runs them, so the draft model loads once). Run it with another checkout first on PYTHONPATH to compare
code versions. For auto with a draft model (`--draft`) it also prints where the draft model's
time went: steps by source (lookup, draft model, plain), drafting seconds per token, and the
draft model's guesses per position (proposed after the guesses before them held, and held).

    python benchmarks/experiments/auto_counts.py writing,qa,translation,roleplay t0.7 32 3 none,ngram,auto
    python benchmarks/experiments/auto_counts.py --model T.gguf --draft D.gguf humaneval greedy 96 2 none,ngram,auto
    FRESH=1 python benchmarks/experiments/auto_counts.py --model T.gguf --draft D.gguf humanities,math greedy 96 1 none,auto
        # every request a first call: a new engine that has learnt nothing (`generate --fresh`)
    (arguments: categories, greedy or t0.7 (seed 1), max new tokens, repeats, methods; --model: the target
     (default: the default model), --draft: the draft model for draft/auto;
     environment: PER prompts per category (2), THREADS (1), FRESH (0), BATCH (0; 1: each category's
     prompts as one batch, as `auto_vs_none.py --batching all` runs them))
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch

torch.set_num_threads(int(os.environ.get("THREADS", "1")))
from devset import DEV_SET
from specdec.bench.tasks import load_humaneval, load_jsonl, select
from specdec.config import SpecConfig, build_engine
from specdec.models.loader import load_model
from specdec.text import encode_prompt
from specdec.types import SamplingParams

args, flags = [], {}
it = iter(sys.argv[1:])
for a in it:
    if a in ("--model", "--draft"):
        flags[a[2:]] = next(it)
    else:
        args.append(a)
cats = args[0].split(","); samp = args[1]; n = int(args[2]); reps = int(args[3])
methods = args[4].split(",") if len(args) > 4 else ["none", "ngram", "auto"]
per = int(os.environ.get("PER", "2"))
target = load_model(flags.get("model"), quiet=True)
dev = [c for c in cats if c != "humaneval"]
tasks = select(load_jsonl(str(DEV_SET)), dev, per) if dev else []
if "humaneval" in cats: tasks += load_humaneval()[:per]
prompts = [encode_prompt(target.tokenizer, t.prompt, t.chat) for t in tasks]
if os.environ.get("BATCH", "0") == "1":  # one call per category, its prompts side by side
    order = list(dict.fromkeys(t.category for t in tasks))
    units = [[i for i, t in enumerate(tasks) if t.category == c] for c in order]
else:
    units = [[i] for i in range(len(prompts))]
kw = {"greedy": {}, "t0.7": {"temperature": 0.7, "seed": 1}}[samp]
params = SamplingParams(max_new_tokens=n, **kw)
res = {m: [] for m in methods}; wall = {m: [] for m in methods}; st = {}; texts = {}
saved = {}; positions = {}
def engine(m):
    return build_engine(SpecConfig(method=m, draft=flags.get("draft") if m in ("draft", "auto") else None), target)


fresh = os.environ.get("FRESH", "0") == "1"
kept = {m: engine(m) for m in methods} if "draft" in flags and not fresh else None
for rep in range(reps):
    for m in methods:
        cpu = w = 0.0; toks = fw = prop = acc = 0; ds = vs = 0.0
        for unit in units:
            i = unit[0]
            if kept is not None:
                eng = kept[m]
            else:
                eng = engine(m)
                if m in saved and not fresh: eng.relearn(json.loads(saved[m]))
            t0 = time.process_time(); t1 = time.perf_counter()
            out = eng.generate([prompts[j] for j in unit], params)
            cpu += time.process_time() - t0; w += time.perf_counter() - t1
            if m != "none" and kept is None: saved[m] = json.dumps(eng.learned())
            for j, r in zip(unit, out):
                texts.setdefault((m, j), []).append(r.tokens)
            pos = positions.setdefault((m, rep), {})  # per draft position: (proposed, held), this repeat
            for r in out:
                toks += len(r.tokens); fw += r.stats.target_forwards; prop += r.stats.proposed; acc += r.stats.accepted
                ds += r.stats.draft_s; vs += r.stats.verify_s
                for j, (p, a) in enumerate(zip(r.stats.proposed_by_pos, r.stats.accepted_by_pos)):
                    old = pos.get(j, (0, 0)); pos[j] = (old[0] + p, old[1] + a)
        res[m].append(cpu / toks * 1000); wall[m].append(w / toks * 1000)
        st[m] = (toks, fw, prop, acc, round(ds / toks * 1000, 2), round(vs / toks * 1000, 2))
base = statistics.median(res[methods[0]])
for m in methods:
    same = all(texts[(m, i)] == texts[(methods[0], i)] for i in range(len(prompts)))
    print(f"{m:8} cpu ms/tok {statistics.median(res[m]):6.2f} wall {statistics.median(wall[m]):6.2f} ratio(cpu) {base / statistics.median(res[m]):.3f}  (toks, forwards, proposed, accepted, draft ms/tok, verify ms/tok) {st[m]}  same text as {methods[0]}: {same}")
    for rep in range(reps):
        if positions.get((m, rep)):
            print(f"   repeat {rep}: per draft position (proposed, held) {[positions[(m, rep)][j] for j in sorted(positions[(m, rep)])]}")
