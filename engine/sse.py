"""The `data:` fields of a server-sent-event stream, read straight from the body's bytes.

SGLang streams one small event per token, so per-chunk work is a real share of what the proxy
spends per token: events are split on bytes and handed over as bytes, which `json.loads` reads
directly, with no text decoding or line-iterator layers in between. Only what SGLang sends is
handled: `data:` lines (events of one line each); comments, `event:` and `id:` fields are
skipped.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator


async def read_sse_data(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """Each `data:` field's value, stripped, in order, from the body's chunks as they arrive
    (cut anywhere); a last line without its newline counts."""
    pending = b""
    async for chunk in chunks:
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if pending.startswith(b"data:"):
        yield pending[5:].strip()
