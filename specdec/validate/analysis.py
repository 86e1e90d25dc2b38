"""Figures and the verdict of `specdec validate`, from the raw counts of `measure.py`.

Predicted vs measured speedup. The prediction is docs/design.md's formula from the measured
acceptance alpha and draft cost c, generalised to steps that draft different numbers of
tokens: a step that drafts k_i tokens commits sum_{j<=k_i} alpha^j tokens on average if
every guess holds independently with probability alpha, and costs 1 + c*k_i target forwards.
Over F steps in which P_j drafted at least j tokens:

    predicted = (F + sum_j alpha^j P_j) / (F + c * sum_j P_j)

which is (1 + alpha + ... + alpha^k) / (1 + c*k) when every step drafts k. A tree counts as a
chain as deep as the tree (the engine's convention: one node per depth can be accepted).

The measured decode speedup factors exactly into the prediction and three measured
corrections, each in units of one plain decoding step T0 (none's decode time per token):

    measured = predicted * (tau / tau_predicted)     # acceptance is not independent per position
                         * (1 / v)                   # a verify forward costs v plain steps, not 1
                         * ((v + d) / (v + d + o))   # engine work outside drafting and verifying

with d, v, o = draft, verify and other seconds per target forward / T0. The report shows each
factor, so a gap between prediction and measurement is explained by what caused it.
"""

from __future__ import annotations

import statistics

NOISE = 0.05  # speedups within 5% of 1 are not counted as a gain


def spread(xs: list[float]) -> dict:
    from .measure import _quantile

    if not xs:
        return {"n": 0}
    return {"n": len(xs), "mean": statistics.fmean(xs), "std": statistics.pstdev(xs), "min": min(xs),
            "p10": _quantile(xs, 0.1), "p50": _quantile(xs, 0.5), "p90": _quantile(xs, 0.9), "max": max(xs)}


def speedup_interval(rows: list[dict], none_rows: list[dict], level: float = 0.95, draws: int = 2000,
                     seed: int = 0) -> list[float] | None:
    """A `level` interval of the decode speedup over the samples: the samples drawn again with
    replacement `draws` times (a seeded bootstrap), each draw's speedup the ratio of its summed decode
    rates (first repeat's times, as `rows` hold them), and the middle `level` of those. It says how
    far another set of samples like these could move the figure (which samples were picked, and each
    run's timing noise); None under 3 samples."""
    import random

    pairs = [(r["new_tokens"] - 1, r["decode_s"], n["new_tokens"] - 1, n["decode_s"])
             for r, n in zip(rows, none_rows) if r["decode_s"] > 0 and n["decode_s"] > 0]
    if len(pairs) < 3:
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(draws):
        pick = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        tok, dec, tok0, dec0 = (sum(p[j] for p in pick) for j in range(4))
        if tok0 > 0 and dec > 0:
            ratios.append((tok / dec) / (tok0 / dec0))
    ratios.sort()
    if not ratios:
        return None
    tail = (1 - level) / 2
    return [ratios[int(tail * (len(ratios) - 1))], ratios[int((1 - tail) * (len(ratios) - 1))]]


def _median_rep(reps: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in reps)


