"""Open sessions on disk, so a restart continues every conversation: a SQLite file in the data
dir, or PostgreSQL (NEXTSTATE_DATABASE_URL), where every serving process shares them.

Each session is one row holding its main line, its pending turn and its provisional transition
as JSON. Writes are ordered and happen on one background thread: a request never waits for the
disk, and the last state written is always the newest. `written()` resolves once the queue
before it is committed (a reply ends after that, so the next request finds its turn wherever
it lands).

Shared (PostgreSQL), a row also carries what lets several processes hold copies of it:
* `rev`, a random token per write; a process writes only over the revision it read, so a copy
  that fell behind (another process took the conversation's last turn) never overwrites the
  newer row — it notices at its next request and reads the row again (`revisions`).
* `session_index`: the chain hashes of each session's line (user-seeded, so globally unique),
  for finding a conversation that arrives without a session id at any process.
* `active_at` and a closing lease (`closer`, `close_until`): an idle session is closed by the
  one process that claims it, and a closer that dies leaves it to the next (`claim_idle`).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nextstate.core.stores.base import Store

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    "user" TEXT NOT NULL,
    id TEXT NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY ("user", id)
);
CREATE TABLE IF NOT EXISTS session_index (
    hash TEXT PRIMARY KEY,
    "user" TEXT NOT NULL,
    id TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS session_index_session ON session_index ("user", id);
"""
# added after the first release: an older file opens with them
_LATER_COLUMNS = {"rev": "TEXT", "active_at": "{float} NOT NULL DEFAULT 0", "closer": "TEXT", "close_until": "{float}"}

# How long a process that claimed an idle session may take to close it before another may.
CLOSE_LEASE_S = 120.0


@dataclass
class Write:
    """One session row to write. `prev`: the revision it replaces (None: a new row); `done`
    is called on the writer thread with whether the row was written (False: another process
    wrote the session meanwhile, or closed it)."""

    user: str
    id: str
    data: str
    rev: str | None = None
    prev: str | None = None
    active_at: float = field(default_factory=time.time)
    hashes: tuple[str, ...] = ()
    done: Callable[[bool], None] | None = None


