"""Predicted outputs and structured output, measured through the Python API (specdec.load).

`edits`: the code-edit dev set (benchmarks/data/code_edits.jsonl: 20 small modules, each with an
instruction; the model answers with the whole updated file), greedy: plain decoding, `--method`
without the prediction and with the original file as the prediction: tokens/s of each, their
ratios, and the share of edits whose answer is the same in all three (it must be all: a
prediction is only a draft).

`extract`: the JSON-schema extraction dev set (benchmarks/data/json_extraction.jsonl: 20
documents with schemas), greedy: constrained decoding with speculation (`--method`), constrained
plain decoding and unconstrained plain decoding: tokens/s and their ratios, and the share of
answers that parse and validate against their schema (`jsonschema`), per variant.

Variants run interleaved, task by task, `--repeats` times; medians are reported with the CPU and
the load. The process's suffix cache is emptied before each timed call, so no variant drafts from
another's answer to the same task. The goals (issue 52): prediction >= 3x on Qwen2.5-Coder-1.5B
(>= 2.5x on the default model); constrained + speculation >= 1.5x constrained plain; constrained
plain >= 0.9x unconstrained plain.

    python benchmarks/structured.py edits --limit 20 --repeats 2 --threads 2
    python benchmarks/structured.py extract --limit 20 --repeats 2 --threads 2
    python benchmarks/structured.py edits --model ~/.cache/specdec/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf

Prints a table and, as the last line, one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

EDIT_SYSTEM = ("You are a careful code editor. Apply the requested change and answer with the complete updated "
               "file in one ```python block, nothing else.")


def edit_task(t: dict) -> tuple[list[dict], str]:
    """(messages, prediction) of one code edit: the prediction is the original file, fenced as the
    answer will be."""
    user = f"{t['instruction']}\n\n```python\n{t['original']}```"
    return ([{"role": "system", "content": EDIT_SYSTEM}, {"role": "user", "content": user}],
            f"```python\n{t['original']}```")


def extract_task(t: dict) -> list[dict]:
    user = (f"{t['instruction']}\n\nDocument:\n{t['document']}\n\nJSON schema:\n"
            f"{json.dumps(t['schema'], ensure_ascii=False)}")
    return [{"role": "user", "content": user}]


def rows(name: str, limit: int) -> list[dict]:
    lines = (HERE / "data" / name).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line][:limit]


def timed(spec, messages, **kw):
    from specdec.drafters.suffix import forget_shared

    forget_shared()  # no suffix drafts from the same task's earlier answers (another variant, repeat)
    t = time.perf_counter()
    out = spec.generate(messages, temperature=0.0, **kw)
    return out, time.perf_counter() - t


def valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_edits(args, spec, plain) -> dict:
    """Per edit: plain decoding (no speculation), `--method` without the prediction and with it."""
    variants = {"plain": (plain, False), "none": (spec, False), "prediction": (spec, True)}
    per, same = {v: [] for v in variants}, 0
    tasks = rows("code_edits.jsonl", args.limit)
    for t in tasks:
        messages, prediction = edit_task(t)
        n = len(spec.tokenizer.encode(t["original"])) + 96
        speeds = {v: [] for v in variants}
        texts = {}
        for _ in range(args.repeats):
            for variant, (engine, predicted) in variants.items():
                out, s = timed(engine, messages, max_new_tokens=n, prediction=prediction if predicted else None)
                speeds[variant].append(len(out.token_ids) / s)
                texts[variant] = out.token_ids
        same += texts["prediction"] == texts["none"] == texts["plain"]
        for v in per:
            per[v].append(statistics.median(speeds[v]))
        print(f"{t['id']:24s} plain {per['plain'][-1]:6.1f}  none {per['none'][-1]:6.1f}  prediction "
              f"{per['prediction'][-1]:6.1f} tok/s  x{per['prediction'][-1] / per['none'][-1]:.2f} (vs plain "
              f"x{per['prediction'][-1] / per['plain'][-1]:.2f})  same {texts['prediction'] == texts['none'] == texts['plain']}",
              flush=True)
    ratios = {"prediction / none": statistics.median(p / q for p, q in zip(per["prediction"], per["none"])),
              "prediction / plain": statistics.median(p / q for p, q in zip(per["prediction"], per["plain"])),
              "none / plain": statistics.median(p / q for p, q in zip(per["none"], per["plain"]))}
    for k, r in ratios.items():
        print(f"median {k}: x{r:.2f}")
    print(f"same answer in all three: {same}/{len(tasks)}")
    return {"ratios": ratios, "same": same, "tasks": len(tasks),
            "tokens_per_s": {v: statistics.median(x) for v, x in per.items()}}


def run_extract(args, spec, plain) -> dict:
    variants = {"constrained+spec": (spec, True), "constrained plain": (plain, True), "plain": (plain, False)}
    speed = {v: [] for v in variants}
    ok = {v: 0 for v in variants}
    tasks = rows("json_extraction.jsonl", args.limit)
    for t in tasks:
        messages = extract_task(t)
        got = {v: [] for v in variants}
        for _ in range(args.repeats):
            for v, (engine, constrained) in variants.items():
                out, s = timed(engine, messages, max_new_tokens=args.max_new_tokens,
                               json_schema=t["schema"] if constrained else None)
                got[v].append(len(out.token_ids) / s)
        for v in variants:  # greedy: every repeat gave the same text; the last one's is checked
            speed[v].append(statistics.median(got[v]))
        ok_now = {}
        for v, (engine, constrained) in variants.items():
            out = engine.generate(messages, temperature=0.0, max_new_tokens=args.max_new_tokens,
                                  json_schema=t["schema"] if constrained else None)
            ok_now[v] = valid(out.text, t["schema"])
            ok[v] += ok_now[v]
        print(f"{t['id']:16s} " + "  ".join(f"{v} {speed[v][-1]:6.1f} tok/s ({'valid' if ok_now[v] else 'invalid'})"
                                             for v in variants), flush=True)
    med = {v: statistics.median(x) for v, x in speed.items()}
    ratios = {"constrained+spec / constrained plain": statistics.median(
                  a / b for a, b in zip(speed["constrained+spec"], speed["constrained plain"])),
              "constrained plain / plain": statistics.median(
                  a / b for a, b in zip(speed["constrained plain"], speed["plain"]))}
    for k, r in ratios.items():
        print(f"{k}: x{r:.2f}")
    print("validates: " + ", ".join(f"{v} {ok[v]}/{len(tasks)}" for v in variants))
    return {"tokens_per_s": med, "ratios": ratios, "validates": ok, "tasks": len(tasks)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("edits", "extract"))
    ap.add_argument("--model", default=None, help="a .gguf or folder (default: the default model)")
    ap.add_argument("--method", default="auto", help="speculation for the speculative variants (default auto)")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=160, help="extract: tokens per answer at most")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    import specdec

    settings = {"threads": args.threads} if args.threads else {}
    spec = specdec.load(args.model, method=args.method, **settings)
    report = {"what": args.what, "model": spec.target.name, "method": args.method, "cpu": _cpu(),
              "load_before": os.getloadavg()[0]}
    plain = specdec.load(args.model, method="none", **settings)
    if args.what == "edits":
        report.update(run_edits(args, spec, plain))
    else:
        report.update(run_extract(args, spec, plain))
    report["load_after"] = os.getloadavg()[0]
    print(json.dumps(report))


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
