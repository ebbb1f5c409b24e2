"""What every store shares: its database, the lock its calls take turns on, and their shapes.

A connection serves one call at a time (neither sqlite3's nor psycopg's may be used from two
threads at once), and the server calls its stores from many (`asyncio.to_thread`): so each
call takes the store's lock for as long as it talks to the database. A call that reads and
then writes takes `_transaction()`, the lock and the database's write transaction together.
Stores differ only in their tables and what they do with them; each opens its database here.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar

from nextstate.core.stores.database import Database


class Store:
    """A store owning some tables, in the SQLite file at `path` or, with `database_url`, in
    PostgreSQL (shared by every nextstate process that names it)."""

    SCHEMA: ClassVar[str]  # CREATE ... IF NOT EXISTS statements (core/stores/database.py's dialect)
    PRAGMAS: ClassVar[tuple[str, ...]] = ()  # SQLite's, e.g. synchronous=NORMAL

    def __init__(self, path: Path, database_url: str | None = None) -> None:
        self._db = Database.open(path, self._schema(database_url), *self.PRAGMAS, url=database_url)
        self._lock = threading.Lock()
        self._upgrade()

    def _schema(self, database_url: str | None) -> str:
        return self.SCHEMA

    def _upgrade(self) -> None:
        """Bring a database an older version wrote up to date (columns added since, indexes)."""

    @property
    def shared(self) -> bool:
        """Whether other processes see this store's rows (PostgreSQL)."""
        return self._db.dialect == "postgres"

    def _one(self, sql: str, params: Iterable[Any] = ()) -> tuple | None:
        with self._lock:
            return self._db.execute(sql, params).fetchone()

    def _all(self, sql: str, params: Iterable[Any] = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    def _execute(self, sql: str, params: Iterable[Any] = ()) -> int:
        """One statement that writes; the rows it changed."""
        with self._lock:
            return self._db.execute(sql, params).rowcount

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[Database]:
        with self._lock, self._db.transaction():
            yield self._db

    def _delete_user_rows(self, *statements: tuple[str, Iterable[Any]]) -> int:
        """Forget: the DELETEs in one transaction, then no copy left in the files; the rows the
        first one removed."""
        with self._lock:
            with self._db.transaction():
                counts = [self._db.execute(sql, params).rowcount for sql, params in statements]
            self._db.scrub()
        return counts[0] if counts else 0

    def ping(self) -> None:
        """One round trip to the database; raises if it cannot be reached."""
        with self._lock:
            self._db.ping()

    def close(self) -> None:
        with self._lock:
            self._db.close()
