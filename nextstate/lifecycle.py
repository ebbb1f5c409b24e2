"""One process's life: what every nextstate process opens, in one order, and closes in reverse.

`nextstate serve`, `judge` and `learn` differ only in the parts they run (nextstate/app.py,
nextstate/workers.py). Each opens the same base through `Process` — the model checked and
converted (preflight), the engine, the chat renderer, the records, the stores — then hands it the
parts it starts, one by one. On the way out each part closes before what it was started after:
the last started closes first, the stores and records after every part that writes to them, the
engine last. A process that fails while starting closes what it had opened, in the same order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType

from nextstate.assembly import EngineFactory, open_engine, preflight, worker_name
from nextstate.core.records import RecordWriter
from nextstate.core.settings import Settings
from nextstate.core.stores.opener import Stores
from nextstate.engine.base import Engine
from nextstate.modelio.chat_template import ChatRenderer


class Process:
    """The base every process opens, and the closes of the parts it runs on top, as one stack.

    `engine=False`: no engine of its own (a learner beside the embedded engine: each serving
    process loads the versions itself). `renderer=False`: nothing here renders chats."""

    def __init__(self, settings: Settings, role: str, *, engine_factory: EngineFactory = open_engine,
                 port: int | None = None, claims_inbox: bool = False, engine: bool = True, renderer: bool = True) -> None:
        self.settings = settings
        self.worker = worker_name(role, port)  # this process, in claims on shared work
        self._engine_factory = engine_factory
        self._claims_inbox = claims_inbox
        self._wants = (engine, renderer)
        self._stack = contextlib.AsyncExitStack()
        self.model_dir: Path
        self.engine: Engine | None = None
        self.renderer: ChatRenderer | None = None
        self.records: RecordWriter
        self.stores: Stores

    async def __aenter__(self) -> Process:
        try:
            await self._open()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def _open(self) -> None:
        wants_engine, wants_renderer = self._wants
        self.model_dir = await asyncio.to_thread(preflight, self.settings)
        if wants_engine:
            self.engine = await self._engine_factory(self.model_dir, self.settings)
            self._stack.push_async_callback(self.engine.close)
        if wants_renderer:
            self.renderer = await asyncio.to_thread(ChatRenderer.from_dir, self.model_dir)
        self.records = RecordWriter(self.settings.records_dir)
        await self.records.start()
        self._stack.push_async_callback(self.records.aclose)
        self.stores = Stores(self.settings, self.worker, claims_inbox=self._claims_inbox)
        self._stack.push_async_callback(self.stores.aclose)

    @property
    def model_name(self) -> str:
        return self.settings.engine.served_model_name or self.model_dir.name

    def started(self, close: Callable[[], Awaitable[object]]) -> None:
        """A part has started: `close` runs before everything opened or started before it."""
        self._stack.push_async_callback(close)

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        await self._stack.aclose()
