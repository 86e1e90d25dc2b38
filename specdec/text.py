"""Text-side helpers around a tokenizer: prompt rendering, streaming detokenisation,
stop strings. The engine never sees text; the CLI, server and benchmarks use these.
"""

from __future__ import annotations

from .types import SpecdecError


def check_text(text: str, what: str) -> str:
    """`text` if a tokenizer can read it, else a SpecdecError naming `what`. Lone surrogates are what
    Python makes of a command-line argument that is not UTF-8, or of a JSON "\\ud800" escape."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SpecdecError(f"{what} is not valid UTF-8 text (character {e.start + 1} is {text[e.start]!r}, a lone "
                           "surrogate: check the encoding of your terminal or file)") from None
    return text


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer, prompt: str | list, chat: bool | None, system: str | None = None,
                  tools: list[dict] | None = None) -> list[int]:
    """Token ids for a prompt.

    chat=None: use the chat template when the tokenizer has one; True: require it;
    False: the raw text as is (with the tokenizer's usual special tokens). A list of
    OpenAI-style messages is always rendered with the template. `tools`: OpenAI function
    definitions for a template that renders them (specdec.tools prepares them).
    """
    if tokenizer is None:
        raise SpecdecError("this model has no tokenizer; cannot encode text prompts")
    messages = prompt if isinstance(prompt, list) else None
    if chat is True and not has_chat_template(tokenizer):
        raise SpecdecError("--chat was given but this model's tokenizer has no chat template; use --raw")
    if messages is not None and not has_chat_template(tokenizer):
        raise SpecdecError("chat messages were given but this model's tokenizer has no chat template")
    use_chat = messages is not None or (chat is not False and has_chat_template(tokenizer))
    if use_chat:
        if messages is None:
            messages = [{"role": "user", "content": prompt}]
        if system:
            messages = [{"role": "system", "content": system}] + [m for m in messages if m.get("role") != "system"]
        extra = {"tools": tools} if tools else {}
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer.encode(prompt)]


class StreamPrinter:
    """Prints a growing completion to a stream as it is produced.

    Holds back text that could still become a stop string (so a stop string is never
    shown), and an incomplete UTF-8 sequence (decoded as U+FFFD) until it completes.
    """

    def __init__(self, tokenizer, stops: list[str] | None = None, out=None) -> None:
        import sys

        self.tok = tokenizer
        self.stops = [s for s in (stops or []) if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.printed = 0
        self.out = out or sys.stdout

    def push(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        cut = find_stop(text, self.stops)
        end = cut if cut is not None else len(text) - self.hold
        while end > self.printed and text[end - 1] == "\ufffd":
            end -= 1
        if end > self.printed:
            self.out.write(text[self.printed:end])
            self.out.flush()
            self.printed = end

    def finish(self, final_text: str) -> None:
        """Print what is left of the final (stop-trimmed) text, then a newline."""
        self.out.write(final_text[self.printed:] + "\n")
        self.out.flush()


def find_stop(text: str, stops: list[str]) -> int | None:
    """Index where the earliest stop string starts in text, or None."""
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None
