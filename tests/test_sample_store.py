"""The sample store — the judge's inbox, samples, feedback, outcomes — on both backends: its
SQLite file (the default) and PostgreSQL (NEXTSTATE_DATABASE_URL), with the same tests. On
PostgreSQL two stores are two processes' views of one database: what one writes, the other reads.
"""

from __future__ import annotations

import pytest

from nextstate.core.stores.opener import Stores
from nextstate.core.stores.samples import HoldOut, SampleStore
from nextstate.core.types import NextState, Sample, Transition, Turn
from nextstate.judge.advantages import with_outcome


@pytest.fixture
def open_store(tmp_path, database_url):
    opened = []

    def open_(worker: str = "w1", hold_out: HoldOut | None = None) -> SampleStore:
        opened.append(SampleStore(tmp_path / "samples.sqlite3", database_url, worker=worker, hold_out=hold_out))
        return opened[-1]

    yield open_
    for store in opened:
        store.close()


def turn(user: str = "alice", index: int = 1, session: str = "s1") -> Turn:
    return Turn(session_id=session, user=user, turn_index=index, messages=[{"role": "user", "content": "hi"}],
                prompt_ids=[1, 2], response_ids=[3], response_logprobs=[-0.5], logprob_temperature=1.0, sampling={},
                policy_version=0, adapter=None, response_message={"role": "assistant", "content": "x"},
                finish_reason="stop", created_at=1.0, response_id=f"chatcmpl-{user}-{session}-{index}")


def transition(t: Turn) -> Transition:
    return Transition(turn=t, next_state=NextState(messages=[{"role": "user", "content": "thanks"}]), reason="next_state")


def sample(user: str = "alice", index: int = 1, status: str = "ready", reward: float = 1.0, session: str = "s1",
           feedback=None, track: str = "personal") -> Sample:
    return Sample(user=user, session_id=session, turn_index=index, policy_version=0, adapter=None, mode="binary",
                  track=track, status=status, prompt_ids=[1, 2], response_ids=[3], old_logprobs=[-0.5],
                  logprob_temperature=1.0, advantages=[reward], loss_mask=[1], reward=reward, votes=[1, 1, None],
                  created_at=1234567890.123456, response_id=f"chatcmpl-{user}-{session}-{index}", feedback=feedback)


def test_the_inbox_keeps_each_turn_once_and_finds_it_by_response_id(open_store):
    store = open_store()
    first = store.add_transition(transition(turn()))
    assert first is not None and store.add_transition(transition(turn())) is None
    other = store.add_transition(transition(turn("bob")))
    assert [i for i, _ in store.pending_transitions()] == [first, other]
    found = store.find_turn("alice", "chatcmpl-alice-s1-1")
    assert found is not None and found[0] == first and found[1].turn.user == "alice"
    assert store.find_turn("bob", "chatcmpl-alice-s1-1") is None, "a user finds only their own turns"
    stored = store.add_sample(sample(), transition_id=first)
    assert stored.id is not None and [i for i, _ in store.pending_transitions()] == [other]
    assert store.sample_for_response("alice", "chatcmpl-alice-s1-1").created_at == 1234567890.123456


def test_a_revised_next_state_replaces_an_untrained_judgement_but_not_a_trained_one(open_store):
    store = open_store()
    tid = store.add_transition(transition(turn()))
    store.add_sample(sample(), transition_id=tid)
    assert store.revise_transition(transition(turn())) == tid
    assert store.session_samples("alice", "s1") == [] and [i for i, _ in store.pending_transitions()] == [tid]
    trained = store.add_sample(sample(), transition_id=tid)
    store.mark_consumed([trained.id])
    assert store.revise_transition(transition(turn())) is None


def test_samples_flow_from_ready_to_trained_in_order(open_store):
    store = open_store()
    ids = [store.add_sample(sample(index=i, user=u)).id for i, u in ((1, "alice"), (2, "bob"), (3, "alice"))]
    assert ids == sorted(ids)
    assert [s.id for s in store.ready_samples(10)] == ids
    assert [s.id for s in store.ready_samples(10, user="alice")] == [ids[0], ids[2]]
    assert store.ready_counts_by_user() == {"alice": 2, "bob": 1}
    store.mark_consumed(ids[:1])
    store.mark_dropped(ids[1:2], "not finite")
    assert [s.id for s in store.ready_samples(10)] == ids[2:]
    assert [s.id for s in store.recent_samples(5)] == [ids[2], ids[0]]
    assert store.training_users(since=0) == {"alice"}
    assert store.samples("dropped")[0].reason == "not finite"


