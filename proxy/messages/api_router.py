"""Anthropic's Messages route: authenticate (x-api-key or a bearer key), parse, prepare, then
answer or stream; errors leave in Anthropic's shape (proxy/errors.py)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from nextstate.proxy.app_state import services
from nextstate.proxy.auth import authenticate
from nextstate.core.stores.keys import ApiKey
from nextstate.proxy.messages.protocol import CountTokensRequest, MessagesRequest
from nextstate.proxy.messages.serving import MessagesServing
from nextstate.proxy.request_body import read_model, request_body_schema
from nextstate.proxy.turn_response import turn_response

router = APIRouter()


@router.post("/v1/messages", openapi_extra=request_body_schema(MessagesRequest))
async def messages(request: Request, key: ApiKey = Depends(authenticate)) -> Response:
    body = await read_model(request, MessagesRequest)
    serving: MessagesServing = services(request).messages
    prep = await serving.prepare(body, request.headers, key)
    return await turn_response(request, prep, bool(body.stream), lambda: serving.stream(prep), lambda: serving.complete(prep))


@router.post("/v1/messages/count_tokens", openapi_extra=request_body_schema(CountTokensRequest))
async def count_tokens(request: Request, key: ApiKey = Depends(authenticate)) -> dict[str, int]:
    body = await read_model(request, CountTokensRequest)
    # a request like any other against the key's limit: it tokenizes the whole prompt
    await services(request).turns.limiter.admit(key, 0)
    return await services(request).messages.count_tokens(body, request.headers, key.user)
