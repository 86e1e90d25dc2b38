"""The text side of the server: prompts to token ids, token ids to text, stop strings,
log-probabilities in OpenAI's shapes. The batcher sees only token ids."""

from __future__ import annotations

from ..text import check_text, encode_prompt, find_stop
from ..types import SpecdecError
from .errors import APIError

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


class TextOps:
    def __init__(self, tokenizer, max_context: int) -> None:
        self.tok = tokenizer
        self.max_context = max_context
        # the most characters one token can stand for: a text of C characters has at least
        # C / max_token_chars tokens, so a prompt far beyond the context is refused before the
        # tokenizer spends seconds on it (on the event loop, where it would stall every request)
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1) if tokenizer is not None else 1
        self.vocab = len(tokenizer) if tokenizer is not None else None

    def decode(self, tokens: list[int], special: bool = False) -> str:
        return self.tok.decode(tokens, skip_special_tokens=not special)

    def check_prompt_text(self, texts: list[str], param: str) -> None:
        for t in texts:
            try:
                check_text(t, f"'{param}'")
            except SpecdecError as e:
                raise APIError(400, str(e), param=param)
        chars = sum(len(t) for t in texts)
        at_least = chars // self.max_token_chars
        if at_least > self.max_context:
            raise APIError(400, f"the prompt has at least {at_least} tokens ({chars} characters); the context is "
                                f"{self.max_context} tokens", param=param)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of chat messages through the model's template ("developer" is rendered as
        "system", as OpenAI defines it), with `tools` for a template that renders them."""
        msgs = [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages]
        self.check_prompt_text([m["content"] for m in msgs], "messages")
        try:
            return encode_prompt(self.tok, msgs, True, tools=tools)
        except SpecdecError as e:
            raise APIError(400, str(e), param="messages")
        except Exception as e:  # noqa: BLE001 - a template that cannot render these messages (e.g. a role it lacks)
            raise APIError(400, f"the model's chat template cannot render these messages: {type(e).__name__}: {e}",
                           param="messages")

    def encode_completion(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            self.check_prompt_text([prompt], "prompt")
            return encode_prompt(self.tok, prompt, False)
        return list(prompt)

    def finish_text(self, tokens: list[int], stops: list[str], reason: str) -> tuple[str, str]:
        """(the text up to a stop string, OpenAI's finish reason)."""
        text = self.decode(tokens)
        cut = find_stop(text, stops) if stops else None
        if cut is not None:
            return text[:cut], "stop"
        return text, FINISH_REASONS.get(reason, reason)

    def kept_tokens(self, tokens: list[int], chars: int, start: int = 0) -> int:
        """How many leading tokens (at least `start`) decode within the first `chars` characters."""
        n = start
        while n < len(tokens) and len(self.decode(tokens[: n + 1])) <= chars:
            n += 1
        return n

    def completion_tokens(self, tokens: list[int], stops: list[str], reason: str) -> int:
        """Tokens a choice used: with a stop string, only up to the token that completed it (a
        speculative step may have committed a few more before the stop was seen)."""
        if not stops or reason != "stop" or not tokens:
            return len(tokens)
        if find_stop(self.decode(tokens), stops) is None:
            return len(tokens)  # ended at EOS
        lo, hi = 1, len(tokens)  # the shortest prefix whose text holds a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if find_stop(self.decode(tokens[:mid]), stops) is not None:
                hi = mid
            else:
                lo = mid + 1
        return lo

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
