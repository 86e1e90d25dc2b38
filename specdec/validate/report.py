"""Writes the results of `specdec validate`: `report.json` (every figure), a self-contained
`report.html` (tables, and plots embedded as PNG data URIs: no external files or scripts),
and a short terminal summary. It formats what `analysis.py` computed and measures nothing.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def plots(result: dict) -> dict[str, str]:
    """Plot name -> PNG data URI."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}
    cfg = result["configs"]
    if cfg:
        fig, ax = plt.subplots(figsize=(6.5, 3.6))
        for name, s in cfg.items():
            if s["acceptance_by_pos"]:
                xs = range(1, len(s["acceptance_by_pos"]) + 1)
                ax.plot(list(xs), s["acceptance_by_pos"], marker="o", label=name)
        ax.set_xlabel("draft position (depth)")
        ax.set_ylabel("share of guesses accepted")
        ax.set_ylim(0, 1)
        ax.set_title("Acceptance by position")
        ax.legend(fontsize=8)
        fig.tight_layout()
        out["acceptance"] = _png(fig)

        names = [n for n in cfg if "prediction" in cfg[n]]
        if names:
            fig, ax = plt.subplots(figsize=(6.5, 3.6))
            xs = range(len(names))
            ax.bar([x - 0.2 for x in xs], [cfg[n]["prediction"]["predicted"] for n in names], 0.4, label="predicted")
            ax.bar([x + 0.2 for x in xs], [cfg[n]["prediction"]["measured"] for n in names], 0.4, label="measured")
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xticks(list(xs), names, rotation=20, fontsize=8)
            ax.set_ylabel("decode speedup over none")
            ax.set_title("Predicted vs measured (concurrency 1)")
            ax.legend(fontsize=8)
            fig.tight_layout()
            out["predicted"] = _png(fig)

        data = [[x for x in s.get("alpha_per_sample", [])] for s in cfg.values()]
        if any(data):
            fig, ax = plt.subplots(figsize=(6.5, 3.4))
            ax.boxplot(data, showmeans=True)
            ax.set_xticks(range(1, len(cfg) + 1), list(cfg))
            ax.set_ylabel("alpha per sample")
            ax.set_ylim(0, 1)
            ax.tick_params(axis="x", labelsize=8, rotation=20)
            ax.set_title("Spread of acceptance over samples")
            fig.tight_layout()
            out["spread"] = _png(fig)

    load = result.get("load")
    if load:
        levels = load["levels"]
        f = result["load_findings"]["by_concurrency"]
        fig, axs = plt.subplots(1, 2, figsize=(10, 3.6))
        for name in [n for n in ("fixed", "adaptive") if n in load["table"]]:
            axs[0].plot(levels, [f[c][name]["throughput_vs_off"] for c in levels], marker="o", label=name)
            axs[1].plot(levels, [f[c][name]["latency_gain"] for c in levels], marker="o", label=name)
        for ax, lab in zip(axs, ("throughput / off", "per-token latency gain (off TPOT p50 / TPOT p50)")):
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [str(c) for c in levels])
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel(lab)
            ax.legend(fontsize=8)
        fig.suptitle(f"Speculation vs off under load ({load.get('drafting', 'prompt lookup')} through the server's "
                     "batcher)")
        fig.tight_layout()
        out["load"] = _png(fig)
    return out


def _table(head: list[str], rows: list[list]) -> str:
    h = "".join(f"<th>{html.escape(str(x))}</th>" for x in head)
    body = "".join("<tr>" + "".join(f"<td>{x}</td>" for x in r) + "</tr>" for r in rows)
    return f"<table><tr>{h}</tr>{body}</table>"


