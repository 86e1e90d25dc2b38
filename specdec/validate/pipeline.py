"""`specdec validate` from start to finish: samples -> configurations -> the three measurements
of `measure.py` -> `analysis.py`'s figures and verdict -> the settings for other frameworks.

`run` takes a loaded target, the encoded samples and the engines to compare, and returns one
JSON-ready dict (what report.json holds). Building engines from method names is the CLI's
job (it owns the flags); this module only orchestrates and shows progress.
"""

from __future__ import annotations

import datetime
import sys
import time
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
    load_settings: tuple[str, ...] = measure.LOAD_SETTINGS  # which of off / fixed / adaptive the load test runs
    dist_samples: int = 2  # samples with a distribution check per method
    dist_draws: int = 800
    dist_tokens: int = 4
    dist_temperature: float = 1.0
    seed: int = 0
    quiet: bool = False


class Progress:
    """One progress bar over the whole run, counted in estimated seconds: each phase's steps (a
    generate call, a concurrency level's run, a distribution check) advance it by what that step is
    expected to cost, so its ETA (tqdm's, from the pace so far) covers the phases still to come.
    `plan` maps a phase to its steps' estimated seconds, in the order they run."""

    def __init__(self, plan: dict[str, list[float]], quiet: bool) -> None:
        from tqdm import tqdm

        self.plan = {name: list(costs) for name, costs in plan.items()}
        self.total = sum(sum(c) for c in self.plan.values())
        self.bar = tqdm(total=round(self.total, 1), desc="validate", disable=quiet, dynamic_ncols=True, leave=False,
                        bar_format="{desc}{percentage:3.0f}%|{bar}| {elapsed} so far, about {remaining} left")
        self._left: list[float] = []

    def phase(self, name: str) -> "Progress":
        """Steps of `name` follow: each update(1) advances the bar by the next step's estimate."""
        self._left = list(self.plan.get(name, []))
        self.bar.set_description(f"validate ({name})")
        return self

    def update(self, n: int = 1) -> None:
        for _ in range(n):
            if self._left:  # (never past the total: the last step's rounding)
                self.bar.update(min(round(self._left.pop(0), 1), max(0.0, self.bar.total - self.bar.n)))

    def close(self) -> None:
        self.bar.close()