class SessionDB(Store):
    """Open sessions: written by one writer thread in the order they were queued, read by the
    server's threads (they share the store's connection and its lock)."""

    SCHEMA = _SCHEMA
    PRAGMAS = ("synchronous=NORMAL",)

    def __init__(self, path: Path, database_url: str | None = None) -> None:
        super().__init__(path, database_url)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._count_lock = threading.Lock()
        self._thread = threading.Thread(target=self._write_queued, name="nextstate-sessions", daemon=True)
        self._thread.start()

    def _upgrade(self) -> None:
        self._db.add_missing_columns("sessions", _LATER_COLUMNS)

    # ------------------------------------------------------------------ reads

    def load(self, user: str | None = None) -> Iterator[dict[str, Any]]:
        """Every open session (of `user`), least recently active first."""
        where, params = ('WHERE "user" = ?', (user,)) if user is not None else ("", ())
        for data, rev in self._all(f"SELECT data, rev FROM sessions {where} ORDER BY active_at", params):
            yield dict(json.loads(data), rev=rev)

    def changed(self, user: str, hashes: Iterable[str], ids: Iterable[str], every: bool,
                known: dict[str, str | None]) -> tuple[dict[str, str | None], list[dict[str, Any]]]:
        """`revisions`, with the rows of those whose revision is not the one `known` (a copy's),
        in one round trip (shared sessions: PostgreSQL)."""
        where, params = self._candidates(user, hashes, ids, every)
        if where is None:
            return {}, []
        rows = self._all(
            "SELECT s.id, s.rev, CASE WHEN k.rev IS NOT DISTINCT FROM s.rev THEN NULL ELSE s.data END "
            "FROM sessions s LEFT JOIN unnest(?::text[], ?::text[]) AS k(id, rev) ON k.id = s.id "
            f'WHERE s."user" = ? AND ({where})',
            [list(known), list(known.values()), user, *params],
        )
        return ({i: rev for i, rev, _ in rows},
                [dict(json.loads(data), rev=rev) for _, rev, data in rows if data is not None])

    def _candidates(self, user: str, hashes: Iterable[str], ids: Iterable[str], every: bool) -> tuple[str | None, list]:
        """The condition naming `user`'s sessions in `ids` or whose line holds one of `hashes`
        (or `every` one), and its parameters; None when it names none."""
        hashes, ids = list(hashes), list(ids)
        conditions: list[str] = ["TRUE"] if every else []
        params: list = []
        if ids:
            conditions.append(f"s.id IN ({','.join('?' * len(ids))})")
            params += ids
        if hashes:
            conditions.append(
                f's.id IN (SELECT id FROM session_index WHERE "user" = ? AND hash IN ({",".join("?" * len(hashes))}))'
            )
            params += [user, *hashes]
        return (" OR ".join(conditions) if conditions else None), params

    def revisions(self, user: str, hashes: Iterable[str] = (), ids: Iterable[str] = (), every: bool = False) -> dict[str, str | None]:
        """The revision of each open session of `user` named in `ids` or whose line holds one
        of `hashes` (a request's chain), or of `every` one: what a process compares its copies
        with."""
        where, params = self._candidates(user, hashes, ids, every)
        if where is None:
            return {}
        return dict(self._all(f'SELECT s.id, s.rev FROM sessions s WHERE s."user" = ? AND ({where})', [user, *params]))

    def claim_idle(self, active_before: float, worker: str, max_per_user: int | None = None,
                   max_sessions: int | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """Take the closing of the sessions to close — nobody used them since `active_before`
        (wall clock), or their user holds more than `max_per_user` (all users more than
        `max_sessions`) and they are the least recent — that no live process is closing
        already; their rows, which the claimer closes and deletes."""
        now = time.time()
        free = "(closer IS NULL OR close_until < ?)"
        with self._transaction() as db:
            # the lease is checked again on the row itself: a process that waited for another's
            # claim of the same row sees it taken (PostgreSQL re-reads an updated row)
            rows = db.execute(
                f'UPDATE sessions SET closer = ?, close_until = ? WHERE {free} AND ("user", id) IN ('
                'SELECT "user", id FROM (SELECT "user", id, active_at, closer, close_until, '
                'ROW_NUMBER() OVER (PARTITION BY "user" ORDER BY active_at DESC) AS nth_of_user, '
                "ROW_NUMBER() OVER (ORDER BY active_at DESC) AS nth FROM sessions) ranked "
                f"WHERE (active_at < ? OR nth_of_user > ? OR nth > ?) AND {free} ORDER BY active_at LIMIT ?"
                ") RETURNING data, rev",
                (worker, now + CLOSE_LEASE_S, now, active_before, max_per_user or 2**62, max_sessions or 2**62, now, limit),
            ).fetchall()
        return [dict(json.loads(data), rev=rev) for data, rev in rows]

    # ------------------------------------------------------------------ writes (queued)

    def save(self, write: Write) -> None:
        """Queue a session's row (its JSON text in `write.data`)."""
        self._put(("save", write))

    def delete(self, user: str, session_id: str) -> None:
        self._put(("delete", (user, session_id)))

    def forget(self, user: str) -> None:
        self._put(("forget", user))

    def _put(self, item: tuple) -> None:
        with self._count_lock:
            self._pending += 1
            self._idle.clear()
        self._queue.put(item)

    def written(self) -> concurrent.futures.Future:
        """Done once every write queued so far is committed: a request awaits this (one
        wake-up from the writer thread) rather than a thread of its own blocking in flush()."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("barrier", done))
        return done

    def flush(self, timeout: float = 30.0) -> bool:
        return self._idle.wait(timeout)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join(10)
        super().close()

    def _write_queued(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            op, arg = item
            try:
                if op == "barrier":
                    if arg.set_running_or_notify_cancel():  # False: the waiter gave up
                        arg.set_result(None)
                else:
                    with self._lock:
                        getattr(self, "_" + op)(arg)
            except Exception:  # noqa: BLE001 - a lost write is logged, the writer goes on
                log.exception("could not persist the sessions (%s)", op)
            with self._count_lock:
                self._pending -= 1
                if self._pending == 0:
                    self._idle.set()

    def _save(self, w: Write) -> None:
        if not self.shared:
            self._db.execute(
                'INSERT INTO sessions ("user", id, data, rev, active_at) VALUES (?, ?, ?, ?, ?) '
                'ON CONFLICT ("user", id) DO UPDATE SET data = excluded.data, rev = excluded.rev, active_at = excluded.active_at',
                (w.user, w.id, w.data, w.rev, w.active_at),
            )
            written = True
        else:
            # one statement, one round trip: the row (over the revision read, or new) and, if it
            # was written, its new hashes in the index (PostgreSQL runs both in one snapshot)
            row = ('INSERT INTO sessions ("user", id, data, rev, active_at) VALUES (?, ?, ?, ?, ?) '
                   'ON CONFLICT ("user", id) DO NOTHING RETURNING id') if w.prev is None else (
                   'UPDATE sessions SET data = ?, rev = ?, active_at = ? WHERE "user" = ? AND id = ? AND rev = ? RETURNING id')
            params = (w.user, w.id, w.data, w.rev, w.active_at) if w.prev is None else (
                w.data, w.rev, w.active_at, w.user, w.id, w.prev)
            (written,) = self._db.execute(
                f"WITH written AS ({row}), indexed AS ("
                'INSERT INTO session_index (hash, "user", id) SELECT h, ?, ? FROM unnest(?::text[]) AS h '
                "WHERE EXISTS (SELECT 1 FROM written) ON CONFLICT (hash) DO UPDATE SET id = excluded.id RETURNING 1"
                ") SELECT EXISTS (SELECT 1 FROM written)",
                (*params, w.user, w.id, list(w.hashes)),
            ).fetchone()
            if not written:
                log.warning("session %s of %s was changed by another process since this one read it; "
                            "its change here is dropped and the session read again", w.id, w.user)
        if w.done is not None:
            w.done(written)

    def _delete(self, key: tuple[str, str]) -> None:
        with self._db.transaction():
            self._db.execute('DELETE FROM sessions WHERE "user" = ? AND id = ?', key)
            self._db.execute('DELETE FROM session_index WHERE "user" = ? AND id = ?', key)

    def _forget(self, user: str) -> None:
        with self._db.transaction():
            self._db.execute('DELETE FROM sessions WHERE "user" = ?', (user,))
            self._db.execute('DELETE FROM session_index WHERE "user" = ?', (user,))
        self._db.scrub()
