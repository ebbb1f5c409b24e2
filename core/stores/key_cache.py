"""Keys checked lately, kept in memory while PostgreSQL says at once when any key changes.

With a shared database every request's key check was a round trip to it, so a database that
slowed down held up every request, even those that need nothing else from it (issue 41: 7.8 s
for a /healthz-like request while PostgreSQL was paused). A key verified in the last
`NEXTSTATE_KEY_CACHE_S` seconds is answered from memory instead — but only while this process
*listens*: a thread holds its own connection with `LISTEN nextstate_api_keys`, and every change
to a key (a revoke, a forget) sends `NOTIFY` in the transaction that makes it, so every process
drops its cached keys the moment the change commits. When that connection is lost the cache is
off (every check goes to the database) until the listener is back, and it starts empty: a change
made meanwhile was never heard, so nothing older than the reconnection is trusted.

A check that read the database while a change was being announced must not put the key it read
back into the cache: `generation` moves on every drop, and a key is kept only if the
generation it was read under is still current. Unknown keys are never cached, so a key just
made works at once. On SQLite (one machine, `nextstate keys revoke` writing the same file from
another process with no way to announce it) there is no cache: the check is a local read.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

CHANNEL = "nextstate_api_keys"
RECONNECT_S = (0.5, 1.0, 2.0, 5.0)  # growing pauses between tries to listen again
POLL_S = 0.5  # how often the listener looks up from waiting to see whether it should stop

V = TypeVar("V")


class KeyCache(Generic[V]):
    """Verified keys by hash, for `ttl_s` seconds, valid only while `listening`."""

    def __init__(self, url: str, ttl_s: float) -> None:
        self.url = url
        self.ttl_s = ttl_s
        self._entries: dict[str, tuple[V, float]] = {}
        self._lock = threading.Lock()
        self.generation = 0
        self.listening = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="key-cache-listener", daemon=True)
        self._thread.start()

    def get(self, digest: str) -> V | None:
        if not self.listening.is_set():
            return None
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None or time.monotonic() - entry[1] > self.ttl_s:
                return None
            return entry[0]

    def put(self, digest: str, value: V, generation: int) -> None:
        """Keep `value`, read from the database when `generation` was current, if it still is."""
        with self._lock:
            if generation == self.generation and self.listening.is_set():
                self._entries[digest] = (value, time.monotonic())

    def drop_all(self) -> None:
        with self._lock:
            self._entries.clear()
            self.generation += 1

    def wait_listening(self, timeout_s: float) -> bool:
        return self.listening.wait(timeout_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _listen(self) -> None:
        tries = 0
        while not self._stop.is_set():
            conn = None
            try:
                import psycopg

                conn = psycopg.connect(self.url, autocommit=True, connect_timeout=5)
                conn.execute(f"LISTEN {CHANNEL}")
                self.drop_all()  # whatever changed while nobody listened was never heard
                self.listening.set()
                tries = 0
                while not self._stop.is_set():
                    for _ in conn.notifies(timeout=POLL_S):
                        self.drop_all()
            except Exception as exc:  # the connection is gone: stop trusting the cache, then try again
                if not self._stop.is_set():
                    log.warning("key cache: not listening to key changes (%s); every key is checked in the database",
                                type(exc).__name__)
            finally:
                self.listening.clear()
                self.drop_all()
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:
                        pass
            self._stop.wait(RECONNECT_S[min(tries, len(RECONNECT_S) - 1)])
            tries += 1
