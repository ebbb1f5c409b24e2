"""What the server serves and how it is doing: /v1/models, /healthz, /readyz, /metrics."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

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


# /readyz: the most a database round trip may take before the process counts as not ready.
READY_TIMEOUT_S = 2.0


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Readiness, for a load balancer: 503 while the shared database cannot be reached (every
    request needs it for the key check), 200 otherwise. `/healthz` stays the liveness check:
    the process itself is fine and needs no restart while its database comes back."""
    keys = services(request).keys
    if keys.shared:
        try:
            await asyncio.wait_for(asyncio.to_thread(keys.ping), READY_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - unreachable, slow or refusing: not ready, whatever the cause
            why = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            return JSONResponse({"status": "not ready", "reason": f"the database cannot be reached: {why}"}, 503)
    return JSONResponse({"status": "ready"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus metrics. They tell who uses the server how much, so they need an admin key
    (`Authorization: Bearer`, which Prometheus' scrape config can send), unless
    NEXTSTATE_METRICS_PUBLIC is set."""
    if not services(request).settings.server.metrics_public:
        await authenticate_admin(request)
    return Response(services(request).metrics.render(), media_type="text/plain; version=0.0.4")
