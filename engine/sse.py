"""The `data:` fields of a server-sent-event stream, read straight from the body's bytes.

httpx's `aiter_lines()` decodes every chunk to text and splits it through two generator
layers; SGLang streams one small event per token, so that per-chunk work is a real share of
what the proxy spends per token. Events here are split on bytes and handed over as bytes,
which `json.loads` reads directly. Only what SGLang sends is handled: `data:` lines (events
of one line each); comments, `event:` and `id:` fields are skipped.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx


async def sse_data(response: httpx.Response) -> AsyncIterator[bytes]:
    """Each `data:` field's value, stripped, in order; a last line without its newline counts."""
    pending = b""
    async for chunk in response.aiter_bytes():
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if pending.startswith(b"data:"):
        yield pending[5:].strip()
