"""API-key authentication as FastAPI dependencies: a bearer token, or Anthropic's x-api-key."""

from __future__ import annotations

import asyncio

from fastapi import Request

from nextstate.proxy.app_state import services
from nextstate.proxy.errors import ApiError
from nextstate.core.stores.keys import ApiKey, KeyStore

_WWW = {"WWW-Authenticate": "Bearer"}


def bearer_secret(request: Request) -> str | None:
    """The key an `Authorization: Bearer <key>` header carries, if any."""
    scheme, _, secret = request.headers.get("authorization", "").partition(" ")
    return secret.strip() if scheme.lower() == "bearer" and secret.strip() else None


def request_secret(request: Request) -> str | None:
    """The key of a request: a bearer token (OpenAI's clients), or `x-api-key` (Anthropic's)."""
    return bearer_secret(request) or request.headers.get("x-api-key", "").strip() or None


async def authenticate(request: Request) -> ApiKey:
    secret = request_secret(request)
    if secret is None:
        raise ApiError(
            401,
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>' (or 'x-api-key: <key>'); "
            "create one with 'nextstate keys create --user NAME'.",
            code="missing_api_key",
            headers=_WWW,
        )
    store: KeyStore = services(request).keys
    # SQLite inline, not in a worker thread: one indexed read of a WAL database (readers never
    # wait for writers) takes ~8 µs here, the hop to a thread and back ~75 µs on every request.
    # PostgreSQL in a thread: a round trip to another machine, or to a database that is slow or
    # restarting, must not hold up the event loop (every other request, /healthz too).
    key = await asyncio.to_thread(store.verify, secret) if store.shared else store.verify(secret)
    if key is None:
        raise ApiError(401, "Incorrect or revoked API key provided.", code="invalid_api_key", headers=_WWW)
    request.state.user = key.user  # for the record of a request that is refused later
    return key


async def authenticate_admin(request: Request) -> ApiKey:
    key = await authenticate(request)
    if not key.admin:
        raise ApiError(403, "This route needs an admin key ('nextstate keys create --admin').", type="permission_error", code="admin_required")
    return key
