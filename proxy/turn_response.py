"""The HTTP side of serving one turn, shared by every API's route: answer or stream, count it,
and record a reply whose client left before its end (never committed, so never trained)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nextstate.proxy.errors import ApiError
from nextstate.proxy.request_body import ClientGone, unless_disconnected
from nextstate.proxy.app_state import services
from nextstate.proxy.turns import PreparedTurn


async def turn_response(
    request: Request,
    prep: PreparedTurn,
    stream: bool,
    events: Callable[[], AsyncIterator[str]],
    complete: Callable[[], Awaitable[dict[str, Any]]],
) -> Response:
    """A JSON reply, or an SSE stream whose first event is awaited here, so that an engine
    failure before the first token keeps its HTTP status."""
    requests = services(request).metrics.requests
    stream_label = "true" if stream else "false"
    try:
        if stream:
            lines = events()
            first = await anext(lines)
        else:
            result = await unless_disconnected(request, complete())
    except ApiError as exc:
        requests.labels(str(exc.status), stream_label).inc()
        raise
    except ClientGone:
        aborted(request, prep, "the client disconnected before its reply was ready")
        return Response(status_code=499)  # nobody reads it: the connection is gone
    requests.labels("200", stream_label).inc()
    if not stream:
        return JSONResponse(result, headers=response_headers(prep))

    async def body() -> AsyncIterator[str]:
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
        body(), media_type="text/event-stream",
        headers={**response_headers(prep), "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def response_headers(prep: PreparedTurn) -> dict[str, str]:
    """What a reply's headers say about its turn: main or side, which session, which version
    served it (known once the engine admitted it), and the key's rate-limit standing."""
    out = {"X-Turn-Type": prep.plan.turn_type, **prep.extra_headers}
    if prep.policy is not None:
        out["X-Policy-Version"] = str(prep.policy.version)
    if prep.plan.session_id:
        out["X-Session-Id"] = prep.plan.session_id
    return out


def aborted(request: Request, prep: PreparedTurn, reason: str) -> None:
    """A reply whose client left: counted and recorded; it was never committed, so never trained."""
    state = services(request)
    state.metrics.aborted.labels(prep.plan.turn_type).inc()
    policy = prep.policy or state.policies.current(prep.key.user)  # gone before the engine took it: the version it would have had
    state.records.write(
        "aborted",
        {"id": prep.id, "user": prep.key.user, "session_id": prep.plan.session_id, "turn_type": prep.plan.turn_type,
         "turn_index": prep.plan.turn_index, "reason": reason},
        version=policy.version,
    )
