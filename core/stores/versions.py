"""Which version of each adapter scope serves, in the shared database, for deployments of several
processes (NEXTSTATE_DATABASE_URL).

The weights stay in the adapters folder, where the engine workers read them; what moves to the
database is the pointer. The learner publishes a version here once every engine worker has it
loaded, and every serving and judging process follows this table (learner/follower.py) instead
of each scope's CURRENT file, which a shared volume (NFS) may show late and which costs a
directory walk per look. Forgetting a user is asked here too: any process may ask, the one
learner acts — it deletes the user's versions and its own state of them — and the followers
stop serving the user's adapter as soon as its row is gone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from nextstate.core.stores.base import Store

_SCHEMA = """
CREATE TABLE IF NOT EXISTS published_versions (
    scope TEXT PRIMARY KEY,
    version INTEGER NOT NULL,
    name TEXT NOT NULL,
    path TEXT NOT NULL,
    published_at {float} NOT NULL
);
CREATE TABLE IF NOT EXISTS forgotten_scopes (
    scope TEXT PRIMARY KEY,
    asked_at {float} NOT NULL
)
"""


@dataclass(frozen=True)
class Published:
    version: int
    name: str  # the engine's name for it (AdapterVersions.serving_name)
    path: str


class VersionRegistry(Store):
    SCHEMA = _SCHEMA
    PRAGMAS = ("busy_timeout=5000",)

    def publish(self, scope: str, version: int, name: str, path: str) -> None:
        self._execute(
            "INSERT INTO published_versions (scope, version, name, path, published_at) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT (scope) DO UPDATE SET version = excluded.version, name = excluded.name, "
            "path = excluded.path, published_at = excluded.published_at",
            (scope, version, name, path, time.time()),
        )

    def published(self) -> dict[str, Published]:
        rows = self._all("SELECT scope, version, name, path FROM published_versions")
        return {scope: Published(int(version), name, path) for scope, version, name, path in rows}

    def forget(self, scope: str) -> bool:
        """Stop serving `scope` everywhere and ask the learner to delete it; whether it had a
        published version."""
        with self._transaction() as db:
            had = db.execute("DELETE FROM published_versions WHERE scope = ?", (scope,)).rowcount > 0
            db.execute("INSERT INTO forgotten_scopes (scope, asked_at) VALUES (?, ?) ON CONFLICT (scope) DO NOTHING",
                       (scope, time.time()))
        return had

    def forgotten(self) -> list[str]:
        """The scopes whose forgetting was asked and not yet done (by the learner)."""
        return [scope for (scope,) in self._all("SELECT scope FROM forgotten_scopes ORDER BY asked_at")]

    def forgot(self, scope: str) -> None:
        """The learner deleted `scope`'s versions and its state of them."""
        self._execute("DELETE FROM forgotten_scopes WHERE scope = ?", (scope,))
