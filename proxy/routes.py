"""The OpenAI-compatible routes and the operational ones (/healthz, /metrics)."""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from proxy.auth import authenticate
from proxy.completions import ChatService, TurnHints
from proxy.errors import OpenAIError, invalid_request, validation_error
from proxy.keys import ApiKey
from proxy.schemas import ChatCompletionRequest

router = APIRouter()

_STARTED = int(time.time())


async def _parse_body(request: Request) -> ChatCompletionRequest:
    """Parsed after authentication (FastAPI would parse the body first), so an unauthenticated
    caller learns nothing about what a valid request looks like."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError:
        raise invalid_request("We could not parse the JSON body of your request. Send valid JSON.") from None
    if not isinstance(data, dict):
        raise invalid_request("The request body must be a JSON object.")
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise validation_error(list(exc.errors())) from None


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, key: ApiKey = Depends(authenticate)) -> Response:
    body = await _parse_body(request)
    chat: ChatService = request.app.state.chat
    prep = await chat.prepare(body, key, TurnHints.from_request(request.headers, body))
    metrics = request.app.state.metrics
    if body.stream:
        stream = chat.stream(prep)
        try:
            first = await anext(stream)  # engine failures before the first token keep their status
        except OpenAIError as exc:
            metrics.requests.labels(str(exc.status), "true").inc()
            raise
        metrics.requests.labels("200", "true").inc()

        async def body_stream():
            yield first
            async for piece in stream:
                yield piece

        return StreamingResponse(
            body_stream(),
            media_type="text/event-stream",
            headers={**prep.headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        result = await chat.complete(prep)
    except OpenAIError as exc:
        metrics.requests.labels(str(exc.status), "false").inc()
        raise
    metrics.requests.labels("200", "false").inc()
    return JSONResponse(result, headers=prep.headers)


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": _STARTED, "owned_by": "nextstate"}


@router.get("/v1/models")
async def list_models(request: Request, _: ApiKey = Depends(authenticate)) -> dict:
    return {"object": "list", "data": [_model_card(request.app.state.chat.model_name)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request, _: ApiKey = Depends(authenticate)) -> dict:
    name = request.app.state.chat.model_name
    if model_id != name:
        raise OpenAIError(404, f"The model '{model_id}' does not exist.", param="model", code="model_not_found")
    return _model_card(name)


@router.get("/healthz")
async def healthz(request: Request) -> dict:
    info = request.app.state.chat.engine.info
    return {"status": "ok", "model": request.app.state.chat.model_name, "device": info.device, "dtype": info.dtype}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4")
