"""POST /v1/completions and /v1/chat/completions: answers and streams in OpenAI's shapes.

Non-streaming: one JSON object with every choice. Streaming (`stream: true`): server-sent
events, each `data: {chunk}`; chat starts each choice with a role delta; text comes from the
choice's TextStream (held back while it could still become a stop string or ends in an
incomplete UTF-8 sequence; both answers are its text, so they agree); each
choice ends with a chunk carrying its finish reason; `stream_options.include_usage` adds a
last chunk with empty choices and the usage; an error after the stream started is a
`data: {"error": ...}` event; the stream always ends with `data: [DONE]`.

Log-probabilities are the target's raw ones (before temperature and top-p), from the
forward that produced each token, the same with or without speculation. With `echo`, a
completion's logprobs start with the prompt's tokens (the first one's null: nothing
predicts it), computed by the prefill.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from . import generation, structured
from ..tools import ToolParser
from .errors import APIError, guarded, internal_error, log
from .requests import check_context, off_loop, parse_body, read_request, sampling
from .schemas import ChatCompletionRequest, CompletionRequest
from .textops import merge_logprobs

router = APIRouter()

MAX_CHOICES = 64  # prompts x n in one request, at most (or the server's --max-n if larger)


SCHEMA_DEFS: dict = {}  # the request models' nested schemas, for /openapi.json's components (see app.py)


def _openapi(schema) -> dict:
    """The request body's JSON schema and both 200 shapes (JSON, or a stream of events) for /openapi.json."""
    body = schema.model_json_schema(ref_template="#/components/schemas/{model}")
    SCHEMA_DEFS.update(body.pop("$defs", {}))
    SCHEMA_DEFS[schema.__name__] = body
    return {"requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{schema.__name__}"}}}},
            "responses": {"200": {"description": "the answer, or with stream: true server-sent events ending "
                                                 "with data: [DONE]",
                                  "content": {"application/json": {"schema": {"type": "object"}},
                                              "text/event-stream": {"schema": {"type": "string"}}}}}}


class Shaper:
    """Builds one request's choices and chunks in OpenAI's shapes."""

    def __init__(self, state, job: generation.Job, chat: bool, top: int | None, created: int) -> None:
        self.state, self.text, self.job, self.chat, self.top = state, state.text, job, chat, top
        self.obj = "chat.completion" if chat else "text_completion"
        self.created = created
        shaping = job.shaping
        self.tools = shaping.tools if shaping is not None else None  # parse tool calls (chat with tools)

    def envelope(self, choices: list, obj: str | None = None, **extra) -> dict:
        return {"id": self.job.rid, "object": obj or self.obj, "created": self.created,
                "model": self.state.model_name, "choices": choices, **extra}

    def logprobs(self, c: generation.Choice, start: int, stop: int, offset: int = 0):
        if self.top is None:
            return None
        if self.chat:
            return self.text.chat_logprobs(c.tokens[start:stop], c.lps[start:stop])
        return self.text.completion_logprobs(c.tokens[start:stop], c.lps[start:stop], offset)

    def echo_logprobs(self, c: generation.Choice):
        """The echoed prompt's logprobs (completions with echo and logprobs)."""
        if self.top is None or c.echo is None or c.request.prompt_lps is None:
            return None
        return self.text.completion_logprobs(c.prompt_ids, c.request.prompt_lps)

    def choice(self, i: int) -> dict:
        c = self.job.choices[i]
        text, reason = c.decoder.text, c.finish_reason()
        keep = c.decoder.tokens_within(len(text)) if self.top is not None else 0
        echo = c.echo or ""
        lp = self.logprobs(c, 0, keep, len(echo))
        if self.chat and self.tools is not None:
            message, reason = structured.message(self.state, c.tokens, self.job.stops, reason, self.tools)
            return {"index": i, "message": message, "logprobs": lp, "finish_reason": reason}
        if self.chat:
            return {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                    "finish_reason": reason}
        return {"index": i, "text": echo + text, "finish_reason": reason,
                "logprobs": merge_logprobs(self.echo_logprobs(c), lp) if self.top is not None else None}

    def usage(self) -> dict:
        """Tokens a choice used: with a stop string, only up to the token that completed it (a
        speculative step may have committed a few more before the stop was seen)."""
        prompt = self.job.prompt_tokens
        comp = sum(c.decoder.used_tokens for c in self.job.choices)
        prediction = self.job.shaping.prediction if self.job.shaping is not None else None
        answers = [c.decoder.text for c in self.job.choices] if prediction is not None else []
        return {"prompt_tokens": prompt, "completion_tokens": comp, "total_tokens": prompt + comp,
                "prompt_tokens_details": {"cached_tokens": self.job.cached_tokens()},
                **structured.usage_details(self.state, prediction, answers)}

    def metrics(self) -> dict:
        """Per-request speculation figures (an extra field OpenAI clients ignore), vLLM's shape."""
        return structured.speculation([c.stats for c in self.job.choices])

    def chunk(self, i: int, text: str, reason: str | None = None, lp=None) -> str:
        if self.chat:
            c = {"index": i, "delta": {"content": text} if text else {}, "logprobs": lp, "finish_reason": reason}
        else:
            c = {"index": i, "text": text, "finish_reason": reason, "logprobs": lp}
        return "data: " + json.dumps(self.envelope([c], self.obj + ".chunk" if self.chat else self.obj)) + "\n\n"

    def tool_chunk(self, i: int, delta: dict) -> str:
        c = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
        return "data: " + json.dumps(self.envelope([c], "chat.completion.chunk")) + "\n\n"

    def role_chunk(self, i: int) -> str:
        c = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return "data: " + json.dumps(self.envelope([c], "chat.completion.chunk")) + "\n\n"


