"""Every error leaves in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Clients written against OpenAI (the official SDKs among them) parse this shape to raise the
right exception class, so a 500 with a stack trace or FastAPI's own `{"detail": ...}` would
surface as an unhelpful error in the user's agent.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class OpenAIError(Exception):
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

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


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


def validation_error(errors: list) -> OpenAIError:
    """One OpenAI-style 400 from pydantic's error list, naming the offending parameter."""
    # A union reports one failure per member; the custom check (value_error) says what is wrong.
    errors = sorted(errors, key=lambda e: e.get("type") != "value_error")
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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = _STATUS_TYPES.get(exc.status_code, "server_error" if exc.status_code >= 500 else "invalid_request_error")
        code = "not_found" if exc.status_code == 404 else None
        return OpenAIError(exc.status_code, str(exc.detail), type=kind, code=code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return OpenAIError(500, "The server had an error while processing your request.", type="server_error").response()
