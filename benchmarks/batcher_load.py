"""The server's batcher under a closed-loop load, in one process, without HTTP: where the time goes.

`serve_load.py` measures `specdec serve` end to end, through HTTP and re-tokenized streams,
where a level of a few seconds is easily 10% off between runs. This drives
`ContinuousBatcher` directly: C clients, each submitting its next request (chat prompts from
Spec-Bench dev, greedy, --max-tokens each) as soon as the previous one finishes, with the
model in this thread, for each setting in turn (off: no speculation; adaptive: `serve
--method auto`, load-aware; fixed: `serve --method auto --fixed-k`), interleaved per repeat
(the order flips every other repeat). Greedy output does not depend on the setting, so every
setting commits the same tokens and the throughput ratio is the ratio of wall times.

Per setting and level it reports tokens/s (median over repeats), the ratio to off per repeat
(adjacent runs, so machine drift hits both alike) and their median, and where the time went
in the last repeat: prefill seconds, and decoding steps by batch size with and without
guesses (steps, seconds, committed tokens per step, milliseconds per step, and of those the
milliseconds outside the target's forward: drafting, the load-aware choice, verification,
bookkeeping). Prints a line per run and level, then one JSON document.

    python benchmarks/batcher_load.py --concurrency 2,8 --requests 48 --repeats 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from devset import DEV_SET

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = DEV_SET


class TimedModel:
    """The batcher's model, with the seconds of its last forward kept (everything else passes through)."""

    def __init__(self, model) -> None:
        self.model, self.last = model, 0.0

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        out = self.model(*args, **kwargs)
        self.last = time.perf_counter() - t
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


class StepLog(logging.Handler):
    """Collects the batcher's per-step debug lines (batch, draft cap, guesses, accepted, ms, why a
    step was plain), each with the step's forward time (the line is logged after the step's forward)."""

    def __init__(self, timed: TimedModel) -> None:
        super().__init__(logging.DEBUG)
        self.timed = timed
        self.steps: list[tuple] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("step:"):
            self.steps.append(tuple(record.args) + (self.timed.last * 1e3,))


def make_batcher(setting: str, lm, k: int, max_batch: int):
    from specdec.config import SpecConfig
    from specdec.core.scheduler import ContinuousBatcher
    from specdec.methods import sources_for

    sources = [] if setting == "off" else sources_for(SpecConfig(method="auto"), lm)[0]
    return ContinuousBatcher(lm.model, lm.eos_ids, sources, method="none" if setting == "off" else "auto", k_max=k,
                             max_batch=max_batch, max_context=1024, adaptive=setting == "adaptive", thread=False)


def drive(batcher, prompts: list[list[int]], clients: int, total: int, max_tokens: int) -> dict:
    """C clients in a closed loop until `total` requests are answered; wall seconds, tokens, prefill seconds."""
    from specdec.core.scheduler import Request
    from specdec.types import SamplingParams

    params = SamplingParams(max_new_tokens=max_tokens)
    state = {"sent": 0, "done": 0, "tokens": 0}
    outputs: dict[int, list[int]] = {}

    def send():
        i = state["sent"]
        state["sent"] += 1
        got: list[int] = []

        def on_done(reason, stats, i=i, got=got):
            outputs[i] = got
            state["done"] += 1
            state["tokens"] += len(got)
            if state["sent"] < total:
                send()

        batcher.submit(Request(prompts[i % len(prompts)], params, got.extend, on_done))

    prefill = [0.0]
    inner = batcher._prefill

    def timed_prefill(req):
        t = time.perf_counter()
        inner(req)
        prefill[0] += time.perf_counter() - t

    batcher._prefill = timed_prefill
    t0 = time.perf_counter()
    for _ in range(min(clients, total)):
        send()
    batcher.run(until=lambda: state["done"] >= total)
    wall = time.perf_counter() - t0
    batcher._prefill = inner
    return {"wall": wall, "tokens": state["tokens"], "throughput": state["tokens"] / wall, "prefill_s": prefill[0],
            "outputs": outputs}


