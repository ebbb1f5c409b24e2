"""Who was forgotten, for every process that shares the database.

`DELETE /v1/admin/users/NAME` on one serving process deletes what the database holds of the
user everywhere at once; but each process also keeps things of its own — its request records
(its data dir's files) and its copies of open sessions in memory. So the forgetting process
writes an event here, and every process purges what it alone holds of that user when it reads
the event (nextstate/forget.py, `follow_forgets`), within seconds.
"""

from __future__ import annotations

import time

from nextstate.core.stores.base import Store

_SCHEMA = """
CREATE TABLE IF NOT EXISTS forget_events (
    id {id},
    "user" TEXT NOT NULL,
    asked_at {float} NOT NULL
)
"""


class ForgetEvents(Store):
    SCHEMA = _SCHEMA

    def add(self, user: str) -> int | None:
        with self._lock:
            return self._db.insert('INSERT INTO forget_events ("user", asked_at) VALUES (?, ?)', (user, time.time()))

    def since(self, last_id: int) -> list[tuple[int, str]]:
        """The events after `last_id`, oldest first: (id, user)."""
        return [(int(i), u) for i, u in self._all('SELECT id, "user" FROM forget_events WHERE id > ? ORDER BY id', (last_id,))]

    def expire(self, before: float) -> int:
        return self._execute("DELETE FROM forget_events WHERE asked_at < ?", (before,))
