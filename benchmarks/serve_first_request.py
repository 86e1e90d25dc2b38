"""The server's first request against later ones, with and without the warm-up before /health
says ok (`ContinuousBatcher.warm_up`; "cold" replaces it with a no-op in the server process).

Per variant and repeat: start `specdec serve` on loopback, poll /health until 200 (time to
ready, from the process start), then time three greedy chat requests back to back (the same
32-token request twice, then another). Variants alternate (cold, warm, warm, cold, ...);
medians over `--repeats` are printed, the last line one JSON document.

    python benchmarks/serve_first_request.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

COLD = "import specdec.core.scheduler as b; b.ContinuousBatcher.warm_up = lambda self, steps=12: 0.0; "
SERVE = "import sys; from specdec.cli import main; sys.exit(main())"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> float:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()
    return time.perf_counter() - t0


def one_run(variant: str, extra: list[str]) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    code = (COLD if variant == "cold" else "") + SERVE
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--port", str(port), "--log-level", "warning",
                             *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None:
                raise SystemExit(proc.stderr.read()[-2000:])
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        chat = url + "/v1/chat/completions"
        ask = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 32, "temperature": 0}
        other = {"messages": [{"role": "user", "content": "Write a haiku about rain."}], "max_tokens": 32,
                 "temperature": 0}
        first, second, third = post(chat, ask), post(chat, ask), post(chat, other)
        return {"ready_s": ready, "first_s": first, "second_s": second, "third_s": third}
    finally:
        proc.kill()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--serve-args", default="", help="extra `specdec serve` arguments, e.g. '--method ngram'")
    args = ap.parse_args()
    runs = {"cold": [], "warm": []}
    for rep in range(args.repeats):
        for variant in (("cold", "warm") if rep % 2 == 0 else ("warm", "cold")):
            r = one_run(variant, args.serve_args.split())
            runs[variant].append(r)
            print(f"{variant:5s} repeat {rep}: " + "  ".join(f"{k} {v:.2f}" for k, v in r.items()), flush=True)
    summary = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
    for v, s in summary.items():
        print(f"median {v:5s}: " + "  ".join(f"{k} {x:.2f}" for k, x in s.items()))
    print(json.dumps({"runs": runs, "median": summary}))


if __name__ == "__main__":
    main()
