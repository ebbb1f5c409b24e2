"""A ceiling on request bodies, for every route, before anything reads them.

A 100 MB body once held the server for 300 s and 13 GB. This ASGI middleware refuses a body
whose Content-Length is over the limit before the app sees the request, and counts the bytes
of a body sent without one (chunked): past the limit, reading it fails with a 413 in OpenAI's
shape, so nothing ever holds more than the limit in memory.
"""

from __future__ import annotations

from typing import Any

from nextstate.proxy.errors import ANTHROPIC_ROUTES, ApiError


def too_large(limit: int) -> ApiError:
    return ApiError(
        413, f"The request body is larger than this server accepts ({limit} bytes; NEXTSTATE_MAX_BODY_BYTES).",
        code="request_too_large",
    )


class BodyLimitMiddleware:
    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            anthropic = str(scope.get("path", "")).startswith(ANTHROPIC_ROUTES)
            await too_large(self.max_bytes).response(anthropic)(scope, receive, send)
            return
        received = 0

        async def counted() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise too_large(self.max_bytes)
            return message

        await self.app(scope, counted, send)
