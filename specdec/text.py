"""Text-side helpers around a tokenizer: prompt rendering, and TextStream, the one incremental
decoder (streaming text, stop strings). The engine never sees text; the CLI, the API, the server
and benchmarks use these.
"""

from __future__ import annotations

import bisect
import sys

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


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    """Chat messages (and the tools offered, rendered by the template) as the model's template
    writes them, ready for the assistant's turn (to be tokenized without adding special tokens:
    the template wrote them)."""
    if not has_chat_template(tokenizer):
        raise SpecdecError("chat messages were given but this model's tokenizer has no chat template")
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)


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


def stop_strings(stops, what: str = "a stop string") -> list[str]:
    """The stop strings that can end a text, each once, in order: an empty one is dropped (it would
    match before the first character; ignored everywhere, as OpenAI's API ignores it), and one a
    tokenizer cannot read (a lone surrogate) is a SpecdecError naming `what`."""
    out: list[str] = []
    for s in stops or ():
        if s and s not in out:
            out.append(check_text(s, what))
    return out


def _replacements_at_end(text: str) -> int:
    """How many U+FFFD end `text`: how tokenizers show bytes of a character whose rest has not come."""
    n = len(text)
    while n and text[n - 1] == "\ufffd":
        n -= 1
    return len(text) - n


