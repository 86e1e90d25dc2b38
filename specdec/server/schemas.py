"""Request bodies of the OpenAI-compatible endpoints as pydantic models.

Every field a request may carry is typed here (strict: "10" is not an integer, true is not
1, NaN and infinities are not numbers), so a body either validates or gets one OpenAI-shaped
400 that names the field (`validation_error` turns pydantic's errors into that message).
Checks that depend on the server (the largest `n`, the vocabulary, the drafting method, the
most messages) read the validation context `{"max_n", "vocab", "method", "max_messages"}`.
Fields OpenAI defines but specdec does not implement are accepted only with the values that
mean "not used" (as many clients send them); anything else is refused rather than silently
ignored. Unknown extra fields (`user`,
`metadata`, ...) are ignored, as OpenAI's own API does for fields a model does not use.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError,
                      ValidationInfo, field_validator, model_validator)

from ..methods import METHODS
from ..text import stop_strings
from ..types import SEED_LIMIT, SpecdecError

Number = Annotated[Union[StrictInt, StrictFloat], Field(allow_inf_nan=False)]
TokenIds = list[StrictInt]

ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_LOGPROBS = 20
MAX_STOPS = 4

# OpenAI fields specdec does not implement, with the values that mean "not used"
UNSUPPORTED = {
    "suffix": ("",), "best_of": (1,), "logit_bias": ({},),
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),  # 0 == 0.0 in _same
    "functions": ([],), "function_call": ("none", "auto"),
    # chat's fields (ChatCompletionRequest declares them); on completions only their "off" values
    "tools": ([],), "tool_choice": ("none", "auto"), "parallel_tool_calls": (True, False),
}

# what a field must be, for the message when its type is wrong (pydantic's own names the union's arms)
FIELD_HELP = {
    "prompt": "'prompt' must be a non-empty string, a list of strings, a list of token ids, or a list of token-id lists",
    "messages": "'messages' must be a non-empty list of {\"role\", \"content\"} objects",
    "stop": f"'stop' must be a string or a list of at most {MAX_STOPS} strings",
    "stream_options": "'stream_options' must be an object like {\"include_usage\": true}",
    "speculative": "'speculative' must be an object like {\"k\": 4} or {\"method\": \"none\"}",
    "prediction": "'prediction' must be {\"type\": \"content\", \"content\": TEXT or a list of text parts}",
    "response_format": "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                       "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
    "tools": "'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": {...}}}",
    "tool_choice": "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                   "\"function\": {\"name\": ...}}",
}
MESSAGE_HELP = {
    "content": "each message's 'content' must be a string or a list of {\"type\": \"text\", \"text\": ...} parts",
    "role": f"each message's 'role' must be one of {', '.join(ROLES)}",
}
KINDS = {"int_type": "an integer", "int_from_float": "an integer", "float_type": "a number",
         "bool_type": "true or false", "string_type": "a string", "finite_number": "a finite number",
         "dict_type": "an object", "list_type": "a list", "model_type": "an object"}
BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
          "less_than": ("<", "lt")}


def _same(v, f) -> bool:
    """JSON equality that keeps true/false apart from 1/0."""
    if isinstance(v, bool) or isinstance(f, bool):
        return type(v) is type(f) and v == f
    return v == f


class FieldError(ValueError):
    """A check across fields that still names the one to fix (pydantic locates it nowhere)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _got(v) -> str:
    try:
        text = json.dumps(v, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def validation_error(e: ValidationError, body: dict) -> tuple[str, str | None]:
    """(message, param) for the first error of a request body: the field, what it must be and
    what it got. A `ValueError` raised by a validator here already says all that."""
    err = e.errors(include_url=False)[0]
    loc = [p for p in err["loc"] if p not in ("function-after", "function-before")]
    param = str(loc[0]) if loc else None
    got = body.get(param) if param is not None else body
    if err["type"] == "value_error":
        cause = err["ctx"]["error"]
        return str(cause), getattr(cause, "param", param)
    if err["type"] == "missing":
        return f"'{param}' is required" + (f" (in {param}[{loc[1]}]: '{loc[2]}')" if len(loc) > 2 else ""), param
    if param == "messages" and len(loc) > 2 and loc[2] in MESSAGE_HELP:
        return f"{MESSAGE_HELP[loc[2]]} (messages[{loc[1]}] has {_got(err.get('input'))})", param
    if param in FIELD_HELP:
        return f"{FIELD_HELP[param]} (got {_got(got)})", param
    if err["type"] in BOUNDS:
        op, key = BOUNDS[err["type"]]
        return f"'{param}' must be {op} {err['ctx'][key]}, got {_got(got)}", param
    if isinstance(got, float) and not math.isfinite(got):
        return f"'{param}' must be a finite number, got {_got(got)}", param
    kind = KINDS.get(err["type"])
    if kind is not None:
        return f"'{param}' must be {kind}, got {_got(got)}", param
    return f"'{param}' is invalid: {err['msg']} (got {_got(got)})", param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class Speculative(BaseModel):
    """Per-request speculation: `k` caps the guesses per step (0: off); `method` is "none", the
    server's method, or one of the server's draft sources alone (e.g. "ngram" on an `auto` server:
    prompt lookup only, no tree or draft model)."""
    model_config = ConfigDict(extra="forbid")
    k: Annotated[StrictInt, Field(ge=0)] | None = None
    method: StrictStr | None = None

    @field_validator("method")
    @classmethod
    def _known_method(cls, v, info: ValidationInfo):
        server = (info.context or {}).get("method", "none")
        allowed = (server, "none") + tuple(s for s in (info.context or {}).get("sources", ()) if s in METHODS)
        if v is not None and v not in allowed:
            raise ValueError(f"this server drafts with {server!r}; 'speculative.method' may be "
                             f"{' or '.join(repr(m) for m in dict.fromkeys(allowed))}")
        return v


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


def _parts_text(v, where: str) -> str:
    """A content value (a string or a list of text parts) as text, parts joined by newlines."""
    if isinstance(v, str):
        return v
    kinds = sorted({p.type for p in v} - {"text"})
    if kinds:
        raise ValueError(f"only text content is supported; {where} has parts of type {', '.join(kinds)}")
    if any(p.text is None for p in v):
        raise ValueError(f"each text part of {where} needs a string 'text'")
    return "\n".join(p.text for p in v)


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat (a draft for it)."""
    model_config = ConfigDict(extra="forbid")
    type: StrictStr
    content: StrictStr | list[ContentPart]

    @model_validator(mode="after")
    def _content_type(self):
        if self.type != "content":
            raise FieldError("prediction", f"'prediction.type' must be \"content\", got {_got(self.type)}")
        _parts_text(self.content, "'prediction.content'")
        return self

    def text(self) -> str:
        return _parts_text(self.content, "'prediction.content'")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr = "response"
    schema_: dict = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: StrictBool | None = None
    description: StrictStr | None = None


class ResponseFormat(BaseModel):
    """`text`, `json_object` (any JSON object) or `json_schema` (a value valid against the
    schema; enforced with or without `strict`)."""
    model_config = ConfigDict(extra="forbid")
    type: StrictStr
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _kind(self):
        if self.type not in ("text", "json_object", "json_schema"):
            raise FieldError("response_format", "'response_format.type' must be \"text\", \"json_object\" or "
                                                 f"\"json_schema\", got {_got(self.type)}")
        if self.type == "json_schema" and self.json_schema is None:
            raise FieldError("response_format", "'response_format' of type \"json_schema\" needs 'json_schema': "
                                                 "{\"name\": ..., \"schema\": {...}}")
        return self


class SamplingFields(BaseModel):
    """Fields both endpoints share."""
    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0)] = 1.0
    top_p: Annotated[Number, Field(gt=0, le=1)] = 1.0
    n: Annotated[StrictInt, Field(ge=1)] = 1
    seed: Annotated[StrictInt, Field(ge=-SEED_LIMIT, lt=SEED_LIMIT)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] = 0  # an extension (as vLLM's): -1 or 0 = off
    min_p: Annotated[Number, Field(ge=0, lt=1)] = 0.0
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOPS)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    speculative: Speculative | None = None
    prediction: Prediction | None = None
    response_format: ResponseFormat | None = None
    user: Any = None

    @field_validator("stop")
    @classmethod
    def _readable_stops(cls, v):
        """A stop string with a lone surrogate is refused (as in prompts); empty ones are kept
        here and ignored where the text is decoded (text.TextStream)."""
        try:
            stop_strings([v] if isinstance(v, str) else v or [], "'stop'")
        except SpecdecError as e:
            raise ValueError(str(e)) from None
        return v

    @field_validator("n")
    @classmethod
    def _n_at_most(cls, v, info: ValidationInfo):
        most = (info.context or {}).get("max_n", 16)
        if v > most:
            raise ValueError(f"'n' must be <= {most}, got {v}")
        return v

    @model_validator(mode="after")
    def _checks(self):
        extra = self.model_extra or {}
        for key, fine in UNSUPPORTED.items():
            v = extra.get(key)
            if v is None or any(_same(v, f) for f in fine):
                continue
            if key == "best_of" and _same(v, self.n):
                continue  # best_of == n: every candidate is returned, nothing to choose
            raise FieldError(key, f"'{key}' is not supported by this server (got {_got(v)}); leave it out")
        if self.seed is not None and self.seed + self.choices_per_prompt() - 1 >= SEED_LIMIT:
            raise FieldError("seed", f"'seed' + n - 1 must be < 2**63 (choice i samples with seed + i), got seed {self.seed} "
                             f"with n {self.n}")
        return self

    def choices_per_prompt(self) -> int:
        return self.n

    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def usage_wanted(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt`: a string, a list of strings, a list of token ids or a list
    of token-id lists (one choice per prompt and per `n`). `echo` puts the prompt in front of
    each choice's text (and, with `logprobs`, its tokens' log-probabilities, the first null);
    `max_tokens: 0` with `echo` scores the prompt without generating."""
    prompt: Union[StrictStr, Annotated[list[StrictStr], Field(min_length=1)], Annotated[TokenIds, Field(min_length=1)],
                  Annotated[list[Annotated[TokenIds, Field(min_length=1)]], Field(min_length=1)]]
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v, info: ValidationInfo):
        if isinstance(v, str) and not v:
            raise ValueError("'prompt' must not be empty")
        if isinstance(v, list) and any(isinstance(p, str) and not p for p in v):
            raise ValueError("'prompt' must not contain an empty string")
        vocab = (info.context or {}).get("vocab")
        if vocab is not None and isinstance(v, list) and v and not isinstance(v[0], str):
            for ids in (v if isinstance(v[0], list) else [v]):
                bad = next((t for t in ids if not 0 <= t < vocab), None)
                if bad is not None:
                    raise ValueError(f"'prompt' holds the token id {bad}; this model's ids are 0..{vocab - 1}")
        return v

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_false_is_off(cls, v):
        return None if v is False else v

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice group: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)

    def new_tokens(self) -> int:
        return 256 if self.max_tokens is None else self.max_tokens

    @model_validator(mode="after")
    def _zero_tokens_only_scores(self):
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens", "'max_tokens': 0 generates nothing; use it with 'echo': true (and 'logprobs') to score "
                             "a prompt, or ask for at least 1 token")
        if self.max_tokens == 0 and self.stream:
            raise FieldError("max_tokens", "'max_tokens': 0 (scoring) is not streamed; leave out 'stream'")
        return self


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr
    arguments: StrictStr | dict = "{}"


