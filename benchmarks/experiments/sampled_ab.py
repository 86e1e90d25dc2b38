"""Plain sampled decoding (`--method none`, temperature 0.8, seed 1, 3 chat prompts x 128 tokens,
2 threads) decode tokens/s of two checkouts, interleaved, a fresh process per run, medians:
what drawing tokens by inverse transform instead of torch.multinomial changed.

    git worktree add --detach /tmp/before 58b5890
    python benchmarks/experiments/sampled_ab.py /tmp/before . 3
"""
import json, statistics, subprocess, sys
import os
old, new, reps = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2]), int(sys.argv[3])
prompts = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works.", "List ten fruits and describe each."]
code = r'''
import json, sys, time, torch
torch.set_num_threads(2)
from specdec.config import SpecConfig, build_engine
from specdec.models.loader import load_model
from specdec.text import encode_prompt
from specdec.types import SamplingParams
t = load_model(None, quiet=True)
e = build_engine(SpecConfig(method="none"), t)
ps = [encode_prompt(t.tokenizer, p, True) for p in json.loads(sys.argv[1])]
e.generate([ps[0]], SamplingParams(max_new_tokens=8, temperature=0.8, seed=1))
toks = secs = 0
for p in ps:
    r = e.generate([p], SamplingParams(max_new_tokens=128, temperature=0.8, seed=1))[0]
    toks += len(r.tokens) - 1; secs += r.stats.decode_s
print(json.dumps(toks / secs))
'''
res = {old: [], new: []}
for _ in range(reps):
    for tree in (old, new):
        out = subprocess.run([sys.executable, "-c", code, json.dumps(prompts)], env={"PYTHONPATH": tree, "PATH": "/usr/bin:/bin", "HOME": "/root"},
                             capture_output=True, text=True, cwd="/tmp")
        res[tree].append(json.loads(out.stdout.strip().splitlines()[-1]))
for tree, v in res.items():
    print(tree, "decode tok/s median %.1f" % statistics.median(v), [round(x, 1) for x in v])
print("new/old %.2f" % (statistics.median(res[new]) / statistics.median(res[old])))
