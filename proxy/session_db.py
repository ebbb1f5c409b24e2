"""Open sessions on disk (SQLite in the data dir), so a restart continues every conversation.

Each session is one row holding its main line, its pending turn and its provisional transition
as JSON. Writes are ordered and happen on one background thread: a request never waits for the
disk, and the last state written is always the newest. `flush()` waits for the queue to drain
(shutdown and tests).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import queue
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nextstate.core.sqlite_store import open_sqlite, scrub

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    user TEXT NOT NULL,
    id TEXT NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (user, id)
);
"""


class SessionDB:
    def __init__(self, path: Path) -> None:
        self._conn = open_sqlite(path, _SCHEMA, "synchronous=NORMAL")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="nextstate-sessions", daemon=True)
        self._thread.start()

    def load(self) -> Iterator[dict[str, Any]]:
        for (data,) in self._conn.execute("SELECT data FROM sessions ORDER BY rowid").fetchall():
            yield json.loads(data)

    def save(self, user: str, session_id: str, data: str) -> None:
        """Queue `data` (the session's JSON text) as the session's row."""
        self._put(("save", user, session_id, data))

    def delete(self, user: str, session_id: str) -> None:
        self._put(("delete", user, session_id, None))

    def forget(self, user: str) -> None:
        self._put(("forget", user, None, None))

    def _put(self, item: tuple) -> None:
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._queue.put(item)

    def written(self) -> concurrent.futures.Future:
        """Done once every write queued so far is committed: a request awaits this (one
        wake-up from the writer thread) rather than a thread of its own blocking in flush()."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("barrier", None, None, done))
        return done

    def flush(self, timeout: float = 30.0) -> bool:
        return self._idle.wait(timeout)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join(10)
        self._conn.close()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            op, user, session_id, data = item
            try:
                if op == "barrier":
                    if data.set_running_or_notify_cancel():  # False: the waiter gave up
                        data.set_result(None)
                elif op == "save":
                    self._conn.execute(
                        "INSERT INTO sessions (user, id, data) VALUES (?, ?, ?) "
                        "ON CONFLICT (user, id) DO UPDATE SET data = excluded.data",
                        (user, session_id, data),
                    )
                elif op == "forget":
                    self._conn.execute("DELETE FROM sessions WHERE user = ?", (user,))
                    scrub(self._conn)
                else:
                    self._conn.execute("DELETE FROM sessions WHERE user = ? AND id = ?", (user, session_id))
            except sqlite3.Error:
                log.exception("could not persist session %s of %s", session_id, user)
            with self._lock:
                self._pending -= 1
                if self._pending == 0:
                    self._idle.set()