def summarize_config(entry: dict, none: dict) -> dict:
    """Acceptance (overall, by position, spread over samples), speed and the predicted/measured
    breakdown for one configuration, against `none` from the same run."""
    rows = entry["samples"]
    F = sum(r["forwards"] for r in rows)
    R = len(rows)
    proposed = sum(r["proposed"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    depth = max((len(r["proposed_by_pos"]) for r in rows), default=0)
    P = [sum(r["proposed_by_pos"][j] for r in rows if j < len(r["proposed_by_pos"])) for j in range(depth)]
    A = [sum(r["accepted_by_pos"][j] for r in rows if j < len(r["accepted_by_pos"])) for j in range(depth)]
    new = sum(r["new_tokens"] for r in rows)
    tau = (new - R) / F if F else 0.0
    alpha = accepted / proposed if proposed else 0.0
    out = {
        "samples": R, "new_tokens": new, "forwards": F, "proposed": proposed, "accepted": accepted,
        "alpha": alpha, "tau": tau, "mean_draft": proposed / F if F else 0.0,
        "acceptance_by_pos": [a / p if p else 0.0 for a, p in zip(A, P)], "proposed_by_pos": P,
        "alpha_per_sample": [r["alpha"] for r in rows if r["proposed"]],
        "alpha_spread": spread([r["alpha"] for r in rows if r["proposed"]]),
        "tau_spread": spread([r["tau"] for r in rows if r["forwards"]]),
        "equal": sum(r["equal"] for r in rows),
        "not_equal": [i for i, r in enumerate(rows) if not r["equal"]],
    }
    # speed: medians over repeats of the summed times
    dec, dec0 = _median_rep(entry["reps"], "decode_s"), _median_rep(none["reps"], "decode_s")
    wall = statistics.median(r["decode_s"] + r["prefill_s"] for r in entry["reps"])
    wall0 = statistics.median(r["decode_s"] + r["prefill_s"] for r in none["reps"])
    new0 = sum(r["new_tokens"] for r in none["samples"])
    F0 = sum(r["forwards"] for r in none["samples"])
    out["decode_tokens_per_s"] = (new - R) / dec if dec else 0.0
    out["speedup"] = ((new - R) / dec) / ((new0 - R) / dec0) if dec and dec0 and new0 > R else 0.0
    out["speedup_interval"] = speedup_interval(rows, none["samples"])
    out["e2e_speedup"] = (new / wall) / (new0 / wall0) if wall and wall0 else 0.0
    out["prefill_share"] = statistics.median(r["prefill_s"] / (r["prefill_s"] + r["decode_s"]) for r in none["reps"]
                                             if r["prefill_s"] + r["decode_s"] > 0) if none["reps"] else 0.0
    # predicted vs measured (see the module docstring)
    draft_s, verify_s = _median_rep(entry["reps"], "draft_s"), _median_rep(entry["reps"], "verify_s")
    T0 = dec0 / F0 if F0 else 0.0
    if F and T0 and verify_s > 0:
        c = (draft_s / proposed) / (verify_s / F) if proposed else 0.0
        tau_pred = (F + sum(alpha ** (j + 1) * p for j, p in enumerate(P))) / F
        predicted = tau_pred / (1 + c * proposed / F)
        d, v = draft_s / (F * T0), verify_s / (F * T0)
        o = max(0.0, dec / (F * T0) - d - v)
        f_accept = tau / tau_pred if tau_pred else 0.0
        f_verify = 1 / v if v else 0.0
        f_other = (v + d) / (v + d + o) if v + d + o else 0.0
        out["prediction"] = {
            "alpha_used": alpha, "draft_cost_c": c, "tau_predicted": tau_pred, "predicted": predicted,
            "measured": out["speedup"], "ratio": out["speedup"] / predicted if predicted else 0.0,
            "draft_per_step": d, "verify_per_step": v, "other_per_step": o,
            "factors": {"acceptance_not_independent": f_accept, "verify_cost": f_verify, "engine_overhead": f_other},
            "factored": predicted * f_accept * f_verify * f_other,
        }
        out["prediction"]["within_20pct"] = abs(out["prediction"]["ratio"] - 1) <= 0.2
        out["prediction"]["explanation"] = explain(out["prediction"])
    return out


def explain(pred: dict) -> str:
    """One sentence per factor that moves the measured speedup away from the prediction by > 5%."""
    f = pred["factors"]
    parts = []
    if abs(f["acceptance_not_independent"] - 1) > NOISE:
        more = f["acceptance_not_independent"] > 1
        parts.append(f"guesses hold {'more' if more else 'less'} often in runs than independent acceptance at "
                     f"alpha={pred['alpha_used']:.2f} predicts (tau {pred['tau_predicted']:.2f} predicted; "
                     f"x{f['acceptance_not_independent']:.2f})")
    if abs(f["verify_cost"] - 1) > NOISE:
        parts.append(f"a verification forward costs {pred['verify_per_step']:.2f} plain decoding steps, not 1 "
                     f"(x{f['verify_cost']:.2f})")
    if abs(f["engine_overhead"] - 1) > NOISE:
        parts.append(f"bookkeeping outside drafting and verification takes {pred['other_per_step']:.2f} of a plain "
                     f"step per forward (x{f['engine_overhead']:.2f})")
    gap = f"measured {pred['measured']:.2f}x vs predicted {pred['predicted']:.2f}x"
    if not parts:
        return gap + ": the formula's assumptions hold within 5% each"
    return gap + ": " + "; ".join(parts)


def load_findings(load: dict) -> dict:
    """Per concurrency: throughput and per-token latency of fixed and adaptive vs off; where
    speculation pays (latency at least NOISE better, throughput not NOISE worse), and the first
    level at which it stops paying."""
    t = load["table"]
    measured = [name for name in ("fixed", "adaptive") if name in t]
    rows = {}
    for c in load["levels"]:
        off = t["off"][c]
        r = {}
        for name in measured:
            s = t[name][c]
            thr = s["throughput"] / off["throughput"] if off["throughput"] else 0.0
            lat = off["token_p50"] / s["token_p50"] if s["token_p50"] else 0.0
            r[name] = {"throughput_vs_off": thr, "latency_gain": lat,
                       "pays": lat >= 1 + NOISE and thr >= 1 - NOISE, "hurts": thr < 1 - NOISE}
        rows[c] = r
    out = {"by_concurrency": rows}
    for name in measured:
        levels = sorted(load["levels"])
        stops = next((c for c in levels if not rows[c][name]["pays"]), None)
        out[name] = {"pays_at": [c for c in levels if rows[c][name]["pays"]], "stops_paying_at": stops,
                     "hurts_at": [c for c in levels if rows[c][name]["hurts"]],
                     # the highest level up to which every tested level paid
                     "max_pays": max([c for c in levels if stops is None or c < stops], default=None)}
    out["failures"] = sum(t[n][c]["failures"] for n in t for c in load["levels"])
    out["checked"] = sum(t[n][c]["checked"] for n in t for c in load["levels"])
    out["equal"] = sum(t[n][c]["equal"] for n in t for c in load["levels"])
    return out


def verdict(configs: dict, load: dict | None, dist: list[dict], skipped_methods: dict) -> dict:
    """Enable or not, the recommended configuration, and up to which concurrency."""
    failures = []
    for name, s in configs.items():
        if s["not_equal"]:
            failures.append(f"{name}: greedy output differs from plain decoding on {len(s['not_equal'])} "
                            f"of {s['samples']} samples")
    for d in dist:
        if d["status"] == "FAIL":
            failures.append(f"{d['config']}: sampled tokens do not follow the target's distribution on sample "
                            f"{d['sample']} (chi-square p = {d['p_value']:.2g})")
    if load is not None:
        if load["failures"]:
            failures.append(f"{load['failures']} request(s) failed in the load test")
        if load["checked"] and load["equal"] < load["checked"]:
            failures.append(f"under load {load['checked'] - load['equal']} of {load['checked']} greedy answers "
                            "differ from plain decoding")
    ranked = sorted(configs.items(), key=lambda kv: kv[1]["speedup"], reverse=True)
    best_name, best = ranked[0] if ranked else (None, None)
    out = {"exactness_failures": failures, "ranking": [(n, s["speedup"]) for n, s in ranked],
           "skipped_methods": skipped_methods}
    if failures:
        out.update(enable=False, headline="DO NOT ENABLE: exactness check failed: " + failures[0],
                   recommended=None)
        return out
    interval = best.get("speedup_interval") if best else None
    if best is None or best["speedup"] < 1 + NOISE:
        sp = f"{best['speedup']:.2f}x" if best else "n/a"
        reach = (f"; its 95% interval over the samples reaches {interval[1]:.2f}x, so more samples may show a gain"
                 if interval and interval[1] >= 1 + NOISE else "")
        out.update(enable=False, recommended=None,
                   headline=f"speculation does not pay on these samples (best: {best_name} at {sp} decode speed "
                            f"at concurrency 1; the gain must exceed {NOISE:.0%}{reach})")
        return out
    out.update(enable=True, recommended=best_name, speedup=best["speedup"], e2e_speedup=best["e2e_speedup"])
    limit = None
    note = ""
    if load is not None:
        ad = load.get("adaptive")
        fx = load.get("fixed")
        limit = fx["max_pays"] if fx else None
        if ad is None:
            note = ""
        elif not ad["hurts_at"]:
            note = ("specdec's load-aware speculation never cost more than 5% throughput at any tested concurrency"
                    + (f" and lowered per-token latency up to concurrency {ad['max_pays']}" if ad["max_pays"] else ""))
        else:
            note = f"load-aware speculation lost throughput at concurrency {', '.join(map(str, ad['hurts_at']))}"
        if fx and fx["hurts_at"]:
            note += (f"; a fixed draft length costs throughput from concurrency {min(fx['hurts_at'])}: "
                     "disable it above " + (str(limit) if limit else "1"))
        if fx is None:
            note += ("; a fixed draft length (what other frameworks run) was not measured under load: the "
                     "settings for them carry no concurrency limit (the full check measures it)")
    out["max_concurrency"] = limit
    out["load_note"] = note
    within = (f", 95% interval over the samples {interval[0]:.2f}-{interval[1]:.2f}x" if interval else "")
    head = (f"ENABLE {best_name}: {best['speedup']:.2f}x decode speed ({best['e2e_speedup']:.2f}x end to end"
            f"{within}) at concurrency 1")
    if interval and interval[0] < 1 + NOISE:
        out["uncertain"] = (f"the interval reaches below {1 + NOISE:.2f}x: a gain is likely, not certain, on "
                            f"{best['samples']} samples; more samples (the full check) settle it")
    if load is not None and load.get("fixed"):
        head += (f"; with a fixed draft length it pays up to concurrency {limit}" if limit
                 else "; with a fixed draft length it did not pay under load")
    out["headline"] = head
    return out
