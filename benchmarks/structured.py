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


def ratios_of(per: dict, pairs: list[tuple[str, str]]) -> dict:
    """Medians of the per-task ratios a / b."""
    return {f"{a} / {b}": statistics.median(p / q for p, q in zip(per[a], per[b])) for a, b in pairs}


def run_edits(args, spec, plain) -> dict:
    """Per edit: plain decoding (no speculation), `--method` without the prediction and with it.
    Tokens/s of whole requests (prefill included) and of their decoding alone (the same prompt's
    prefill in every variant: what the prediction can speed up)."""
    variants = {"plain": (plain, False), "none": (spec, False), "prediction": (spec, True)}
    per, dec, same = {v: [] for v in variants}, {v: [] for v in variants}, 0
    tasks = rows("code_edits.jsonl", args.limit)
    for t in tasks:
        messages, prediction = edit_task(t)
        n = len(spec.tokenizer.encode(t["original"])) + 96
        speeds, decode = {v: [] for v in variants}, {v: [] for v in variants}
        texts = {}
        for _ in range(args.repeats):
            for variant, (engine, predicted) in variants.items():
                out, s = timed(engine, messages, max_new_tokens=n, prediction=prediction if predicted else None)
                speeds[variant].append(len(out.token_ids) / s)
                decode[variant].append(len(out.token_ids) / max(out.stats.decode_s, 1e-9))
                texts[variant] = out.token_ids
        same += texts["prediction"] == texts["none"] == texts["plain"]
        for v in per:
            per[v].append(statistics.median(speeds[v]))
            dec[v].append(statistics.median(decode[v]))
        print(f"{t['id']:22s} {len(texts['plain']):4d} tok  plain {per['plain'][-1]:6.1f}  none {per['none'][-1]:6.1f}  "
              f"prediction {per['prediction'][-1]:6.1f} tok/s  x{per['prediction'][-1] / per['none'][-1]:.2f} (vs plain "
              f"x{per['prediction'][-1] / per['plain'][-1]:.2f}); decoding x{dec['prediction'][-1] / dec['none'][-1]:.2f} "
              f"(vs plain x{dec['prediction'][-1] / dec['plain'][-1]:.2f})  "
              f"same {texts['prediction'] == texts['none'] == texts['plain']}", flush=True)
    pairs = [("prediction", "none"), ("prediction", "plain"), ("none", "plain")]
    ratios, decoding = ratios_of(per, pairs), ratios_of(dec, pairs)
    for k in ratios:
        print(f"median {k}: x{ratios[k]:.2f} (decoding alone x{decoding[k]:.2f})")
    print(f"same answer in all three: {same}/{len(tasks)}")
    return {"ratios": ratios, "decoding_ratios": decoding, "same": same, "tasks": len(tasks),
            "tokens_per_s": {v: statistics.median(x) for v, x in per.items()},
            "decoding_tokens_per_s": {v: statistics.median(x) for v, x in dec.items()}}


def run_extract(args, spec, plain) -> dict:
    """Per document: constrained decoding with `--method`, constrained plain decoding, unconstrained
    plain decoding. Tokens/s of whole requests and of decoding alone: constrained and unconstrained
    answers differ in length, so whole-request rates spread the same prefill over different
    counts; decoding alone is what the mask costs."""
    variants = {"constrained+spec": (spec, True), "constrained plain": (plain, True), "plain": (plain, False)}
    speed, dec = {v: [] for v in variants}, {v: [] for v in variants}
    ok = {v: 0 for v in variants}
    tasks = rows("json_extraction.jsonl", args.limit)
    for t in tasks:
        messages = extract_task(t)
        for engine in (spec, plain):  # the schema's grammar compiled for each engine's vocabulary, untimed
            engine.generate(messages, temperature=0.0, max_new_tokens=1, json_schema=t["schema"])
        got, got_dec = {v: [] for v in variants}, {v: [] for v in variants}
        for _ in range(args.repeats):
            for v, (engine, constrained) in variants.items():
                out, s = timed(engine, messages, max_new_tokens=args.max_new_tokens,
                               json_schema=t["schema"] if constrained else None)
                got[v].append(len(out.token_ids) / s)
                got_dec[v].append(len(out.token_ids) / max(out.stats.decode_s, 1e-9))
        for v in variants:  # greedy: every repeat gave the same text; the last one's is checked
            speed[v].append(statistics.median(got[v]))
            dec[v].append(statistics.median(got_dec[v]))
        ok_now = {}
        for v, (engine, constrained) in variants.items():
            out = engine.generate(messages, temperature=0.0, max_new_tokens=args.max_new_tokens,
                                  json_schema=t["schema"] if constrained else None)
            ok_now[v] = valid(out.text, t["schema"])
            ok[v] += ok_now[v]
        print(f"{t['id']:16s} " + "  ".join(f"{v} {speed[v][-1]:6.1f} ({dec[v][-1]:6.1f} decoding) tok/s "
                                             f"({'valid' if ok_now[v] else 'invalid'})" for v in variants), flush=True)
    pairs = [("constrained+spec", "constrained plain"), ("constrained plain", "plain")]
    ratios, decoding = ratios_of(speed, pairs), ratios_of(dec, pairs)
    for k in ratios:
        print(f"{k}: x{ratios[k]:.2f} (decoding alone x{decoding[k]:.2f})")
    print("validates: " + ", ".join(f"{v} {ok[v]}/{len(tasks)}" for v in variants))
    return {"tokens_per_s": {v: statistics.median(x) for v, x in speed.items()}, "ratios": ratios,
            "decoding_tokens_per_s": {v: statistics.median(x) for v, x in dec.items()}, "decoding_ratios": decoding,
            "validates": ok, "tasks": len(tasks)}


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

    # no prefix cache: the variants send the same prompt one after the other, and a later one would
    # find it cached (each variant's prefill timed cold, as forget_shared empties the suffix cache)
    settings = {"prefix_cache_mb": 0} | ({"threads": args.threads} if args.threads else {})
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
