"""OpenAI's Responses route: authenticate, parse, prepare (with the stored conversation of
`previous_response_id`), then answer or stream."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from nextstate.proxy.app_state import services
from nextstate.proxy.auth import authenticate
from nextstate.core.stores.keys import ApiKey
from nextstate.proxy.request_body import read_model, request_body_schema
from nextstate.proxy.responses.protocol import ResponsesRequest
from nextstate.proxy.responses.serving import ResponsesServing
from nextstate.proxy.turn_response import turn_response

router = APIRouter()


@router.post("/v1/responses", openapi_extra=request_body_schema(ResponsesRequest))
async def responses(request: Request, key: ApiKey = Depends(authenticate)) -> Response:
    body = await read_model(request, ResponsesRequest)
    serving: ResponsesServing = services(request).responses
    prep, conversation = await serving.prepare(body, request.headers, key)
    return await turn_response(
        request, prep, bool(body.stream),
        lambda: serving.stream(prep, body, conversation), lambda: serving.complete(prep, body, conversation),
    )


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request, key: ApiKey = Depends(authenticate)) -> dict[str, Any]:
    return await services(request).responses.retrieve(key.user, response_id)


@router.get("/v1/responses/{response_id}/input_items")
async def response_input_items(response_id: str, request: Request, key: ApiKey = Depends(authenticate)) -> dict[str, Any]:
    return await services(request).responses.input_items(key.user, response_id)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request, key: ApiKey = Depends(authenticate)) -> dict[str, Any]:
    return await services(request).responses.delete(key.user, response_id)