def plan_run(encoded: list[list[int]], n_configs: int, opts: "Options", n_checks: int, prefill_s_per_token: float,
             step_s: float) -> dict[str, list[float]]:
    """Each phase's steps with their estimated seconds, from a plain run's cost of a prompt token
    (prefill) and of a decoding step (batch 1): the speculative configurations taken to cost what
    plain decoding does, a batched step of b rows (1 + (b - 1) / 2) single steps. Rough by design:
    the progress bar's ETA corrects it by the pace measured so far."""
    new = opts.max_new_tokens

    def run(length: int, rows: int = 1, tokens: int = new) -> float:
        return rows * length * prefill_s_per_token + tokens * step_s * (1 + (rows - 1) / 2)

    mean_len = sum(len(e) for e in encoded) / max(1, len(encoded))
    plan = {"acceptance": [run(len(ids)) for _ in range(opts.repeats) for ids in encoded
                           for _ in range(1 + n_configs)]}
    levels = sorted(set(opts.concurrency))
    per_level = {c: c * max(1, -(-opts.min_requests // c)) for c in levels}  # requests at level c
    settings = measure.load_settings(opts.load_settings)
    plan["under load"] = []
    for rnd in range(opts.repeats):
        for c in levels:
            for _ in settings:  # (the first round's unmeasured warm-up burst first: measure.load)
                if rnd == 0:
                    plan["under load"].append(run(int(mean_len), c, min(new, measure.WARM_TOKENS)))
                plan["under load"].append(per_level[c] / c * run(int(mean_len), c))
    # a check: one prefill of the prompt, the draws' batched steps, then per depth a prefill of the
    # prompt and the distinct prefixes (at most one a draw) forwarded past a copy of its cache
    shortest = sorted(len(e) for e in encoded)[0] if encoded else 0
    batches, depth = -(-opts.dist_draws // 32), opts.dist_tokens
    draws = shortest * prefill_s_per_token + batches * depth * step_s * (1 + 31 / 2)
    exact = depth * shortest * prefill_s_per_token + opts.dist_draws * depth * (depth / 2) * prefill_s_per_token
    plan["distribution"] = [draws + exact] * n_checks
    return plan


def _calibrate(engine, ids: list[int]) -> tuple[float, float]:
    """Seconds a prompt token (prefill) and a decoding step cost: one short plain run of `ids`."""
    [res] = engine.generate([ids], SamplingParams(temperature=0.0, max_new_tokens=16))
    st = res.stats
    return st.prefill_s / max(1, len(ids)), st.decode_s / max(1, st.new_tokens - 1)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def run(target, samples: Samples, configs: list[measure.Config], none_engine, opts: Options,
        skipped_methods: dict[str, str], command: str, machine: dict, drafts: dict | None = None) -> dict:
    """drafts: method -> the draft / head path the user gave (for the recommended settings)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=opts.max_new_tokens)
    enc = samples.encoded
    # one configuration per method (chain / tree) gets distribution checks
    per_method: dict[tuple, measure.Config] = {}
    for c in configs:
        per_method.setdefault((c.method, c.tree), c)
    checking = opts.dist_draws > 0 and opts.dist_samples > 0 and per_method
    n_checks = len(per_method) * min(opts.dist_samples, len(enc)) if checking else 0
    # how long it will take, said up front: from one short plain run (also a warm-up)
    plan = plan_run(enc, len(configs), opts, n_checks, *_calibrate(none_engine, enc[0]))
    if not opts.concurrency:
        plan["under load"] = []
    estimate = {name: round(sum(costs), 1) for name, costs in plan.items()}
    if not opts.quiet:
        print(f"[specdec] validate: about {_minutes(sum(estimate.values()))} on this machine (acceptance "
              f"{_minutes(estimate['acceptance'])}, under load {_minutes(estimate['under load'])}, distribution "
              f"{_minutes(estimate['distribution'])}; from a first plain run: the bar's ETA follows the real pace)",
              file=sys.stderr)
    progress = Progress(plan, opts.quiet)
    took: dict[str, float] = {}
    t0 = time.perf_counter()

    # 1. acceptance and speed at concurrency 1 (also greedy exactness against plain decoding)
    raw = measure.acceptance(configs, none_engine, enc, params, opts.repeats, progress.phase("acceptance"))
    took["acceptance"] = round(time.perf_counter() - t0, 1)
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
            t0 = time.perf_counter()
            levels = sorted(set(opts.concurrency))
            reference = [r["tokens"] for r in raw["none"]["samples"]]
            from ..config import SpecConfig
            from ..methods import sources_for

            # the server's own drafting: auto (prompt lookup beside the EAGLE head or the draft model
            # the target has, else prompt lookup alone)
            server = SpecConfig(method="auto")
            load = measure.load(target.model, target.eos_ids, enc, params, levels, opts.load_k, opts.min_requests,
                                opts.repeats, reference, progress.phase("under load"),
                                make_sources=lambda: sources_for(server, target)[0], settings=opts.load_settings)
            findings = analysis.load_findings(load)
            took["under load"] = round(time.perf_counter() - t0, 1)

        # 3. distribution checks on the shortest samples, one configuration per method (chain / tree)
        interrupted = "the distribution check"
        t0 = time.perf_counter()
        # among the shorter half of the samples (cheap to prefill hundreds of times), those where the
        # method guessed most often at concurrency 1, so the check sees guesses verified
        shorter = sorted(range(len(enc)), key=lambda i: len(enc[i]))[: max(opts.dist_samples, (len(enc) + 1) // 2)]
        if checking:
            progress.phase("distribution")
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
                    progress.update(1)
            took["distribution"] = round(time.perf_counter() - t0, 1)
        interrupted = None
    except KeyboardInterrupt:
        print(f"\n[specdec] interrupted during {interrupted}: writing a partial report", file=sys.stderr)
    finally:
        progress.close()

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
        "options": vars(opts) | {"concurrency": list(opts.concurrency), "load_settings": list(opts.load_settings)},
        "none": {k: none_sum[k] for k in ("decode_tokens_per_s", "prefill_share", "new_tokens", "forwards")},
        "configs": summaries, "load": load, "load_findings": findings, "distribution": dist,
        "verdict": verdict, "skipped_methods": skipped_methods,
        "timing": {"estimated_s": estimate, "measured_s": took},
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
