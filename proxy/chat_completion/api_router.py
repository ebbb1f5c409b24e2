"""The chat completions route: authenticate, parse, prepare, then answer or stream."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from nextstate.proxy.app_state import services
from nextstate.proxy.auth import authenticate
from nextstate.proxy.chat_completion.protocol import ChatCompletionRequest
from nextstate.proxy.chat_completion.serving import ChatCompletionServing
from nextstate.core.stores.keys import ApiKey
from nextstate.proxy.request_body import read_model, request_body_schema
from nextstate.proxy.turn_response import turn_response

router = APIRouter()


@router.post("/v1/chat/completions", openapi_extra=request_body_schema(ChatCompletionRequest))
async def chat_completions(request: Request, key: ApiKey = Depends(authenticate)) -> Response:
    # Parsed after authentication (FastAPI would parse the body first), so an unauthenticated
    # caller learns nothing about what a valid request looks like.
    body = await read_model(request, ChatCompletionRequest)
    serving: ChatCompletionServing = services(request).chat
    prep = await serving.prepare(body, request.headers, key)
    return await turn_response(
        request, prep, bool(body.stream), lambda: serving.stream(prep, body), lambda: serving.complete(prep, body)
    )
