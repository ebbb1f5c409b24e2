"""The server's outgoing HTTP connections (to SGLang, to a judge endpoint): one aiohttp session
each, made on first use.

An aiohttp session belongs to the event loop it was made in, and the engine and the judge client
are built before the server's loop runs; made lazily, the session is made inside that loop. A
closed one is made again, so close() is safe to call at any time.
"""

from __future__ import annotations

from typing import Any

import aiohttp


class LazySession:
    def __init__(self, *, connection_limit: int = 100, **options: Any) -> None:
        """`options` go to aiohttp.ClientSession; `connection_limit` to its connector (0: none)."""
        self._limit = connection_limit
        self._options = options
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self._limit), **self._options)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
