"""GET /v1/models, /health and /metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from .requests import check_key, check_metrics_key

router = APIRouter()


@router.get("/v1/models")
async def models(req: HTTPRequest):
    state = req.app.state.specdec
    check_key(state, req)
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0, "owned_by": "specdec"}]}


@router.get("/health")
async def health(req: HTTPRequest):
    """200 {"status": "ok"} once the server is warm and serving; 503 with "starting" while it
    warms its kernels and caches, "draining" once it is shutting down (load balancers wait or
    move on)."""
    b = req.app.state.specdec.batcher
    status = "draining" if b.draining else "ok" if b.ready.is_set() else "starting"
    return JSONResponse({"status": status, "batch": len(b.rows), "queued": b.waiting.qsize()},
                        status_code=200 if status == "ok" else 503)


@router.get("/metrics")
async def metrics(req: HTTPRequest):
    check_metrics_key(req.app.state.specdec, req)
    body, content_type = req.app.state.specdec.metrics.render()
    return Response(body, media_type=content_type)
