"""The text side of the server: prompts to token ids, token ids to text, log-probabilities in
OpenAI's shapes (an answer's text and its stop strings are its TextStream's, in generation.py).
The batcher sees only token ids."""

from __future__ import annotations

import re
import secrets

from ..text import check_text, encode_prompt, render_chat
from ..types import SpecdecError
from .errors import APIError


class TextOps:
    """special_in_messages: chat messages' text that spells a special token (`<|im_start|>`)
    becomes that token (vLLM's and llama.cpp's behaviour); by default it is read as plain text,
    so a user cannot open a turn of another role."""

    def __init__(self, tokenizer, max_context: int, special_in_messages: bool = False) -> None:
        self.tok = tokenizer
        self.max_context = max_context
        self.special_in_messages = special_in_messages
        # the most characters one token can stand for: a text of C characters has at least
        # C / max_token_chars tokens, so a prompt far beyond the context is refused before the
        # tokenizer spends seconds on it
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1) if tokenizer is not None else 1
        self.vocab = len(tokenizer) if tokenizer is not None else None
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        specials = {t.content for t in added.values() if getattr(t, "special", False) and t.content}
        self.specials = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))) \
            if specials else None

    def decode(self, tokens: list[int], special: bool = False) -> str:
        return self.tok.decode(tokens, skip_special_tokens=not special)

    def check_prompt_text(self, texts: list[str], param: str) -> None:
        for t in texts:
            try:
                check_text(t, f"'{param}'")
            except SpecdecError as e:
                raise APIError(400, str(e), param=param)
        self.check_length(sum(len(t) for t in texts), param)

    def check_length(self, chars: int, param: str) -> None:
        at_least = chars // self.max_token_chars
        if at_least > self.max_context:
            raise APIError(400, f"the prompt has at least {at_least} tokens ({chars} characters); the context is "
                                f"{self.max_context} tokens", param=param)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of chat messages through the model's template ("developer" is rendered as
        "system", as OpenAI defines it), with `tools` for a template that renders them. The
        rendered text is checked against the context before it is tokenized; special-token text
        in the messages is plain text unless special_in_messages (each occurrence stands in the
        template as a marker, and the rendered text is tokenized piece by piece around the
        markers: messages without such text are tokenized exactly as before)."""
        msgs = [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages]
        self.check_prompt_text([m["content"] for m in msgs], "messages")
        literal: dict[str, str] = {}  # marker -> the special-token text it stands for
        if self.specials is not None and not self.special_in_messages:
            nonce = secrets.token_hex(8)

            def mark(match) -> str:
                key = f"specdec{nonce}n{len(literal)}x"
                literal[key] = match.group(0)
                return key

            msgs = [{**m, "content": self.specials.sub(mark, m["content"])} for m in msgs]
        try:
            text = render_chat(self.tok, msgs, tools)
        except SpecdecError as e:
            raise APIError(400, str(e), param="messages")
        except Exception as e:  # noqa: BLE001 - a template that cannot render these messages (e.g. a role it lacks)
            raise APIError(400, f"the model's chat template cannot render these messages: {type(e).__name__}: {e}",
                           param="messages")
        self.check_length(len(text), "messages")
        if not literal:
            return [int(i) for i in self.tok.encode(text, add_special_tokens=False)]
        ids: list[int] = []
        for k, piece in enumerate(re.split("(" + "|".join(map(re.escape, literal)) + ")", text)):
            if k % 2:
                ids += self.tok.encode(literal[piece], add_special_tokens=False, split_special_tokens=True)
            elif piece:
                ids += self.tok.encode(piece, add_special_tokens=False)
        return [int(i) for i in ids]

    def encode_completion(self, prompt: str | list[int]) -> list[int]:
        """A completions prompt: the caller's whole prompt, special-token text included (read as
        those tokens), or token ids."""
        if isinstance(prompt, str):
            self.check_prompt_text([prompt], "prompt")
            return encode_prompt(self.tok, prompt, False)
        return list(prompt)

    def chat_logprobs(self, tokens: list[int], lps: list) -> dict:
        """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs}]}."""
        def entry(t, v):
            s = self.decode([t], special=True)
            return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in alts]}
                            for t, (lp, alts) in zip(tokens, lps)]}

    def completion_logprobs(self, tokens: list[int], lps: list, offset: int = 0) -> dict:
        """OpenAI's completions shape: {tokens, token_logprobs, top_logprobs, text_offset}; an
        entry of lps may be None (an echoed prompt's first token: nothing predicts it)."""
        pieces = [self.decode([t], special=True) for t in tokens]
        offsets, pos = [], offset
        for s in pieces:
            offsets.append(pos)
            pos += len(s)
        return {"tokens": pieces, "token_logprobs": [e[0] if e is not None else None for e in lps],
                "top_logprobs": [{self.decode([a], special=True): v for a, v in e[1]} if e is not None else None
                                 for e in lps],
                "text_offset": offsets}


def merge_logprobs(a: dict | None, b: dict | None) -> dict | None:
    """Two completions logprobs objects one after the other (an echoed prompt's, then the answer's)."""
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