class TextStream:
    """One answer's text, as its tokens come: the one incremental decoder of the CLI, the Python
    API and the server (docs/design.md, "Text").

    `push(ids)` returns the text those tokens add that can be shown now: a character whose bytes
    have not all come (shown as U+FFFD by the tokenizer) waits for the rest, and text that could
    still become a stop string waits until it cannot. Once a stop string appears the text ends
    before it (`stopped`), and later tokens add nothing. `finish()` returns what was held back;
    then `text` is the whole answer, equal to decoding every token at once and cutting at the
    stop string (bytes that never form a character aside: docs/design.md). Of several stop
    strings, the one that is complete first ends the text.

    Linear in the answer's length: each push decodes a window of the last few tokens (since a
    token boundary where the text ended between characters, kept one push back so that a
    tokenizer's leading-space rule sees the same neighbour), never the whole answer, and the stop
    search reads only the held-back text and the new characters. token_ends=True also records,
    per token, where its text ends (pushing one token at a time), for log-probabilities.
    """

    SLIDE = 16  # tokens a window may span before it moves up to a recent clean boundary

    def __init__(self, tokenizer, stops=(), token_ends: bool = False) -> None:
        self.tok = tokenizer
        self.stops = stop_strings(stops)
        self.tokens: list[int] = []
        self.ends: list[int] | None = [] if token_ends else None  # per token: characters up to its end
        self.stopped = False
        self.used: int | None = None  # with a stop: the tokens up to the one that completed it
        self._start = 0  # the window: tokens[_start:] are decoded on each push
        self._mark = 0  # the last boundary where the window's text ended between characters
        self._done = 0  # characters of the window's text already taken
        self._taken = 0  # characters taken in all (the window's first character is _taken - _done)
        self._pending = ""  # taken text not released: it could begin a stop string
        self._released: list[str] = []
        self._released_chars = 0
        self._unread = ""  # released by reached_stop, handed out by the next push or finish

    @property
    def text(self) -> str:
        """The text released so far (after finish(): the whole answer, cut at a stop string)."""
        return "".join(self._released)

    @property
    def shown(self) -> int:
        """Characters of text released so far."""
        return self._released_chars

    @property
    def used_tokens(self) -> int:
        """Tokens the answer used: up to the one that completed a stop string, else all (a
        speculative step may commit a few past the stop before it is seen)."""
        return self.used if self.used is not None else len(self.tokens)

    def push(self, ids) -> str:
        ids = [int(t) for t in ids]
        out = self._unread
        self._unread = ""
        if self.ends is None:
            out += self._feed(ids)
        else:
            for t in ids:
                out += self._feed([t])
        return out

    def reached_stop(self, tokens: list[int]) -> bool:
        """The scheduler's stop_fn: pushes the tokens of `tokens` (the whole answer so far) not
        pushed yet, keeping their text for the next push or finish, and says whether a stop
        string has appeared."""
        if len(tokens) > len(self.tokens):
            self._unread = self.push(tokens[len(self.tokens):])
        return self.stopped

    def finish(self, tokens: list[int] | None = None) -> str:
        """Everything still held back (a last incomplete character as the tokenizer shows it);
        after it, `text` is the whole answer. tokens: the whole answer, where some of it was
        never pushed (a run that does not stream)."""
        out = self.push(tokens[len(self.tokens):]) if tokens is not None else self._unread
        self._unread = ""
        if not self.stopped:
            window = self._decode(self.tokens[self._start:])
            new = window[self._done:]
            self._taken += len(new)
            self._done = len(window)
            out += self._take(new, self._taken - self._done)
            if not self.stopped:
                out += self._release(len(self._pending))
        return out

    def tokens_within(self, chars: int) -> int:
        """How many leading tokens end within the first `chars` characters (needs token_ends)."""
        return bisect.bisect_right(self.ends, chars)

    # ------------------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def _feed(self, ids: list[int]) -> str:
        self.tokens.extend(ids)
        if self.stopped:
            if self.ends is not None:
                self.ends.extend([sys.maxsize] * len(ids))  # past the text: no token after a stop is in it
            return ""
        window = self._decode(self.tokens[self._start:])
        clean = len(window) - _replacements_at_end(window)
        new = window[self._done:clean] if clean > self._done else ""
        self._taken += len(new)
        self._done = max(self._done, clean)
        if self.ends is not None:
            end = self._taken - self._done + len(window)
            self.ends.append(max(end, self.ends[-1]) if self.ends else end)
        out = self._take(new, self._taken - self._done)
        if clean == len(window) and not self.stopped:  # the text ends between two characters
            if len(self.tokens) - self._start > self.SLIDE and self._mark > self._start:
                self._start = self._mark
                self._done = len(self._decode(self.tokens[self._start:]))
            self._mark = len(self.tokens)
        return out

    def _take(self, new: str, base: int) -> str:
        """Stop strings over the taken text: release what cannot begin one (base: where the
        window's text starts, in characters)."""
        pending = self._pending + new
        self._pending = pending
        if not self.stops:
            return self._release(len(pending))
        hit = None
        for s in self.stops:
            at = pending.find(s)
            if at >= 0 and (hit is None or (at + len(s), at) < (hit[0] + len(hit[1]), hit[0])):
                hit = (at, s)
        if hit is None:
            return self._release(len(pending) - self._hold(pending))
        at, s = hit
        out = self._release(at)
        self.stopped = True
        self._pending = ""
        self.used = self._tokens_through(self._released_chars + len(s), base)
        return out

    def _release(self, n: int) -> str:
        out, self._pending = self._pending[:n], self._pending[n:]
        if out:
            self._released.append(out)
            self._released_chars += len(out)
        return out

    def _hold(self, pending: str) -> int:
        """The longest end of `pending` that begins a stop string. Where repetitive text gives one
        stop string many candidate starts, it holds from the earliest unchecked one after a few
        checks (holding more only delays text; it never lets a stop string through)."""
        hold = 0
        for s in self.stops:
            p = pending.find(s[0], max(0, len(pending) - len(s) + 1))
            checks = 0
            while p >= 0 and len(pending) - p > hold:
                if checks == 8 or s.startswith(pending[p:]):
                    hold = len(pending) - p
                    break
                checks += 1
                p = pending.find(s[0], p + 1)
        return hold

    def _tokens_through(self, chars: int, base: int) -> int:
        """The fewest tokens whose text reaches `chars` characters: the tokens since the last
        boundary between characters (where the text was shorter) are re-read one token longer
        at a time (once per answer, at its stop string)."""
        for n in range(self._mark + 1, len(self.tokens)):
            window = self._decode(self.tokens[self._start:n])
            if base + len(window) - _replacements_at_end(window) >= chars:
                return n
        return len(self.tokens)

