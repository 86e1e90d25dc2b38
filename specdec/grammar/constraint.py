"""Grammars compiled once per (tokenizer, grammar) and each request's `Constraint` over them.

The engine (llguidance) matches the bytes of the tokens against the grammar, so every spelling
of the text in tokens is allowed (`{"` or `{` then `"`), special tokens never are, and an
end-of-sequence token only where the text is complete. JSON is written with fixed separators
(", " and ": ", no other whitespace), as `json.dumps` writes it: fewer choices, more forced
tokens.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from ..types import SpecdecError

# how JSON is written under a constraint: json.dumps' separators, no other whitespace
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GRAMMARS_KEPT = 64  # compiled grammars kept per vocabulary (a server sees the same schemas again)


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match: `kind` "json" (any JSON object when `schema` is
    None, else a value valid against the JSON schema `schema`) or "lark" (the Lark grammar
    `text`, which may embed JSON schemas as `%json {...}`); `what` names it in errors."""
    kind: str
    schema: str | None = None  # the schema as canonical JSON text (hashable, the cache key)
    text: str | None = None
    what: str = "response_format"

    def engine_grammar(self) -> str:
        import llguidance

        if self.kind == "json":
            schema = json.loads(self.schema) if self.schema is not None else {"type": "object"}
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except ValueError as e:
                raise SpecdecError(f"{self.what}: the JSON schema is invalid: {e}") from None
        return llguidance.LLMatcher.grammar_from_lark(self.text)


def json_object(what: str = "response_format") -> GrammarSpec:
    """Any JSON object (OpenAI's `json_object`)."""
    return GrammarSpec("json", None, what=what)


def json_schema(schema: dict, what: str = "response_format") -> GrammarSpec:
    """A JSON value valid against `schema` (a JSON Schema object)."""
    if not isinstance(schema, dict):
        raise SpecdecError(f"{what}: a JSON schema must be an object, got {type(schema).__name__}")
    return GrammarSpec("json", json.dumps(schema, ensure_ascii=False), what=what)  # key order is the output order


def lark(text: str, what: str) -> GrammarSpec:
    """Text matching the Lark grammar `text` (llguidance's dialect: `%json {schema}` embeds a schema)."""
    return GrammarSpec("lark", text=text, what=what)


def lark_json(schema: dict) -> str:
    """A JSON schema inside a Lark grammar (`%json {...}`), written with the same separators as
    `json_schema`'s (the engine's default inside Lark is free whitespace)."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def _engine_error(spec: GrammarSpec, message: str) -> SpecdecError:
    """One line saying what in the schema the engine refused and what to do."""
    keys = re.search(r"Unimplemented keys: \[(.*?)\]", message)
    if keys:
        names = ", ".join(f"'{k}'" for k in json.loads(f"[{keys.group(1)}]"))
        return SpecdecError(f"{spec.what}: the JSON schema uses {names}, which structured output does not support; "
                            "leave it out of the schema")
    # (the engine's first line, without its position "at L(C): ": what follows it is its state or the
    # Lark grammar specdec wrote around the schema, with a caret, none of which the request's author wrote)
    first = " ".join(re.sub(r"^at \d+\(\d+\): ", "", message.strip().split("\n")[0]).split())
    return SpecdecError(f"{spec.what}: the grammar cannot be compiled: {first[:300]}")


class Vocabulary:
    """The engine's view of one tokenizer at one vocabulary width (the model's logits may be
    wider than the tokenizer: those ids are never allowed), with its compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids) -> None:
        import llguidance

        backend = getattr(tokenizer, "_tk", None) or getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise SpecdecError("structured output needs a tokenizer backed by a tokenizer.json (the `tokenizers` "
                               "library); this model's tokenizer is not")
        eos = [int(i) for i in eos_ids] or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        if not eos:
            raise SpecdecError("structured output needs an end-of-sequence token; this model has none")
        self.size = int(vocab_size)
        self.eos = eos
        self.engine = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.size, eos_token=eos)
        self._grammars: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> "Grammar":
        import llguidance

        grammar = spec.engine_grammar()
        with self._lock:
            matcher = self._grammars.get(grammar)
            if matcher is not None:
                self._grammars.move_to_end(grammar)
                return Grammar(self, matcher, spec)
        matcher = llguidance.LLMatcher(self.engine, grammar, log_level=0)
        if matcher.is_error():
            raise _engine_error(spec, matcher.get_error())
        with self._lock:
            self._grammars[grammar] = matcher
            while len(self._grammars) > GRAMMARS_KEPT:
                self._grammars.popitem(last=False)
        return Grammar(self, matcher, spec)


