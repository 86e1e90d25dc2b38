"""Ray Serve replicas against the plain server, on one machine.

Four setups, each serving the same model with the server's defaults (method auto): the plain
`specdec serve --threads T` and `--threads 1` (one process, no Ray running), `serve --ray` with
R replicas of 1 thread, and `serve --ray` with 1 replica of T threads (R = T = the machine's
cores by default).
For each setup and each client count, every client sends --requests completions in a row
(greedy, --max-tokens tokens, prompts that differ per request); throughput is completion
tokens per second of wall time, latency the median per request. A last column times a 1-token
request alone (median of 8): the fixed cost per request, so its difference between a Ray setup
and the plain server is what Ray's hops (proxy, router, engine replica) add to each request.
Setups are interleaved within each of --rounds rounds; the table gives medians over rounds.

    python benchmarks/ray_serve.py --clients 1,2,4,8 --rounds 2

--hops N instead times where Ray's overhead sits, N times each, interleaved: the same 1-token
request to the plain one-thread server over HTTP; to a one-thread Ray Serve replica through a
deployment handle (a Ray actor call into the replica's in-process app: no HTTP, no router); and
to the same replica through Ray Serve's HTTP proxy and the router (what a client gets).

    python benchmarks/ray_serve.py --hops 30

Prints a table, then one JSON document as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MODEL_NAME = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def wait_ready(url: str, timeout_s: float = 300) -> None:
    end = time.time() + timeout_s
    while time.time() < end:
        try:
            post(url, {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1})
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer in {timeout_s} s")


def load(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    """clients threads, each sending `requests` completions in a row."""
    latencies, tokens, lock = [], [0], threading.Lock()

    def client(c: int) -> None:
        for j in range(requests):
            t0 = time.perf_counter()
            r = post(url, {"model": MODEL_NAME, "prompt": f"Write a short note about item {c * 100 + j}.",
                           "max_tokens": max_tokens, "temperature": 0})
            with lock:
                latencies.append(time.perf_counter() - t0)
                tokens[0] += r["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"tok_s": tokens[0] / wall, "p50_s": statistics.median(latencies)}


def one_token_latency(url: str) -> float:
    times = []
    for j in range(8):
        t0 = time.perf_counter()
        post(url, {"model": MODEL_NAME, "prompt": f"Hello {j}", "max_tokens": 1, "temperature": 0})
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(url: str, levels: list[int], requests: int, max_tokens: int) -> dict:
    out = {c: load(url, c, requests, max_tokens) for c in levels}
    out["one_token_s"] = one_token_latency(url)
    return out


def run_plain(threads: int, levels, requests, max_tokens) -> dict:
    proc, url = start_plain(threads)
    try:
        return measure(url, levels, requests, max_tokens)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run_ray(replicas: int, threads: int, levels, requests, max_tokens) -> dict:
    import ray
    from ray import serve

    from specdec.flags import build_parser
    from specdec.distributed import start_ray
    from specdec.distributed.ray_serve import run_app, stop_app

    start_ray(None, quiet=True)
    try:
        args = build_parser().parse_args(["serve", "--ray", "--replicas", str(replicas), "--threads", str(threads),
                                          "--port", str(free_port()), "--max-context", "512"])
        url = run_app(args, name="bench")
        wait_ready(url)
        result = measure(url, levels, requests, max_tokens)
        stop_app("bench")
        serve.shutdown()
        return result
    finally:
        ray.shutdown()


def start_plain(threads: int):
    """(process, url) of a plain `specdec serve` that answers."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")}
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--port", str(port), "--threads",
                             str(threads), "--max-context", "512", "--log-level", "warning"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url)
    return proc, url


