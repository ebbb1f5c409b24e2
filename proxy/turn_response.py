"""The HTTP side of serving one turn, shared by every API's route: answer or stream, count it,
and record a reply whose client left before its end (never committed, so never trained).

Every API streams a turn the same way — an opening event once the engine admitted the request,
keep-alives while a long prompt is prefilled, deltas, the finish, and after the opening event
errors as an error event — and differs only in the events' shapes: `stream_turn` holds the
control flow once, each API's `StreamWriter` the shapes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nextstate.proxy.decode import Admitted, Delta, Finished, StillWorking, TurnEvent
from nextstate.proxy.errors import OpenAIError
from nextstate.proxy.request_body import ClientGone, unless_disconnected
from nextstate.proxy.turns import PreparedTurn


class StreamWriter(Protocol):
    """One API's server-sent events for one reply."""

    def start(self) -> str: ...  # the opening event(s): awaited by the route, so sent as one item
    def keep_alive(self) -> str: ...
    def delta(self, delta: Delta) -> list[str]: ...
    def finish(self, done: Finished) -> list[str]: ...
    def error(self, exc: OpenAIError) -> str: ...
    def end(self) -> list[str]: ...  # after a finish, e.g. chat completions' `[DONE]`


async def stream_turn(
    events: AsyncIterator[TurnEvent], writer: StreamWriter,
    on_finish: Callable[[Finished], Awaitable[None]] | None = None,
) -> AsyncIterator[str]:
    """The turn's events as SSE text. The opening event comes once the engine admitted the
    request, so a caller awaiting it still sees an engine that is down as an exception with its
    status; after it, errors arrive as the writer's error event. `on_finish` runs before the
    finish events go out (Responses stores the conversation there)."""
    started = False
    try:
        async for item in events:
            if isinstance(item, Admitted):
                started = True
                yield writer.start()
            elif isinstance(item, StillWorking):
                yield writer.keep_alive()
            elif isinstance(item, Delta):
                for line in writer.delta(item):
                    yield line
            else:
                if on_finish is not None:
                    await on_finish(item)
                for line in writer.finish(item):
                    yield line
    except OpenAIError as exc:
        if not started:
            raise
        yield writer.error(exc)
        return
    for line in writer.end():
        yield line


async def turn_response(
    request: Request,
    prep: PreparedTurn,
    stream: bool,
    events: Callable[[], AsyncIterator[str]],
    complete: Callable[[], Awaitable[dict[str, Any]]],
) -> Response:
    """A JSON reply, or an SSE stream whose first event is awaited here, so that an engine
    failure before the first token keeps its HTTP status."""
    requests = request.app.state.metrics.requests
    stream_label = "true" if stream else "false"
    try:
        if stream:
            lines = events()
            first = await anext(lines)
        else:
            result = await unless_disconnected(request, complete())
    except OpenAIError as exc:
        requests.labels(str(exc.status), stream_label).inc()
        raise
    except ClientGone:
        aborted(request, prep, "the client disconnected before its reply was ready")
        return Response(status_code=499)  # nobody reads it: the connection is gone
    requests.labels("200", stream_label).inc()
    if not stream:
        return JSONResponse(result, headers=prep.headers)

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
