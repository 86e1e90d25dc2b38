"""From an HTTP request to validated settings: the API key, the content type, the body (read
within --body-timeout), the JSON, the model name, the pydantic request model, and the sampling
settings the batcher takes. Parsing, validating and tokenizing run on a small thread pool
(`off_loop`), not on the event loop, so a large body cannot stall /health and the streams."""

from __future__ import annotations

import asyncio
import functools
import json
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request as HTTPRequest
from pydantic import ValidationError

from ..methods import REQUEST_SOURCES
from ..types import SamplingParams, SpecdecError
from .errors import APIError
from .schemas import SamplingFields, validation_error


def check_key(state, req: HTTPRequest) -> None:
    if state.api_key is None:
        return
    if req.headers.get("authorization", "") != f"Bearer {state.api_key}":
        raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')", "authentication_error")


def check_metrics_key(state, req: HTTPRequest) -> None:
    """/metrics needs the API key too (it shows the load and the request counts), unless the
    server was started with --public-metrics (for a scraper that cannot send a key)."""
    if not state.public_metrics:
        check_key(state, req)


def check_serving(state) -> None:
    """503 while the server warms up or drains (Retry-After says when to come back)."""
    if state.batcher.draining:
        raise APIError(503, "the server is shutting down and takes no new requests", "server_error",
                       headers={"Retry-After": "5"})
    if not state.batcher.ready.is_set():
        raise APIError(503, "the server is starting (warming up its kernels); retry in a few seconds", "server_error",
                       headers={"Retry-After": "2"})


def check_content_type(req: HTTPRequest) -> None:
    """415 unless the body is declared JSON. A browser page may send a text/plain, form or
    untyped POST to any address without asking first (no CORS preflight); requiring
    application/json makes it ask, and this server never says yes, so no other site can make it
    generate (which matters most without --api-key)."""
    kind = req.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json" and not (kind.startswith("application/") and kind.endswith("+json")):
        raise APIError(415, f"the request body must be JSON sent with 'Content-Type: application/json' (got "
                            f"{repr(kind) if kind else 'no Content-Type'})")


async def read_body(state, req: HTTPRequest) -> bytes:
    """The body's bytes, or a 408 that closes the connection when they do not all arrive within
    the body timeout (a client that promised more than it sent would hold the connection open)."""
    try:
        return await asyncio.wait_for(req.body(), timeout=state.body_timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {state.body_timeout:g} s (is its Content-Length "
                            "right?)", "timeout_error", headers={"Connection": "close"}) from None


def parse_body(state, raw: bytes, schema: type[SamplingFields]):
    """The body as `schema`, validated (after the JSON and model checks); runs off the loop."""
    try:
        body = json.loads(raw or b"{}")
    except RecursionError:
        raise APIError(400, "the request body nests JSON arrays or objects too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, and an integer of over 4300 digits
        raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != state.model_name:
        raise APIError(404, f"model {str(model)[:80]!r} not found; this server serves {state.model_name!r}",
                       "not_found_error", "model")
    context = {"max_n": state.max_n, "vocab": state.text.vocab, "method": state.batcher.method,
               "sources": state.batcher.sources.labels, "max_messages": state.batcher.max_context}
    try:
        return schema.model_validate(body, context=context)
    except ValidationError as e:
        message, param = validation_error(e, body)
        raise APIError(400, message, param=param) from None
    except RecursionError:  # a model field nested beyond what the validator walks
        raise APIError(400, "the request body nests JSON arrays or objects too deeply") from None


async def read_request(state, req: HTTPRequest) -> bytes:
    """The checks before a body is parsed (key, serving, content type), then its bytes."""
    check_key(state, req)
    check_serving(state)
    check_content_type(req)
    return await read_body(state, req)


_POOL: ThreadPoolExecutor | None = None


async def off_loop(fn, *args):
    """fn(*args) on the text threads (two: a flood of large bodies queues there, while the event
    loop goes on answering /health and the streams)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="specdec-text")
    return await asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args))


def sampling(state, body: SamplingFields, max_tokens: int) -> tuple[SamplingParams, tuple[int | None, frozenset | None]]:
    """(sampling settings, (cap on guesses or None, the draft sources the request may take or None: all))."""
    spec_k, sources = None, None
    if body.speculative is not None:
        spec_k = body.speculative.k
        method = body.speculative.method
        if method == "none":
            spec_k = 0
        elif method is not None and method != state.batcher.method:  # one of the server's sources alone
            sources = frozenset({method}) | REQUEST_SOURCES
    try:
        params = SamplingParams(max_new_tokens=max(max_tokens, 1), temperature=float(body.temperature),
                                top_p=float(body.top_p), top_k=max(body.top_k, 0), min_p=float(body.min_p),
                                seed=body.seed)
    except SpecdecError as e:
        raise APIError(400, str(e))
    return params, (spec_k, sources)


def check_context(state, ids: list[int], max_tokens: int) -> None:
    """400 unless the prompt, max_tokens and the batcher's room for one step's guesses (its
    largest step plus 2) fit the context: the largest max_tokens is context - prompt - that."""
    reserve = state.batcher.slots + 2
    if len(ids) + max_tokens + reserve > state.batcher.max_context:
        most = state.batcher.max_context - len(ids) - reserve
        room = f"max_tokens may be at most {most}" if most > 0 else "shorten the prompt"
        raise APIError(400, f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds the context of "
                            f"{state.batcher.max_context} tokens less {reserve} kept for speculation; {room}",
                       param="max_tokens")
