"""Start-up of `specdec generate` on a warm cache: wall time to the first streamed byte, and where
it goes.

Two measurements per repeat, interleaved:
- end to end: a `specdec generate PROMPT --max-new-tokens 1` subprocess per method, timed from
  launch to its first stdout byte (the first token) and to its exit, and its CPU seconds;
- stages, in one fresh subprocess each: import torch, import specdec.cli, load the model,
  build the method's engine (its drafter: the EAGLE head for auto), encode the prompt, and the
  first token (prefill; the kernels' first calls).
Medians over repeats. The cache (converted weights, built kernels) must be warm: run one
`specdec generate` first. --baseline DIR (another checkout, e.g. `git worktree add --detach
/tmp/before main`) times its end-to-end runs too, interleaved with this checkout's, for a
before/after ratio measured in one run.

    python benchmarks/startup.py --repeats 3 --methods none,auto
    python benchmarks/startup.py --repeats 3 --methods none,auto --baseline /tmp/before
    python benchmarks/startup.py --repeats 5 --methods none,auto --threads 1 --baseline /tmp/before
        # one thread: the CPU seconds are not inflated by threads waiting for a busy machine's cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Name three colours."

STAGES = r"""
import json, sys, time
t = [("start", time.perf_counter())]
import torch
t.append(("import torch", time.perf_counter()))
from specdec import cli
t.append(("import specdec.cli", time.perf_counter()))
from specdec.models.loader import load_model
target = load_model(None, quiet=True)
t.append(("load model", time.perf_counter()))
from specdec.config import SpecConfig, build_engine
engine = build_engine(SpecConfig(method=sys.argv[1]), target)
t.append(("build engine", time.perf_counter()))
from specdec.text import encode_prompt
ids = encode_prompt(target.tokenizer, sys.argv[2], None)
t.append(("encode prompt", time.perf_counter()))
from specdec.types import SamplingParams
engine.generate([ids], SamplingParams(max_new_tokens=1))
t.append(("first token", time.perf_counter()))
print(json.dumps({b[0]: b[1] - a[1] for a, b in zip(t, t[1:])}))
"""


def end_to_end(method: str, root: Path = ROOT, threads: int | None = None) -> tuple[float, float, float]:
    """(seconds to the first stdout byte, seconds to exit, CPU seconds) of one generate call of the
    checkout at root. The CPU seconds (user + system of the process and its children) move less
    than wall time when other work shares the machine."""
    env = dict(os.environ, PYTHONPATH=str(root))
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "specdec.cli", "generate", PROMPT, "--method", method,
                          "--max-new-tokens", "1", "--quiet", *(["--threads", str(threads)] if threads else [])],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdout.read(1)
    first = time.perf_counter() - t0
    p.stdout.read()
    err = p.stderr.read()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"generate --method {method} failed (exit {p.returncode}): {err.decode()[-500:]}")
    return first, wall, usage.ru_utime + usage.ru_stime


def stages(method: str, threads: int | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    out = subprocess.run([sys.executable, "-c", STAGES, method, PROMPT], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-800:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default="none,auto")
    ap.add_argument("--baseline", metavar="DIR", default=None,
                    help="another checkout to time end to end, interleaved with this one")
    ap.add_argument("--threads", type=int, default=None,
                    help="generate --threads N (default: the cores other processes leave free)")
    args = ap.parse_args()
    methods = args.methods.split(",")
    e2e = {m: [] for m in methods}
    base = {m: [] for m in methods}
    parts = {m: [] for m in methods}
    for i in range(args.repeats):
        for m in methods:
            if args.baseline and i % 2:  # (alternate which goes first)
                base[m].append(end_to_end(m, Path(args.baseline), args.threads))
            e2e[m].append(end_to_end(m, ROOT, args.threads))
            if args.baseline and not i % 2:
                base[m].append(end_to_end(m, Path(args.baseline), args.threads))
            parts[m].append(stages(m, args.threads))
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else "?"
    print(f"medians of {args.repeats}; load average {' '.join(load)}")
    doc = {}
    for m in methods:
        first, total, cpu = (statistics.median(r[i] for r in e2e[m]) for i in range(3))
        st = {k: statistics.median(p[k] for p in parts[m]) for k in parts[m][0]}
        print(f"{m}: first token {first:.2f} s, exit {total:.2f} s, CPU {cpu:.2f} s; stages: "
              + ", ".join(f"{k} {v:.2f}" for k, v in st.items()))
        doc[m] = {"first_token_s": [r[0] for r in e2e[m]], "exit_s": [r[1] for r in e2e[m]],
                  "cpu_s": [r[2] for r in e2e[m]], "stages": parts[m]}
        if args.baseline:
            b_first, b_total, b_cpu = (statistics.median(r[i] for r in base[m]) for i in range(3))
            print(f"{m}: baseline {args.baseline}: first token {b_first:.2f} s, exit {b_total:.2f} s, CPU {b_cpu:.2f} s; "
                  f"this checkout / baseline: first token {first / b_first:.2f}, exit {total / b_total:.2f}, "
                  f"CPU {cpu / b_cpu:.2f}")
            doc[m].update(baseline_first_token_s=[r[0] for r in base[m]], baseline_exit_s=[r[1] for r in base[m]],
                          baseline_cpu_s=[r[2] for r in base[m]])
    print(json.dumps({"benchmark": "startup", "repeats": args.repeats, "methods": doc}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
