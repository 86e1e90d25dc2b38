"""Tool calls: OpenAI's `tools` rendered for the model, its tool-call text parsed back into
OpenAI's `tool_calls`, and the grammar that makes it call a tool (`tool_choice` "required" or a
named function).

A model writes tool calls in the syntax its chat template teaches (`syntax_for` reads it from
the template):
- "hermes": `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call
  (Qwen2.5, Qwen3, Hermes; and the generic format below);
- "mistral": `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`;
- "llama3": `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` or alone), calls
  separated by `;`.
A template that renders no tools gets the generic format: specdec itself appends the tools to the
system message in the Hermes wording (the one Qwen2.5's template writes), renders earlier calls
as `<tool_call>` blocks and `tool` messages as `<tool_response>` blocks in a user turn, and parses
the Hermes syntax. A template that renders tools in a syntax not listed here is refused
(`SpecdecError`), never answered as silent text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from .grammar.constraint import lark_json
from .types import SpecdecError

HERMES, MISTRAL, LLAMA3 = "hermes", "mistral", "llama3"

GENERIC_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


@dataclass(frozen=True)
class ToolSyntax:
    """How one model family writes tool calls: `name` (HERMES, MISTRAL, LLAMA3), `native` (its
    template renders the tools; False: specdec's generic Hermes rendering)."""
    name: str
    native: bool

    @property
    def opener(self) -> str:
        return {HERMES: "<tool_call>", MISTRAL: "[TOOL_CALLS]", LLAMA3: "<|python_tag|>"}[self.name]

    @property
    def args_key(self) -> str:
        return "parameters" if self.name == LLAMA3 else "arguments"


def syntax_for(template: str | None) -> ToolSyntax:
    """The tool-call syntax a chat template teaches (generic Hermes when it renders no tools)."""
    if not template:
        raise SpecdecError("'tools' need a chat model; this model's tokenizer has no chat template")
    if not re.search(r"\btools\b", template):
        return ToolSyntax(HERMES, native=False)
    if "<tool_call>" in template:
        return ToolSyntax(HERMES, native=True)
    if "[TOOL_CALLS]" in template:
        return ToolSyntax(MISTRAL, native=True)
    if "<|python_tag|>" in template or "ipython" in template:
        return ToolSyntax(LLAMA3, native=True)
    raise SpecdecError("this model's chat template renders tools in a tool-call syntax specdec does not parse "
                       "(it knows <tool_call> (Hermes, Qwen), [TOOL_CALLS] (Mistral) and Llama 3's JSON); leave "
                       "out 'tools'")


def _arguments_object(arguments) -> dict:
    """An earlier call's arguments as a dict (OpenAI sends a JSON string; templates want an object)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if isinstance(arguments, str) and arguments.strip() else {}
    except json.JSONDecodeError:
        raise SpecdecError(f"a tool call's 'arguments' is not JSON: {str(arguments)[:80]!r}") from None
    if not isinstance(value, dict):
        raise SpecdecError(f"a tool call's 'arguments' must be a JSON object, got {str(arguments)[:80]!r}")
    return value


def hermes_call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def render_messages(messages: list[dict], tools: list[dict] | None, syntax: ToolSyntax) -> tuple[list[dict], list | None]:
    """(messages, tools) ready for the chat template: earlier calls' arguments as objects; for a
    template without tools (generic), the tools in the system message, calls as `<tool_call>`
    text and tool results as `<tool_response>` blocks in a user turn."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls") or []
        if calls:
            fixed = []
            for c in calls:
                fn = dict(c.get("function") or {})
                fn["arguments"] = _arguments_object(fn.get("arguments"))
                fixed.append({**c, "function": fn})
            m["tool_calls"] = fixed
        if not syntax.native:
            if calls:
                text = [m["content"]] if m.get("content") else []
                text += [hermes_call(c["function"].get("name", ""), c["function"]["arguments"]) for c in m["tool_calls"]]
                m = {"role": "assistant", "content": "\n".join(text)}
            elif m["role"] == "tool":
                m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        elif m.get("content") is None:
            m["content"] = ""
        out.append(m)
    if syntax.native or not tools:
        return out, (tools or None)
    listing = GENERIC_PROMPT.format(tools="".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools))
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{listing}"}
    else:
        out.insert(0, {"role": "system", "content": listing})
    return out, None


