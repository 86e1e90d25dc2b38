"""From an HTTP request to validated settings: the API key, the JSON body, the model name, the
pydantic request model, and the sampling settings the batcher takes."""

from __future__ import annotations

import json

from fastapi import Request as HTTPRequest
from pydantic import ValidationError

from ..types import SamplingParams, SpecdecError
from .errors import APIError
from .schemas import SamplingFields, validation_error


def check_key(state, req: HTTPRequest) -> None:
    if state.api_key is None:
        return
    if req.headers.get("authorization", "") != f"Bearer {state.api_key}":
        raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')", "authentication_error")


def check_serving(state) -> None:
    """503 while the server warms up or drains (Retry-After says when to come back)."""
    if state.batcher.draining:
        raise APIError(503, "the server is shutting down and takes no new requests", "server_error",
                       headers={"Retry-After": "5"})
    if not state.batcher.ready.is_set():
        raise APIError(503, "the server is starting (warming up its kernels); retry in a few seconds", "server_error",
                       headers={"Retry-After": "2"})


async def read_body(state, req: HTTPRequest) -> dict:
    try:
        body = json.loads(await req.body() or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}")
    except RecursionError:
        raise APIError(400, "the request body nests JSON arrays or objects too deeply")
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != state.model_name:
        raise APIError(404, f"model {str(model)[:80]!r} not found; this server serves {state.model_name!r}",
                       "not_found_error", "model")
    return body


async def parse(state, req: HTTPRequest, schema: type[SamplingFields]):
    """The request's validated body as `schema`, after the key, serving and model checks."""
    check_key(state, req)
    check_serving(state)
    body = await read_body(state, req)
    context = {"max_n": state.max_n, "vocab": state.text.vocab, "method": state.batcher.method}
    try:
        return schema.model_validate(body, context=context)
    except ValidationError as e:
        message, param = validation_error(e, body)
        raise APIError(400, message, param=param) from None
    except RecursionError:  # a model field nested beyond what the validator walks
        raise APIError(400, "the request body nests JSON arrays or objects too deeply") from None


def sampling(state, body: SamplingFields, max_tokens: int) -> tuple[SamplingParams, tuple[int | None, bool]]:
    """(sampling settings, (cap on guesses or None, EAGLE trees / draft model allowed))."""
    spec_k, trees = None, True
    if body.speculative is not None:
        spec_k = body.speculative.k
        if body.speculative.method == "none":
            spec_k = 0
        elif body.speculative.method == "ngram" and state.batcher.method == "auto":
            trees = False  # prompt lookup only
    try:
        params = SamplingParams(max_new_tokens=max(max_tokens, 1), temperature=float(body.temperature),
                                top_p=float(body.top_p), top_k=max(body.top_k, 0), min_p=float(body.min_p),
                                seed=body.seed)
    except SpecdecError as e:
        raise APIError(400, str(e))
    return params, (spec_k, trees)


def check_context(state, ids: list[int], max_tokens: int) -> None:
    if len(ids) + max_tokens + 2 > state.batcher.max_context:
        raise APIError(400, f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds the context of "
                            f"{state.batcher.max_context} tokens", param="max_tokens")
