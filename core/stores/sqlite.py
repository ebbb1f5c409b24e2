"""How every SQLite file in the data dir is opened and grown, in one place.

The keys, the samples, the open sessions and the stored Responses each live in their own file, shared by the server's
threads (one connection, autocommit, the caller's own lock) and readable by `nextstate status`
or `forget` while the server writes (write-ahead log). Tables only ever gain columns, so a data
dir written by an older version opens with the new ones added.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path


def open_sqlite(path: Path, schema: str, *pragmas: str) -> sqlite3.Connection:
    """A connection in WAL mode with `schema` applied; `pragmas` are extra `PRAGMA` settings.

    `secure_delete`: a deleted row's bytes are overwritten, not left in a free page where a
    copy of the file would still hold a forgotten user's text (see `scrub`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    for pragma in ("journal_mode=WAL", "secure_delete=ON", *pragmas):
        conn.execute(f"PRAGMA {pragma}")
    conn.executescript(schema)
    return conn


def scrub(conn: sqlite3.Connection) -> None:
    """After deleting a user's rows: copy the write-ahead log into the database and empty it.
    Until then the log keeps the pages as they were before the delete — the user's text — for
    as long as no checkpoint happens to run."""
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def add_missing_columns(conn: sqlite3.Connection, table: str, columns: dict[str, str]) -> list[str]:
    """Add each column (name: SQL type) that `table` lacks; returns those added."""
    present = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
    added = [column for column in columns if column.strip('"') not in present]  # a name may come quoted ("user")
    for column in added:
        conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {columns[column]}")
    return added
