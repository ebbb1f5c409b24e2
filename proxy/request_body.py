"""Request bodies read defensively: bounded in size, depth and content, before any model sees them.

Every JSON body nextstate accepts goes through `read_json` (its size is bounded before, by
`body_limit.BodyLimitMiddleware`): nesting deeper than `MAX_DEPTH` and text that no later step
can encode — a lone UTF-16 surrogate (`"\\ud800"`), which JSON allows and UTF-8 does not — are
a 400 naming where they are. Later steps (pydantic, the tokenizer, the JSONL records) can then
take any string they get. (Control characters are fine in text: models write them, and
clients send our replies back; only values echoed as headers, like session ids, refuse them.) A client that disconnects while
sending its body is `ClientGone`: nobody is left to answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from nextstate.proxy.errors import invalid_request, validation_error

MAX_DEPTH = 64
# A surrogate pair in the JSON text decodes to one character outside this range, so what it
# finds is a lone surrogate.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class ClientGone(ClientDisconnect):
    """The client disconnected before its answer: there is nobody to answer."""


async def unless_disconnected(request: Request, work: Awaitable[T], poll_s: float = 0.25) -> T:
    """`work`'s result, unless the client disconnects first: then the work is cancelled (a
    reply nobody will read must not hold a decoding slot, nor be trained on) and ClientGone."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def read_json(request: Request) -> dict[str, Any]:
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise ClientGone from None
    try:
        data = json.loads(raw)
    except RecursionError:
        raise invalid_request(f"The JSON body is nested too deeply (more than {MAX_DEPTH} levels).") from None
    except (ValueError, UnicodeDecodeError):
        raise invalid_request("We could not parse the JSON body of your request. Send valid JSON.") from None
    if not isinstance(data, dict):
        raise invalid_request("The request body must be a JSON object.")
    check_values(data)
    return data


async def read_model(request: Request, model: type[M]) -> M:
    data = await read_json(request)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(list(exc.errors())) from None


def check_values(data: Any) -> None:
    """Depth and lone surrogates, without recursion (any depth is safe to check). A value's
    path is spelled out only for an error: spelling it for every value cost four times the
    parse itself on an agent's request (0.3 ms for OpenClaw's)."""
    stack: list[tuple[Any, Where, int]] = [(data, None, 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise invalid_request(
                f"The JSON body is nested too deeply (more than {MAX_DEPTH} levels).", param=_path(where) or None
            )
        if isinstance(value, dict):
            for key, item in value.items():
                if _LONE_SURROGATE.search(key):
                    _surrogate((where, key))
                stack.append((item, (where, key), depth + 1))
        elif isinstance(value, list):
            stack.extend((item, (where, i), depth + 1) for i, item in enumerate(value))
        elif isinstance(value, str) and _LONE_SURROGATE.search(value):
            _surrogate(where)


Where = tuple[Any, str | int] | None  # (the parent's Where, this key or index), None at the root


def _path(where: Where) -> str:
    keys: list[str | int] = []
    while where is not None:
        where, key = where
        keys.append(key)
    path = ""
    for key in reversed(keys):
        path = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else str(key))
    return path


def _surrogate(where: Where) -> None:
    path = _path(where)[:200].encode("utf-8", "backslashreplace").decode()  # a key may hold the surrogate
    raise invalid_request("Text must be valid Unicode: it holds a lone UTF-16 surrogate.", param=path or None)


def request_body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI for a body read with `read_model` (FastAPI cannot see it): for /docs and fuzzing.
    The model's definitions are inlined, since an OpenAPI document resolves `#/$defs/...` from
    its own root."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}