def test_feedback_outcomes_and_stats(open_store):
    store = open_store()
    store.set_feedback("alice", "r1", 1, None)
    store.set_feedback("alice", "r1", -1, "say it shorter")  # a second rating replaces the first
    assert store.get_feedback("alice", "r1") == {"rating": -1, "correction": "say it shorter"}
    assert store.get_feedback("bob", "r1") is None
    assert store.feedback_counts() == {"up": 0, "down": 1, "with_correction": 1}
    store.add_sample(sample(feedback={"rating": 1}))
    store.add_sample(sample(index=2, status="dropped", reward=0.0))
    waiting = store.add_sample(sample(index=3, status="awaiting_outcome", reward=0.0, track="outcome", session="s2"))
    assert store.set_outcome("alice", "s2", 1.0, with_outcome) == 1
    assert store.get_outcome("alice", "s2") == 1.0 and store.session_expects_outcome("alice", "s2")
    assert store.sample_for_response("alice", waiting.response_id).status == "ready"
    [row] = store.by_version()
    assert (row["samples"], row["accepted"], row["dropped"], row["feedback_up"]) == (3, 2, 1, 1)
    stats = store.stats()
    assert stats["modes"]["binary"] == {"judged": 3, "accepted": 2, "dropped": 1, "awaiting_outcome": 0,
                                      "from_accepted_replies": 0, "held_out": 0}
    store.set_meta("calibration", {"passed": True})
    assert store.get_meta("calibration") == {"passed": True}


def test_forget_takes_everything_of_one_user_and_nothing_else(open_store):
    store = open_store()
    for user in ("alice", "bob"):
        store.add_transition(transition(turn(user)))
        store.add_sample(sample(user))
        store.set_feedback(user, f"r-{user}", 1, None)
        store.set_outcome(user, "s1", 1.0, with_outcome)
    assert store.forget("alice") == 4
    assert store.session_samples("alice", "s1") == [] and store.find_turn("alice", "chatcmpl-alice-s1-1") is None
    assert store.get_outcome("alice", "s1") is None and store.get_feedback("alice", "r-alice") is None
    assert len(store.session_samples("bob", "s1")) == 1 and store.find_turn("bob", "chatcmpl-bob-s1-1") is not None


def test_two_stores_on_one_database_see_each_others_writes(open_store):
    """Two processes (a proxy and a learner, say) open the same database: samples one judges,
    the other trains on; what the learner marks trained, the proxy sees as trained."""
    judge_side, learner_side = open_store(), open_store()
    stored = judge_side.add_sample(sample())
    assert [s.id for s in learner_side.ready_samples(10)] == [stored.id]
    learner_side.mark_consumed([stored.id])
    assert judge_side.ready_samples(10) == [] and judge_side.samples("consumed")[0].id == stored.id


def test_each_transition_is_judged_by_one_worker_and_a_dead_workers_come_back(open_store):
    """Two judges share the inbox. What one hands over is its own to judge; the other, starting,
    claims nothing of it while the first lives. When the first dies, its lease runs out and the
    other takes its transitions; the first, come back too late, cannot store its judgement."""
    from nextstate.core.stores import samples as sample_store

    a, b = open_store("judge-a"), open_store("judge-b")
    tid = a.add_transition(transition(turn()))
    assert b.claim_pending() == [], "a live worker's transition is not taken"
    later = __import__("time").time() + sample_store.LEASE_S + 1
    assert [i for i, _ in b.claim_pending(now=later)] == [tid], "a dead worker's transition returns"
    assert a.add_sample(sample(), transition_id=tid, claimed=True) is None, "judged by b now, not by a"
    judged = b.add_sample(sample(), transition_id=tid, claimed=True)
    assert judged is not None and len(a.session_samples("alice", "s1")) == 1
    assert b.claim_pending(now=later) == [] and a.claim_pending(now=later) == []


