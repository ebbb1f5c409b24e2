"""Every store of a process, from the settings: where each keeps its rows is named here once.

Each process opens what it uses and no more (`nextstate learn` never opens the keys; `nextstate
forget`, offline, opens each store for a moment), so a store is opened on first use, and one
`aclose` closes whatever was opened, in the reverse order. With NEXTSTATE_DATABASE_URL every
store keeps its rows in that one PostgreSQL database, each on a connection of its own (a slow
read of the samples never holds up a request's key check); without it, each has its SQLite file
in the data dir, and what only matters across processes (rate windows, replies in flight,
dashboard sign-ins, published versions) stays in this process's memory or adapters folder.
"""

from __future__ import annotations

import asyncio
import logging
from functools import cached_property
from pathlib import Path

from nextstate.core.settings import Settings
from nextstate.core.stores.base import Store
from nextstate.core.stores.dashboard_sessions import DashboardSessions
from nextstate.core.stores.forget_events import ForgetEvents
from nextstate.core.stores.keys import KeyStore
from nextstate.core.stores.parallel_slots import LocalSlots, SharedSlots, Slots
from nextstate.core.stores.rate_windows import MemoryWindows, SharedWindows, Windows
from nextstate.core.stores.responses import ResponseStore
from nextstate.core.stores.samples import HoldOut, SampleStore
from nextstate.core.stores.sessions import SessionDB
from nextstate.core.stores.versions import VersionRegistry

log = logging.getLogger(__name__)

# Each store's SQLite file in the data dir (unused with a database URL).
FILES = {
    "keys": "nextstate.sqlite3",
    "samples": "samples.sqlite3",
    "sessions": "sessions.sqlite3",
    "responses": "responses.sqlite3",
    "versions": "versions.sqlite3",
    "windows": "rates.sqlite3",
    "slots": "running.sqlite3",
    "forget_events": "forgotten.sqlite3",
}
# The order they are closed in: what holds the others' rows in flight first.
_CLOSE_ORDER = ("slots", "dashboard_sessions", "windows", "responses", "sessions", "samples", "versions", "forget_events",
                "keys")


class Stores:
    """The stores of one process. `worker` names the process in what it claims or leases in a
    shared database; `claims_inbox`: its sample store takes transitions to judge under that
    name (a serving process that leaves judging to `nextstate judge` writes them unclaimed)."""

    def __init__(self, settings: Settings, worker: str = "", claims_inbox: bool = False) -> None:
        self.settings = settings
        self.worker = worker
        self.claims_inbox = claims_inbox
        self.url = settings.server.database_url

    def path(self, name: str) -> Path:
        """The SQLite file a store keeps its rows in (FILES)."""
        return self.settings.data_dir / FILES[name]

    @cached_property
    def keys(self) -> KeyStore:
        return KeyStore(self.path("keys"), self.url, cache_s=self.settings.server.key_cache_s)

    @cached_property
    def samples(self) -> SampleStore:
        learner = self.settings.learner
        return SampleStore(self.path("samples"), self.url, worker=self.worker if self.claims_inbox else "",
                           hold_out=HoldOut(learner.held_out_every, learner.held_out_max))

    @cached_property
    def sessions(self) -> SessionDB:
        return SessionDB(self.path("sessions"), self.url)

    @cached_property
    def responses(self) -> ResponseStore:
        server = self.settings.server
        return ResponseStore(self.path("responses"), self.url, max_per_user=server.stored_responses_max,
                             max_bytes_per_user=int(server.stored_responses_max_mb * 2**20))

    @cached_property
    def versions(self) -> VersionRegistry | None:
        """Each scope's serving version, where several processes share a database (one
        process alone reads the adapters folder's files instead)."""
        return VersionRegistry(self.path("versions"), self.url) if self.url else None

    @cached_property
    def forget_events(self) -> ForgetEvents | None:
        """Who was forgotten, for the other processes on one database (each purges what it
        alone holds); one process alone forgets everything itself."""
        return ForgetEvents(self.path("forget_events"), self.url) if self.url else None

    @cached_property
    def windows(self) -> Windows:
        """Rate-limit windows: several serving processes on one database count together."""
        return SharedWindows(self.path("windows"), self.url) if self.url else MemoryWindows()

    @cached_property
    def slots(self) -> Slots:
        """Replies in flight per user, across the processes on one database."""
        return SharedSlots(self.path("slots"), self.url, self.worker) if self.url else LocalSlots()

    @cached_property
    def dashboard_sessions(self) -> DashboardSessions:
        return DashboardSessions(database_url=self.url, attempts=self.windows)

    def opened(self) -> list[str]:
        return [name for name in _CLOSE_ORDER if name in self.__dict__]

    async def aclose(self) -> None:
        """Close every store opened, each once, however the others fared."""
        for name in self.opened():
            store = self.__dict__.pop(name)
            try:
                if isinstance(store, SharedSlots):
                    await store.aclose()  # gives back this process's slots first
                elif isinstance(store, (Store, DashboardSessions)):
                    await asyncio.to_thread(store.close)
            except Exception:  # noqa: BLE001 - the others still close
                log.exception("could not close the %s store", name)

    def close(self) -> None:
        """`aclose` for code with no event loop running (the command line)."""
        asyncio.run(self.aclose())
