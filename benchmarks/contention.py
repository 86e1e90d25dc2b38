"""Plain decoding idle and beside busy processes: how much of its idle speed `specdec generate` keeps.

Each variant is one `specdec generate --method none` subprocess (environment variables such as
OMP_WAIT_POLICY take effect only before torch starts, so every run is a fresh process). Per
repeat, every variant runs once idle and once beside --busy bounded busy loops
(`timeout S sh -c 'yes > /dev/null'`), the variants interleaved so drift hits all alike; the
decode rate comes from the run's --json stats (new tokens / decode seconds) and the medians
over repeats are printed with the ratio busy / idle. The issue's goal: >= 0.35x (a fair share
with 4 runnable threads on 2 cores is ~0.5x).

    python benchmarks/contention.py --repeats 3 --max-new-tokens 64
    python benchmarks/contention.py --variants default,threads1,passive
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a short story about a robot who learns to paint."

# name -> (extra environment, extra generate flags)
VARIANTS = {
    "default": ({}, []),
    "threads1": ({}, ["--threads", "1"]),
    "threads2": ({}, ["--threads", "2"]),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, []),
    "active": ({"OMP_WAIT_POLICY": "ACTIVE"}, []),
    "spin0": ({"GOMP_SPINCOUNT": "0"}, []),
}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def run_once(env_extra: dict, flags: list[str], max_new: int, method: str) -> float:
    """One generate run; its decode tokens/s from the --json stats."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env.update(PYTHONPATH=str(ROOT), **env_extra)  # only the variant's own thread settings
    cmd = [sys.executable, "-m", "specdec.cli", "generate", PROMPT, "--method", method, "--max-new-tokens",
           str(max_new), "--json", "--quiet", "--fresh", *flags]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {out.stderr.strip()[-500:]}")
    stats = json.loads(out.stdout.strip().splitlines()[-1])["stats"]
    return stats["new_tokens"] / max(stats["decode_s"], 1e-9)


def start_busy(n: int, seconds: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(["timeout", str(seconds), "sh", "-c", "yes > /dev/null"]) for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="default,threads1,passive", help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--busy", type=int, default=2, help="busy loops beside the busy runs")
    ap.add_argument("--method", default="none")
    args = ap.parse_args()
    names = args.variants.split(",")
    rates: dict[tuple[str, str], list[float]] = {(n, c): [] for n in names for c in ("idle", "busy")}
    for r in range(args.repeats):
        for name in names:
            env_extra, flags = VARIANTS[name]
            rates[(name, "idle")].append(run_once(env_extra, flags, args.max_new_tokens, args.method))
            busy = start_busy(args.busy, 120)
            time.sleep(0.5)
            try:
                rates[(name, "busy")].append(run_once(env_extra, flags, args.max_new_tokens, args.method))
            finally:
                for p in busy:
                    p.terminate()
                    p.wait()
            print(f"repeat {r + 1} {name}: idle {rates[(name, 'idle')][-1]:.1f} busy {rates[(name, 'busy')][-1]:.1f} "
                  "tok/s", file=sys.stderr)
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cpus; {args.busy} busy loops; method {args.method}; "
          f"{args.max_new_tokens} new tokens; medians of {args.repeats}")
    print(f"{'variant':10s} {'idle tok/s':>10s} {'busy tok/s':>10s} {'busy/idle':>9s}")
    doc = {}
    for name in names:
        idle, busy = statistics.median(rates[(name, 'idle')]), statistics.median(rates[(name, 'busy')])
        print(f"{name:10s} {idle:10.1f} {busy:10.1f} {busy / idle:9.2f}")
        doc[name] = {"idle": rates[(name, 'idle')], "busy": rates[(name, 'busy')]}
    print(json.dumps({"cpu": cpu_name(), "args": vars(args), "rates": doc}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