def test_a_restarted_worker_takes_its_own_claims_back_at_once(open_store):
    first = open_store("proxy-1")
    tid = first.add_transition(transition(turn()))
    first.close()
    assert [i for i, _ in open_store("proxy-1").claim_pending()] == [tid]


def test_workers_claiming_at_once_get_disjoint_transitions(open_store):
    """Abandoned transitions claimed by four workers at the same moment: each exactly once."""
    import threading
    import time

    from nextstate.core.stores import samples as sample_store

    writer = open_store("gone")
    ids = [writer.add_transition(transition(turn(index=i))) for i in range(40)]
    workers = [open_store(f"judge-{k}") for k in range(4)]
    later = time.time() + sample_store.LEASE_S + 1
    claimed: dict[str, list[int]] = {}
    start = threading.Barrier(len(workers))

    def claim(store) -> None:
        start.wait()
        claimed[store.worker] = [i for i, _ in store.claim_pending(now=later)]

    threads = [threading.Thread(target=claim, args=(w,)) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    taken = [i for got in claimed.values() for i in got]
    assert sorted(taken) == ids, "every transition claimed, none twice"


def test_a_server_on_postgres_keeps_its_samples_there_and_forgets_them_there(server_factory, postgres):
    """NEXTSTATE_DATABASE_URL: a rated reply's sample is in PostgreSQL, where another process
    (a learner elsewhere) reads it; `forget` deletes it there."""
    from tests.test_feedback import rate
    from tests.test_learner import learning_server

    url = postgres.fresh_database("serving")
    server = learning_server(server_factory, learn=False, database_url=url)
    alice = server.key("alice")
    reply = server.client(alice).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                          max_tokens=3)
    assert rate(server, alice, reply.id, 1).status_code == 200
    elsewhere = SampleStore(server.settings.data_dir / "unused.sqlite3", url)
    try:
        found = elsewhere.sample_for_response("alice", reply.id)
        assert found is not None and (found.status, found.reward) == ("ready", 1.0)
        assert not Stores(server.settings).path("samples").exists(), "nothing in the data dir's SQLite file"
        admin = server.key("root", admin=True)
        import httpx

        answer = httpx.delete(f"{server.base_url}/admin/users/alice", headers={"Authorization": f"Bearer {admin}"}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert elsewhere.sample_for_response("alice", reply.id) is None
    finally:
        elsewhere.close()


def test_an_older_inbox_gets_its_user_column_once_and_forget_still_finds_its_turns(tmp_path):
    """Transitions written before the "user" column existed (it was read out of their JSON) get
    it filled when the file is first opened by this version."""
    import sqlite3

    path = tmp_path / "samples.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE transitions (id INTEGER PRIMARY KEY AUTOINCREMENT, created_at REAL NOT NULL, "
                 "status TEXT NOT NULL, data TEXT NOT NULL, turn_key TEXT, response_id TEXT)")
    old = transition(turn("alice"))
    conn.execute("INSERT INTO transitions (created_at, status, data, turn_key, response_id) VALUES (1, 'pending', ?, 'k', ?)",
                 (old.model_dump_json(), old.turn.response_id))
    conn.commit()
    conn.close()
    store = SampleStore(path)
    try:
        assert store.find_turn("alice", old.turn.response_id) is not None
        assert store.forget("alice") == 1 and store.pending_transitions() == []
    finally:
        store.close()


def test_judges_polling_an_unclaimed_inbox_take_a_bounded_batch_each_and_keep_it_while_they_live(open_store):
    """Serving processes that leave judging to `nextstate judge` write unclaimed transitions;
    each judge takes at most its batch, oldest first, and renews its claims while it lives."""
    from nextstate.core.stores import samples as sample_store

    import time

    serving = open_store("")  # writes unclaimed
    ids = [serving.add_transition(transition(turn(index=i))) for i in range(5)]
    a, b = open_store("judge-a"), open_store("judge-b")
    lease = sample_store.LEASE_S
    assert [i for i, _ in a.claim_pending(now=time.time() - lease / 2, limit=2, own=False)] == ids[:2]
    assert [i for i, _ in b.claim_pending(limit=2, own=False)] == ids[2:4]
    # a's claims, taken half a lease ago, would run out before b's; renewed, they last a lease from now
    assert a.renew_claims() == 2 and serving.renew_claims() == 0
    later = time.time() + lease * 3 / 4
    assert [i for i, _ in b.claim_pending(now=later, own=False)] == [ids[4]], "a's claims hold while renewed"
    assert set(ids[:2]) <= {i for i, _ in b.claim_pending(now=time.time() + lease + 1, own=False)}, \
        "not renewed (a died), they return"