async def _answer(state, req: HTTPRequest, job: generation.Job, shaper: Shaper, stream: bool, usage: bool):
    if stream:
        return StreamingResponse(_stream(state, job, shaper, usage), media_type="text/event-stream")
    if not await generation.collect(job, req):
        from fastapi.responses import Response

        return Response(status_code=499)  # the client left; nobody reads this
    choices = [shaper.choice(i) for i in range(len(job.choices))]
    return shaper.envelope(choices, usage=shaper.usage(), metrics=shaper.metrics())


def _prepare_completion(state, raw: bytes):
    """(body, sampling, speculation, [(prompt ids, echoed text)]): the work before a completion
    is queued, off the event loop."""
    body = parse_body(state, raw, CompletionRequest)
    prompts = body.prompts()
    if len(prompts) * body.n > max(MAX_CHOICES, state.max_n):
        raise APIError(400, f"{len(prompts)} prompts x n {body.n} is more than {max(MAX_CHOICES, state.max_n)} "
                            "choices in one request; split it", param="prompt")
    params, spec = sampling(state, body, body.new_tokens())
    encoded = []
    for p in prompts:
        ids = state.text.encode_completion(p)
        check_context(state, ids, body.new_tokens())
        encoded.append((ids, (p if isinstance(p, str) else state.text.decode(p, special=True)) if body.echo else None))
    return body, params, spec, encoded


@router.post("/v1/completions", openapi_extra=_openapi(CompletionRequest))
@guarded
async def completions(req: HTTPRequest):
    state = req.app.state.specdec
    raw = await read_request(state, req)
    body, params, spec, encoded = await off_loop(_prepare_completion, state, raw)
    shaping = await structured.prepare(state, body)
    rid = "cmpl-" + uuid.uuid4().hex[:24]
    prompt_top = body.logprobs if body.echo and body.logprobs is not None else None
    job = generation.submit(state, encoded, params, body.n, body.stops(), spec, body.logprobs, rid,
                            prompt_top=prompt_top, score_only=body.max_tokens == 0, shaping=shaping)
    shaper = Shaper(state, job, False, body.logprobs, int(time.time()))
    return await _answer(state, req, job, shaper, body.stream, body.usage_wanted())