class ToolCallIn(BaseModel):
    """An earlier answer's tool call, sent back in an assistant message."""
    model_config = ConfigDict(extra="allow")
    id: StrictStr | None = None
    type: StrictStr = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: read by templates that know them
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = Field(default=None, validate_default=True)
    tool_calls: list[ToolCallIn] | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, v):
        if v not in ROLES:
            raise ValueError(f"unknown message role {_got(v)}; roles are {', '.join(ROLES)}")
        return v

    @field_validator("content")
    @classmethod
    def _text_only(cls, v):
        if isinstance(v, list) and v:
            _parts_text(v, "a message")
        if isinstance(v, list) and not v:
            raise ValueError("each message's 'content' must be a string or a list of {\"type\": \"text\", \"text\": "
                             "...} parts")
        return v

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("each message's 'content' must be a string or a list of {\"type\": \"text\", \"text\": "
                             "...} parts (only an assistant message with 'tool_calls' may leave it out)")
        return self

    def text(self) -> str:
        """The content as text: text parts are joined by newlines (none: "")."""
        return "" if self.content is None else _parts_text(self.content, "a message")


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: StrictStr | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr = "function"
    function: FunctionDef

    @field_validator("type")
    @classmethod
    def _function_only(cls, v):
        if v != "function":
            raise ValueError(f"only tools of type \"function\" are supported, got {_got(v)}")
        return v


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. Roles: system, user, assistant, tool, developer; content as a
    string or a list of text parts (an assistant message with `tool_calls` may have none).
    `logprobs: true` with `top_logprobs` (0..20). `tools` with `tool_choice` ("none", "auto",
    "required" or a named function) and `parallel_tool_calls`."""
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: StrictStr | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True

    @field_validator("messages", mode="before")
    @classmethod
    def _not_more_than_the_context(cls, v, info: ValidationInfo):
        """Each message takes at least one token of the context: more messages than that are
        refused before each is validated (170,000 empty ones took seconds)."""
        most = (info.context or {}).get("max_messages")
        if most is not None and isinstance(v, list) and len(v) > most:
            raise ValueError(f"'messages' has {len(v)} messages; at most {most} fit the context of {most} tokens")
        return v

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        return self

    @model_validator(mode="after")
    def _tool_choice(self):
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            raise FieldError("tools", "two tools share a name; each function needs its own")
        choice = self.tool_choice
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise FieldError("tool_choice", f"'tool_choice' must be \"none\", \"auto\", \"required\" or "
                                            f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {_got(choice)}")
        if choice not in (None, "none", "auto") and not names:
            raise FieldError("tool_choice", "'tool_choice' asks for a tool call but 'tools' is empty")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise FieldError("tool_choice", f"'tool_choice' names the function {_got(choice.function.name)}, which is not "
                                            "in 'tools'")
        return self

    def tool_mode(self) -> str | None:
        """None (no tools, or "none"), "auto", "required", or the name of the function to call."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def tool_dicts(self) -> list[dict]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def new_tokens(self) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return 256 if self.max_tokens is None else self.max_tokens

    def top(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
