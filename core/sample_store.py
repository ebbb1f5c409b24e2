"""The durable hand-off between judge and learner (SQLite in the data dir).

Two queues live here. `transitions` is the judge's inbox: a (turn, next state) pair is
written before it is judged and marked done in the same transaction that stores its sample,
so a crash mid-judgement re-judges it on restart instead of losing it. `samples` holds every
judged turn, accepted or dropped (with the reason), which the learner consumes in order and
the admin stats summarise. Calls are blocking; async callers use `asyncio.to_thread`.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nextstate.core.types import Sample, Transition

_SCHEMA = """
CREATE TABLE IF NOT EXISTS transitions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at REAL NOT NULL,
    status TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS transitions_status ON transitions (status, id);
CREATE TABLE IF NOT EXISTS samples (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at REAL NOT NULL,
    user TEXT NOT NULL,
    session_id TEXT NOT NULL,
    turn_index INTEGER NOT NULL,
    policy_version INTEGER NOT NULL,
    mode TEXT NOT NULL,
    track TEXT NOT NULL,
    status TEXT NOT NULL,
    reason TEXT NOT NULL,
    reward REAL NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS samples_status ON samples (status, id);
CREATE INDEX IF NOT EXISTS samples_session ON samples (user, session_id);
CREATE TABLE IF NOT EXISTS outcomes (
    user TEXT NOT NULL,
    session_id TEXT NOT NULL,
    reward REAL NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (user, session_id)
);
"""

_COLUMNS = ("id", "created_at", "user", "session_id", "turn_index", "policy_version", "mode", "track", "status", "reason", "reward")
_DATA_FIELDS = ("adapter", "prompt_ids", "response_ids", "old_logprobs", "logprob_temperature", "advantages",
                "loss_mask", "votes", "hint", "teacher_logprobs", "outcome")


# How a stored sample changes once its session's outcome is known (the judge's reward math;
# None leaves the sample as it is).
Rescore = Callable[[Sample, float], "Sample | None"]


def _data(sample: Sample) -> str:
    return json.dumps({k: getattr(sample, k) for k in _DATA_FIELDS})


def _sample_from_row(row: tuple) -> Sample:
    return Sample(**dict(zip(_COLUMNS, row[:-1])), **json.loads(row[-1]))


class SampleStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.executescript(_SCHEMA)
        # Since 0.1: one transition per turn. A turn handed over again (a crash after the judge
        # took it, before its session was saved) is recognised and not judged twice.
        columns = {row[1] for row in self._conn.execute("PRAGMA table_info(transitions)")}
        if "turn_key" not in columns:
            self._conn.execute("ALTER TABLE transitions ADD COLUMN turn_key TEXT")
        self._conn.execute("CREATE UNIQUE INDEX IF NOT EXISTS transitions_turn ON transitions (turn_key)")
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # ---------------------------------------------------------------- transitions (judge inbox)

    def add_transition(self, transition: Transition) -> int | None:
        """Put a transition in the inbox; None if its turn is there already (pending or judged)."""
        turn = transition.turn
        key = f"{turn.user}\x1f{turn.session_id}\x1f{turn.turn_index}"
        with self._lock:
            cur = self._conn.execute(
                "INSERT OR IGNORE INTO transitions (created_at, status, data, turn_key) VALUES (?, 'pending', ?, ?)",
                (time.time(), transition.model_dump_json(), key),
            )
        return int(cur.lastrowid) if cur.rowcount else None

    def pending_transitions(self) -> list[tuple[int, Transition]]:
        with self._lock:
            rows = self._conn.execute("SELECT id, data FROM transitions WHERE status = 'pending' ORDER BY id").fetchall()
        return [(row[0], Transition.model_validate_json(row[1])) for row in rows]

    # ---------------------------------------------------------------- samples

    def add_sample(self, sample: Sample, transition_id: int | None = None, rescore: Rescore | None = None) -> Sample:
        """Store a judged sample and close its transition, atomically.

        A sample waiting for its session's outcome is passed through `rescore` here if the
        outcome was posted while it was being judged, so it cannot wait forever for an outcome
        that came.
        """
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                if sample.status == "awaiting_outcome" and rescore is not None:
                    row = self._conn.execute(
                        "SELECT reward FROM outcomes WHERE user = ? AND session_id = ?", (sample.user, sample.session_id)
                    ).fetchone()
                    if row is not None:
                        sample = rescore(sample, float(row[0])) or sample
                data = _data(sample)
                cur = self._conn.execute(
                    "INSERT INTO samples (created_at, user, session_id, turn_index, policy_version, mode, track, "
                    "status, reason, reward, data) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (sample.created_at, sample.user, sample.session_id, sample.turn_index, sample.policy_version,
                     sample.mode, sample.track, sample.status, sample.reason, sample.reward, data),
                )
                if transition_id is not None:
                    self._conn.execute("UPDATE transitions SET status = 'done' WHERE id = ?", (transition_id,))
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
        return sample.model_copy(update={"id": int(cur.lastrowid)})

    def _rows(self, where: str, params: tuple = (), limit: int | None = None) -> list[Sample]:
        sql = f"SELECT {', '.join(_COLUMNS)}, data FROM samples WHERE {where} ORDER BY id"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        with self._lock:
            rows = self._conn.execute(sql, params).fetchall()
        return [_sample_from_row(row) for row in rows]

    def samples(self, status: str | None = None, limit: int | None = None) -> list[Sample]:
        if status is None:
            return self._rows("1 = 1", limit=limit)
        return self._rows("status = ?", (status,), limit)

    def session_samples(self, user: str, session_id: str) -> list[Sample]:
        return self._rows("user = ? AND session_id = ?", (user, session_id))

    def ready_samples(self, limit: int, user: str | None = None) -> list[Sample]:
        """The oldest samples ready to train, of one user or of everyone."""
        if user is None:
            return self._rows("status = 'ready'", (), limit)
        return self._rows("status = 'ready' AND user = ?", (user,), limit)

    def ready_counts_by_user(self) -> dict[str, int]:
        with self._lock:
            rows = self._conn.execute("SELECT user, COUNT(*) FROM samples WHERE status = 'ready' GROUP BY user ORDER BY MIN(id)").fetchall()
        return {user: count for user, count in rows}

    def mark_consumed(self, ids: list[int]) -> None:
        with self._lock:
            self._conn.executemany("UPDATE samples SET status = 'consumed' WHERE id = ?", [(i,) for i in ids])

    def mark_dropped(self, ids: list[int], reason: str) -> None:
        """Samples the learner will not train on (not finite, no signal), with the reason."""
        with self._lock:
            self._conn.executemany(
                "UPDATE samples SET status = 'dropped', reason = ? WHERE id = ? AND status = 'ready'", [(reason, i) for i in ids]
            )

    # ---------------------------------------------------------------- outcomes (general agents)

    def get_outcome(self, user: str, session_id: str) -> float | None:
        with self._lock:
            row = self._conn.execute(
                "SELECT reward FROM outcomes WHERE user = ? AND session_id = ?", (user, session_id)
            ).fetchone()
        return None if row is None else float(row[0])

    def set_outcome(self, user: str, session_id: str, outcome: float, rescore: Rescore) -> int:
        """Record a session's outcome and pass its not-yet-trained samples through `rescore`,
        atomically. Returns how many samples changed."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.execute(
                    "INSERT INTO outcomes (user, session_id, reward, created_at) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT (user, session_id) DO UPDATE SET reward = excluded.reward, created_at = excluded.created_at",
                    (user, session_id, outcome, time.time()),
                )
                rows = self._conn.execute(
                    f"SELECT {', '.join(_COLUMNS)}, data FROM samples WHERE user = ? AND session_id = ? "
                    "AND status IN ('ready', 'awaiting_outcome') ORDER BY id",
                    (user, session_id),
                ).fetchall()
                updated = 0
                for sample in map(_sample_from_row, rows):
                    changed = rescore(sample, outcome)
                    if changed is None:
                        continue
                    updated += 1
                    self._conn.execute(
                        "UPDATE samples SET status = ?, track = ?, reason = ?, reward = ?, data = ? WHERE id = ?",
                        (changed.status, changed.track, changed.reason, changed.reward, _data(changed), sample.id),
                    )
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
        return updated

    def session_expects_outcome(self, user: str, session_id: str) -> bool:
        """Whether a session's turns were served with X-Outcome-Expected (their samples are on
        the outcome track)."""
        with self._lock:
            row = self._conn.execute(
                "SELECT 1 FROM samples WHERE user = ? AND session_id = ? AND track = 'outcome' LIMIT 1", (user, session_id)
            ).fetchone()
        return row is not None

    def session_known(self, user: str, session_id: str) -> bool:
        with self._lock:
            row = self._conn.execute(
                "SELECT 1 FROM samples WHERE user = ? AND session_id = ? LIMIT 1", (user, session_id)
            ).fetchone()
        return row is not None

    # ---------------------------------------------------------------- privacy

    def forget(self, user: str) -> int:
        """Delete everything of `user`: samples, outcomes, the judge's inbox. Returns the count."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                count = self._conn.execute("DELETE FROM samples WHERE user = ?", (user,)).rowcount
                count += self._conn.execute("DELETE FROM outcomes WHERE user = ?", (user,)).rowcount
                count += self._conn.execute(
                    "DELETE FROM transitions WHERE json_extract(data, '$.turn.user') = ?", (user,)
                ).rowcount
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
        return count

    def expire(self, before: float) -> int:
        """Delete what is done with and older than `before` (a timestamp): trained or dropped
        samples, judged transitions. Samples still waiting to train are kept."""
        with self._lock:
            count = self._conn.execute(
                "DELETE FROM samples WHERE status IN ('consumed', 'dropped') AND created_at < ?", (before,)
            ).rowcount
            count += self._conn.execute(
                "DELETE FROM transitions WHERE status = 'done' AND created_at < ?", (before,)
            ).rowcount
        return count

    # ---------------------------------------------------------------- stats

    def stats(self) -> dict[str, Any]:
        with self._lock:
            by_mode = self._conn.execute(
                "SELECT mode, status, COUNT(*) FROM samples GROUP BY mode, status"
            ).fetchall()
            by_version = self._conn.execute(
                "SELECT policy_version, COUNT(*), AVG(reward) FROM samples WHERE status != 'dropped' "
                "GROUP BY policy_version ORDER BY policy_version"
            ).fetchall()
            reasons = self._conn.execute(
                "SELECT reason, COUNT(*) FROM samples WHERE status = 'dropped' GROUP BY reason"
            ).fetchall()
            pending = self._conn.execute("SELECT COUNT(*) FROM transitions WHERE status = 'pending'").fetchone()[0]
        modes: dict[str, dict[str, int]] = {}
        for mode, status, count in by_mode:
            entry = modes.setdefault(mode, {"judged": 0, "accepted": 0, "dropped": 0, "awaiting_outcome": 0})
            entry["judged"] += count
            if status == "dropped":
                entry["dropped"] += count
            elif status == "awaiting_outcome":
                entry["awaiting_outcome"] += count
            else:
                entry["accepted"] += count
        return {
            "modes": modes,
            "dropped_reasons": {reason: count for reason, count in reasons},
            "policy_versions": [
                {"policy_version": v, "samples": n, "mean_reward": round(mean, 4)} for v, n, mean in by_version
            ],
            "transitions_pending": pending,
        }