_VOCABS: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
_VOCABS_LOCK = threading.Lock()


def grammar_for(tokenizer, vocab_size: int, eos_ids, spec: GrammarSpec) -> "Grammar":
    """`spec` compiled for `tokenizer` at `vocab_size` logits (cached per tokenizer: the first
    grammar of a tokenizer reads its vocabulary, 1-2 s for 49k tokens, 4-6 s for 152k; a grammar
    seen before costs nothing). Raises SpecdecError for an invalid or unsupported grammar."""
    key = (int(vocab_size), tuple(int(i) for i in eos_ids))
    with _VOCABS_LOCK:
        per = _VOCABS.setdefault(tokenizer, {})
        vocab = per.get(key)
        if vocab is None:
            vocab = per[key] = Vocabulary(tokenizer, vocab_size, eos_ids)
    return vocab.compile(spec)


class Grammar:
    """A compiled grammar; `constraint()` starts a request's state at the beginning of the text."""

    def __init__(self, vocab: Vocabulary, matcher, spec: GrammarSpec) -> None:
        self.vocab, self._matcher, self.spec = vocab, matcher, spec

    def constraint(self) -> "Constraint":
        return Constraint(self._matcher.deep_copy(), self.vocab)


def unpack(bitmask: np.ndarray, size: int) -> np.ndarray:
    """[N, W] int32 words (bit j of word w: token 32 w + j; little-endian) -> [N, size] bool.
    In numpy (unpackbits: ~0.05 ms for 152k tokens): torch's small ops wake its thread pool,
    1.6 ms on one thread and tens of ms on a busy machine."""
    return np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")[:, :size].astype(bool)


