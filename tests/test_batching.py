"""Choosing a batch (learner/batching.py): the batch, or what the scope waits for and why."""

from __future__ import annotations

from nextstate.core.settings import LearnerSettings
from nextstate.core.types import Sample
from nextstate.learner.batching import Waiting, choose_batch

NOW = 10_000.0


def sample(user: str = "alice", age_s: float = 0.0, i: int = 0) -> Sample:
    return Sample(
        id=i, user=user, session_id="s", turn_index=1, policy_version=0, adapter=None, mode="binary", status="ready",
        prompt_ids=[1, 2], response_ids=[3], old_logprobs=[-1.0], logprob_temperature=1.0, advantages=[1.0],
        loss_mask=[1], reward=1.0, created_at=NOW - age_s,
    )


def settings(**overrides) -> LearnerSettings:
    # batch 16 (the counts below; the default is 8), partial >= 4 after 120 s, one user <= 50% of a shared batch
    return LearnerSettings(**{"batch_size": 16} | overrides)


def test_a_lone_user_trains_whoever_else_holds_a_key():
    """With the contributors rule lifted (a team of one), a lone user's samples train."""
    lone = settings(shared_min_contributors=1)
    ready = [sample(age_s=200, i=i) for i in range(4)]
    assert choose_batch("shared", ready, lone, training_users={"alice"}, now=NOW) == ready
    full = [sample(i=i) for i in range(16)]
    assert choose_batch("shared", full, lone, training_users=set(), now=NOW) == full


def test_a_lone_rater_cannot_move_a_shared_adapter_and_two_can():
    """mallory rates twelve replies: at the defaults the shared adapter waits for a second user
    (it used to train on batches that were all hers); with alice's samples in, it trains, and
    neither fills more than half."""
    mallory = [sample("mallory", age_s=500, i=i) for i in range(16)]
    waiting = choose_batch("shared", mallory, settings(), training_users=set(), now=NOW)
    assert isinstance(waiting, Waiting) and waiting.reason == "contributors" and "mallory" in waiting.detail
    assert isinstance(choose_batch("shared", mallory[:4], settings(), {"mallory"}, now=NOW), Waiting)
    both = mallory + [sample("alice", age_s=400, i=100 + i) for i in range(8)]
    batch = choose_batch("shared", both, settings(), training_users={"mallory", "alice"}, now=NOW)
    assert isinstance(batch, list) and {x.user for x in batch} == {"mallory", "alice"}
    assert sum(x.user == "mallory" for x in batch) <= len(batch) / 2
    # a user's own adapter is theirs alone: the rule is the shared scope's
    assert choose_batch("mallory", mallory, settings(), set(), now=NOW) == mallory


def test_the_share_cap_holds_while_another_user_trains_the_adapter_and_says_so():
    ready = [sample(age_s=500, i=i) for i in range(12)]
    waiting = choose_batch("shared", ready, settings(shared_min_contributors=1), training_users={"alice", "bob"}, now=NOW)
    assert isinstance(waiting, Waiting) and waiting.reason == "user_share" and waiting.ready == 12
    assert "alice" in waiting.detail and "bob" in waiting.detail and "NEXTSTATE_ADAPTER_SCOPE=user" in waiting.detail
    # bob's samples arrive: half and half
    mixed = ready + [sample("bob", age_s=10, i=100 + i) for i in range(8)]
    batch = choose_batch("shared", mixed, settings(), training_users={"alice", "bob"}, now=NOW)
    assert isinstance(batch, list) and len(batch) == 16 and sum(x.user == "bob" for x in batch) == 8
    # the cap is the shared scope's: a user's own adapter takes all of their samples
    assert len(choose_batch("alice", ready, settings(), training_users=set(), now=NOW)) == 12


def test_a_partial_batch_waits_for_its_time_and_says_how_long():
    ready = [sample(age_s=30, i=i) for i in range(5)]
    waiting = choose_batch("alice", ready, settings(), set(), now=NOW)
    assert waiting.reason == "batch_wait" and "in 90 s" in waiting.detail
    assert choose_batch("alice", ready, settings(), set(), now=NOW + 90) == ready
    few = choose_batch("alice", ready[:3], settings(), set(), now=NOW + 1000)
    assert few.reason == "min_batch" and "3 sample(s) ready" in few.detail and "or at least 4" in few.detail
    # at the defaults a partial batch is never smaller than a full one: the detail names only the batch
    default = choose_batch("alice", ready[:3], LearnerSettings(), set(), now=NOW + 1000)
    assert default.reason == "min_batch" and default.detail.endswith("an update needs 4 (NEXTSTATE_BATCH_SIZE)")
    off = choose_batch("alice", ready, settings(batch_wait_s=0), set(), now=NOW + 1000)
    assert off.reason == "partial_off"
    assert choose_batch("alice", [], settings(), set(), now=NOW) is None


def test_nextstate_status_says_what_training_waits_for_from_the_data_dir(tmp_path):
    """Offline (`nextstate status`, server running or not): the same choice, from the store."""
    from nextstate.core.stores.samples import SampleStore
    from nextstate.learner.batching import waiting_in_store
    from nextstate.learner.versions import AdapterVersions
    from nextstate.progress import progress_report, render_text

    store = SampleStore(tmp_path / "samples.sqlite3")
    try:
        for i in range(2):
            store.add_sample(sample(age_s=10, i=i).model_copy(update={"id": None, "created_at": NOW - 10}))
        (why,) = waiting_in_store(store, settings(), per_user=True, now=NOW)
        assert (why.scope, why.reason, why.ready) == ("alice", "min_batch", 2)
        report = progress_report(store, AdapterVersions(tmp_path / "adapters"), mode="binary", per_user=True,
                                 learner_settings=settings())
        assert "training waits (alice, min_batch): 2 sample(s) ready" in render_text(report, "here")
    finally:
        store.close()
