"""OpenAI-compatible HTTP API over the continuous batcher (`specdec serve`).

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as
server-sent events, `stream_options: {"include_usage": true}` for a last chunk with usage,
`n`, `max_tokens`, `temperature`, `top_p`, `seed`, `stop`), GET
/v1/models, GET /health, GET /metrics (Prometheus text). Per-request speculation in an
extra body field: `"speculative": {"k": 0..k_max}` (0 turns it off for that request) and/or
`"method"`: "none", the server's method, or "ngram" on an `auto` server (prompt lookup only,
no EAGLE tree or draft-model guesses for that request).
Errors are OpenAI-style JSON: 400 for invalid parameters (also text with lone surrogates,
JSON nested too deeply, and a prompt whose length in characters already proves it longer
than the context, refused before tokenizing), 401 for a wrong API key, 404 for an unknown
model or path, 405 for a wrong HTTP method, 429 with Retry-After when the queue is full,
408 when a request runs past the request timeout (counted from arrival, queued or running).
A client that disconnects, streaming or not, cancels its request (its batch row is freed);
requests cancelled while queued give their place in the queue up. With a stop string,
usage counts tokens only up to the one that completed it (as plain decoding would).

Log-probabilities: completions `logprobs: N` (0..20: each token's and the N most likely),
chat `logprobs: true` with `top_logprobs: N` (0..20), streamed or not. They are the target's
raw log-probabilities (before temperature and top-p), from the forward that produced each
token, the same with or without speculation.

Text lives here (tokenizer, chat template, stop strings); the batcher sees only token ids.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..text import check_text, find_stop
from ..types import SamplingParams, SpecdecError
from .batcher import ContinuousBatcher, Request

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.n = 0
        self.lock = threading.Lock()

    def observe(self, v: float) -> None:
        with self.lock:
            self.n += 1
            self.sum += v
            for i, b in enumerate(self.buckets):
                if v <= b:
                    self.counts[i] += 1
                    break
            else:
                self.counts[-1] += 1

    def prometheus(self, name: str) -> list[str]:
        out, cum = [], 0
        with self.lock:
            for b, c in zip(self.buckets, self.counts):
                cum += c
                out.append(f'{name}_bucket{{le="{b}"}} {cum}')
            out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
            out.append(f"{name}_sum {self.sum:.6f}")
            out.append(f"{name}_count {self.n}")
        return out


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers or {}


def _num(body: dict, key: str, kind, default, lo=None, hi=None, lo_open=False):
    v = body.get(key, default)
    if v is None:
        return default
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise APIError(400, f"'{key}' must be an integer, got {json.dumps(v)}", param=key)
    if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise APIError(400, f"'{key}' must be a number, got {json.dumps(v)}", param=key)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise APIError(400, f"'{key}' must be {'>' if lo_open else '>='} {lo}, got {v}", param=key)
    if hi is not None and v > hi:
        raise APIError(400, f"'{key}' must be <= {hi}, got {v}", param=key)
    return v


# OpenAI fields specdec does not implement, with the values that mean "not used": a request that
# leaves them there (as many clients send them) is served; any other value is refused with a 400
# rather than silently ignored
_UNSUPPORTED = {
    "echo": (False,), "suffix": ("",), "best_of": (1,), "logit_bias": ({},),
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),  # 0 == 0.0 in _same
    "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"), "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},), "prediction": (),
}


def _same(v, f) -> bool:
    """JSON equality that keeps true/false apart from 1/0."""
    if isinstance(v, bool) or isinstance(f, bool):
        return type(v) is type(f) and v == f
    return v == f


def refuse_unsupported(body: dict) -> None:
    for key, fine in _UNSUPPORTED.items():
        v = body.get(key)
        if v is None or any(_same(v, f) for f in fine):
            continue
        if key == "best_of" and _same(v, body.get("n", 1)):
            continue  # best_of == n: every candidate is returned, nothing to choose
        raise APIError(400, f"'{key}' is not supported by this server (got {json.dumps(v)[:80]}); leave it out",
                       param=key)


def _text_content(c) -> str:
    """A message's content as text: a string, or OpenAI's list of {"type": "text", "text": ...} parts
    (joined by newlines); anything else (images, audio, a missing content) is a 400."""
    if isinstance(c, str):
        return c
    if isinstance(c, list) and c and all(isinstance(p, dict) for p in c):
        kinds = {p.get("type") for p in c}
        if kinds == {"text"} and all(isinstance(p.get("text"), str) for p in c):
            return "\n".join(p["text"] for p in c)
        if kinds - {"text"}:
            raise APIError(400, f"only text content is supported; a message has parts of type "
                                f"{', '.join(sorted(map(str, kinds - {'text'})))}", param="messages")
    raise APIError(400, "each message's 'content' must be a string or a list of {\"type\": \"text\", \"text\": "
                        "...} parts", param="messages")


def create_app(lm, batcher: ContinuousBatcher, model_name: str, api_key: str | None = None,
               request_timeout: float = 600.0, max_n: int = 16):
    app = FastAPI(title="specdec", version="0.1.0")
    tok = lm.tokenizer
    ttft = Histogram()
    per_token = Histogram()
    e2e = Histogram()

    @app.exception_handler(APIError)
    async def _api_error(_req, exc: APIError):
        return JSONResponse({"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": None}},
                            status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(req, exc: StarletteHTTPException):  # unknown paths, wrong methods: OpenAI's shape too
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        what = {404: f"no such endpoint: {req.method} {req.url.path}",
                405: f"{req.method} is not allowed on {req.url.path}"}.get(exc.status_code, str(exc.detail))
        return JSONResponse({"error": {"message": what, "type": kind, "param": None, "code": None}},
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    def check_key(req: HTTPRequest) -> None:
        if api_key is None:
            return
        auth = req.headers.get("authorization", "")
        if auth != f"Bearer {api_key}":
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')", "authentication_error")

    async def read_body(req: HTTPRequest) -> dict:
        try:
            body = json.loads(await req.body() or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}")
        except RecursionError:
            raise APIError(400, "the request body nests JSON arrays or objects too deeply")
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != model_name:
            raise APIError(404, f"model {model!r} not found; this server serves {model_name!r}", "not_found_error", "model")
        return body

    def want_logprobs(body: dict, chat: bool) -> int | None:
        """None: no logprobs; N: each token's and the N most likely alternatives."""
        lp = body.get("logprobs")
        if chat:
            if lp is not None and not isinstance(lp, bool):
                raise APIError(400, f"'logprobs' must be true or false, got {json.dumps(lp)}", param="logprobs")
            top = _num(body, "top_logprobs", int, None, lo=0, hi=20)
            if top is not None and not lp:
                raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            return (top or 0) if lp else None
        if lp is None or lp is False:
            return None
        return _num(body, "logprobs", int, None, lo=0, hi=20)

    def sampling(body: dict) -> tuple[SamplingParams, int, list[str], int | None]:
        max_tokens = _num(body, "max_tokens", int, 256, lo=1)
        if "max_completion_tokens" in body:
            max_tokens = _num(body, "max_completion_tokens", int, max_tokens, lo=1)
        temperature = _num(body, "temperature", float, 1.0, lo=0)
        top_p = _num(body, "top_p", float, 1.0, lo=0, hi=1, lo_open=True)
        n = _num(body, "n", int, 1, lo=1, hi=max_n)
        seed = _num(body, "seed", int, None)
        top_k = _num(body, "top_k", int, 0, lo=-1)  # an extension (as vLLM's): -1 or 0 = off
        min_p = _num(body, "min_p", float, 0.0, lo=0, hi=1)
        refuse_unsupported(body)
        stop = body.get("stop")
        if stop is None:
            stops = []
        elif isinstance(stop, str):
            stops = [stop]
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
            stops = stop
        else:
            raise APIError(400, "'stop' must be a string or a list of at most 4 strings", param="stop")
        spec = body.get("speculative")
        spec_k, trees = None, True
        if spec is not None:
            if not isinstance(spec, dict):
                raise APIError(400, "'speculative' must be an object like {\"k\": 4}", param="speculative")
            spec_k = _num(spec, "k", int, None, lo=0)
            allowed = (None, batcher.method, "none") + (("ngram",) if batcher.method == "auto" else ())
            if spec.get("method") not in allowed:
                raise APIError(400, f"this server drafts with {batcher.method!r}; 'speculative.method' may be "
                                    f"{' or '.join(repr(m) for m in allowed[1:])}", param="speculative")
            if spec.get("method") == "none":
                spec_k = 0
            elif spec.get("method") == "ngram" and batcher.method == "auto":
                trees = False  # prompt lookup only
        try:
            params = SamplingParams(max_new_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                                    top_k=max(top_k, 0), min_p=float(min_p), seed=seed)
        except SpecdecError as e:
            raise APIError(400, str(e))
        return params, n, stops, (spec_k, trees)

    def run(ids: list[int], params: SamplingParams, stops: list[str], spec, n: int, top: int | None):
        """Submit n requests; spec: (cap on guesses or None, EAGLE trees allowed). Returns
        (requests, an asyncio queue of (index, kind, payload))."""
        spec_k, trees = spec
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        reqs = []
        for i in range(n):
            p = params if params.seed is None or n == 1 else SamplingParams(**{**params.__dict__, "seed": params.seed + i})
            def on_tokens(new, lps=None, i=i):
                loop.call_soon_threadsafe(out.put_nowait, (i, "tokens", (list(new), lps)))

            def on_done(reason, stats, i=i):
                loop.call_soon_threadsafe(out.put_nowait, (i, "done", (reason, stats)))

            def stop_fn(tokens):
                return find_stop(tok.decode(tokens, skip_special_tokens=True), stops) is not None

            r = Request(list(ids), p, on_tokens, on_done, stop_fn=stop_fn if stops else None, spec_k=spec_k,
                        logprobs=top, trees=trees)
            try:
                batcher.submit(r)
            except queue.Full:
                for q in reqs:
                    q.cancel()
                raise APIError(429, "the server is busy (request queue full); retry later", "rate_limit_error",
                               headers={"Retry-After": "1"})
            except SpecdecError as e:
                raise APIError(400, str(e), param="max_tokens")
            reqs.append(r)
        return reqs, out

    def finish_text(tokens: list[int], stops: list[str], reason: str) -> tuple[str, str]:
        text = tok.decode(tokens, skip_special_tokens=True)
        cut = find_stop(text, stops) if stops else None
        if cut is not None:
            return text[:cut], "stop"
        return text, {"eos": "stop", "stop": "stop", "length": "length"}.get(reason, reason)

    def kept_tokens(tokens: list[int], chars: int, start: int = 0) -> int:
        """How many leading tokens (at least `start`) decode within the first `chars` characters."""
        n = start
        while n < len(tokens) and len(tok.decode(tokens[: n + 1], skip_special_tokens=True)) <= chars:
            n += 1
        return n

    def format_logprobs(tokens: list[int], lps: list, chat: bool, offset: int = 0):
        """OpenAI's shapes: chat {"content": [{token, logprob, bytes, top_logprobs}]}; completions
        {tokens, token_logprobs, top_logprobs, text_offset}."""
        pieces = [tok.decode([t], skip_special_tokens=False) for t in tokens]
        if chat:
            def entry(s, v):
                return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

            return {"content": [{**entry(s, lp), "top_logprobs": [entry(tok.decode([a], skip_special_tokens=False), v)
                                                                for a, v in alts]}
                                for s, (lp, alts) in zip(pieces, lps)]}
        offsets, pos = [], offset
        for s in pieces:
            offsets.append(pos)
            pos += len(s)
        return {"tokens": pieces, "token_logprobs": [lp for lp, _ in lps],
                "top_logprobs": [{tok.decode([a], skip_special_tokens=False): v for a, v in alts} for _, alts in lps],
                "text_offset": offsets}

    # the most characters one token can stand for: a text of C characters has at least
    # C / max_token_chars tokens, so a prompt far beyond the context is refused before the
    # tokenizer spends seconds on it (on the event loop, where it would stall every request)
    max_token_chars = max((len(t) for t in tok.get_vocab()), default=1) if tok is not None else 1

    def check_prompt_text(texts: list[str], param: str) -> None:
        for t in texts:
            try:
                check_text(t, f"'{param}'")
            except SpecdecError as e:
                raise APIError(400, str(e), param=param)
        at_least = sum(len(t) for t in texts) // max_token_chars
        if at_least > batcher.max_context:
            raise APIError(400, f"the prompt has at least {at_least} tokens ({sum(len(t) for t in texts)} characters); "
                                f"the context is {batcher.max_context} tokens", param=param)

    def encode(body: dict, chat: bool) -> list[int]:
        from ..text import encode_prompt

        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs):
                raise APIError(400, "'messages' must be a non-empty list of {role, content} objects with string "
                                    "content", param="messages")
            msgs = [{"role": m["role"], "content": _text_content(m.get("content"))} for m in msgs]
            check_prompt_text([m["content"] for m in msgs] + [m["role"] for m in msgs], "messages")
            try:
                return encode_prompt(tok, msgs, True)
            except SpecdecError as e:
                raise APIError(400, str(e), param="messages")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise APIError(400, "'prompt' must be a non-empty string (or a list of exactly one string)", param="prompt")
        check_prompt_text([prompt], "prompt")
        return encode_prompt(tok, prompt, False)

    def completion_tokens(tokens: list[int], stops: list[str], reason: str) -> int:
        """Tokens a choice used: with a stop string, only up to the token that completed it (a
        speculative step may have committed a few more before the stop was seen)."""
        if not stops or reason != "stop" or not tokens:
            return len(tokens)
        full = tok.decode(tokens, skip_special_tokens=True)
        if find_stop(full, stops) is None:
            return len(tokens)  # ended at EOS
        lo, hi = 1, len(tokens)  # the shortest prefix whose text holds a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if find_stop(tok.decode(tokens[:mid], skip_special_tokens=True), stops) is not None:
                hi = mid
            else:
                lo = mid + 1
        return lo

    async def handle(req: HTTPRequest, chat: bool):
        check_key(req)
        body = await read_body(req)
        params, n, stops, spec = sampling(body)
        top = want_logprobs(body, chat)
        opts = body.get("stream_options")
        if opts is not None and (not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool)):
            raise APIError(400, "'stream_options' must be an object like {\"include_usage\": true}", param="stream_options")
        usage_wanted = bool(opts and opts.get("include_usage"))
        ids = encode(body, chat)
        if len(ids) + params.max_new_tokens + 2 > batcher.max_context:
            raise APIError(400, f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_new_tokens}) exceeds "
                                f"the context of {batcher.max_context} tokens", param="max_tokens")
        t0 = time.perf_counter()
        reqs, out = run(ids, params, stops, spec, n, top)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if body.get("stream"):
            return StreamingResponse(stream(req, reqs, out, stops, rid, created, chat, t0, top,
                                            len(ids) if usage_wanted else None),
                                     media_type="text/event-stream")
        toks = [[] for _ in range(n)]
        lps = [[] for _ in range(n)]
        done = [None] * n
        try:
            while any(d is None for d in done):
                if time.perf_counter() - t0 > request_timeout:
                    raise APIError(408, f"the request took longer than {request_timeout:.0f} s", "timeout_error")
                try:
                    i, kind, payload = await asyncio.wait_for(out.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await req.is_disconnected():  # the client went away: stop generating for it
                        return Response(status_code=499)
                    continue
                if kind == "tokens":
                    toks[i].extend(payload[0])
                    lps[i].extend(payload[1] or [])
                else:
                    done[i] = payload
        finally:
            for r, d in zip(reqs, done):
                if d is None:  # timed out or failed: free the batch row
                    r.cancel()
        choices = []
        for i in range(n):
            text, reason = finish_text(toks[i], stops, done[i][0])
            lp = None
            if top is not None:
                keep = kept_tokens(toks[i], len(text))
                lp = format_logprobs(toks[i][:keep], lps[i][:keep], chat)
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                                "finish_reason": reason})
            else:
                choices.append({"index": i, "text": text, "finish_reason": reason, "logprobs": lp})
        comp = sum(completion_tokens(t, stops, c["finish_reason"]) for t, c in zip(toks, choices))
        dt = time.perf_counter() - t0
        e2e.observe(dt)
        for d in done:
            if d[1].get("first_token_s") is not None:
                ttft.observe(d[1]["first_token_s"])
        if comp:
            per_token.observe(dt / max(1, comp // n))
        return {"id": rid, "object": obj, "created": created, "model": model_name, "choices": choices,
                "usage": {"prompt_tokens": len(ids), "completion_tokens": comp, "total_tokens": len(ids) + comp}}

    async def stream(req, reqs, out, stops, rid, created, chat, t0, top, prompt_tokens=None):
        """prompt_tokens: send a last chunk with usage (stream_options.include_usage)."""
        n = len(reqs)
        reasons = [""] * n
        toks = [[] for _ in range(n)]
        lps = [[] for _ in range(n)]
        lp_sent = [0] * n  # tokens whose logprobs were sent
        sent = [0] * n  # characters of text already sent
        done = [False] * n
        obj = "chat.completion.chunk" if chat else "text_completion"
        first = True
        last = time.perf_counter()

        def chunk(i, text, reason=None):
            lp = None
            if top is not None:  # the tokens now wholly inside the text sent
                start = lp_sent[i]
                lp_sent[i] = kept_tokens(toks[i], sent[i] + len(text), start)
                if lp_sent[i] > start:
                    offset = len(tok.decode(toks[i][:start], skip_special_tokens=True))
                    lp = format_logprobs(toks[i][start:lp_sent[i]], lps[i][start:lp_sent[i]], chat, offset)
            if chat:
                delta = {"content": text} if text else {}
                c = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}
            else:
                c = {"index": i, "text": text, "finish_reason": reason, "logprobs": lp}
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model_name,
                                          "choices": [c]}) + "\n\n"

        try:
            if chat:
                for i in range(n):
                    yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model_name,
                                                 "choices": [{"index": i, "delta": {"role": "assistant"},
                                                              "finish_reason": None}]}) + "\n\n"
            while not all(done):
                try:
                    i, kind, payload = await asyncio.wait_for(out.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await req.is_disconnected():
                        return
                    if time.perf_counter() - t0 > request_timeout:
                        yield "data: " + json.dumps({"error": {"message": "request timed out", "type": "timeout_error"}}) + "\n\n"
                        return
                    continue
                if time.perf_counter() - t0 > request_timeout:
                    yield "data: " + json.dumps({"error": {"message": "request timed out", "type": "timeout_error"}}) + "\n\n"
                    return
                if kind == "tokens":
                    toks[i].extend(payload[0])
                    lps[i].extend(payload[1] or [])
                    now = time.perf_counter()
                    if first:
                        first = False
                    else:
                        per_token.observe((now - last) / max(1, len(payload[0])))
                    last = now
                    text = tok.decode(toks[i], skip_special_tokens=True)
                    cut = find_stop(text, stops) if stops else None
                    safe = cut if cut is not None else len(text)
                    if stops:  # hold back a possible partial stop string
                        hold = max(len(s) for s in stops) - 1
                        safe = cut if cut is not None else max(sent[i], len(text) - hold)
                    if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest
                        safe = min(safe, len(text) - 1)
                    if safe > sent[i]:
                        yield chunk(i, text[sent[i]:safe])
                        sent[i] = safe
                else:
                    reason, stats = payload
                    text, fr = finish_text(toks[i], stops, reason)
                    if len(text) > sent[i]:
                        yield chunk(i, text[sent[i]:])
                    yield chunk(i, "", fr)
                    done[i] = True
                    reasons[i] = fr
                    if stats.get("first_token_s") is not None:
                        ttft.observe(stats["first_token_s"])
            e2e.observe(time.perf_counter() - t0)
            if prompt_tokens is not None:  # OpenAI's shape: empty choices, the request's usage
                comp = sum(completion_tokens(t, stops, r) for t, r in zip(toks, reasons))
                yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model_name,
                                             "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                                      "completion_tokens": comp,
                                                                      "total_tokens": prompt_tokens + comp}}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for r, d in zip(reqs, done):
                if not d:
                    r.cancel()  # the client went away: free the batch row

    @app.post("/v1/completions")
    async def completions(req: HTTPRequest):
        return await handle(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: HTTPRequest):
        return await handle(req, chat=True)

    @app.get("/v1/models")
    async def models(req: HTTPRequest):
        check_key(req)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "specdec"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "batch": len(batcher.rows), "queued": batcher.waiting.qsize()}

    @app.get("/metrics")
    async def metrics():
        s = batcher.stats()
        lines = [
            "# TYPE specdec_requests_total counter", f"specdec_requests_total {s['requests']}",
            "# TYPE specdec_requests_finished_total counter", f"specdec_requests_finished_total {s['finished']}",
            "# TYPE specdec_requests_cancelled_total counter", f"specdec_requests_cancelled_total {s['cancelled']}",
            "# TYPE specdec_generated_tokens_total counter", f"specdec_generated_tokens_total {s['tokens']}",
            "# TYPE specdec_draft_tokens_proposed_total counter", f"specdec_draft_tokens_proposed_total {s['proposed']}",
            "# TYPE specdec_draft_tokens_accepted_total counter", f"specdec_draft_tokens_accepted_total {s['accepted']}",
            "# TYPE specdec_acceptance_rate gauge", f"specdec_acceptance_rate {s['alpha']:.6f}",
            "# TYPE specdec_mean_accepted_length gauge", f"specdec_mean_accepted_length {s['tau']:.6f}",
            "# TYPE specdec_batch_size gauge", f"specdec_batch_size {s['batch']}",
            "# TYPE specdec_queue_size gauge", f"specdec_queue_size {s['queued']}",
            "# TYPE specdec_draft_length gauge", f"specdec_draft_length {s['draft_k']}",
            "# TYPE specdec_tree_rows_total counter", f"specdec_tree_rows_total {s['tree_rows']}",
            "# TYPE specdec_draft_model_rows_total counter", f"specdec_draft_model_rows_total {s['draft_rows']}",
            "# TYPE specdec_lookup_rows_total counter", f"specdec_lookup_rows_total {s['lookup_rows']}",
            "# TYPE specdec_time_to_first_token_seconds histogram", *ttft.prometheus("specdec_time_to_first_token_seconds"),
            "# TYPE specdec_time_per_output_token_seconds histogram", *per_token.prometheus("specdec_time_per_output_token_seconds"),
            "# TYPE specdec_request_seconds histogram", *e2e.prometheus("specdec_request_seconds"),
        ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    return app
