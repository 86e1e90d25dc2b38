"""OpenAI-compatible HTTP API over the continuous batcher (`specdec serve`).

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as
server-sent events, `stream_options: {"include_usage": true}` for a last chunk with usage,
`n`, `max_tokens`, `temperature`, `top_p`, `seed`, `stop`; completions also take `prompt` as
a string, a list of strings, a list of token ids or a list of token-id lists, `echo`, and
`logprobs` with `echo` for the prompt's tokens, `max_tokens: 0` with `echo` to score only),
GET /v1/models, GET /health ("starting" until warm, then "ok"; "draining" at shutdown),
GET /metrics (Prometheus; with --api-key it needs the key too, unless --public-metrics). POST
bodies must be `Content-Type: application/json` (else 415). Per-request speculation in an
extra body field: `"speculative": {"k": 0..k_max}` (0 turns it off for that request) and/or
`"method"`: "none", the server's method, or "ngram" on an `auto` server (prompt lookup only).

Request bodies are pydantic models (schemas.py); errors are OpenAI-shaped JSON (errors.py);
the routes live in completions.py and admin.py, a request's life on the batcher in
generation.py, the text side in textops.py, /metrics in metrics.py, the process (warm-up,
signals, draining) in runner.py. Text lives here; the batcher sees only token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI

from . import admin, completions
from ..core.scheduler import ContinuousBatcher
from .errors import install_error_handlers
from .metrics import ServerMetrics
from .textops import TextOps


@dataclass
class ServerState:
    """What the routes read (as `request.app.state.specdec`)."""
    lm: object
    batcher: ContinuousBatcher
    model_name: str
    api_key: str | None
    request_timeout: float
    max_n: int
    text: TextOps
    metrics: ServerMetrics
    body_timeout: float = 60.0
    public_metrics: bool = False


def create_app(lm, batcher: ContinuousBatcher, model_name: str, api_key: str | None = None,
               request_timeout: float = 600.0, max_n: int = 16, body_timeout: float = 60.0,
               public_metrics: bool = False, special_in_messages: bool = False) -> FastAPI:
    """The FastAPI app serving `lm` through `batcher` (whose worker runs elsewhere: its own
    thread, or `batcher.run()` in the caller's). Until `batcher.ready` is set, /health says
    "starting" and requests get 503. body_timeout: seconds a request's body may take to arrive;
    public_metrics: /metrics without the API key; special_in_messages: special-token text in
    chat messages becomes those tokens (see TextOps)."""
    app = FastAPI(title="specdec", version="0.1.0")
    app.state.specdec = ServerState(lm, batcher, model_name, api_key, request_timeout, max_n,
                                    TextOps(lm.tokenizer, batcher.max_context, special_in_messages),
                                    ServerMetrics(batcher), body_timeout, public_metrics)
    install_error_handlers(app)
    app.include_router(completions.router)
    app.include_router(admin.router)
    openapi = app.openapi

    def with_request_schemas() -> dict:
        """FastAPI's document plus the request models (the routes read their bodies themselves)."""
        doc = openapi()
        doc.setdefault("components", {}).setdefault("schemas", {}).update(completions.SCHEMA_DEFS)
        return doc

    app.openapi = with_request_schemas
    return app


def app_settings(args) -> dict:
    """create_app's keyword arguments from `specdec serve`'s flags (the CLI's and --ray's)."""
    return dict(api_key=args.api_key, request_timeout=args.request_timeout, body_timeout=args.body_timeout,
                public_metrics=args.public_metrics, special_in_messages=args.special_tokens_in_messages)