def breakdown(steps: list[tuple]) -> dict:
    """Decoding steps grouped by (batch size, guessed or not): count, seconds, tokens per step, ms per step."""
    groups = defaultdict(lambda: [0, 0.0, 0, 0.0])
    for A, cap, guesses, accepted, ms, _why, fwd_ms in steps:
        g = groups[(A, guesses > 0)]
        g[0] += 1
        g[1] += ms / 1e3
        g[2] += A + accepted
        g[3] += (ms - fwd_ms) / 1e3
    return {f"{A}{'+spec' if spec else ''}": {"steps": n, "seconds": round(s, 3), "tokens_per_step": round(t / n, 2),
                                             "ms_per_step": round(1e3 * s / n, 2), "ms_outside_forward": round(1e3 * o / n, 2)}
            for (A, spec), (n, s, t, o) in sorted(groups.items())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="Spec-Bench style JSONL (first turns, as chat)")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--requests", type=int, default=48, help="requests answered per level and setting. Default: 48")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--settings", default="off,adaptive", help="of off, adaptive, fixed; off first. Default: off,adaptive")
    ap.add_argument("--warmup", type=int, default=8, help="requests each batcher answers before measuring. Default: 8")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    settings = args.settings.split(",")
    if settings[0] != "off" or not set(settings) <= {"off", "adaptive", "fixed"}:
        ap.error("--settings: off first, then any of adaptive, fixed")
    torch.set_num_threads(args.threads)

    from specdec.models.loader import load_model

    lm = load_model(args.model, quiet=True)
    texts = [json.loads(line)["turns"][0] for line in open(args.data)]
    encoded = [lm.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
               for t in texts]
    fits = [ids for ids in encoded if len(ids) < 1024 - args.max_tokens - 64]
    prompts = fits[:: max(1, len(fits) // 32)][:32]
    batchers = {}
    logs = {}
    for s in settings:
        batchers[s] = make_batcher(s, lm, args.k, args.max_batch)
        batchers[s].model = TimedModel(batchers[s].model)
        logs[s] = StepLog(batchers[s].model)
        batchers[s].log = logging.getLogger(f"batcher_load.{s}")
        batchers[s].log.setLevel(logging.DEBUG)
        batchers[s].log.propagate = False
        batchers[s].log.addHandler(logs[s])
        drive(batchers[s], prompts[::-1], 1, args.warmup // 2, args.max_tokens)
        drive(batchers[s], prompts[::-1], args.warmup // 2, args.warmup // 2, args.max_tokens)
    print(f"threads {torch.get_num_threads()}, {args.requests} requests per level, max_tokens {args.max_tokens}",
          file=sys.stderr)
    levels = [int(c) for c in args.concurrency.split(",")]
    raw = {s: {c: [] for c in levels} for s in settings}
    last = {}
    for rep in range(args.repeats):
        for c in levels:
            order = settings if rep % 2 == 0 else settings[::-1]
            for s in order:
                logs[s].steps.clear()
                res = drive(batchers[s], prompts, c, args.requests, args.max_tokens)
                raw[s][c].append(res)
                last[(s, c)] = breakdown(logs[s].steps)
                print(f"rep {rep} c={c:<3} {s:<9} {res['throughput']:7.1f} tok/s  wall {res['wall']:6.2f} s  "
                      f"prefill {res['prefill_s']:5.2f} s", file=sys.stderr)
    base = raw["off"]
    for s in settings:
        for c in levels:
            for a, b in zip(raw[s][c], base[c]):
                if a["outputs"] != b["outputs"]:
                    print(f"WARNING: {s} at c={c} answered differently from off", file=sys.stderr)
    table = {}
    for c in levels:
        row = {}
        for s in settings:
            ratios = [a["throughput"] / b["throughput"] for a, b in zip(raw[s][c], base[c])]
            row[s] = {"throughput": statistics.median(r["throughput"] for r in raw[s][c]),
                      "ratio_per_repeat": [round(r, 3) for r in ratios], "ratio": statistics.median(ratios),
                      "prefill_s": statistics.median(r["prefill_s"] for r in raw[s][c]), "steps": last[(s, c)]}
        table[c] = row
        print(f"c={c:<3} " + "  ".join(f"{s} {row[s]['throughput']:6.1f} tok/s ({row[s]['ratio']:.2f}x)" for s in settings))
    print(json.dumps({"benchmark": "batcher_load", "threads": torch.get_num_threads(), "requests": args.requests,
                      "max_tokens": args.max_tokens, "k": args.k, "table": table}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
