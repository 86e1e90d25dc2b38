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


def check_encoded(encoded: list[list[int]], max_context: int, max_new_tokens: int, where) -> list[str]:
    """Refuse (one line, naming the prompt by `where(i)`) a prompt with no tokens or one that fills
    the model's context; returns a note for each prompt that leaves fewer than max_new_tokens."""
    notes = []
    for i, ids in enumerate(encoded):
        if not ids:
            raise SpecdecError(f"{where(i)} is empty and goes in raw (--raw, a row's \"chat\": false, or a tokenizer "
                               "without a chat template): there is nothing to continue from")
        if len(ids) + 1 > max_context:
            raise SpecdecError(f"{where(i)} has {len(ids)} tokens but the model's context is {max_context}")
        if len(ids) + max_new_tokens > max_context:
            notes.append(f"{where(i)} has {len(ids)} tokens, so at most {max_context - len(ids)} of --max-new-tokens "
                         f"{max_new_tokens} fit in the model's context ({max_context})")
    return notes


def encode_prompts(args, cfg, tok, rows_in: list[tuple], max_context: int, sources) -> tuple[list[list[int]], list[str]]:
    """(every prompt's ids, notes to print) as `generate` reads them: a --prompts-file row's own
    "chat" (true / false) wins over --chat / --raw; a prompt with no tokens or one that fills the
    context is refused (check_encoded); the notes name settings that do nothing in this run and
    prompts that leave less room than --max-new-tokens. The Ray actors of `generate --ray` call it
    too, so both runs check prompts alike."""
    from .config import unused_setting_notes
    from .text import encode_prompt, has_chat_template

    chats = [args.chat if chat is None else chat for _, chat in rows_in]
    encoded = [encode_prompt(tok, p, chat, args.system) for (p, _), chat in zip(rows_in, chats)]
    any_chat = any(isinstance(p, list) or c is True or (c is None and has_chat_template(tok))
                   for (p, _), c in zip(rows_in, chats))
    notes = unused_setting_notes(cfg, sources, any_chat, args.system)
    notes += check_encoded(encoded, max_context, cfg.sampling.max_new_tokens,
                           lambda i: prompt_where(args, i, len(encoded)))
    return encoded, notes
