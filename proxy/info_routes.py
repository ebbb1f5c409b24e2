"""What the server serves and how it is doing: /v1/models, /healthz, /metrics."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from nextstate.proxy.app_state import services
from nextstate.proxy.auth import authenticate, authenticate_admin
from nextstate.proxy.errors import ApiError
from nextstate.core.stores.keys import ApiKey

router = APIRouter()

_STARTED = int(time.time())


def _model_card(request: Request) -> dict:
    """OpenAI's model object, plus the context length under the names clients look for it
    (vLLM's `max_model_len`, `context_length`, `context_window`): an agent that knows the
    window sizes its prompt instead of being refused."""
    turns = services(request).turns
    context = turns.engine.info.max_context
    return {
        "id": turns.model_name, "object": "model", "created": _STARTED, "owned_by": "nextstate",
        "max_model_len": context, "context_length": context, "context_window": context,
    }


@router.get("/v1/models")
async def list_models(request: Request, _: ApiKey = Depends(authenticate)) -> dict:
    return {"object": "list", "data": [_model_card(request)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request, _: ApiKey = Depends(authenticate)) -> dict:
    if model_id != services(request).turns.model_name:
        raise ApiError(404, f"The model '{model_id}' does not exist.", param="model", code="model_not_found")
    return _model_card(request)


@router.get("/healthz")
async def healthz(request: Request) -> dict:
    info = services(request).turns.engine.info
    return {"status": "ok", "model": services(request).turns.model_name, "device": info.device, "dtype": info.dtype}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus metrics. They tell who uses the server how much, so they need an admin key
    (`Authorization: Bearer`, which Prometheus' scrape config can send), unless
    NEXTSTATE_METRICS_PUBLIC is set."""
    if not services(request).settings.server.metrics_public:
        await authenticate_admin(request)
    return Response(services(request).metrics.render(), media_type="text/plain; version=0.0.4")
