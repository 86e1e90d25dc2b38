"""What the adaptive methods learned, kept between runs (`specdec generate`).

`ngram` and `auto` learn as they decode: how far prompt lookup's guesses tend to hold, what
one more verified token costs next to a plain step, how long the EAGLE head (or the draft
model) takes to draft and how many of its tokens hold. A process that answers one prompt (a
`specdec generate` call) would learn all of that again every time, starting from priors
(a verified token at 0.08 of a step; the tree not drafted until a probe has timed it), and
spend the first dozens of steps of every request measuring. So `generate` saves what its
engine learned at the end of a run and the next run on the same machine, thread count, model,
weights and method starts from it. The saved counts are capped (a few steps' worth), so a
new text soon outweighs the last one.

The file is `learned.json` in specdec's cache folder (`~/.cache/specdec`, `SPECDEC_CACHE`),
one entry per key. `SPECDEC_LEARNED=0` (or `generate --fresh`) neither reads nor writes it;
`SPECDEC_LEARNED=PATH` uses another file. A missing, unreadable or malformed file or entry is
ignored (the run starts from priors and, if it can, writes a good entry); it never stops a run.

Exactness does not depend on any of this: greedy output equals plain greedy output whatever
the drafters guess, and a seeded sample's drafting never reads timing or carried counts (the
drafters give such requests fresh, clockless policies). Only speed changes.

This module knows files and keys, not models: it calls `learned()` / `relearn(state)` on
whatever it is handed (an `Engine`).
"""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path

VERSION = 3  # bump when a drafter's learned() layout changes: older entries are then ignored
MAX_ENTRIES = 64  # oldest entries dropped beyond this


def path() -> Path | None:
    """The file, or None when switched off (SPECDEC_LEARNED=0)."""
    env = os.environ.get("SPECDEC_LEARNED")
    if env == "0":
        return None
    if env:
        return Path(env)
    from .models.loader import cache_root

    return cache_root() / "learned.json"


def cpu_name() -> str:
    """The CPU kind timing depends on: its model name, family and model as the kernel reports
    them (a model name alone, "AMD EPYC" in some VMs, covers several generations)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("model name", "cpu family", "model") and name not in fields:
                    fields[name] = value.strip()
                if not line.strip() and fields:
                    break  # the first processor's entry is enough
    except OSError:
        pass
    if not fields:
        return platform.processor() or platform.machine()
    return f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})"


def key(model: str, weights: str, dtype: str, method: str, threads: int) -> str:
    """One entry per machine kind, thread count, model, weights and method."""
    return " | ".join([cpu_name(), f"{os.cpu_count()} cpus", f"{threads} threads", model, weights, dtype, method])


def _read(p: Path) -> dict:
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("entries"), dict):
        return {}
    data["entries"] = {k: v for k, v in data["entries"].items() if isinstance(v, dict)}  # drop what is not an entry
    return data


def restore(engine, k: str, file: Path | None = None) -> bool:
    """Start `engine` from the entry saved under k. False if there is none, or it does not fit
    (a part of the engine may then start from it already: only speed depends on it)."""
    file = file or path()
    if file is None:
        return False
    entry = _read(file).get("entries", {}).get(k)
    if not isinstance(entry, dict) or not isinstance(entry.get("state"), dict):
        return False
    try:
        engine.relearn(entry["state"])
    except (AttributeError, KeyError, TypeError, ValueError):
        return False
    return True


def save(engine, k: str, file: Path | None = None) -> bool:
    """Save what `engine` learned under k (atomically; other keys kept). False if there is
    nothing to save or the file cannot be written."""
    file = file or path()
    state = engine.learned()
    if file is None or not state:
        return False
    data = _read(file) or {"version": VERSION, "entries": {}}
    entries = data["entries"]
    entries[k] = {"saved": time.time(), "state": state}
    if len(entries) > MAX_ENTRIES:
        def when(e):
            t = entries[e].get("saved", 0)
            return t if isinstance(t, (int, float)) else 0

        for old in sorted(entries, key=when)[: len(entries) - MAX_ENTRIES]:
            del entries[old]
    tmp = None
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=".learned-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, file)  # atomic: a reader sees the old file or the new one, never half of one
    except (OSError, TypeError, ValueError):
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return False
    return True


def nonneg(v, name: str) -> float | None:
    """A saved time, count or mean checked on the way in (finite, >= 0); None stays None."""
    if v is None:
        return None
    v = float(v)
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"learned {name} out of range: {v}")
    return v
