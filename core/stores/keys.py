"""Per-user API keys, kept only as SHA-256 hashes, in the data dir's SQLite file or in
PostgreSQL (NEXTSTATE_DATABASE_URL), where every nextstate process checks the same keys.

A key is shown once, at creation. Keys are 256-bit random tokens, so a plain SHA-256 (no
slow KDF) is enough to make a stolen database useless, and lets a request be checked with one
indexed lookup. A revoked key stops working at once, even when `nextstate keys revoke` runs in
another process: on SQLite the server reads the table on every request; on PostgreSQL a key
verified lately is answered from memory while every change to a key is announced to every
process (core/stores/key_cache.py), so a slow database does not hold up every request.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from nextstate.core.stores.base import Store
from nextstate.core.stores.key_cache import CHANNEL, KeyCache

KEY_PREFIX = "ns-"
# Sent in the transaction that changes a key: every process's cache hears it when that commits.
_NOTIFY = f"SELECT pg_notify('{CHANNEL}', '')"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    "user" TEXT NOT NULL,
    key_hash TEXT NOT NULL UNIQUE,
    hint TEXT NOT NULL,
    admin INTEGER NOT NULL DEFAULT 0,
    created_at {float} NOT NULL,
    revoked_at {float},
    rpm INTEGER,
    tpm INTEGER,
    user_since {float}
);
"""
# Columns added since the first release, with their type: added to an older database on open.
_ADDED_COLUMNS = {"rpm": "INTEGER", "tpm": "INTEGER", "user_since": "{float}"}


@dataclass(frozen=True)
class ApiKey:
    id: str
    user: str
    hint: str  # first characters of the key, enough to recognise it in a list
    admin: bool
    created_at: float
    revoked_at: float | None
    rpm: int | None = None  # requests per minute; None: no limit
    tpm: int | None = None  # tokens per minute; None: no limit
    # When this user name got its first key: a name forgotten (every key deleted) and given a
    # new key is a new user, whose prefix-cache partition the old one's entries are not in.
    user_since: float | None = None

    @property
    def active(self) -> bool:
        return self.revoked_at is None


# The columns an ApiKey is read from, in its fields' order (`_key`).
_KEY_COLUMNS = 'id, "user", hint, admin, created_at, revoked_at, rpm, tpm, user_since'


def _key(row: tuple) -> ApiKey:
    return ApiKey(row[0], row[1], row[2], bool(row[3]), row[4], row[5], row[6], row[7], row[8])


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class KeyStore(Store):
    SCHEMA = _SCHEMA
    PRAGMAS = ("busy_timeout=5000",)

    def __init__(self, path: Path, database_url: str | None = None, cache_s: float = 0.0) -> None:
        """`cache_s`: on PostgreSQL, how long a verified key is answered from memory (0: never)."""
        super().__init__(path, database_url)
        self._cache: KeyCache[ApiKey] | None = KeyCache(database_url, cache_s) if self.shared and cache_s > 0 else None

    def _announce(self, db) -> None:
        """Tell every process's key cache, when the transaction commits, that a key changed."""
        if self.shared:
            db.execute(_NOTIFY)

    def _upgrade(self) -> None:
        if "user_since" in self._db.add_missing_columns("api_keys", _ADDED_COLUMNS):
            self._db.execute('UPDATE api_keys SET user_since = (SELECT MIN(k.created_at) FROM api_keys k '
                             'WHERE k."user" = api_keys."user")')

    def create(self, user: str, admin: bool = False, rpm: int | None = None, tpm: int | None = None) -> tuple[ApiKey, str]:
        user = user.strip()
        if not user or len(user) > 100 or any(c.isspace() for c in user):
            raise ValueError("a user name is 1-100 characters without spaces")
        if any(limit is not None and limit < 1 for limit in (rpm, tpm)):
            raise ValueError("rate limits are positive numbers (leave them out for no limit)")
        secret = KEY_PREFIX + secrets.token_urlsafe(32)
        key = ApiKey(
            id="key_" + secrets.token_hex(6),
            user=user,
            hint=secret[:10] + "…",
            admin=admin,
            created_at=time.time(),
            revoked_at=None,
            rpm=rpm,
            tpm=tpm,
        )
        with self._transaction() as db:
            (since,) = db.execute('SELECT MIN(user_since) FROM api_keys WHERE "user" = ?', (user,)).fetchone()
            key = dataclasses.replace(key, user_since=key.created_at if since is None else since)
            db.execute(
                'INSERT INTO api_keys (id, "user", key_hash, hint, admin, created_at, rpm, tpm, user_since) '
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (key.id, key.user, _hash(secret), key.hint, int(admin), key.created_at, rpm, tpm, key.user_since),
            )
        return key, secret

    def verify(self, secret: str) -> ApiKey | None:
        """The active key matching `secret`, or None. Compared in constant time."""
        digest = _hash(secret)
        generation = self._cache.generation if self._cache is not None else 0
        if self._cache is not None and (cached := self._cache.get(digest)) is not None:
            return cached
        row = self._one(f"SELECT {_KEY_COLUMNS}, key_hash FROM api_keys WHERE key_hash = ?", (digest,))
        if row is None or not hmac.compare_digest(row[9], digest):
            return None
        key = _key(row)
        if not key.active:
            return None
        if self._cache is not None:
            self._cache.put(digest, key, generation)
        return key

    def get(self, key_id: str) -> ApiKey | None:
        """The active key with this id, or None (revoked, forgotten, never made)."""
        row = self._one(f"SELECT {_KEY_COLUMNS} FROM api_keys WHERE id = ?", (key_id,))
        key = _key(row) if row is not None else None
        return key if key is not None and key.active else None

    def list(self) -> list[ApiKey]:
        return [_key(r) for r in self._all(f"SELECT {_KEY_COLUMNS} FROM api_keys ORDER BY created_at")]

    def forget(self, user: str) -> int:
        """Delete every key of `user` (revoked ones too); returns how many."""
        announce = [(_NOTIFY, ())] if self.shared else []
        count = self._delete_user_rows(('DELETE FROM api_keys WHERE "user" = ?', (user,)), *announce)
        self._changed()
        return count

    def revoke(self, key_id: str) -> bool:
        with self._transaction() as db:
            changed = db.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                                 (time.time(), key_id)).rowcount > 0
            self._announce(db)
        self._changed()
        return changed

    def _changed(self) -> None:
        """This process's own cache forgets at once, before its NOTIFY comes back to it."""
        if self._cache is not None:
            self._cache.drop_all()

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
        super().close()