def _prepare_chat(state, raw: bytes):
    """(body, sampling, speculation, prompt ids, the tool-call syntax to parse or None): the work
    before a chat request is queued (the template and the tokenizer), off the event loop."""
    body = parse_body(state, raw, ChatCompletionRequest)
    params, spec = sampling(state, body, body.new_tokens())
    messages, tools, syntax = structured.chat_messages(state, body)
    ids = state.text.encode_chat(messages, tools)
    check_context(state, ids, body.new_tokens())
    return body, params, spec, ids, syntax


@router.post("/v1/chat/completions", openapi_extra=_openapi(ChatCompletionRequest))
@guarded
async def chat_completions(req: HTTPRequest):
    state = req.app.state.specdec
    raw = await read_request(state, req)
    body, params, spec, ids, syntax = await off_loop(_prepare_chat, state, raw)
    shaping = await structured.prepare(state, body, syntax)
    rid = "chatcmpl-" + uuid.uuid4().hex[:24]
    job = generation.submit(state, [(ids, None)], params, body.n, body.stops(), spec, body.top(), rid,
                            shaping=shaping)
    shaper = Shaper(state, job, True, body.top(), int(time.time()))
    return await _answer(state, req, job, shaper, body.stream, body.usage_wanted())


class _StreamText:
    """Per choice: whether its stream started, and the tokens whose logprobs were sent."""

    def __init__(self) -> None:
        self.lp_sent = 0
        self.started = False


def _delta(shaper: Shaper, st: _StreamText, i: int) -> str | None:
    """The chunk with choice i's text that arrived since the last one (None if none did), and
    the logprobs of the tokens now wholly inside the text sent."""
    c = shaper.job.choices[i]
    piece, c.unsent = c.unsent, ""
    lp = None
    if shaper.top is not None and c.within > st.lp_sent:
        start, st.lp_sent = st.lp_sent, c.within
        offset = len(c.echo or "") + (c.decoder.ends[start - 1] if start else 0)
        lp = shaper.logprobs(c, start, st.lp_sent, offset)
    if not piece and lp is None:
        return None
    return shaper.chunk(i, piece, None, lp)


def _opening(shaper: Shaper, i: int) -> str | None:
    """What a choice's stream starts with: chat's role delta, or a completion's echoed prompt."""
    c = shaper.job.choices[i]
    if shaper.chat:
        return shaper.role_chunk(i)
    if c.echo is not None:
        return shaper.chunk(i, c.echo, None, shaper.echo_logprobs(c))
    return None


async def _stream(state, job: generation.Job, shaper: Shaper, usage: bool):
    texts = [_StreamText() for _ in job.choices]
    parsers = [ToolParser(shaper.tools) for _ in job.choices] if shaper.tools is not None else None
    try:
        async for i, kind in generation.events(job):
            st = texts[i]
            if not st.started:
                st.started = True
                opening = _opening(shaper, i)
                if opening:
                    yield opening
            if parsers is not None:  # chat with tools: content and tool-call deltas
                for delta in structured.tool_deltas(state, parsers[i], job.choices[i].tokens, job.stops,
                                                    final=kind == "done"):
                    yield shaper.tool_chunk(i, delta)
            else:
                piece = _delta(shaper, st, i)
                if piece:
                    yield piece
            if kind == "done":
                reason = job.choices[i].finish_reason()
                if parsers is not None and parsers[i].calls and reason == "stop":
                    reason = "tool_calls"
                yield shaper.chunk(i, "", reason)
        final = shaper.usage()
        if usage:  # OpenAI's shape: empty choices, the request's usage (and the speculation figures)
            yield "data: " + json.dumps(shaper.envelope([], shaper.obj + ".chunk" if shaper.chat else shaper.obj,
                                                        usage=final, metrics=shaper.metrics())) + "\n\n"
    except APIError as e:
        yield e.event()
    except Exception:  # noqa: BLE001 - the stream has started: an error event, not a 500
        log.exception("request %s failed while streaming", job.rid)
        yield internal_error(job.rid).event()
    finally:
        job.cancel()  # the client went away (or the stream failed): free the batch rows
    yield "data: [DONE]\n\n"
