"""Every error leaves in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, or,
under Anthropic's routes (/v1/messages), in Anthropic's: {"type": "error", "error": {"type",
"message"}}. One exception type, `ApiError`, carries an error to whichever shape its route
speaks (admin and feedback routes answer in OpenAI's).

Clients written against OpenAI or Anthropic (the official SDKs among them) parse their shape to
raise the right exception class, so a 500 with a stack trace or FastAPI's own `{"detail": ...}`
would surface as an unhelpful error in the user's agent.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from nextstate.engine.base import EngineError

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered to the client: its HTTP status and OpenAI's fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, anthropic: bool = False) -> JSONResponse:
        body = self.anthropic_body() if anthropic else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


# Anthropic's error types by HTTP status (docs.anthropic.com, "Errors").
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
}
ANTHROPIC_ROUTES = "/v1/messages"


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def server_error() -> ApiError:
    """nextstate's own failure (a bug): said plainly, the details left to the server's log."""
    return ApiError(500, "The server had an error while processing your request.", type="server_error")


def engine_error(exc: EngineError) -> ApiError:
    """The engine's failure as the client should see it: 502/503/504 for an engine that is
    down, slow or broken (retry later), 400 for a request it refused."""
    status = exc.http_status
    if status >= 500:
        return ApiError(status, f"The model server failed: {exc}", type="server_error", code="engine_error")
    return ApiError(status, f"The model server refused the request: {exc}", code="engine_rejected")


def _param_from_loc(loc: tuple) -> str | None:
    parts = [p for p in loc if p not in ("body", "query", "header", "path")]
    # Pydantic adds the matched union member's name (e.g. "str", "list[...]"); drop it.
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool"}):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out or None


def validation_error(errors: list) -> ApiError:
    """One OpenAI-style 400 from pydantic's error list, naming the offending parameter."""
    # A union reports one failure per member; the custom check (value_error) says what is wrong,
    # and otherwise the member that got furthest into the value (`input` as a list of items
    # failing at input[0].role, not `input` as a string failing at once).
    errors = sorted(errors, key=lambda e: (e.get("type") != "value_error", -len(e.get("loc", ()))))
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return invalid_request("We could not parse the JSON body of your request. Send valid JSON.")
    param = _param_from_loc(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        msg = f"Missing required parameter: '{param}'."
    elif param:
        msg = f"Invalid value for '{param}': {msg}"
    return invalid_request(msg, param=param)


_STATUS_TYPES = {401: "invalid_request_error", 403: "permission_error", 404: "invalid_request_error", 405: "invalid_request_error"}


def refused(request: Request, error: ApiError) -> JSONResponse:
    """The error response, after recording the refusal (a record and a /metrics count): a
    request nextstate turned down must be as visible to the operator as one it served."""
    state = getattr(request.app.state, "services", None)  # None before the lifespan built it
    if state is not None:
        state.metrics.refused.labels(str(error.status), error.code or error.type).inc()
        state.records.write(
            "refused",
            {
                "method": request.method, "path": request.url.path, "user": getattr(request.state, "user", None),
                "status": error.status, "code": error.code, "param": error.param, "message": error.message[:500],
            },
        )
    return error.response(anthropic=request.url.path.startswith(ANTHROPIC_ROUTES))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _openai_error(request: Request, exc: ApiError) -> JSONResponse:
        return refused(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return refused(request, validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = _STATUS_TYPES.get(exc.status_code, "server_error" if exc.status_code >= 500 else "invalid_request_error")
        code = "not_found" if exc.status_code == 404 else None
        return refused(request, ApiError(exc.status_code, str(exc.detail), type=kind, code=code, headers=exc.headers))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: Exception) -> Response:
        # The client hung up while sending its request: one line, no traceback, nobody to answer.
        log.info("client disconnected during %s %s", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return refused(request, server_error())
