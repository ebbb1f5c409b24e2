"""One control flow for every API's stream of a turn; each API supplies only its events' shapes.

Every API streams a turn the same way — an opening event once the engine admitted the request,
keep-alives while a long prompt is prefilled, deltas, the finish, and after the opening event
errors as an error event — and differs only in the events' shapes: `stream_turn` holds the
control flow once, each API's `StreamWriter` the shapes.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from nextstate.core.policy import PolicyRef
from nextstate.proxy.decode import Admitted, Delta, Finished, StillWorking, TurnEvent
from nextstate.proxy.errors import ApiError, server_error

log = logging.getLogger(__name__)


class StreamWriter(Protocol):
    """One API's server-sent events for one reply."""

    def start(self, policy: PolicyRef) -> str: ...  # the opening event(s), once the engine admitted the turn
    def keep_alive(self) -> str: ...
    def delta(self, delta: Delta) -> list[str]: ...
    def finish(self, done: Finished) -> list[str]: ...
    def error(self, exc: ApiError) -> str: ...
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
                yield writer.start(item.policy)
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
    except ApiError as exc:
        if not started:
            raise
        yield writer.error(exc)
        return
    except Exception:
        # A bug past the opening event (the turn's own failures arrive as ApiError): the client
        # gets an error event instead of a stream cut without a word, and the log the traceback.
        if not started:
            raise
        log.exception("a stream failed after it started")
        yield writer.error(server_error())
        return
    for line in writer.end():
        yield line