def _call_schema(tool: dict, syntax: ToolSyntax) -> dict:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, syntax.args_key: params},
            "required": ["name", syntax.args_key], "additionalProperties": False}


def call_grammar(tools: list[dict], choice: str | None, parallel: bool, syntax: ToolSyntax, tokenizer) -> str:
    """A Lark grammar (llguidance's dialect) for an answer that is only tool calls: of the named
    function `choice`, or (None) of any of `tools`; one call, or with `parallel` one or more.
    The arguments follow each function's `parameters` schema."""
    chosen = [t for t in tools if choice is None or t["function"]["name"] == choice]
    one = {"anyOf": [_call_schema(t, syntax) for t in chosen]} if len(chosen) > 1 else _call_schema(chosen[0], syntax)
    if syntax.name == MISTRAL:
        array = {"type": "array", "items": one, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        return f"start: {_marker(tokenizer, '[TOOL_CALLS]')} \" \" calls\ncalls: {lark_json(array)}\n"
    if syntax.name == LLAMA3:
        more = ' ("; " call)*' if parallel else ""
        return f"start: call{more}\ncall: {lark_json(one)}\n"
    more = ' ("\\n" call)*' if parallel else ""
    return (f"start: call{more}\ncall: {_marker(tokenizer, '<tool_call>')} \"\\n\" body \"\\n\" "
            f"{_marker(tokenizer, '</tool_call>')}\nbody: {lark_json(one)}\n")


def _marker(tokenizer, text: str) -> str:
    """A fixed piece of text in the grammar: a token the tokenizer adds on top of its merges
    (Qwen's `<tool_call>`, Mistral's `[TOOL_CALLS]`) by its id, since the engine matches such a
    token as a whole, not by its text (and the template teaches the model that token); anything
    else as a string."""
    backend = getattr(tokenizer, "_tk", None) or getattr(tokenizer, "backend_tokenizer", None)
    token_id = backend.token_to_id(text) if backend is not None else None
    if token_id is not None and token_id in backend.get_added_tokens_decoder():
        return f"<[{token_id}]>"
    return json.dumps(text)


@dataclass
class ToolCall:
    """One parsed call: `arguments` is the JSON text of the arguments as the model wrote it."""
    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


def _scan_value(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON value starting at text[start] (after whitespace), or None while
    it is incomplete."""
    i = start
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    if i >= len(text):
        return None
    if text[i] not in "{[":
        try:
            _, end = json.JSONDecoder().raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        return end
    for j, ch, depth in _outside_strings(text, i):
        if ch in "}]" and depth == 0:
            return j + 1
    return None


def _outside_strings(text: str, start: int = 0):
    """(index, character, bracket depth after it) for each character of `text` from `start` that
    is outside a JSON string (quotes and escapes followed)."""
    depth, in_str, esc = 0, False, False
    for j in range(start, len(text)):
        ch = text[j]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        yield j, ch, depth


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def _partial_call(body: str, args_key: str) -> tuple[str | None, str, bool]:
    """(name when complete, the arguments' text so far, arguments complete) of one call's JSON
    object being written."""
    m = _NAME.search(body)
    name = json.loads(f'"{m.group(1)}"') if m else None
    a = re.search(r'"%s"\s*:\s*' % args_key, body)
    if not a:
        return name, "", False
    start = a.end()
    end = _scan_value(body, start)
    return name, body[start:end] if end is not None else body[start:], end is not None


class ToolParser:
    """Reads a model's answer (as text, special tokens kept) into content and tool calls, as a
    whole (`parse`) or as it grows (`feed`: the deltas to stream, OpenAI's way: a call's id and
    name first, then its arguments in pieces). The streamed pieces add up to what `parse` gives."""

    def __init__(self, syntax: ToolSyntax) -> None:
        self.syntax = syntax
        self.sent_content = 0
        self.content_started = False
        self.calls: list[ToolCall] = []
        self.sent_args: list[int] = []

    def _split(self, text: str) -> tuple[int | None, list[str]]:
        """(where the calls start or None, each call's JSON text so far)."""
        s = self.syntax
        if s.name == HERMES:
            at = text.find("<tool_call>")
            if at < 0:
                return None, []
            bodies = []
            for part in text[at:].split("<tool_call>")[1:]:
                bodies.append(part.split("</tool_call>")[0].strip())
            return at, bodies
        if s.name == MISTRAL:
            at = text.find("[TOOL_CALLS]")
            if at < 0:
                return None, []
            rest = text[at + len("[TOOL_CALLS]"):].lstrip()
            if rest.startswith("["):  # a JSON array of calls
                return at, _array_items(rest)
            bodies = []  # name[ARGS]{...} per call
            for part in rest.split("[TOOL_CALLS]"):
                if "[ARGS]" in part:
                    nm, args = part.split("[ARGS]", 1)
                    bodies.append(json.dumps({"name": nm.strip()})[:-1] + ', "arguments": ' + args)
            return at, bodies
        stripped = text.lstrip()
        at = len(text) - len(stripped)
        if stripped.startswith("<|python_tag|>"):
            stripped = stripped[len("<|python_tag|>"):]
        elif not stripped.startswith("{"):
            return None, []
        return at, [b for b in _split_top(stripped, ";")]

    def _held(self, text: str) -> int:
        """How much of the end of `text` to hold back: a partial opener, or (Llama 3) an answer
        that may still turn into a JSON call."""
        opener = self.syntax.opener
        if self.syntax.name == LLAMA3:
            head = text.lstrip()
            if not head or opener.startswith(head) or head.startswith("{"):
                return len(text)
        for k in range(min(len(opener) - 1, len(text)), 0, -1):
            if text.endswith(opener[:k]):
                return k
        return 0

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, the complete calls) of a finished answer. An answer whose call text is
        not valid JSON is all content (nothing is dropped silently)."""
        at, bodies = self._split(text)
        calls = []
        for body in bodies:
            call = self._complete(body)
            if call is not None:
                calls.append(call)
        if not calls:
            return (text.strip() or None), []
        content = text[:at].strip()
        return content or None, calls

    def _complete(self, body: str) -> ToolCall | None:
        name, args, done = _partial_call(body, self.syntax.args_key)
        if name is None or not done:
            return None
        try:
            if not isinstance(json.loads(args), dict):
                return None
        except json.JSONDecodeError:
            return None
        return ToolCall(name, args)

    def feed(self, text: str, final: bool) -> list[dict]:
        """The new deltas for the answer so far: {"content": str} and {"tool_calls": [...]}
        entries in OpenAI's chunk shape; `final` when the answer is complete. Content is sent
        stripped as `parse` strips it (leading whitespace dropped, trailing whitespace held
        until more text follows). A call is opened once its name is complete; if its text then
        turns out malformed, the stream cannot take it back (`parse` would give it as content;
        a constrained answer is never malformed)."""
        out = []
        at, bodies = self._split(text)
        if final and at is not None and not self.calls and not any(self._complete(b) for b in bodies):
            at = None  # no call after all: all of it is content
        end = at if at is not None else len(text) - (0 if final else self._held(text))
        end = len(text[:end].rstrip())
        if end > self.sent_content:
            piece = text[self.sent_content:end]
            if not self.content_started:
                piece = piece.lstrip()
            if piece:
                self.content_started = True
                out.append({"content": piece})
            self.sent_content = end
        if at is None:
            return out
        for i, body in enumerate(bodies):
            name, args, done = _partial_call(body, self.syntax.args_key)
            if i >= len(self.calls):
                if name is None or (final and self._complete(body) is None):
                    break
                self.calls.append(ToolCall(name, ""))
                self.sent_args.append(0)
                out.append({"tool_calls": [{"index": i, "id": self.calls[i].id, "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
            if len(args) > self.sent_args[i]:
                piece = args[self.sent_args[i]:]
                out.append({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
                self.calls[i].arguments += piece
                self.sent_args[i] = len(args)
            if not done:
                break
        return out


def _split_top(text: str, sep: str) -> list[str]:
    """`text` split at `sep` outside JSON strings and brackets."""
    parts, last = [], 0
    for j, ch, depth in _outside_strings(text):
        if ch == sep and depth == 0:
            parts.append(text[last:j].strip())
            last = j + 1
    parts.append(text[last:].strip())
    return [p for p in parts if p]


def _array_items(text: str) -> list[str]:
    """The items of a JSON array of objects being written (`[{...}, {...`), each as text."""
    inner = text[1:]
    end = _scan_value(text, 0)
    if end is not None:
        inner = text[1:end - 1]
    return _split_top(inner, ",") if inner.strip() else []
