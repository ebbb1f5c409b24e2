"""The chat completions route: authenticate, parse, prepare, then answer or stream."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nextstate.proxy.auth import authenticate
from nextstate.proxy.chat_completion.protocol import ChatCompletionRequest
from nextstate.proxy.chat_completion.serving import ChatCompletionServing
from nextstate.proxy.errors import OpenAIError
from nextstate.proxy.request_body import ClientGone, read_model, request_body_schema, unless_disconnected
from nextstate.proxy.turns import PreparedTurn
from nextstate.proxy.keys import ApiKey

router = APIRouter()


@router.post("/v1/chat/completions", openapi_extra=request_body_schema(ChatCompletionRequest))
async def chat_completions(request: Request, key: ApiKey = Depends(authenticate)) -> Response:
    # Parsed after authentication (FastAPI would parse the body first), so an unauthenticated
    # caller learns nothing about what a valid request looks like.
    body = await read_model(request, ChatCompletionRequest)
    serving: ChatCompletionServing = request.app.state.chat
    prep = await serving.prepare(body, request.headers, key)
    requests = request.app.state.metrics.requests
    stream_label = "true" if body.stream else "false"
    try:
        if body.stream:
            lines = serving.stream(prep, body)
            first = await anext(lines)  # an engine failure before the first token keeps its status
        else:
            result = await unless_disconnected(request, serving.complete(prep, body))
    except OpenAIError as exc:
        requests.labels(str(exc.status), stream_label).inc()
        raise
    except ClientGone:
        aborted(request, prep, "the client disconnected before its reply was ready")
        return Response(status_code=499)  # nobody reads it: the connection is gone
    requests.labels("200", stream_label).inc()
    if not body.stream:
        return JSONResponse(result, headers=prep.headers)

    async def body_stream():
        finished = False
        try:
            yield first
            async for line in lines:
                yield line
            finished = True
        finally:
            if not finished:  # the client went away (or the server is stopping): nothing is trained
                aborted(request, prep, "the client closed the stream before its end")

    return StreamingResponse(
        body_stream(),
        media_type="text/event-stream",
        headers={**prep.headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def aborted(request: Request, prep: PreparedTurn, reason: str) -> None:
    """A reply whose client left: counted and recorded; it was never committed, so never trained."""
    request.app.state.metrics.aborted.labels(prep.plan.turn_type).inc()
    request.app.state.records.write(
        "aborted",
        {"id": prep.id, "user": prep.key.user, "session_id": prep.plan.session_id, "turn_type": prep.plan.turn_type,
         "turn_index": prep.plan.turn_index, "reason": reason},
        version=prep.policy.version,
    )
