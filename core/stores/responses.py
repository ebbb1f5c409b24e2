"""Stored responses, so that `previous_response_id` continues a conversation the client did
not resend.

Each stored response is its whole conversation in chat shape (without the instructions, which
OpenAI does not carry over either) ending with the reply, under (user, response id): another
user's id is simply not found. Stored in the data dir's `responses.sqlite3`, or in PostgreSQL
(NEXTSTATE_DATABASE_URL), where any nextstate process finds a response another one stored;
forgetting a user and the retention period delete them like the rest of a user's data. Each
user has a quota (NEXTSTATE_STORED_RESPONSES_MAX, _MAX_MB): past it, their oldest go first.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from nextstate.core.stores.base import Store

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    "user" TEXT NOT NULL,
    id TEXT NOT NULL,
    created_at {float} NOT NULL,
    messages TEXT NOT NULL,
    response TEXT,
    input_items TEXT,
    PRIMARY KEY ("user", id)
);
"""


# The stored size of a row, in characters of its JSON (what a per-user quota counts).
_SIZE = "LENGTH(messages) + COALESCE(LENGTH(response), 0) + COALESCE(LENGTH(input_items), 0)"


class ResponseStore(Store):
    SCHEMA = _SCHEMA
    PRAGMAS = ("synchronous=NORMAL",)

    def __init__(self, path: Path, database_url: str | None = None, max_per_user: int | None = None,
                 max_bytes_per_user: int | None = None) -> None:
        """`max_per_user`, `max_bytes_per_user`: each user's quota (None: none); past either, a
        save deletes that user's oldest responses."""
        self.max_per_user = max_per_user
        self.max_bytes_per_user = max_bytes_per_user
        super().__init__(path, database_url)

    def _upgrade(self) -> None:
        # the Response object as it was returned (GET /v1/responses/{id}) and this request's own
        # input items (…/input_items); rows stored before these columns existed have neither
        self._db.add_missing_columns("responses", {"response": "TEXT", "input_items": "TEXT"})

    def save(self, user: str, response_id: str, messages: list[dict[str, Any]],
             response: dict[str, Any] | None = None, input_items: list[dict[str, Any]] | None = None) -> None:
        with self._transaction() as db:
            db.execute(
                'INSERT INTO responses ("user", id, created_at, messages, response, input_items) VALUES (?, ?, ?, ?, ?, ?) '
                'ON CONFLICT ("user", id) DO UPDATE SET created_at = excluded.created_at, messages = excluded.messages, '
                "response = excluded.response, input_items = excluded.input_items",
                (user, response_id, time.time(), json.dumps(messages, ensure_ascii=False),
                 None if response is None else json.dumps(response, ensure_ascii=False),
                 None if input_items is None else json.dumps(input_items, ensure_ascii=False)),
            )
            self._keep_to_quota(db, user)

    def _keep_to_quota(self, db: Any, user: str) -> None:
        """Delete `user`'s oldest responses past their quota (count and size), the newest kept."""
        if self.max_per_user is None and self.max_bytes_per_user is None:
            return
        count, size = db.execute(f'SELECT COUNT(*), SUM({_SIZE}) FROM responses WHERE "user" = ?', (user,)).fetchone()
        most_count, most_bytes = self.max_per_user or count, self.max_bytes_per_user or (size or 0)
        if count <= most_count and (size or 0) <= most_bytes:
            return
        kept, total, gone = 0, 0, []
        for response_id, row_size in db.execute(
                f'SELECT id, {_SIZE} FROM responses WHERE "user" = ? ORDER BY created_at DESC, id DESC', (user,)).fetchall():
            kept, total = kept + 1, total + row_size
            if kept > most_count or (total > most_bytes and kept > 1):  # the newest stays, however large
                gone.append(response_id)
        db.executemany('DELETE FROM responses WHERE "user" = ? AND id = ?', [(user, i) for i in gone])

    def response(self, user: str, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """The stored Response object and its input items, or None (unknown, or another user's)."""
        row = self._one('SELECT response, input_items FROM responses WHERE "user" = ? AND id = ?', (user, response_id))
        if row is None or row[0] is None:
            return None
        return json.loads(row[0]), json.loads(row[1] or "[]")

    def delete(self, user: str, response_id: str) -> bool:
        return self._delete_user_rows(('DELETE FROM responses WHERE "user" = ? AND id = ?', (user, response_id))) > 0

    def conversation(self, user: str, response_id: str) -> list[dict[str, Any]] | None:
        row = self._one('SELECT messages FROM responses WHERE "user" = ? AND id = ?', (user, response_id))
        return None if row is None else json.loads(row[0])

    def forget(self, user: str) -> int:
        return self._delete_user_rows(('DELETE FROM responses WHERE "user" = ?', (user,)))

    def expire(self, cutoff: float) -> int:
        return self._execute("DELETE FROM responses WHERE created_at < ?", (cutoff,))
