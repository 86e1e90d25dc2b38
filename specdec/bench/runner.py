"""Side-by-side benchmark of decoding methods on task sets (`specdec bench`).

Every method runs on the same weights, prompts and settings in one process, interleaved
per prompt (prompt 1: none, ngram, draft, auto; prompt 2: ...), so machine drift hits all
methods alike. Each (prompt, method) pair runs `repeats` times; per category a method's
speed is total new tokens / total wall seconds (prefill + decode) per repeat, and the
median over repeats is reported. Greedy runs also report the share of prompts whose
output equals specdec `none` token for token.

Peers (transformers `generate`, llama.cpp) are not part of this runner yet.
Prints a table per category; the caller prints the JSON document.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections import defaultdict

import torch

from ..metrics import summarize
from .tasks import Task


def machine_info(threads: int) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "threads": threads, "torch": torch.__version__, "python": platform.python_version()}


def run(engines: dict, tasks: list[Task], encoded: list[list[int]], params, repeats: int, quiet: bool = False) -> dict:
    """engines: method -> Engine. Returns per-method, per-category results."""
    from tqdm import tqdm

    methods = list(engines)
    # results[method][category] = list over repeats of (tokens, seconds), plus the stats
    totals = {m: defaultdict(lambda: [[0, 0.0] for _ in range(repeats)]) for m in methods}
    stats = {m: defaultdict(list) for m in methods}
    outputs = {m: {} for m in methods}
    bar = tqdm(total=repeats * len(tasks) * len(methods), desc="bench", unit="run", disable=quiet, dynamic_ncols=True)
    for r in range(repeats):
        for i, (task, ids) in enumerate(zip(tasks, encoded)):
            for m in methods:
                t0 = time.perf_counter()
                [res] = engines[m].generate([ids], params)
                dt = time.perf_counter() - t0
                acc = totals[m][task.category][r]
                acc[0] += len(res.tokens)
                acc[1] += dt
                if r == 0:
                    stats[m][task.category].append(res)
                    outputs[m][i] = res.tokens
                bar.update(1)
    bar.close()

    cats = sorted({t.category for t in tasks})
    table = {}
    for m in methods:
        table[m] = {}
        for c in cats + ["all"]:
            per_rep = []
            for r in range(repeats):
                if c == "all":
                    tok = sum(totals[m][k][r][0] for k in cats)
                    sec = sum(totals[m][k][r][1] for k in cats)
                else:
                    tok, sec = totals[m][c][r]
                per_rep.append(tok / sec if sec else 0.0)
            res_list = [x for k in cats for x in stats[m][k]] if c == "all" else stats[m][c]
            s = summarize(res_list)
            idx = [i for i, t in enumerate(tasks) if c == "all" or t.category == c]
            same = sum(outputs[m][i] == outputs.get("none", outputs[m])[i] for i in idx)
            table[m][c] = {
                "tokens_per_s": statistics.median(per_rep),
                "alpha": s["alpha"],
                "tau": s["tau"],
                "acceptance_by_pos": s["acceptance_by_pos"],
                "draft_s": s["draft_s"],
                "verify_s": s["verify_s"],
                "draft_cost": s["draft_cost"],
                "new_tokens": s["new_tokens"],
                "prompts": len(idx),
                "equal_to_none": f"{same}/{len(idx)}",
            }
    if "none" in table:
        for m in methods:
            for c, row in table[m].items():
                base = table["none"][c]["tokens_per_s"]
                row["speedup_vs_none"] = row["tokens_per_s"] / base if base else 0.0
    return {"methods": methods, "categories": cats + ["all"], "table": table}


def format_table(result: dict) -> str:
    lines = []
    head = f"{'category':<16}{'method':<8}{'tok/s':>8}{'x none':>8}{'alpha':>7}{'tau':>6}{'draft s':>9}{'verify s':>9}{'= none':>9}"
    for c in result["categories"]:
        lines.append(head)
        for m in result["methods"]:
            r = result["table"][m][c]
            lines.append(f"{c:<16}{m:<8}{r['tokens_per_s']:>8.1f}{r.get('speedup_vs_none', 0):>8.2f}"
                         f"{r['alpha']:>7.2f}{r['tau']:>6.2f}{r['draft_s']:>9.2f}{r['verify_s']:>9.2f}"
                         f"{r['equal_to_none']:>9}")
        lines.append("")
    return "\n".join(lines)
