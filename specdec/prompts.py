"""The prompts of a `generate` run: from the prompt argument, stdin, or a JSONL file; each
mistake ends in one line that names the prompt (by file and number) and what is wrong."""

from __future__ import annotations

import sys

from .text import check_text
from .types import SpecdecError


def read_prompts(args) -> list[tuple]:
    """[(prompt text or messages, chat)]: chat is a --prompts-file row's own "chat" setting
    (None where the row has none: --chat / --raw / the tokenizer decide)."""
    if args.prompts_file:
        if args.prompt not in (None, "-"):
            raise SpecdecError("give either a prompt argument or --prompts-file, not both")
        return read_prompts_file(args.prompts_file)
    if args.prompt is not None and args.prompt != "-":
        return [(check_text(args.prompt, "the prompt argument"), None)]
    if sys.stdin is None or sys.stdin.isatty():
        raise SpecdecError("no prompt: pass it as an argument, pipe it on stdin, or use --prompts-file FILE.jsonl")
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    try:
        text = data.decode("utf-8-sig") if isinstance(data, bytes) else data
    except UnicodeDecodeError as e:
        raise SpecdecError(f"the prompt read from stdin is not UTF-8 text (byte {e.start + 1} is "
                           f"0x{data[e.start]:02x})") from None
    if not text.strip():
        raise SpecdecError("the prompt read from stdin is empty")
    return [(text.rstrip("\n"), None)]


def read_prompts_file(path: str) -> list[tuple]:
    """[(prompt text or messages, the row's "chat" or None)] from a JSONL file; errors name the
    line and the reason."""
    from .bench.tasks import load_jsonl

    return [(t.prompt, t.chat if isinstance(t.prompt, str) else None) for t in load_jsonl(path)]


def prompt_where(args, i: int, n: int) -> str:
    """How an error names prompt i (from 0) of n: by file and number, by number, or "the prompt"."""
    if args.prompts_file:
        return f"{args.prompts_file}: prompt {i + 1}"
    return f"prompt {i + 1}" if n > 1 else "the prompt"
