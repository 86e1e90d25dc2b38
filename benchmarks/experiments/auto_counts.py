"""Methods against plain decoding counted rather than timed: CPU seconds of this process per
generated token (prefill included; one thread by default, which another process's preemption
does not stretch), target forwards, guesses proposed and accepted, per method, over the first
PER prompts of each category; each adaptive method starts from what its previous request
learned, as `generate` calls do. Run it with another checkout first on PYTHONPATH to compare
code versions.

    python benchmarks/experiments/auto_counts.py writing,qa,translation,roleplay t0.7 32 3 none,ngram,auto
    (arguments: categories, greedy or t0.7 (seed 1), max new tokens, repeats, methods;
     environment: PER prompts per category (2), THREADS (1))
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

cats = sys.argv[1].split(","); samp = sys.argv[2]; n = int(sys.argv[3]); reps = int(sys.argv[4])
methods = sys.argv[5].split(",") if len(sys.argv) > 5 else ["none", "ngram", "auto"]
per = int(os.environ.get("PER", "2"))
target = load_model(None, quiet=True)
dev = [c for c in cats if c != "humaneval"]
tasks = select(load_jsonl(str(DEV_SET)), dev, per) if dev else []
if "humaneval" in cats: tasks += load_humaneval()[:per]
prompts = [encode_prompt(target.tokenizer, t.prompt, t.chat) for t in tasks]
kw = {"greedy": {}, "t0.7": {"temperature": 0.7, "seed": 1}}[samp]
params = SamplingParams(max_new_tokens=n, **kw)
res = {m: [] for m in methods}; wall = {m: [] for m in methods}; st = {}
saved = {}
for rep in range(reps):
    for m in methods:
        cpu = w = 0.0; toks = fw = prop = acc = 0; ds = vs = 0.0
        for p in prompts:
            eng = build_engine(SpecConfig(method=m), target)
            if m in saved: eng.relearn(json.loads(saved[m]))
            t0 = time.process_time(); t1 = time.perf_counter()
            out = eng.generate([p], params)
            cpu += time.process_time() - t0; w += time.perf_counter() - t1
            if m != "none": saved[m] = json.dumps(eng.learned())
            for r in out:
                toks += len(r.tokens); fw += r.stats.target_forwards; prop += r.stats.proposed; acc += r.stats.accepted
                ds += r.stats.draft_s; vs += r.stats.verify_s
        res[m].append(cpu / toks * 1000); wall[m].append(w / toks * 1000)
        st[m] = (toks, fw, prop, acc, round(ds / toks * 1000, 2), round(vs / toks * 1000, 2))
base = statistics.median(res[methods[0]])
for m in methods:
    print(f"{m:8} cpu ms/tok {statistics.median(res[m]):6.2f} wall {statistics.median(wall[m]):6.2f} ratio(cpu) {base / statistics.median(res[m]):.3f}  (toks, forwards, proposed, accepted, draft ms/tok, verify ms/tok) {st[m]}")
