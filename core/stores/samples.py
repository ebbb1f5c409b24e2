"""The durable hand-off between judge and learner (SQLite in the data dir).

Two queues live here. `transitions` is the judge's inbox: a (turn, next state) pair is
written before it is judged and marked done in the same transaction that stores its sample,
so a crash mid-judgement re-judges it on restart instead of losing it. Several processes may
share the inbox (PostgreSQL, NEXTSTATE_DATABASE_URL, or one data dir's file): each transition
is claimed by one worker for a lease (`LEASE_S`, renewed while the worker lives), the one that
wrote it first or — when serving processes leave judging to `nextstate judge` processes — the
judge that polls for it first; a worker claims what is unclaimed, its own from before a restart,
or left by a worker whose lease ran out (it died), and a judgement is stored only while its
worker still holds the claim, so no turn is judged into two samples. `samples` holds every judged turn, accepted or dropped (with the reason), which
the learner consumes in order and the admin stats summarise. Calls are blocking; async callers use `asyncio.to_thread`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nextstate.core.stores.base import Store
from nextstate.core.types import Sample, Transition, Turn

_SCHEMA = """
CREATE TABLE IF NOT EXISTS transitions (
    id {id},
    created_at {float} NOT NULL,
    status TEXT NOT NULL,
    data TEXT NOT NULL,
    turn_key TEXT,
    response_id TEXT,
    "user" TEXT,
    claimed_by TEXT,
    claimed_until {float}
);
CREATE INDEX IF NOT EXISTS transitions_status ON transitions (status, id);
CREATE TABLE IF NOT EXISTS samples (
    id {id},
    created_at {float} NOT NULL,
    "user" TEXT NOT NULL,
    session_id TEXT NOT NULL,
    turn_index INTEGER NOT NULL,
    policy_version INTEGER NOT NULL,
    mode TEXT NOT NULL,
    track TEXT NOT NULL,
    status TEXT NOT NULL,
    reason TEXT NOT NULL,
    reward {float} NOT NULL,
    data TEXT NOT NULL,
    response_id TEXT,
    tries INTEGER NOT NULL DEFAULT 0,
    accepted_from INTEGER
);
CREATE INDEX IF NOT EXISTS samples_status ON samples (status, id);
CREATE INDEX IF NOT EXISTS samples_session ON samples ("user", session_id);
CREATE TABLE IF NOT EXISTS feedback (
    response_id TEXT PRIMARY KEY,
    "user" TEXT NOT NULL,
    rating INTEGER NOT NULL,
    correction TEXT,
    created_at {float} NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS outcomes (
    "user" TEXT NOT NULL,
    session_id TEXT NOT NULL,
    reward {float} NOT NULL,
    created_at {float} NOT NULL,
    PRIMARY KEY ("user", session_id)
);
"""

HELD_OUT_REASON = "held out: never trained, each version of its scope is scored on it"

# How long a worker's claim on a transition lasts unless renewed (`renew_claims`, which a live
# worker calls every quarter of it, however long its judge takes): a worker that died has its
# transitions judged by another after this.
LEASE_S = 60.0


def _turn_key(turn: Turn) -> str:
    """A turn's identity in the inbox: the inbox keeps each turn once."""
    return f"{turn.user}\x1f{turn.session_id}\x1f{turn.turn_index}"


_COLUMNS = ("id", "created_at", "user", "session_id", "turn_index", "policy_version", "mode", "track", "status", "reason",
            "reward", "response_id", "tries", "accepted_from")
_SELECTED = ", ".join(f'"{c}"' for c in _COLUMNS)  # "user" is a reserved word in PostgreSQL
_DATA_FIELDS = ("adapter", "prompt_ids", "response_ids", "old_logprobs", "logprob_temperature", "advantages",
                "loss_mask", "votes", "hint", "teacher_logprobs", "outcome", "feedback",
                "teacher_prompt_ids", "distill_weight", "contrast_prompt_ids")


# How a stored sample changes once its session's outcome is known (the judge's reward math;
# None leaves the sample as it is).
Rescore = Callable[[Sample, float], "Sample | None"]


def _data(sample: Sample) -> str:
    return json.dumps({k: getattr(sample, k) for k in _DATA_FIELDS})


def _sample_from_row(row: tuple) -> Sample:
    return Sample(**dict(zip(_COLUMNS, row[:-1])), **json.loads(row[-1]))


@dataclass(frozen=True)
class HoldOut:
    """Which of a person's samples are held out: the `every`-th, 2·`every`-th, ... of those that
    could teach (a verdict or a hint, on their own turn), up to `most` (NEXTSTATE_HELD_OUT_*).
    Counted in the insert's transaction, from the rows themselves (no counter that a crash or a
    second process could leave wrong), and a person's first few samples always train."""

    every: int = 8
    most: int = 32

    def applies(self, sample: Sample) -> bool:
        return (self.every > 0 and sample.status == "ready" and sample.track == "personal"
                and sample.accepted_from is None and (sample.reward != 0 or sample.hint is not None))


class SampleStore(Store):
    SCHEMA = _SCHEMA
    PRAGMAS = ("synchronous=NORMAL",)

    def __init__(self, path: Path, database_url: str | None = None, worker: str = "",
                 hold_out: HoldOut | None = None) -> None:
        """`worker` names this process among those sharing the database (its claims); the same
        name after a restart takes its claims back at once. `hold_out`: which samples are never
        trained (None: none)."""
        self.worker = worker
        self.hold_out = hold_out
        super().__init__(path, database_url)

    def _upgrade(self) -> None:
        # Since 0.1: one transition per turn. A turn handed over again (a crash after the judge
        # took it, before its session was saved) is recognised and not judged twice.
        # Since 0.2: feedback names a turn by the response id its client got.
        # Since 0.3: a transition's user is a column (it was read out of its JSON).
        # Since 0.4: claims, so that several processes share the inbox.
        added = self._db.add_missing_columns("transitions", {"turn_key": "TEXT", "response_id": "TEXT", '"user"': "TEXT",
                                                             "claimed_by": "TEXT", "claimed_until": "{float}"})
        # Since 0.5: how many updates trained a sample without being published (it waits again).
        # Since 0.6: a sample built from a reply accepted after a correction names that reply's turn
        # (no longer made; such rows stay out of the counts).
        self._db.add_missing_columns("samples", {"response_id": "TEXT", "tries": "INTEGER NOT NULL DEFAULT 0",
                                                 "accepted_from": "INTEGER"})
        with self._db.schema_change():  # processes starting together: one creates, the others find them
            # One such sample per corrected turn, whichever worker judged which of the two turns first.
            self._db.execute('CREATE UNIQUE INDEX IF NOT EXISTS samples_accepted ON samples ("user", session_id, turn_index) '
                             "WHERE accepted_from IS NOT NULL")
            self._db.execute("CREATE UNIQUE INDEX IF NOT EXISTS transitions_turn ON transitions (turn_key)")
            self._db.execute("CREATE INDEX IF NOT EXISTS transitions_response ON transitions (response_id)")
            self._db.execute("CREATE INDEX IF NOT EXISTS samples_response ON samples (response_id)")
        if '"user"' in added:  # once, for the transitions an older version wrote
            self._db.execute(f'UPDATE transitions SET "user" = {self._db.json_text("data", "turn", "user")}')

    # ---------------------------------------------------------------- transitions (judge inbox)

    def add_transition(self, transition: Transition, status: str = "pending") -> int | None:
        """Put a transition in the inbox; None if its turn is there already (pending or judged).

        `status` "unjudged" keeps a turn no judge will look at (no next state, or implicit
        judging off), so that explicit feedback can still find it by its response id."""
        with self._lock:
            return self._insert_transition(transition, status, " ON CONFLICT (turn_key) DO NOTHING")

    def _insert_transition(self, transition: Transition, status: str, conflict: str = "") -> int | None:
        """Insert it, claimed by this worker (who judges what it hands over); a store opened
        without a worker name (a tool, a test) leaves it for any worker to claim."""
        turn = transition.turn
        now = time.time()
        owner, until = self._claim(now)
        return self._db.insert(
            'INSERT INTO transitions (created_at, status, data, turn_key, response_id, "user", claimed_by, claimed_until) '
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)" + conflict,
            (now, status, transition.model_dump_json(), _turn_key(turn), turn.response_id, turn.user, owner, until),
        )

    def revise_transition(self, transition: Transition, status: str = "pending") -> int | None:
        """Put a revised next state in place of the one handed over earlier for the same turn,
        its untrained judgement deleted, so that the turn is judged again; the id of its inbox
        entry, or None when it stands as it is: trained already, or rated by its user. A turn
        not in the inbox yet is simply added."""
        turn = transition.turn
        with self._transaction():
            row = self._db.execute("SELECT id FROM transitions WHERE turn_key = ?", (_turn_key(turn),)).fetchone()
            if row is None:
                return self._insert_transition(transition, status)
            rated = turn.response_id is not None and self._db.execute(
                "SELECT 1 FROM feedback WHERE response_id = ? AND \"user\" = ?", (turn.response_id, turn.user)
            ).fetchone() is not None
            trained = self._db.execute(
                "SELECT 1 FROM samples WHERE \"user\" = ? AND session_id = ? AND turn_index = ? AND status = 'consumed'",
                (turn.user, turn.session_id, turn.turn_index),
            ).fetchone() is not None
            if rated or trained:
                return None
            self._db.execute(
                "DELETE FROM samples WHERE \"user\" = ? AND session_id = ? AND turn_index = ?",
                (turn.user, turn.session_id, turn.turn_index),
            )
            now = time.time()
            self._db.execute(
                "UPDATE transitions SET data = ?, status = ?, created_at = ?, claimed_by = ?, claimed_until = ? WHERE id = ?",
                (transition.model_dump_json(), status, now, *self._claim(now), row[0]),
            )
            return int(row[0])

    def find_turn(self, user: str, response_id: str) -> tuple[int, Transition] | None:
        """The stored transition of `user`'s turn that answered with `response_id`."""
        row = self._one(
            "SELECT id, data FROM transitions WHERE response_id = ? AND \"user\" = ?",
            (response_id, user),
        )
        return None if row is None else (row[0], Transition.model_validate_json(row[1]))

    def close_transition(self, transition_id: int, status: str = "done") -> None:
        """Take a pending transition out of the judge's queue: judged another way ("done"), or
        left for explicit feedback only ("unjudged")."""
        with self._lock:
            self._db.execute("UPDATE transitions SET status = ? WHERE id = ? AND status = 'pending'", (status, transition_id))

    def _claim(self, now: float) -> tuple[str | None, float | None]:
        """(claimed_by, claimed_until) of what this worker writes: its own, or nobody's."""
        return (self.worker, now + LEASE_S) if self.worker else (None, None)

    def pending_transitions(self) -> list[tuple[int, Transition]]:
        rows = self._all("SELECT id, data FROM transitions WHERE status = 'pending' ORDER BY id")
        return [(row[0], Transition.model_validate_json(row[1])) for row in rows]

    def claim_pending(self, now: float | None = None, limit: int | None = None,
                      own: bool = True) -> list[tuple[int, Transition]]:
        """Claim for this worker (oldest first, at most `limit`) the pending transitions no live
        worker holds: unclaimed, its own (`own`: it restarted), or claimed by a worker whose lease
        ran out (it died). Workers that claim at once get disjoint sets (PostgreSQL skips rows
        another holds locked; SQLite takes them one writer at a time)."""
        now = time.time() if now is None else now
        mine = "claimed_by = ? OR " if own else ""
        with self._transaction():
            rows = self._db.execute(
                "UPDATE transitions SET claimed_by = ?, claimed_until = ? WHERE id IN ("
                "SELECT id FROM transitions WHERE status = 'pending' "
                f"AND (claimed_by IS NULL OR {mine}claimed_until IS NULL OR claimed_until < ?) ORDER BY id LIMIT ?"
                f"{self._db.skip_locked}) RETURNING id, data",
                (self.worker, now + LEASE_S, *((self.worker,) if own else ()), now, limit if limit is not None else 2**62),
            ).fetchall()
        return sorted((int(row[0]), Transition.model_validate_json(row[1])) for row in rows)

    def release_claims(self) -> int:
        """Let go of this worker's claims on the transitions it has not judged: it stops, and
        any worker (itself restarted on another port among them) may take them at once rather
        than after the lease."""
        if not self.worker:
            return 0
        with self._lock:
            return self._db.execute(
                "UPDATE transitions SET claimed_by = NULL, claimed_until = NULL WHERE claimed_by = ? AND status = 'pending'",
                (self.worker,),
            ).rowcount

    def renew_claims(self) -> int:
        """Extend this worker's claims on the transitions it has not judged yet: it lives."""
        if not self.worker:
            return 0
        with self._lock:
            return self._db.execute(
                "UPDATE transitions SET claimed_until = ? WHERE claimed_by = ? AND status = 'pending'",
                (time.time() + LEASE_S, self.worker),
            ).rowcount

    # ---------------------------------------------------------------- samples

    def add_sample(self, sample: Sample, transition_id: int | None = None, rescore: Rescore | None = None,
                   claimed: bool = False) -> Sample | None:
        """Store a judged sample and close its transition, atomically. `claimed`: the judge's
        own judgement of the transition, stored only while this worker holds its claim (None
        when another worker took it over, its lease having run out).

        A sample waiting for its session's outcome is passed through `rescore` here if the
        outcome was posted while it was being judged, so it cannot wait forever for an outcome
        that came.
        """
        with self._transaction():
            if claimed and transition_id is not None and self._db.execute(
                "UPDATE transitions SET status = 'done' WHERE id = ? AND status = 'pending' "
                "AND (claimed_by = ? OR claimed_by IS NULL)",
                (transition_id, self.worker),
            ).rowcount != 1:
                return None
            if sample.status == "awaiting_outcome" and rescore is not None:
                row = self._db.execute(
                    "SELECT reward FROM outcomes WHERE \"user\" = ? AND session_id = ?", (sample.user, sample.session_id)
                ).fetchone()
                if row is not None:
                    sample = rescore(sample, float(row[0])) or sample
            sample = self._held_out(sample)
            sample_id = self._insert_sample(sample)
            if transition_id is not None:
                self._db.execute("UPDATE transitions SET status = 'done' WHERE id = ?", (transition_id,))
        return sample.model_copy(update={"id": sample_id})

    def _held_out(self, sample: Sample) -> Sample:
        """The sample as it is to be stored: held out if its turn is its person's every-th
        (`HoldOut`). Inside the insert's transaction."""
        if self.hold_out is None or not self.hold_out.applies(sample):
            return sample
        held, total = self._db.execute(
            "SELECT COUNT(*) FILTER (WHERE status = 'held_out'), COUNT(*) FROM samples WHERE \"user\" = ? "
            "AND track = 'personal' AND accepted_from IS NULL AND status IN ('ready', 'consumed', 'held_out') "
            # a hint, read as text: json.dumps writes a missing one as `"hint": null` (a cast to
            # jsonb would fail on a sample whose text holds an escaped NUL, on PostgreSQL)
            "AND (reward != 0 OR data NOT LIKE ?)",
            (sample.user, '%"hint": null%'),
        ).fetchone()
        if (total + 1) % self.hold_out.every == 0 and held < self.hold_out.most:
            return sample.model_copy(update={"status": "held_out", "reason": HELD_OUT_REASON})
        return sample

    def _insert_sample(self, sample: Sample, conflict: str = "") -> int | None:
        return self._db.insert(
            "INSERT INTO samples (created_at, \"user\", session_id, turn_index, policy_version, mode, track, "
            "status, reason, reward, response_id, accepted_from, data) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)" + conflict,
            (sample.created_at, sample.user, sample.session_id, sample.turn_index, sample.policy_version, sample.mode,
             sample.track, sample.status, sample.reason, sample.reward, sample.response_id, sample.accepted_from,
             _data(sample)),
        )

    def _rows(self, where: str, params: tuple = (), limit: int | None = None) -> list[Sample]:
        sql = f"SELECT {_SELECTED}, data FROM samples WHERE {where} ORDER BY id"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        rows = self._all(sql, params)
        return [_sample_from_row(row) for row in rows]

    def sample_for_response(self, user: str, response_id: str) -> Sample | None:
        found = self._rows('"user" = ? AND response_id = ?', (user, response_id), 1)
        return found[0] if found else None

    def judging_state(self, user: str, response_id: str | None, session_id: str) -> tuple[bool, float | None]:
        """What the judge looks up before it judges a turn, in one trip to this thread: whether
        the reply has a sample already (its user rated it), and its session's outcome."""
        with self._lock:
            rated = bool(response_id) and self._db.execute(
                "SELECT 1 FROM samples WHERE \"user\" = ? AND response_id = ? LIMIT 1", (user, response_id)
            ).fetchone() is not None
        return rated, self.get_outcome(user, session_id)

    def replace_sample(self, sample_id: int, sample: Sample) -> bool:
        """Give a stored, not yet trained sample new contents (its turn was rated); False if it
        was trained meanwhile."""
        with self._lock:
            # a held-out turn stays held out, whatever its new verdict: it was never trained on
            cur = self._db.execute(
                "UPDATE samples SET status = CASE WHEN status = 'held_out' THEN status ELSE ? END, track = ?, "
                "reason = CASE WHEN status = 'held_out' THEN reason ELSE ? END, reward = ?, mode = ?, data = ? "
                "WHERE id = ? AND status != 'consumed'",
                (sample.status, sample.track, sample.reason, sample.reward, sample.mode, _data(sample), sample_id),
            )
        return cur.rowcount == 1

    # ---------------------------------------------------------------- explicit feedback

    def set_feedback(self, user: str, response_id: str, rating: int, correction: str | None) -> None:
        """Keep a rating (a second one replaces the first) before it is applied."""
        with self._lock:
            self._db.execute(
                "INSERT INTO feedback (response_id, \"user\", rating, correction, created_at) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (response_id) DO UPDATE SET rating = excluded.rating, correction = excluded.correction, "
                "created_at = excluded.created_at",
                (response_id, user, rating, correction, time.time()),
            )

    def get_feedback(self, user: str, response_id: str) -> dict[str, Any] | None:
        row = self._one(
            "SELECT rating, correction FROM feedback WHERE response_id = ? AND \"user\" = ?", (response_id, user)
        )
        return None if row is None else {"rating": int(row[0]), "correction": row[1]}

    def samples(self, status: str | None = None, limit: int | None = None) -> list[Sample]:
        if status is None:
            return self._rows("1 = 1", limit=limit)
        return self._rows("status = ?", (status,), limit)

    def session_samples(self, user: str, session_id: str) -> list[Sample]:
        return self._rows('"user" = ? AND session_id = ?', (user, session_id))

    def ready_samples(self, limit: int, user: str | None = None) -> list[Sample]:
        """The oldest samples ready to train, of one user or of everyone."""
        if user is None:
            return self._rows("status = 'ready'", (), limit)
        return self._rows("status = 'ready' AND \"user\" = ?", (user,), limit)

    def recent_samples(self, limit: int, user: str | None = None, exclude: set[int] | frozenset = frozenset()) -> list[Sample]:
        """The newest accepted samples (ready or trained), of one user or of everyone, newest
        first: what the publish gate holds out."""
        where, params = "status IN ('ready', 'consumed')", ()
        if user is not None:
            where, params = where + " AND \"user\" = ?", (user,)
        sql = f"SELECT {_SELECTED}, data FROM samples WHERE {where} ORDER BY id DESC LIMIT {int(limit + len(exclude))}"
        rows = self._all(sql, params)
        return [s for s in map(_sample_from_row, rows) if s.id not in exclude][:limit]

    def held_out_samples(self, user: str | None = None, exclude_user: str | None = None) -> list[Sample]:
        """The held-out samples of one user (or everyone's, or everyone's but one user's),
        oldest first: what each version is scored on."""
        if user is not None:
            return self._rows("status = 'held_out' AND \"user\" = ?", (user,))
        if exclude_user is not None:
            return self._rows("status = 'held_out' AND \"user\" != ?", (exclude_user,))
        return self._rows("status = 'held_out'")

    def held_out_count(self, user: str) -> int:
        return int(self._one("SELECT COUNT(*) FROM samples WHERE status = 'held_out' AND \"user\" = ?", (user,))[0])

    def training_users(self, since: float) -> set[str]:
        """Users with samples ready to train, or with samples trained that were made since `since`."""
        rows = self._all(
            "SELECT DISTINCT \"user\" FROM samples WHERE status = 'ready' OR (status = 'consumed' AND created_at >= ?)",
            (since,),
        )
        return {user for (user,) in rows}

    def ready_counts_by_user(self) -> dict[str, int]:
        rows = self._all("SELECT \"user\", COUNT(*) FROM samples WHERE status = 'ready' GROUP BY \"user\" ORDER BY MIN(id)")
        return {user: count for user, count in rows}

    def mark_consumed(self, ids: list[int]) -> None:
        with self._lock:
            self._db.executemany("UPDATE samples SET status = 'consumed' WHERE id = ?", [(i,) for i in ids])

    def mark_returned(self, ids: list[int], reason: str) -> None:
        """Samples an update trained on that was not published: they stay ready, one try more,
        with the reason (the learner tries them again; a person's rating is never lost to it)."""
        with self._lock:
            self._db.executemany(
                "UPDATE samples SET reason = ?, tries = tries + 1 WHERE id = ? AND status = 'ready'", [(reason, i) for i in ids]
            )

    def returned_counts(self) -> dict[str, int]:
        """Ready samples that came back from an unpublished update, by the reason they came back."""
        rows = self._all(
            "SELECT reason, COUNT(*) FROM samples WHERE status = 'ready' AND tries > 0 GROUP BY reason"
        )
        return {reason: count for reason, count in rows}

    def mark_dropped(self, ids: list[int], reason: str) -> None:
        """Samples the learner will not train on (not finite, no signal), with the reason."""
        with self._lock:
            self._db.executemany(
                "UPDATE samples SET status = 'dropped', reason = ? WHERE id = ? AND status = 'ready'", [(reason, i) for i in ids]
            )

    # ---------------------------------------------------------------- outcomes (general agents)

    def get_outcome(self, user: str, session_id: str) -> float | None:
        row = self._one(
            "SELECT reward FROM outcomes WHERE \"user\" = ? AND session_id = ?", (user, session_id)
        )
        return None if row is None else float(row[0])

    def set_outcome(self, user: str, session_id: str, outcome: float, rescore: Rescore) -> int:
        """Record a session's outcome and pass its not-yet-trained samples through `rescore`,
        atomically. Returns how many samples changed."""
        with self._transaction():
            self._db.execute(
                "INSERT INTO outcomes (\"user\", session_id, reward, created_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (\"user\", session_id) DO UPDATE SET reward = excluded.reward, created_at = excluded.created_at",
                (user, session_id, outcome, time.time()),
            )
            rows = self._db.execute(
                f"SELECT {_SELECTED}, data FROM samples WHERE \"user\" = ? AND session_id = ? "
                "AND status IN ('ready', 'awaiting_outcome') ORDER BY id",
                (user, session_id),
            ).fetchall()
            updated = 0
            for sample in map(_sample_from_row, rows):
                changed = rescore(sample, outcome)
                if changed is None:
                    continue
                updated += 1
                self._db.execute(
                    "UPDATE samples SET status = ?, track = ?, reason = ?, reward = ?, data = ? WHERE id = ?",
                    (changed.status, changed.track, changed.reason, changed.reward, _data(changed), sample.id),
                )
        return updated

    def session_expects_outcome(self, user: str, session_id: str) -> bool:
        """Whether a session's turns were served with X-Outcome-Expected (their samples are on
        the outcome track)."""
        row = self._one(
            "SELECT 1 FROM samples WHERE \"user\" = ? AND session_id = ? AND track = 'outcome' LIMIT 1", (user, session_id)
        )
        return row is not None

    def session_known(self, user: str, session_id: str) -> bool:
        row = self._one(
            "SELECT 1 FROM samples WHERE \"user\" = ? AND session_id = ? LIMIT 1", (user, session_id)
        )
        return row is not None

    # ---------------------------------------------------------------- privacy

    def forget(self, user: str) -> int:
        """Delete everything of `user`: samples, outcomes, the judge's inbox. Returns the count."""
        with self._lock:
            with self._db.transaction():
                count = sum(self._db.execute(f'DELETE FROM {table} WHERE "user" = ?', (user,)).rowcount
                            for table in ("samples", "outcomes", "feedback", "transitions"))
            self._db.scrub()
        return count

    def expire(self, before: float) -> int:
        """Delete what is done with and older than `before` (a timestamp): trained or dropped
        samples, judged transitions. Samples still waiting to train are kept."""
        with self._lock:
            count = self._db.execute(
                "DELETE FROM samples WHERE status IN ('consumed', 'dropped', 'held_out') AND created_at < ?", (before,)
            ).rowcount
            count += self._db.execute(
                "DELETE FROM transitions WHERE status IN ('done', 'unjudged') AND created_at < ?", (before,)
            ).rowcount
            count += self._db.execute("DELETE FROM feedback WHERE created_at < ?", (before,)).rowcount
        return count

    # ---------------------------------------------------------------- facts about the server

    def set_meta(self, key: str, value: Any) -> None:
        """A small fact kept with the samples (the judge's calibration), for `nextstate status`."""
        with self._lock:
            self._db.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (key, json.dumps(value)),
            )

    def get_meta(self, key: str) -> Any:
        row = self._one("SELECT value FROM meta WHERE key = ?", (key,))
        return None if row is None else json.loads(row[0])

    # ---------------------------------------------------------------- stats

    def by_version(self, per_user: bool = False) -> list[dict[str, Any]]:
        """Per adapter scope ("shared", or each user with per-user adapters) and policy version
        that served the turns: samples by status, mean reward of the accepted ones, and the
        explicit ratings among them."""
        scope = '"user"' if per_user else "'shared'"
        group = '"user", policy_version' if per_user else "policy_version"  # PostgreSQL groups by no constant
        rating = f"CAST({self._db.json_text('data', 'feedback', 'rating')} AS INTEGER)"
        rows = self._all(
            f"SELECT {scope}, policy_version, COUNT(*), "
            "COUNT(*) FILTER (WHERE status != 'dropped'), COUNT(*) FILTER (WHERE status = 'dropped'), "
            "AVG(CASE WHEN status != 'dropped' THEN reward END), "
            f"COUNT(*) FILTER (WHERE {rating} = 1), COUNT(*) FILTER (WHERE {rating} = -1) "
            # a sample built from an accepted reply repeats that reply's reward: counted once
            f"FROM samples WHERE accepted_from IS NULL GROUP BY {group} ORDER BY {group}"
        )
        return [
            {"scope": sc, "policy_version": v, "samples": n, "accepted": int(acc or 0), "dropped": int(drop or 0),
             "mean_reward": None if mean is None else round(mean, 4), "feedback_up": int(up or 0),
             "feedback_down": int(down or 0)}
            for sc, v, n, acc, drop, mean, up, down in rows
        ]

    def feedback_counts(self) -> dict[str, int]:
        with self._lock:
            up, down, corrections = self._db.execute(
                "SELECT COUNT(*) FILTER (WHERE rating = 1), COUNT(*) FILTER (WHERE rating = -1), COUNT(correction) FROM feedback"
            ).fetchone()
        return {"up": int(up or 0), "down": int(down or 0), "with_correction": int(corrections or 0)}

    def stats(self) -> dict[str, Any]:
        with self._lock:
            by_mode = self._db.execute(
                "SELECT mode, status, accepted_from IS NOT NULL, COUNT(*) FROM samples "
                "GROUP BY mode, status, accepted_from IS NOT NULL"
            ).fetchall()
            by_version = self._db.execute(
                "SELECT policy_version, COUNT(*), AVG(reward) FROM samples WHERE status != 'dropped' AND accepted_from IS NULL "
                "GROUP BY policy_version ORDER BY policy_version"
            ).fetchall()
            reasons = self._db.execute(
                "SELECT reason, COUNT(*) FROM samples WHERE status = 'dropped' GROUP BY reason"
            ).fetchall()
            pending = self._db.execute("SELECT COUNT(*) FROM transitions WHERE status = 'pending'").fetchone()[0]
        modes: dict[str, dict[str, int]] = {}
        for mode, status, built, count in by_mode:
            entry = modes.setdefault(mode, {"judged": 0, "accepted": 0, "dropped": 0, "awaiting_outcome": 0,
                                            "from_accepted_replies": 0, "held_out": 0})
            if built:  # no judgement of its own: a reply accepted after a correction, on the corrected turn
                entry["from_accepted_replies"] += count
                continue
            entry["judged"] += count
            if status == "dropped":
                entry["dropped"] += count
            elif status == "awaiting_outcome":
                entry["awaiting_outcome"] += count
            elif status == "held_out":  # accepted too, but never trained: what versions are scored on
                entry["accepted"] += count
                entry["held_out"] += count
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