class Constraint:
    """One request's grammar state after its committed text (PROPOSERS.md's `Constraint`).

    `allowed` and `forced` try tokens and roll them back; only `advance` moves the state."""

    def __init__(self, matcher, vocab: Vocabulary) -> None:
        self._m = matcher
        self.vocab = vocab
        self.size = vocab.size
        self._words = (self.size + 31) // 32

    def _rows(self, n: int) -> np.ndarray:
        return np.zeros((n, self._words), dtype=np.int32)

    def _fill(self, matcher, words: np.ndarray, row: int) -> None:
        """The allowed tokens at the matcher's state into words[row], one bit a token (the engine
        writes straight into the array; llguidance.torch would cost a torch.compile at import)."""
        matcher.unsafe_compute_mask_ptr(words[row].ctypes.data, 4 * self._words)

    def _walk(self, paths: list[list[int]]):
        """Yield (row, live) with the matcher after the committed text followed by paths[row]
        (live: the path stays within the grammar and holds no end-of-sequence token), rolling
        back only what the next path does not share; the committed state is restored at the end."""
        m = self._m
        on: list[int] = []  # the tokens consumed beyond the committed text right now
        try:
            for row, path in enumerate(paths):
                common = 0
                while common < len(on) and common < len(path) and on[common] == path[common]:
                    common += 1
                if len(on) > common:
                    m.rollback(len(on) - common)
                    del on[common:]
                rest = list(path[common:])
                took = m.try_consume_tokens(rest) if rest else 0
                on.extend(rest[:took])
                yield row, took == len(rest) and not any(t in self.vocab.eos for t in path)
        finally:
            if on:
                m.rollback(len(on))

    def allowed(self, paths: list[list[int]]) -> torch.Tensor:
        """[len(paths), V] bool: the tokens allowed after the committed text followed by each
        path (paths[0] == [] is the pending position). A path that leaves the grammar (or runs
        past its end) is never reached by verification, since its first illegal token is
        refused by its parent's row; its row is all True, so the masked logits stay finite."""
        words = self._rows(len(paths))
        dead = []
        for row, live in self._walk(paths):
            if live:
                self._fill(self._m, words, row)
            else:
                dead.append(row)
        mask = unpack(words, self.size)
        mask[dead] = True
        mask[~mask.any(axis=1)] = True
        return torch.from_numpy(mask)

    def allows(self, paths: list[list[int]], tokens: list[int]) -> list[bool]:
        """Per position, whether tokens[i] is allowed after the committed text followed by
        paths[i] (as `allowed(paths)[i, tokens[i]]` says, a path that leaves the grammar allowing
        everything): one token checked, far cheaper than a whole mask (a mask of a 49k vocabulary
        and its unpacking cost ~0.1-0.5 ms; a check ~1 us). An end-of-sequence token is allowed
        where the text is complete."""
        m = self._m
        out = []
        for row, live in self._walk(paths):
            token = tokens[row]
            if not live:
                out.append(True)
            elif token in self.vocab.eos:
                out.append(m.is_accepting())
            else:
                out.append(token < self.size and m.validate_tokens([token]) == 1)
        return out

    def advance(self, ids: list[int]) -> None:
        """The committed text grew by `ids` (each allowed where it stands). An end-of-sequence
        token ends the text (the engine takes none once the grammar is complete)."""
        ids = list(ids)
        end = next((i for i, t in enumerate(ids) if t in self.vocab.eos), None)
        if end is not None:
            ids = ids[:end]
        if ids and not self._m.consume_tokens(ids):
            raise RuntimeError(f"a committed token is outside the grammar: {self._m.get_error()[:200]}")
        if end is not None and not self._m.is_accepting():
            raise RuntimeError("an end-of-sequence token was committed before the grammar's text was complete")

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` next tokens that the grammar allows alone, one after the other (a
        jump-forward draft that cannot fail: an end-of-sequence token included where it is the
        only choice); [] when the next token has a choice."""
        m = self._m
        out: list[int] = []
        words = self._rows(1)
        consumed = 0
        try:
            while len(out) < limit:
                if not m.compute_ff_bytes() and not m.is_accepting():
                    break  # the next byte has a choice: so has the next token (no mask needed)
                token = self._only(m, words)
                if token is None:
                    break
                out.append(token)
                if token in self.vocab.eos:
                    break
                if not m.consume_token(token):
                    raise RuntimeError(m.get_error()[:200])
                consumed += 1
        finally:
            if consumed:
                m.rollback(consumed)
        return out

    def _only(self, matcher, words: np.ndarray) -> int | None:
        """The one token the matcher allows now, or None if it allows several (or none): the
        mask's words read as they are, one nonzero word holding one bit."""
        self._fill(matcher, words, 0)
        nonzero = np.flatnonzero(words[0])
        if len(nonzero) != 1:
            return None
        word = int(words[0, nonzero[0]]) & 0xFFFFFFFF
        if word & (word - 1):
            return None
        token = 32 * int(nonzero[0]) + word.bit_length() - 1
        return token if token < self.size else None

    def accepts(self, ids: list[int]) -> int:
        """How many leading tokens of `ids` the grammar allows after the committed text."""
        return self._m.validate_tokens(list(ids))

    def finished(self) -> bool:
        """The text is complete for the grammar: only an end-of-sequence token may follow (or
        one was committed)."""
        m = self._m
        if m.is_stopped():
            return True
        if not m.is_accepting():
            return False
        words = self._rows(1)
        self._fill(m, words, 0)
        return set(np.flatnonzero(unpack(words, self.size)[0]).tolist()) <= set(self.vocab.eos)
