"""Tables, a Markdown report and PNG plots from a `runner.run` result.

Knows the shape of the result dictionary, nothing about models. Plots need matplotlib
(a dependency of specdec); without it the report says the plots were not drawn.
"""

from __future__ import annotations

import json
from pathlib import Path


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


COLUMNS = [  # header, key, format
    ("tok/s", "tokens_per_s", ".1f"),
    ("x none", "speedup_vs_none", ".2f"),
    ("x hf", "speedup_vs_hf", ".2f"),
    ("dec tok/s", "decode_tokens_per_s", ".1f"),
    ("dec x none", "decode_speedup_vs_none", ".2f"),
    ("alpha", "alpha", ".2f"),
    ("tau", "tau", ".2f"),
    ("draft s", "draft_s", ".2f"),
    ("verify s", "verify_s", ".2f"),
    ("peak MB", "peak_rss_mb", ".0f"),
    ("work MB", "working_mb", ".0f"),
    ("= none", "equal_to_none", ""),
]


def format_table(result: dict) -> str:
    """Plain-text table: one block per category, one line per runner."""
    lines = []
    head = f"{'category':<16}{'runner':<17}" + "".join(f"{h:>11}" for h, _, _ in COLUMNS)
    for c in result["categories"]:
        lines.append(head)
        for n in result["runners"]:
            row = result["table"][n][c]
            if row["status"] != "ok":
                lines.append(f"{c:<16}{n:<17}  {row['status'][:100]}")
                continue
            lines.append(f"{c:<16}{n:<17}" + "".join(f"{_f(row.get(k), fm):>11}" for _, k, fm in COLUMNS))
        lines.append("")
    return "\n".join(lines)


def markdown(result: dict, command: str, plots: list[str]) -> str:
    out = ["# specdec bench\n", f"Command: `{command}`\n", f"Machine: {json.dumps(result.get('machine', {}))}\n",
           f"Settings: max_new_tokens={result.get('max_new_tokens')}, k={result.get('k')}, "
           f"temperature={result.get('temperature')}, repeats={result.get('repeats')} (median reported), "
           f"{result.get('prompts')} prompts, runners interleaved per prompt.\n"]
    bad = {n: s for n, s in result["status"].items() if s != "ok"}
    if bad:
        out.append("Runners that did not run or failed:\n")
        out += [f"- `{n}`: {s}" for n, s in bad.items()]
        out.append("")
    if any(n.startswith("llamacpp") for n in result["runners"]):
        out.append("llama.cpp reads the same GGUF blocks with its own kernels (its own rounding and sum order), so "
                   "its greedy output may part from specdec's (`= none`) at a near-tie of two tokens.\n")
    for c in result["categories"]:
        out.append(f"## {c}\n")
        out.append("| runner | " + " | ".join(h for h, _, _ in COLUMNS) + " |")
        out.append("|---|" + "---|" * len(COLUMNS))
        for n in result["runners"]:
            row = result["table"][n][c]
            if row["status"] != "ok":
                out.append(f"| {n} | {row['status']} |" + " |" * (len(COLUMNS) - 1))
                continue
            out.append(f"| {n} | " + " | ".join(_f(row.get(k), fm) for _, k, fm in COLUMNS) + " |")
        out.append("")
    out.append("tok/s: new tokens / wall seconds of whole `generate` calls (prefill included). x none, x hf: "
               "speedup over specdec `none` and over transformers' plain `generate`. dec tok/s, dec x none: the same "
               "for specdec's decode phase alone (prefill excluded; it is the same work for every method). alpha: accepted / proposed "
               "drafts; tau: tokens per target forward (specdec only). peak MB: the process's peak resident "
               "memory while the runner ran (all runners share one process); work MB: the most it grew during "
               "one call. = none: prompts whose output equals specdec `none` token for token.\n")
    for p in plots:
        out.append(f"![{p}]({p})\n")
    return "\n".join(out)


def plots(result: dict, out: Path) -> list[str]:
    """Speedup by category and runner; acceptance by draft position. Returns file names."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    names = [n for n in result["runners"] if result["status"][n] == "ok"]
    cats = result["categories"]
    key = "speedup_vs_hf" if "hf" in names else "speedup_vs_none"
    files = []
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(cats) * max(1, len(names)) / 3), 4))
    w = 0.8 / max(1, len(names))
    for j, n in enumerate(names):
        ys = [result["table"][n][c].get(key) or 0 for c in cats]
        ax.bar([i + j * w for i in range(len(cats))], ys, width=w, label=n)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(cats))], cats, rotation=30, ha="right")
    ax.set_ylabel("speedup over " + ("transformers plain generate" if key == "speedup_vs_hf" else "specdec none"))
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=110)
    plt.close(fig)
    files.append("speedup.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    drew = False
    for n in names:
        acc = result["table"][n]["all"].get("acceptance_by_pos")
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=n)
            drew = True
    if drew:
        ax.set_xlabel("draft position")
        ax.set_ylabel("share of drafts accepted")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "acceptance.png", dpi=110)
        files.append("acceptance.png")
    plt.close(fig)
    return files


def write(result: dict, out: Path, command: str) -> list[str]:
    """results.json, report.md and the PNGs into `out`; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    pngs = plots(result, out)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "report.md").write_text(markdown(result, command, pngs))
    return ["results.json", "report.md"] + pngs