def test_a_worker_that_stops_lets_go_of_its_claims_at_once(open_store):
    """A stopped worker's unjudged transitions need not wait out its lease: a restart on
    another port (another worker name) takes them at once."""
    first, restarted = open_store("serve-1"), open_store("serve-2")
    ids = [first.add_transition(transition(turn(index=i))) for i in range(2)]
    assert [i for i, _ in first.claim_pending()] == ids
    assert restarted.claim_pending() == [], "held while the first lives"
    assert first.release_claims() == 2 and open_store("").release_claims() == 0
    assert [i for i, _ in restarted.claim_pending()] == ids


def test_every_eighth_sample_of_a_person_is_held_out_up_to_a_cap_and_stays_held_out(open_store):
    store = open_store(hold_out=HoldOut(every=4, most=2))
    added = [store.add_sample(sample("alice", i, session=f"s{i}")) for i in range(1, 13)]
    assert [s.status for s in added].count("held_out") == 2
    assert [s.turn_index for s in added if s.status == "held_out"] == [4, 8], "the 4th and 8th, then the cap"
    # not counted: a sample with nothing to teach, one built from another turn, another person's
    store.add_sample(sample("alice", 20, reward=0.0, session="s20"))
    assert [store.add_sample(sample("bob", i, session=f"b{i}")).status for i in range(1, 5)] == ["ready"] * 3 + ["held_out"]
    assert [s.turn_index for s in store.held_out_samples("alice")] == [4, 8]
    # a hint teaches without a reward (a benched judge's hindsight sample): it counts, and may be held out
    carol = [store.add_sample(sample("carol", i, session=f"c{i}")) for i in range(1, 4)]
    hinted = store.add_sample(sample("carol", 4, reward=0.0, session="c4").model_copy(update={"hint": 'say "hi"\x00'}))
    assert [s.status for s in carol] == ["ready"] * 3 and hinted.status == "held_out"
    assert {s.user for s in store.held_out_samples(exclude_user="alice")} == {"bob", "carol"}
    assert all(s.status == "ready" for s in store.ready_samples(100)), "never handed to the learner"
    # a rating of a held-out turn changes its verdict, not whether it trains
    held = store.held_out_samples("alice")[0]
    assert store.replace_sample(held.id, held.model_copy(update={"status": "ready", "reward": -1.0, "reason": "rated"}))
    again = store.held_out_samples("alice")[0]
    assert (again.status, again.reward) == ("held_out", -1.0) and again.reason.startswith("held out")
    # retention and forgetting take them with the rest
    assert store.forget("bob") > 0 and store.forget("carol") > 0 and store.held_out_samples(exclude_user="alice") == []
    store.expire(before=2e9)
    assert store.held_out_samples() == []


def test_processes_opening_one_new_postgres_database_at_once_all_open_it(postgres, tmp_path):
    """A deployment's proxies, judges and learners start together on one new database: each
    creates what is missing, one at a time, and none fails on another's index (PostgreSQL's
    CREATE INDEX IF NOT EXISTS is not safe against the same statement running at once: the
    distributed test's judge once exited on pg_class's unique key)."""
    import threading
    import uuid

    for _ in range(6):  # the race is lost about one time in two on two cores without the lock
        url = postgres.fresh_database(f"t{uuid.uuid4().hex[:12]}")
        start, errors, stores = threading.Barrier(6), [], []

        def open_it(i: int) -> None:
            start.wait()
            try:
                stores.append(SampleStore(tmp_path / f"unused{i}.db", url))
            except Exception as exc:  # noqa: BLE001 - the test reports every failure
                errors.append(exc)

        threads = [threading.Thread(target=open_it, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert errors == [] and len(stores) == 6
        for store in stores:
            store.close()