def hops(reps: int) -> dict:
    """Median seconds of one 1-token request by each path (see the module docstring)."""
    import ray
    from ray import serve

    from specdec.cli import build_parser
    from specdec.distributed import start_ray
    from specdec.distributed.ray_serve import run_app

    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    raw = json.dumps(body).encode()
    asgi_request = {"method": "POST", "path": "/v1/completions", "query_string": b"",
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}
    proc, plain_url = start_plain(1)
    start_ray(None, quiet=True)
    try:
        args = build_parser().parse_args(["serve", "--ray", "--replicas", "1", "--threads", "1",
                                          "--port", str(free_port()), "--max-context", "512"])
        ray_url = run_app(args, name="bench")
        wait_ready(ray_url)
        handle = serve.get_deployment_handle("SpecdecEngine", app_name="bench").options(stream=True)

        def direct():
            messages = list(handle.http.remote(asgi_request, raw))
            assert messages[0]["status"] == 200, messages

        paths = {"plain server, HTTP": lambda: post(plain_url, body),
                 "Ray replica, handle (no HTTP)": direct,
                 "Ray Serve, HTTP proxy + router": lambda: post(ray_url, body)}
        times = {name: [] for name in paths}
        for _ in range(reps):
            for name, fn in paths.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        serve.shutdown()
        return {name: statistics.median(t) for name, t in times.items()}
    finally:
        ray.shutdown()
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="1,2,4,8", help="client counts. Default: 1,2,4,8")
    ap.add_argument("--requests", type=int, default=3, help="requests per client and level. Default: 3")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per request. Default: 32")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the setups (medians reported). Default: 2")
    ap.add_argument("--cores", type=int, default=os.cpu_count(), help="T and R. Default: the machine's cores")
    ap.add_argument("--hops", type=int, default=0, metavar="N",
                    help="instead: time one 1-token request by each path N times (see above)")
    a = ap.parse_args()
    os.environ.setdefault("SPECDEC_LEARNED", "0")
    if a.hops:
        result = hops(a.hops)
        for name, sec in result.items():
            print(f"{name:<34}{sec * 1e3:>8.1f} ms")
        print(json.dumps({"hops_median_s": result, "reps": a.hops}))
        return
    levels = [int(x) for x in a.clients.split(",")]
    os.environ.setdefault("SPECDEC_LEARNED", "0")
    n = a.cores
    setups = {f"plain, {n} threads": lambda: run_plain(n, levels, a.requests, a.max_tokens),
              "plain, 1 thread": lambda: run_plain(1, levels, a.requests, a.max_tokens),
              f"ray, {n} replicas x 1 thread": lambda: run_ray(n, 1, levels, a.requests, a.max_tokens),
              f"ray, 1 replica x {n} threads": lambda: run_ray(1, n, levels, a.requests, a.max_tokens)}
    runs: dict[str, list[dict]] = {name: [] for name in setups}
    for r in range(a.rounds):
        for name, fn in setups.items():
            print(f"round {r + 1}: {name} ...", file=sys.stderr, flush=True)
            runs[name].append(fn())
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"\n{cpu}, {os.cpu_count()} cores; {a.requests} requests x {a.max_tokens} tokens per client; "
          f"medians of {a.rounds} rounds")
    print(f"{'setup':<30}" + "".join(f"{f'{c} cl tok/s':>13}{'p50 s':>8}" for c in levels) + f"{'1-token s':>11}")
    table = {}
    for name, rs in runs.items():
        row = {c: {k: statistics.median(x[c][k] for x in rs) for k in ("tok_s", "p50_s")} for c in levels}
        row["one_token_s"] = statistics.median(x["one_token_s"] for x in rs)
        table[name] = row
        print(f"{name:<30}" + "".join(f"{row[c]['tok_s']:>13.1f}{row[c]['p50_s']:>8.2f}" for c in levels)
              + f"{row['one_token_s']:>11.3f}")
    print(json.dumps({"cpu": cpu, "cores": os.cpu_count(), "requests": a.requests, "max_tokens": a.max_tokens,
                      "rounds": a.rounds, "results": {k: {str(c): v for c, v in row.items()}
                                                      for k, row in table.items()}}))


if __name__ == "__main__":
    main()
