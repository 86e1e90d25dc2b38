"""`specdec serve` under load: throughput and latency vs concurrency, speculation off / fixed /
load-aware (adaptive), same run, same prompts.

Settings (`--settings`): off (no speculation); fixed (prompt lookup + the shipped EAGLE head's
trees on every step, up to k guesses: `serve --fixed-k`); adaptive (the same, load-aware: the
server's default `serve --method auto`); adaptive-ngram and fixed-ngram (prompt lookup only,
`serve --method ngram`); adaptive-draft and fixed-draft (the shipped draft model's guesses,
`serve --method draft`); adaptive-lookup-draft and fixed-lookup-draft (prompt lookup beside the
shipped draft model, `serve --method auto --draft DRAFT`); adaptive-eagle and fixed-eagle (the
shipped EAGLE head's tree alone, `serve --method eagle`), adaptive-medusa and fixed-medusa (the
shipped Medusa heads' tree, `serve --method medusa`). Each setting is a `specdec serve` process on loopback (started at
once, idle while another is measured); the clients are threads in this process. At each concurrency level C, C client threads each send `--requests-per-client`
streaming chat requests back to back (prompts: first turns of Spec-Bench dev, spread over
categories, as chat; or with `--data humaneval` the HumanEval prompts as raw completions; or with
`--data code` short raw completions, a comment line and a `def` header per HumanEval task;
greedy, max_tokens fixed; answers may end early at EOS, so tokens are counted as received,
by re-tokenizing each streamed chunk). Each (repeat, level) sends prompts no earlier one sent (the same ones to every setting), so no
request drafts from its own earlier answer in a server's suffix cache. Measured per level: throughput (completion tokens / wall seconds), time to
first token (p50), time per output token (TPOT: a request's time from its first to its last
chunk / its tokens after the first; p50 and p95 over requests), the per-token latency a
reader of the stream sees, and inter-token latency (ITL: gaps between streamed chunks divided
by the tokens they carried; p50 and p95; its median hides speculation's gain, since most
chunks still carry one token). Settings are run in turn per concurrency level (off, fixed,
adaptive, then adaptive, fixed, off: the order flips every repeat) for `--repeats` rounds and
the median is reported, with the median of the per-repeat ratios adaptive / off ("paired":
adjacent runs, so the machine's drift between repeats cancels). `--min-requests` makes the
clients of a low concurrency level send more requests each, so that no level lasts only a
few seconds.

    python benchmarks/serve_load.py --concurrency 1,2,4,8,16,32 --min-requests 24 --out /tmp/serve-bench
    python benchmarks/serve_load.py --data code --max-tokens 96 --settings off,adaptive --concurrency 1,8,16,32 \
        --repeats 3 --min-requests 16 --threads 0       # speculation's cost on short code completions

`--busy N` measures beside N busy loops (`yes > /dev/null`, started after the warm-up and
stopped at the end): run once without and once with it to see what a server keeps of its speed
when other work shares the machine.

Prints a table and, as the last line, one JSON document; `--out` also gets a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from contention import start_busy
from devset import DEV_SET

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = DEV_SET


# name -> (server method, load-aware); auto = prompt lookup + the shipped EAGLE head's trees
SETTINGS = {"off": ("none", False), "fixed": ("auto", False), "adaptive": ("auto", True),
            "adaptive-ngram": ("ngram", True), "fixed-ngram": ("ngram", False),
            "adaptive-draft": ("draft", True), "fixed-draft": ("draft", False),
            "adaptive-lookup-draft": ("auto", True, "draft"), "fixed-lookup-draft": ("auto", False, "draft"),
            "adaptive-eagle": ("eagle", True), "fixed-eagle": ("eagle", False),
            "adaptive-suffix": ("suffix", True),
            "adaptive-medusa": ("medusa", True), "fixed-medusa": ("medusa", False)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(setting: str, args) -> tuple:
    """A `specdec serve` process for one setting; returns (process, base URL) once it answers."""
    import subprocess
    import urllib.request

    method, adaptive, *with_draft = SETTINGS[setting]
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; from specdec.cli import main; sys.exit(main())", "serve",
           "--method", method, "-k", str(args.k), "--max-batch", str(args.max_batch), "--max-context", "1024",
           "--port", str(port), *(["--threads", str(args.threads)] if args.threads else []), "--served-model-name", "m",
           "--log-level", "debug" if args.step_log else "warning"]
    if not adaptive:
        cmd.append("--fixed-k")
    if with_draft:  # auto with the shipped draft model in the EAGLE head's place
        from specdec.models.loader import DEFAULT_DRAFT_DIR

        cmd += ["--draft", str(DEFAULT_DRAFT_DIR)]
    if args.model:
        cmd += ["--model", args.model]
    err = subprocess.PIPE
    if args.step_log:  # the server's debug lines (one per decode step) go to a file, read after each level
        Path(args.step_log).mkdir(parents=True, exist_ok=True)
        err = open(Path(args.step_log) / f"{setting}.log", "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True)
    proc.log_path = Path(err.name) if args.step_log else None
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url + "/v1"
        except OSError:
            pass
        if proc.poll() is not None or time.time() - t0 > 300:
            proc.kill()
            said = proc.log_path.read_text() if proc.log_path else proc.stderr.read()
            raise SystemExit(f"the {setting} server did not start: {said[-2000:]}")
        time.sleep(0.5)


STEP_LINE = re.compile(r"step: batch (\d+), draft cap \d+, guesses (\d+), accepted \d+, ([\d.]+) ms")


PREFILL_LINE = re.compile(r"prefill: \d+ tokens(?: \(\d+ cached\))?, row \d+, ([\d.]+) ms")


def step_seconds(path: Path, skip: int) -> tuple[int, dict]:
    """From a server's debug log (`--step-log`), the decode steps and prefills logged after line
    `skip`: (lines now, {"step_s": seconds in decode steps, "steps": how many, "spec_steps":
    those that verified guesses, "prefill_s": seconds in prefills}). The rest of a level's wall
    time is HTTP and waiting."""
    lines = path.read_text().splitlines()
    steps = [m.groups() for line in lines[skip:] if (m := STEP_LINE.search(line))]
    prefill = sum(float(m.group(1)) for line in lines[skip:] if (m := PREFILL_LINE.search(line)))
    return len(lines), {"step_s": sum(float(ms) for _, _, ms in steps) / 1e3, "steps": len(steps),
                        "spec_steps": sum(1 for _, g, _ in steps if int(g) > 0), "prefill_s": prefill / 1e3}


def server_metrics(url: str) -> dict:
    """The server's Prometheus counters and gauges, name -> value (a labelled series as
    name{label="value"})."""
    import urllib.request

    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def drive(url: str, prompts: list[str], conc: int, per_client: int, max_tokens: int, tok, chat: bool = True) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)
    ttft, tpot, gaps, tokens, errors = [], [], [], [0], []
    lock = threading.Lock()

    def one(c: int):
        for j in range(per_client):
            p = prompts[(c * per_client + j) % len(prompts)]
            t0 = time.perf_counter()
            last, first, t_first, n_req, n_first = t0, True, t0, 0, 0
            try:
                if chat:
                    events = client.chat.completions.create(model="m", messages=[{"role": "user", "content": p}],
                                                            max_tokens=max_tokens, temperature=0, stream=True)
                else:
                    events = client.completions.create(model="m", prompt=p, max_tokens=max_tokens, temperature=0,
                                                       stream=True)
                for ev in events:
                    piece = (ev.choices[0].delta.content if chat else ev.choices[0].text) if ev.choices else None
                    if not piece:
                        continue
                    now = time.perf_counter()
                    n = max(1, len(tok.encode(piece, add_special_tokens=False)))
                    with lock:
                        if first:
                            ttft.append(now - t0)
                            first, t_first, n_first = False, now, n
                        else:
                            gaps.append((now - last) / n)
                        tokens[0] += n
                    last = now
                    n_req += n
                if n_req > n_first:
                    with lock:
                        tpot.append((last - t_first) / (n_req - n_first))
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    ths = [threading.Thread(target=one, args=(c,)) for c in range(conc)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    wall = time.perf_counter() - t0
    q = lambda xs, f: statistics.quantiles(xs, n=100)[int(f * 100) - 1] if len(xs) >= 2 else (xs[0] if xs else 0.0)  # noqa: E731
    return {"throughput": tokens[0] / wall, "ttft_p50": statistics.median(ttft) if ttft else 0.0,
            "token_p50": q(tpot, 0.5), "token_p95": q(tpot, 0.95), "itl_p50": q(gaps, 0.5), "itl_p95": q(gaps, 0.95),
            "errors": len(errors), "wall": wall}


def short_code_prompts() -> list[str]:
    """Short raw code completions, as an editor plugin sends them: per HumanEval task, a comment line
    (the first sentence of the docstring) and the function's `def` header, e.g.
    "# Return the decimal part of the number.\ndef truncate_number(number: float) -> float:\n"."""
    from specdec.bench.tasks import load_humaneval

    out = []
    for task in load_humaneval():
        lines = task.prompt.splitlines()
        at = max((i for i, ln in enumerate(lines) if ln.startswith("def ")), default=None)  # (the entry point)
        if at is None:
            continue
        doc = " ".join(ln.strip().strip('"').strip() for ln in lines[at + 1:at + 4]).strip()
        first = re.split(r"(?<=[.!?])\s", doc, maxsplit=1)[0].strip() if doc else ""
        if first:
            out.append(f"# {first}\n{lines[at]}\n")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", default=str(DEFAULT_DATA),
                    help="Spec-Bench JSONL (chat requests), 'humaneval' (raw completions of the whole prompts) or "
                         "'code' (short raw completions: a comment line and a def header per HumanEval task)")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=0,
                    help="at least this many requests per level (clients send more each at low concurrency, where "
                         "a few requests make a level of a few seconds and the machine's drift dominates). Default: 0")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="the servers' --threads; 0: their default (the cores other processes leave free)")
    ap.add_argument("--warmup", type=int, default=4,
                    help="requests each server answers (one at a time, then all at once) before measuring, so its "
                         "step-time model and acceptance estimates start warm. Default: 4")
    ap.add_argument("--settings", default="off,fixed,adaptive,adaptive-ngram",
                    help="server settings to compare (of " + ", ".join(SETTINGS) + "); off and adaptive are needed "
                         "for the ratio columns")
    ap.add_argument("--step-log", default=None, metavar="DIR",
                    help="run the servers with --log-level debug, their stderr in DIR/<setting>.log, and report per "
                         "level the seconds spent in decode steps and in prefills (the rest of the wall time is HTTP "
                         "and waiting)")
    ap.add_argument("--busy", type=int, default=0, help="busy loops running beside the measured levels. Default: 0")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from specdec.models.loader import load_model

    lm = load_model(args.model, quiet=True)
    chat = args.data not in ("humaneval", "code")
    if chat:
        texts = [json.loads(line)["turns"][0] for line in open(args.data)]
    elif args.data == "code":
        texts = short_code_prompts()
    else:
        from specdec.bench.tasks import load_humaneval

        texts = [t.prompt for t in load_humaneval()]
    fits = [t for t in texts if len(lm.tokenizer.encode(t)) < 1024 - args.max_tokens - 64]
    # chat: 32 spread over the file (its categories); code: every task, so that levels and repeats
    # send distinct prompts (a repeated prompt drafts its own earlier answer from the suffix cache)
    prompts = fits if args.data == "code" else fits[:: max(1, len(fits) // 32)][:32]
    settings = {}
    for name in args.settings.split(","):
        if name not in SETTINGS:
            ap.error(f"unknown setting {name!r}; choose from {', '.join(SETTINGS)}")
        settings[name] = SETTINGS[name]
    if "off" not in settings or "adaptive" not in settings:
        ap.error("--settings must include off and adaptive")
    servers = {name: start(name, args) for name in settings}
    for name in settings:  # warm up: first requests pay one-off costs and the load model's first measurements
        if args.warmup:
            drive(servers[name][1], prompts[::-1], 1, args.warmup, args.max_tokens, lm.tokenizer, chat)
            drive(servers[name][1], prompts[::-1], args.warmup, 1, args.max_tokens, lm.tokenizer, chat)
    levels = [int(c) for c in args.concurrency.split(",")]
    raw = {name: {c: [] for c in levels} for name in settings}
    # each (repeat, level) sends prompts no earlier one sent (both settings the same ones): a
    # server's suffix cache keeps every answer, and a prompt sent again would draft its own answer
    fresh = prompts[: len(prompts) - args.warmup] if args.warmup else prompts  # (the last ones warm up)
    offset = 0
    need = args.repeats * sum(c * max(args.requests_per_client, -(-args.min_requests // c)) for c in levels)
    if need > len(fresh):
        print(f"note: {need} requests over {len(fresh)} prompts: some repeat (the suffix cache then has their answers)",
              file=sys.stderr)
    busy = start_busy(args.busy, 3600)
    try:
        for rep in range(args.repeats):
            for c in levels:
                per_client = max(args.requests_per_client, -(-args.min_requests // c))
                batch = [fresh[(offset + i) % len(fresh)] for i in range(c * per_client)]
                offset += c * per_client
                for name in (list(settings) if rep % 2 == 0 else list(settings)[::-1]):  # order flips each repeat
                    log = servers[name][0].log_path
                    skip = step_seconds(log, 0)[0] if log else 0
                    res = drive(servers[name][1], batch, c, per_client, args.max_tokens, lm.tokenizer, chat)
                    if log:
                        res.update(step_seconds(log, skip)[1])
                    raw[name][c].append(res)
                    print(f"rep {rep} c={c:<3} {name:<9} {res['throughput']:7.1f} tok/s  ttft {res['ttft_p50']*1e3:7.0f} ms  "
                          f"TPOT p50 {res['token_p50']*1e3:6.1f} ms  p95 {res['token_p95']*1e3:6.1f} ms  "
                          f"ITL p50 {res['itl_p50']*1e3:6.1f} ms  errors {res['errors']}"
                          + (f"  in steps {res['step_s']:5.2f} s, prefills {res['prefill_s']:5.2f} s of {res['wall']:5.2f} "
                             f"({res['steps']} steps, {res['spec_steps']} with guesses)" if log else ""),
                          file=sys.stderr)
    finally:
        for loop in busy:
            loop.terminate()
            loop.wait()
    table = {name: {c: {k: statistics.median(r[k] for r in raw[name][c]) for k in raw[name][c][0]} for c in levels}
             for name in settings}
    # adaptive / off per repeat: adjacent runs, so drift between repeats cancels
    paired = {c: [a["throughput"] / o["throughput"] for a, o in zip(raw["adaptive"][c], raw["off"][c])] for c in levels}
    print(f"{'conc':>5} " + "".join(f"{n + ' tok/s':>16}{n + ' TPOT ms':>16}" for n in settings)
          + f"{'adaptive/off':>14}{'paired':>8}{'TPOT off/adaptive':>19}")
    for c in levels:
        line = f"{c:>5} "
        for n in settings:
            line += f"{table[n][c]['throughput']:>16.1f}{table[n][c]['token_p50'] * 1e3:>16.1f}"
        line += f"{table['adaptive'][c]['throughput'] / table['off'][c]['throughput']:>14.2f}"
        line += f"{statistics.median(paired[c]):>8.2f}"
        line += f"{table['off'][c]['token_p50'] / table['adaptive'][c]['token_p50']:>19.2f}"
        print(line)
    metrics = {n: server_metrics(servers[n][1]) for n in settings}
    result = {"benchmark": "serve_load", "data": args.data, "threads": args.threads, "busy": args.busy, "settings": settings, "max_tokens": args.max_tokens, "k": args.k,
              "requests_per_client": args.requests_per_client, "min_requests": args.min_requests,
              "repeats": args.repeats, "table": table,
              "adaptive_over_off_per_repeat": {c: [round(r, 3) for r in paired[c]] for c in levels},
              "draft_k_last": {n: metrics[n].get("specdec_draft_length") for n in settings},
              "tree_rows": {n: metrics[n].get('specdec_source_rows_total{source="eagle"}', 0.0) for n in settings},
              "tau": {n: metrics[n].get("specdec_mean_accepted_length") for n in settings}}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "serve_load.json").write_text(json.dumps(result, indent=1))
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axs = plt.subplots(1, 2, figsize=(10, 4))
        for n in settings:
            axs[0].plot(levels, [table[n][c]["throughput"] for c in levels], marker="o", label=n)
            axs[1].plot(levels, [table[n][c]["token_p50"] * 1e3 for c in levels], marker="o", label=n)
        for ax, lab in zip(axs, ("throughput (tokens/s)", "time per output token p50 (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel(lab)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / "serve_load.png", dpi=110)
    for proc, _ in servers.values():
        proc.terminate()
        proc.wait(timeout=30)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
