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
from pathlib import Path
from typing import Any

from nextstate.types import Sample, Transition

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


def step_reward(outcome: float, votes: list[int | None]) -> float:
    """o + Σ r_i / m (paper §4.4.2); a failed vote counts as 0."""
    return outcome + (sum(v or 0 for v in votes) / len(votes) if votes else 0.0)


class SampleStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # ---------------------------------------------------------------- transitions (judge inbox)

    def add_transition(self, transition: Transition) -> int:
        with self._lock:
            cur = self._conn.execute(
                "INSERT INTO transitions (created_at, status, data) VALUES (?, 'pending', ?)",
                (time.time(), transition.model_dump_json()),
            )
        return int(cur.lastrowid)

    def pending_transitions(self) -> list[tuple[int, Transition]]:
        with self._lock:
            rows = self._conn.execute("SELECT id, data FROM transitions WHERE status = 'pending' ORDER BY id").fetchall()
        return [(row[0], Transition.model_validate_json(row[1])) for row in rows]

    # ---------------------------------------------------------------- samples

    def add_sample(self, sample: Sample, transition_id: int | None = None) -> Sample:
        """Store a judged sample and close its transition, atomically.

        A sample waiting for its session's outcome picks the outcome up here if it was posted
        while the sample was being judged, so it cannot wait forever for an outcome that came.
        """
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                if sample.status == "awaiting_outcome":
                    row = self._conn.execute(
                        "SELECT reward FROM outcomes WHERE user = ? AND session_id = ?", (sample.user, sample.session_id)
                    ).fetchone()
                    if row is not None:
                        sample = sample.model_copy(
                            update={"status": "ready", "outcome": row[0], "reward": step_reward(row[0], sample.votes),
                                    "reason": "outcome + mean votes"}
                        )
                data = json.dumps({k: getattr(sample, k) for k in _DATA_FIELDS})
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
        return [Sample(**dict(zip(_COLUMNS, row[:-1])), **json.loads(row[-1])) for row in rows]

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

    # ---------------------------------------------------------------- outcomes (general agents)

    def get_outcome(self, user: str, session_id: str) -> float | None:
        with self._lock:
            row = self._conn.execute(
                "SELECT reward FROM outcomes WHERE user = ? AND session_id = ?", (user, session_id)
            ).fetchone()
        return None if row is None else float(row[0])

    def set_outcome(self, user: str, session_id: str, outcome: float) -> int:
        """Record a session's outcome and fold it into its not-yet-trained samples.

        Returns how many samples were updated; they become outcome-track samples whose reward
        is o + mean(votes), released to the learner if they were waiting for it.
        """
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.execute(
                    "INSERT INTO outcomes (user, session_id, reward, created_at) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT (user, session_id) DO UPDATE SET reward = excluded.reward, created_at = excluded.created_at",
                    (user, session_id, outcome, time.time()),
                )
                rows = self._conn.execute(
                    "SELECT id, status, data FROM samples WHERE user = ? AND session_id = ? "
                    "AND status IN ('ready', 'awaiting_outcome')",
                    (user, session_id),
                ).fetchall()
                updated = 0
                for sample_id, _status, raw in rows:
                    data = json.loads(raw)
                    if not data["votes"]:  # an OPD-only sample has no step reward to add o to
                        continue
                    updated += 1
                    data["outcome"] = outcome
                    self._conn.execute(
                        "UPDATE samples SET status = 'ready', track = 'outcome', reward = ?, data = ? WHERE id = ?",
                        (step_reward(outcome, data["votes"]), json.dumps(data), sample_id),
                    )
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
        return updated

    def session_known(self, user: str, session_id: str) -> bool:
        with self._lock:
            row = self._conn.execute(
                "SELECT 1 FROM samples WHERE user = ? AND session_id = ? LIMIT 1", (user, session_id)
            ).fetchone()
        return row is not None

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
