"""A reply accepted right after a correction also trains on the prompt of the turn it corrected."""

from __future__ import annotations

import pytest

from nextstate.judge.accepted import REASON, corrected_pairs
from nextstate.core.types import Sample
from tests.test_feedback import rate
from tests.test_judge import converse, judged_server
from tests.test_learner import learning_server

CORRECTED = [
    {"role": "user", "content": "Translate 'good morning' for me."},
    {"role": "user", "content": "No, that's wrong. I need it in French."},  # turn 1 corrected → -1
    {"role": "user", "content": "Thanks, that's great!"},  # turn 2 accepted → +1
]


def settled_samples(server) -> list[Sample]:
    server.end_conversations()
    server.drain_judge()
    return server.app.state.services.samples.samples()


def derived(samples: list[Sample]) -> list[Sample]:
    return [s for s in samples if s.reason.startswith(REASON)]


def test_the_accepted_reply_becomes_a_sample_of_the_corrected_turn(server_factory, judge):
    server = judged_server(server_factory, judge, accepted_after_correction=True)
    converse(server.client(server.key("alice")), CORRECTED)
    samples = settled_samples(server)
    own = {s.turn_index: s for s in samples if s.accepted_from is None}
    assert (own[1].reward, own[2].reward) == (-1, 1)
    [extra] = derived(samples)
    # the corrected turn's prompt, the accepted turn's reply and reward
    assert (extra.turn_index, extra.accepted_from, extra.status, extra.reward, extra.response_id) == (1, 2, "ready", 1.0, None)
    assert extra.prompt_ids == own[1].prompt_ids and extra.response_ids == own[2].response_ids
    assert extra.advantages == [1.0] * len(extra.response_ids) and extra.loss_mask == [1] * len(extra.response_ids)
    assert own[1].reward_weight == own[2].reward_weight == extra.reward_weight == 1.0, "what a baseline is taken off at"
    # old logprobs: the serving policy's own scores of that reply on that prompt (PPO's ratio starts at 1)
    engine = server.app.state.services.turns.engine
    rescored = server.call(engine.score(extra.prompt_ids + extra.response_ids, len(extra.prompt_ids),
                                        adapter=None, temperature=own[2].logprob_temperature))
    assert extra.old_logprobs == pytest.approx(rescored, abs=1e-5)
    assert extra.old_logprobs != pytest.approx(own[2].old_logprobs, abs=1e-3), "scored on the other prompt"
    record = next(r for r in server.records() if r["kind"] == "accepted_reply")
    assert (record["sample_id"], record["turn_index"], record["accepted_from"]) == (extra.id, 1, 2)


def test_it_is_off_by_default(server_factory, judge):
    server = judged_server(server_factory, judge)
    converse(server.client(server.key("alice")), CORRECTED)
    samples = settled_samples(server)
    assert len(samples) == 2 and not derived(samples)


def test_a_persons_ratings_make_it_without_a_judge_and_only_once(server_factory):
    server = learning_server(server_factory, learn=False, accepted_after_correction=True)
    alice = server.key("alice")
    client = server.client(alice)
    messages = [{"role": "user", "content": "Say something."}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Shorter, please."}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    assert rate(server, alice, first.id, -1, "Answer in one short sentence.").json()["status"] == "accepted"
    for _ in range(2):  # rating the accepted reply again replaces its sample; the extra one stays one
        assert rate(server, alice, second.id, 1).json()["status"] == "accepted"
    [extra] = derived(server.app.state.services.samples.samples())
    assert extra.turn_index == 1 and extra.reward == 1.0 and extra.status == "ready"


def _sample(index: int, reward: float, status: str = "ready", accepted_from: int | None = None,
            track: str = "personal") -> Sample:
    return Sample(user="u", session_id="s", turn_index=index, policy_version=0, adapter=None, mode="combined",
                  track=track, status=status, reason="", prompt_ids=[index], response_ids=[2], old_logprobs=[-1.0],
                  logprob_temperature=1.0, advantages=[reward], loss_mask=[1], reward=reward, created_at=0,
                  accepted_from=accepted_from)


def test_only_a_negative_verdict_then_a_positive_one_on_the_next_turn_pair():
    bad, good = _sample(1, -1.0), _sample(2, 1.0)
    assert corrected_pairs([good, bad]) == [(bad, good)], "in either order"
    assert corrected_pairs([_sample(1, -1.0), _sample(3, 1.0)]) == [], "not consecutive"
    assert corrected_pairs([bad, _sample(2, 0.0)]) == [] and corrected_pairs([bad, _sample(2, -1.0)]) == []
    assert corrected_pairs([_sample(1, 0.0), good]) == [], "the earlier reply was not corrected"
    assert corrected_pairs([bad, _sample(2, 1.0, status="dropped")]) == []
    assert corrected_pairs([bad, good, _sample(1, 1.0, accepted_from=2)]) == [], "once per corrected turn"
    assert corrected_pairs([bad, _sample(2, 1.0, track="outcome")]) == [], "an outcome step's reward is the episode's"
    chain = [_sample(1, -1.0), _sample(2, -1.0), _sample(3, 1.0)]
    assert corrected_pairs(chain) == [(chain[1], chain[2])], "the reply accepted corrects the turn just before it"
