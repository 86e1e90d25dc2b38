"""`specdec validate` from start to finish: samples -> configurations -> the three measurements
of `measure.py` -> `analysis.py`'s figures and verdict -> the settings for other frameworks.

`run` takes a loaded target, the encoded samples and the engines to compare, and returns one
JSON-ready dict (what report.json holds). Building engines from method names is the CLI's
job (it owns the flags); this module only orchestrates and shows progress.
"""

from __future__ import annotations

import datetime
import sys
from dataclasses import dataclass

from ..types import SamplingParams
from . import analysis, measure
from .samples import Samples


@dataclass
class Options:
    max_new_tokens: int = 128
    repeats: int = 2
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    load_k: int = 8  # prompt lookup's draft length in the load test (fixed, and the load-aware cap)
    min_requests: int = 8  # requests per concurrency level at least
    dist_samples: int = 2  # samples with a distribution check per method
    dist_draws: int = 400
    dist_tokens: int = 4
    dist_temperature: float = 1.0
    seed: int = 0
    quiet: bool = False


def _bar(total: int, desc: str, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", disable=quiet, dynamic_ncols=True, leave=False)


def run(target, samples: Samples, configs: list[measure.Config], none_engine, opts: Options,
        skipped_methods: dict[str, str], command: str, machine: dict, drafts: dict | None = None) -> dict:
    """drafts: method -> the draft / head path the user gave (for the recommended settings)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=opts.max_new_tokens)
    enc = samples.encoded

    # 1. acceptance and speed at concurrency 1 (also greedy exactness against plain decoding)
    bar = _bar(opts.repeats * len(enc) * (1 + len(configs)), "acceptance", opts.quiet)
    raw = measure.acceptance(configs, none_engine, enc, params, opts.repeats, bar)
    bar.close()
    none_sum = analysis.summarize_config(raw["none"], raw["none"])
    summaries = {}
    for c in configs:
        s = analysis.summarize_config(raw[c.name], raw["none"])
        s.update(method=c.method, k=c.k, tree=c.tree)
        s["per_sample"] = [{"id": t.task_id, "category": t.category, "alpha": r["alpha"], "tau": r["tau"],
                            "new_tokens": r["new_tokens"], "equal": r["equal"],
                            "acceptance_by_pos": [a / p if p else 0.0 for a, p in zip(r["accepted_by_pos"],
                                                                                       r["proposed_by_pos"])],
                            **({"first_difference": r["first_difference"]} if not r["equal"] else {})}
                           for t, r in zip(samples.tasks, raw[c.name]["samples"])]
        s["by_category"] = by_category(samples, raw[c.name]["samples"], raw["none"]["samples"])
        summaries[c.name] = s

    # 2 and 3 may be interrupted (Ctrl-C): what was measured so far is still reported
    interrupted = None
    load = findings = None
    dist: list[dict] = []
    try:
        # 2. under load, through the server's batcher
        if opts.concurrency:
            interrupted = "the load test"
            levels = sorted(set(opts.concurrency))
            reference = [r["tokens"] for r in raw["none"]["samples"]]
            bar = _bar(opts.repeats * len(levels) * len(measure.LOAD_SETTINGS), "under load", opts.quiet)
            from ..config import SpecConfig
            from ..methods import sources_for

            # the server's own drafting: auto (prompt lookup beside the EAGLE head or the draft model
            # the target has, else prompt lookup alone)
            server = SpecConfig(method="auto")
            load = measure.load(target.model, target.eos_ids, enc, params, levels, opts.load_k, opts.min_requests,
                                opts.repeats, reference, bar, make_sources=lambda: sources_for(server, target)[0])
            bar.close()
            findings = analysis.load_findings(load)

        # 3. distribution checks on the shortest samples, one configuration per method (chain / tree)
        interrupted = "the distribution check"
        per_method: dict[tuple, measure.Config] = {}
        for c in configs:
            per_method.setdefault((c.method, c.tree), c)
        # among the shorter half of the samples (cheap to prefill hundreds of times), those where the
        # method guessed most often at concurrency 1, so the check sees guesses verified
        shorter = sorted(range(len(enc)), key=lambda i: len(enc[i]))[: max(opts.dist_samples, (len(enc) + 1) // 2)]
        if opts.dist_draws > 0 and opts.dist_samples > 0 and per_method:
            bar = _bar(opts.dist_samples * len(per_method), "distribution", opts.quiet)
            for c in per_method.values():
                rows = raw[c.name]["samples"]
                chosen = sorted(shorter, key=lambda i: -rows[i]["proposed"] / max(1, rows[i]["forwards"]))
                for i in chosen[: opts.dist_samples]:
                    d = measure.distribution(c, target.model, enc[i], opts.dist_draws, opts.dist_tokens,
                                             opts.dist_temperature, opts.seed + 1000 * i)
                    d.update(config=c.name, sample=samples.tasks[i].task_id)
                    d["status"] = ("inconclusive" if not d["tested"] else "FAIL" if not d["passed"] else
                                   "pass" if d["exercised"] else "pass (no guesses verified)")
                    dist.append(d)
                    bar.update(1)
            bar.close()
        interrupted = None
    except KeyboardInterrupt:
        print(f"\n[specdec] interrupted during {interrupted}: writing a partial report", file=sys.stderr)

    verdict = analysis.verdict(summaries, findings, dist, skipped_methods)
    if verdict.get("recommended"):
        best = next(c for c in configs if c.name == verdict["recommended"])
        verdict["recommended_method"], verdict["recommended_k"] = best.method, best.k
    if interrupted:
        verdict["headline"] = f"PARTIAL (interrupted during {interrupted}): " + verdict["headline"]
    result = {
        "interrupted": interrupted, "command": command, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "model": target.name, "machine": machine,
        "samples": {"source": samples.source, "format": samples.fmt, "read": samples.total, "kept": len(enc),
                    "skipped": samples.skipped, "ids": [t.task_id for t in samples.tasks],
                    "prompt_tokens": [len(e) for e in enc]},
        "options": vars(opts) | {"concurrency": list(opts.concurrency)},
        "none": {k: none_sum[k] for k in ("decode_tokens_per_s", "prefill_share", "new_tokens", "forwards")},
        "configs": summaries, "load": load, "load_findings": findings, "distribution": dist,
        "verdict": verdict, "skipped_methods": skipped_methods,
    }
    result["settings"] = recommended_settings(verdict, target, drafts or {})
    return result


def by_category(samples: Samples, rows: list[dict], none_rows: list[dict]) -> dict:
    """alpha, tau and decode speedup (first repeat's times) per sample category."""
    out = {}
    for cat in dict.fromkeys(t.category for t in samples.tasks):
        idx = [i for i, t in enumerate(samples.tasks) if t.category == cat]
        prop = sum(rows[i]["proposed"] for i in idx)
        fwd = sum(rows[i]["forwards"] for i in idx)
        dec, dec0 = sum(rows[i]["decode_s"] for i in idx), sum(none_rows[i]["decode_s"] for i in idx)
        tok, tok0 = (sum(r[i]["new_tokens"] - 1 for i in idx) for r in (rows, none_rows))
        out[cat] = {"samples": len(idx), "alpha": sum(rows[i]["accepted"] for i in idx) / prop if prop else 0.0,
                    "tau": tok / fwd if fwd else 0.0,
                    "speedup": (tok / dec) / (tok0 / dec0) if dec and dec0 and tok0 else 0.0}
    return out


def recommended_settings(verdict: dict, target, drafts: dict) -> list[dict]:
    from .settings import METHODS, framework_settings

    method = verdict.get("recommended_method") or "none"
    k = verdict.get("recommended_k") or 0
    if method not in METHODS:
        return []  # a drafter of the Python API alone: no command line or framework runs it
    if method in ("eagle", "medusa") and verdict.get("recommended", "").endswith("tree"):
        k = k or 4  # a tree's depth stands in for the chain length the other frameworks take
    # the name a serving framework loads: the hub id of the default model, else what the user gave
    model = "HuggingFaceTB/SmolLM2-135M-Instruct" if target.source == "default" else target.source
    on = bool(verdict.get("enable"))
    draft = drafts.get(method)
    if draft is None and method in ("draft", "auto"):  # what specdec used: the shipped head or draft
        from ..drafters.eagle import default_eagle_for
        from ..models.loader import default_draft_for

        shipped = default_eagle_for(target) if method == "auto" and getattr(target.model, "native", False) else None
        shipped = shipped or default_draft_for(target)
        draft = str(shipped) if shipped is not None else None
    out = framework_settings(method if on else "none", k if on else 0, draft=draft,
                             max_concurrency=verdict.get("max_concurrency"), model=str(model),
                             gguf=getattr(target, "gguf", None))
    if target.source == "default":  # specdec loads its embedded default model without --model
        for e in out:
            if e["framework"] == "specdec":
                e["command"] = e["command"].replace(f" --model {model}", "")
                e["notes"] = [n.replace(f" --model {model}", "") for n in e["notes"]]
    return out
