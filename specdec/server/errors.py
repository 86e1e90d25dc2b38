"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status.

400 invalid parameters, 401 a wrong API key, 404 an unknown model or path, 405 a wrong HTTP
method, 408 a request past the request timeout or a body that did not arrive within the body
timeout (then the connection is closed), 415 a body not declared JSON, 429 a full queue (with
Retry-After), 500 a failure inside this one request (logged once with its request id; the
server stays up), 503 while the server starts or shuts down. A stream that has started ends with the same
object as a `data:` event, then `data: [DONE]`.
"""

from __future__ import annotations

import functools
import json
import logging

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("specdec.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def event(self) -> str:
        """The error as a server-sent event (a stream that already started cannot change its status)."""
        return "data: " + json.dumps(self.body()) + "\n\n"


def internal_error(request_id: str) -> APIError:
    return APIError(500, f"the server failed while handling this request (id {request_id}); other requests are not "
                         "affected; the server log has the details", "server_error")


def guarded(handler):
    """Route handler wrapper: an exception other than APIError becomes an OpenAI-shaped 500 for this
    request only, logged once with an id the client also gets."""

    @functools.wraps(handler)
    async def wrapper(*args, **kwargs):
        try:
            return await handler(*args, **kwargs)
        except APIError:
            raise
        except Exception:
            import uuid

            rid = "req-" + uuid.uuid4().hex[:16]
            log.exception("request %s failed", rid)
            raise internal_error(rid) from None

    return wrapper


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_req, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(req, exc: StarletteHTTPException):  # unknown paths, wrong methods: OpenAI's shape too
        kind = {404: "not_found_error"}.get(exc.status_code, "invalid_request_error")
        what = {404: f"no such endpoint: {req.method} {req.url.path}",
                405: f"{req.method} is not allowed on {req.url.path}"}.get(exc.status_code, str(exc.detail))
        return JSONResponse(APIError(exc.status_code, what, kind).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))