def _f(x, fmt=".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:.6em 0 1.2em}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;
text-align:right}th{background:#f3f3f3}td:first-child{text-align:left}.ok{color:#170}.fail{color:#b00;font-weight:bold}
.verdict{font-size:1.2em;padding:.8em;border-radius:6px}.yes{background:#e6f4e6}.no{background:#fbeaea}
code,pre{background:#f6f6f6;padding:2px 4px;font-size:12px;white-space:pre-wrap}small{color:#666}"""


def _html_load(result: dict, images: dict[str, str]) -> list[str]:
    """The "Under load" section: off / fixed / load-aware per concurrency level."""
    parts: list[str] = []
    load = result.get("load")
    if load:
        t = load["table"]
        parts.append(f"<h2>Under load</h2><p>The server's batched engine with its own speculation "
                     f"({load.get('drafting', 'prompt lookup')}, k = {load['k']}): "
                     f"{', '.join({'off': 'off', 'fixed': 'fixed k', 'adaptive': 'load-aware'}[n] for n in t)}; "
                     f"at each concurrency C, C clients send requests "
                     f"back to back (at least {load['min_requests']} per level), medians of {load['repeats']} "
                     "rounds. TPOT: time per output token of a request (first to last token / tokens after the "
                     "first; p50, p95 over requests), the per-token latency a reader of the stream sees. ITL: each "
                     "gap between deliveries / the tokens delivered; its median hides speculation's gain, as most "
                     "deliveries still carry one token.</p>")
        f = result["load_findings"]["by_concurrency"]
        rows = []
        for c in load["levels"]:
            for name in [n for n in ("off", "fixed", "adaptive") if n in t]:
                s = t[name][c]
                gain = "" if name == "off" else (f"{_f(f[c][name]['throughput_vs_off'])} / "
                                                 f"{_f(f[c][name]['latency_gain'])}")
                rows.append([str(c), name, _f(s["throughput"], ".1f"), _f(1e3 * s["ttft_p50"], ".0f"),
                             _f(1e3 * s["token_p50"], ".1f"), _f(1e3 * s["token_p95"], ".1f"),
                             _f(1e3 * s.get("itl_p50", 0), ".1f"), _f(1e3 * s.get("itl_p95", 0), ".1f"),
                             _f(s["mean_guesses"]), gain,
                             f"<span class='{'fail' if s['failures'] else 'ok'}'>{s['failures']}</span>",
                             f"{s['equal']}/{s['checked']}"])
        parts.append(_table(["clients", "setting", "tok/s", "TTFT p50 ms", "TPOT p50 ms", "TPOT p95 ms",
                             "ITL p50 ms", "ITL p95 ms",
                             "guesses/row/step", "throughput / latency gain vs off", "failed", "greedy equal"], rows))
        if "load" in images:
            parts.append(f"<img src='{images['load']}'>")
    return parts


def _draws_note(dist: list[dict]) -> str:
    """How many draws the checks took and what that many can miss."""
    from .measure import THOROUGH_DRAWS

    fewest = min(x["draws"] for x in dist)
    if fewest >= THOROUGH_DRAWS:
        return f"{fewest} draws each"
    return (f"{fewest} draws each: enough for gross errors, subtle ones may pass unseen below {THOROUGH_DRAWS}, "
            "see docs/validate.md")


def _html_distribution(result: dict) -> list[str]:
    """The "Distribution check" section: one row per sampled-continuation test."""
    e = html.escape
    parts: list[str] = []
    dist = result.get("distribution", [])
    if dist:
        parts.append("<h2>Distribution check</h2><p>Seeded sampled continuations with speculation vs the target's "
                     "exact probabilities from plain forwards over every sampled prefix. Two tests: chi-square over "
                     "every prefix seen at least 30 times, and, over every token after the first (the first comes "
                     "from the prefill; speculation produces the rest), the randomised probability integral "
                     "transform (tokens ordered by probability), which is uniform exactly when the tokens follow "
                     "the target. Fails when either p-value is below 0.001 / 2. The drafters guess at every step "
                     "here (prompt lookup without its adaptive length, auto without its gate), so there are "
                     f"guesses to verify. Draws: {html.escape(_draws_note(dist))}.</p>")
        rows = [[e(d["config"]), e(str(d["sample"])), str(d["draws"]), f"{d['tokens']} @ T={d['temperature']}",
                 f"{d['accepted']}/{d['proposed']}", f"{d['groups']} ({_f(d['chi2'], '.1f')}, {d['dof']} dof)",
                 _f(d["p_value_grouped"], ".3g"), str(d["speculated_tokens"]), _f(d["pit_p_value"], ".3g"),
                 _f(d["tv_first_token"], ".3f"),
                 f"<span class='{'fail' if d['status'] == 'FAIL' else 'ok'}'>{d['status']}</span>"] for d in dist]
        parts.append(_table(["config", "sample", "draws", "tokens", "guesses accepted", "groups (chi2, dof)",
                             "p grouped", "speculated tokens", "p PIT", "TV first token", "result"], rows))
    return parts


def html_report(result: dict, images: dict[str, str]) -> str:
    v = result["verdict"]
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>specdec validate</title><style>{CSS}</style>"
             "</head><body><h1>specdec validate</h1>",
             f"<p><small>{e(result['command'])}<br>model {e(result['model'])}; samples {e(result['samples']['source'])}"
             f" ({result['samples']['kept']} kept of {result['samples']['read']} read, "
             f"{len(result['samples']['skipped'])} skipped); {e(json.dumps(result['machine']))}; "
             f"{e(result['date'])}</small></p>",
             f"<div class='verdict {'yes' if v['enable'] else 'no'}'>{e(v['headline'])}</div>"]
    if v.get("uncertain"):
        parts.append(f"<p><b>Uncertain:</b> {e(v['uncertain'])}.</p>")
    if v["exactness_failures"]:
        parts.append("<h2 class='fail'>EXACTNESS FAILURES</h2><ul>" +
                     "".join(f"<li class='fail'>{e(x)}</li>" for x in v["exactness_failures"]) + "</ul>")
    if v.get("load_note"):
        parts.append(f"<p>{e(v['load_note'])}.</p>")
    if result.get("settings"):
        parts.append("<h2>Settings</h2><p>For the recommended configuration. Flag names change between versions: "
                     "check them against the version you run.</p>")
        rows = [[e(s["framework"]), e(s["checked_against"]), "yes" if s["supported"] else "<b>no</b>",
                 f"<code>{e(s['command'])}</code>" if s["command"] else "",
                 "<br>".join(e(n) for n in s["notes"])] for s in result["settings"]]
        parts.append(_table(["framework", "checked against", "supported", "command", "notes"], rows))

    cfg = result["configs"]
    parts.append("<h2>Acceptance and speed at concurrency 1</h2><p>Greedy, batch 1, each configuration against "
                 "plain decoding in the same run (medians of the repeats). alpha = accepted / proposed guesses; "
                 "tau = tokens committed per target forward; spread = over samples (p10 / p50 / p90); the decode "
                 "speedup's 95% interval: the samples drawn again with replacement (a bootstrap over the first "
                 "repeat's times), how far another set of samples like these could move it.</p>")
    rows = []
    for n, s in cfg.items():
        a, t = s["alpha_spread"], s["tau_spread"]
        ci = s.get("speedup_interval")
        rows.append([e(n), _f(s["alpha"]), f"{_f(a.get('p10'))} / {_f(a.get('p50'))} / {_f(a.get('p90'))}",
                     _f(s["tau"]), f"{_f(t.get('p10'))} / {_f(t.get('p50'))} / {_f(t.get('p90'))}",
                     _f(s["mean_draft"]), _f(s["decode_tokens_per_s"], ".1f"),
                     _f(s["speedup"]) + (f" ({_f(ci[0])}-{_f(ci[1])})" if ci else ""),
                     _f(s["e2e_speedup"]),
                     f"<span class='{'ok' if not s['not_equal'] else 'fail'}'>{s['equal']}/{s['samples']}</span>"])
    parts.append(_table(["config", "alpha", "alpha p10/p50/p90", "tau", "tau p10/p50/p90", "guesses/step",
                         "decode tok/s", "decode speedup (95% interval)", "end-to-end speedup", "greedy equal"], rows))
    if cfg:
        none = result["none"]
        parts.append(f"<p>none: {_f(none['decode_tokens_per_s'], '.1f')} decode tok/s; prefill is "
                     f"{_f(100 * none['prefill_share'], '.0f')}% of plain decoding's wall time, the same work with "
                     "or without speculation, which is why end-to-end speedups are smaller.</p>")
    cats = list(next(iter(cfg.values()))["by_category"]) if cfg else []
    if len(cats) > 1:
        parts.append("<h3>By category</h3><p>Decode speedup over none (alpha) per sample category, first repeat's "
                     "times.</p>")
        rows = [[e(n)] + [f"{_f(s['by_category'][c]['speedup'])} ({_f(s['by_category'][c]['alpha'])})"
                          for c in cats] for n, s in cfg.items()]
        parts.append(_table(["config"] + [f"{c} ({cfg[next(iter(cfg))]['by_category'][c]['samples']})"
                                          for c in cats], rows))
    for key in ("acceptance", "spread"):
        if key in images:
            parts.append(f"<img src='{images[key]}'>")
    preds = {n: s["prediction"] for n, s in cfg.items() if "prediction" in s}
    if preds:
        parts.append("<h2>Predicted vs measured</h2><p>Predicted: (F + &Sigma; alpha<sup>j</sup> P<sub>j</sub>) / "
                     "(F + c &Sigma; P<sub>j</sub>) from the measured alpha and draft cost c (docs/design.md's formula for "
                     "steps of different draft lengths). The measured decode speedup is the prediction times three "
                     "measured factors; their product reproduces it.</p>")
        rows = [[e(n), _f(p["alpha_used"]), _f(p["draft_cost_c"], ".3f"), _f(p["predicted"]), _f(p["measured"]),
                 f"<span class='{'ok' if p['within_20pct'] else 'fail'}'>{_f(p['ratio'])}</span>",
                 _f(p["factors"]["acceptance_not_independent"]), _f(p["factors"]["verify_cost"]),
                 _f(p["factors"]["engine_overhead"]), e(p["explanation"])] for n, p in preds.items()]
        parts.append(_table(["config", "alpha", "c", "predicted", "measured", "measured / predicted",
                             "x acceptance runs", "x verify cost", "x overhead", "why"], rows))
        if "predicted" in images:
            parts.append(f"<img src='{images['predicted']}'>")
    parts += _html_load(result, images) + _html_distribution(result)
    sk = result["samples"]["skipped"]
    if sk or result.get("skipped_methods"):
        parts.append("<h2>Skipped</h2><ul>" + "".join(f"<li>sample {e(str(x['id']))}: {e(x['reason'])}</li>"
                                                      for x in sk) +
                     "".join(f"<li>method {e(m)}: {e(r)}</li>" for m, r in result.get("skipped_methods", {}).items())
                     + "</ul>")
    parts.append("<p><small>Full figures: report.json beside this file.</small></p></body></html>")
    return "\n".join(parts)


def terminal_summary(result: dict) -> str:
    v = result["verdict"]
    lines = ["", "== specdec validate ==", v["headline"]]
    if v.get("uncertain"):
        lines.append("  uncertain: " + v["uncertain"])
    for x in v["exactness_failures"]:
        lines.append("  EXACTNESS FAILURE: " + x)
    cfg = result["configs"]
    if cfg:
        lines.append(f"{'config':<16}{'alpha':>7}{'tau':>7}{'speedup':>9}{'e2e':>7}{'pred':>7}  greedy-equal")
        for n, s in cfg.items():
            p = s.get("prediction", {}).get("predicted")
            lines.append(f"{n:<16}{s['alpha']:>7.2f}{s['tau']:>7.2f}{s['speedup']:>8.2f}x{s['e2e_speedup']:>6.2f}x"
                         f"{_f(p):>7}  {s['equal']}/{s['samples']}")
    if result.get("load"):
        f = result["load_findings"]["by_concurrency"]
        names = [n for n in ("adaptive", "fixed") if n in result["load"]["table"]]
        lines.append(f"under load ({' / '.join(names)} throughput vs off): " + ", ".join(
            f"c={c}: " + " / ".join(f"{f[c][n]['throughput_vs_off']:.2f}" for n in names)
            for c in result["load"]["levels"]))
    if v.get("load_note"):
        lines.append(v["load_note"])
    d = result.get("distribution", [])
    if d:
        lines.append(f"distribution checks ({_draws_note(d)}): " + ", ".join(f"{x['config']} {x['status']}" for x in d))
    if result["samples"]["skipped"]:
        lines.append(f"skipped samples: {len(result['samples']['skipped'])} (too long for the context; see the report)")
    return "\n".join(lines)


def write(result: dict, out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "report.html").write_text(html_report(result, plots(result)), encoding="utf-8")
    return ["report.json", "report.html"]
