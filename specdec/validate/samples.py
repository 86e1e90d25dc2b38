"""A user's sample prompts for `specdec validate`: read, encode, and keep those that fit.

Accepted files: plain text (one prompt per non-empty line), JSONL (one object per line with
`prompt`, OpenAI-style `messages`, or Spec-Bench `turns`; optional `id` and `category`), or
the word `humaneval` (the HumanEval prompts as raw code completions). Errors name the file,
the line and what is wrong. Samples longer than the context are skipped and counted, never
silently dropped. This module reads files and tokenizes; it runs no model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..bench.tasks import Task, load_humaneval, load_jsonl
from ..types import SpecdecError


@dataclass
class Samples:
    tasks: list[Task]  # kept, in file order
    encoded: list[list[int]]  # their token ids
    skipped: list[dict] = field(default_factory=list)  # {"id", "tokens", "reason"}
    source: str = ""
    fmt: str = ""  # "text lines", "jsonl" or "humaneval"
    total: int = 0  # samples read before any was skipped or cut by --max-samples


def read_samples(spec: str) -> tuple[list[Task], str]:
    """Tasks from `spec` (a path or 'humaneval') and the format it was read as."""
    if spec == "humaneval":
        return load_humaneval(), "humaneval"
    path = Path(spec)
    if not path.exists():
        raise SpecdecError(f"{spec}: no such file (give a text file with one prompt per line, a JSONL file with "
                           "'prompt' or 'messages' per line, or 'humaneval')")
    if path.is_dir():
        raise SpecdecError(f"{spec} is a folder; give a file of samples")
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: a leading byte-order mark is not part of line 1
    except UnicodeDecodeError:
        raise SpecdecError(f"{spec} is not UTF-8 text") from None
    except OSError as e:
        raise SpecdecError(f"cannot read {spec}: {e.strerror}") from None
    lines = text.splitlines()
    first = next((ln.strip() for ln in lines if ln.strip()), None)
    if first is None:
        raise SpecdecError(f"{spec} is empty: it needs at least one prompt (one per line, or JSONL with 'prompt')")
    if first.startswith("{"):
        try:
            json.loads(first)
        except json.JSONDecodeError:
            pass  # a text prompt that starts with a brace
        else:
            return load_jsonl(path), "jsonl"
    tasks = [Task(str(n), "user", ln.strip(), True) for n, ln in enumerate(lines, 1) if ln.strip()]
    return tasks, "text lines"


def spread(tasks: list[Task], limit: int | None) -> list[Task]:
    """At most `limit` tasks, taken round-robin over categories so every category is represented."""
    if not limit or len(tasks) <= limit:
        return list(tasks)
    by_cat: dict[str, list[Task]] = {}
    for t in tasks:
        by_cat.setdefault(t.category, []).append(t)
    out: list[Task] = []
    i = 0
    while len(out) < limit:
        for ts in by_cat.values():
            if i < len(ts) and len(out) < limit:
                out.append(ts[i])
        i += 1
    order = {id(t): n for n, t in enumerate(tasks)}
    return sorted(out, key=lambda t: order[id(t)])


def load_samples(spec: str, tokenizer, max_context: int, reserve: int, limit: int | None = None,
                 chat: bool | None = None) -> Samples:
    """Read, keep at most `limit` (spread over categories), encode, and skip (with the count and
    reason) any sample whose prompt plus `reserve` tokens (answer, draft, margin) exceeds the
    context. chat=False sends every text prompt raw; None: the file's own choice."""
    from ..text import encode_prompt

    tasks, fmt = read_samples(spec)
    total = len(tasks)
    tasks = spread(tasks, limit)
    kept, encoded, skipped = [], [], []
    for t in tasks:
        # chat rows use the template when the tokenizer has one; raw rows (HumanEval, --raw) never
        ids = encode_prompt(tokenizer, t.prompt, None if t.chat is not False and chat is not False else False)
        if not ids:
            skipped.append({"id": t.task_id, "tokens": 0, "reason": "empty prompt"})
        elif len(ids) + reserve > max_context:
            skipped.append({"id": t.task_id, "tokens": len(ids),
                            "reason": f"{len(ids)} prompt tokens + {reserve} for the answer exceed the context "
                                      f"of {max_context}"})
        else:
            kept.append(t)
            encoded.append(ids)
    if not kept:
        why = f"; e.g. sample {skipped[0]['id']}: {skipped[0]['reason']}" if skipped else ""
        raise SpecdecError(f"no sample of {spec} fits: all {len(tasks)} were skipped{why}")
    return Samples(kept, encoded, skipped, spec, fmt, total)
