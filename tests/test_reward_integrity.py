"""No user can steer the model beyond their share: outcomes, shares of a batch, bad samples."""

from __future__ import annotations

import time

import httpx
import torch

from nextstate.core.settings import LearnerSettings
from nextstate.learner.trainer import LoraTrainer
from tests.judge_server import ScriptedJudge
from tests.test_judge import SCRIPT, converse
from tests.test_learner import PROMPT, feed, generate, learning_server, make_sample, served_samples, wait_for


def post_outcome(server, key, session, reward) -> httpx.Response:
    return httpx.post(f"{server.base_url}/sessions/{session}/outcome", json={"reward": reward},
                      headers={"Authorization": f"Bearer {key}"}, timeout=30)


def test_outcomes_only_for_declared_sessions_and_within_bounds(server_factory):
    judge = ScriptedJudge()
    try:
        server = server_factory(judge_base_url=judge.base_url, mode="binary", prm_votes=1)
        key = server.key("env")
        client = server.client(key)
        converse(client, SCRIPT[:2], headers={"X-Session-Id": "declared", "X-Outcome-Expected": "true"})
        converse(client, SCRIPT[:2], headers={"X-Session-Id": "ordinary"})
        refused = post_outcome(server, key, "ordinary", 1)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "outcome_not_expected"
        for reward in (1_000_000, 1e308, -2, 1.0001):
            resp = post_outcome(server, key, "declared", reward)
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "reward_out_of_range", reward
        assert post_outcome(server, key, "declared", "1").status_code == 400, "a string is not a number"
        assert post_outcome(server, key, "declared", 1).status_code == 200
        server.end_conversations()
        server.drain_judge()
        assert post_outcome(server, key, "declared", -1).status_code == 200, "still known once the session closed"
        assert post_outcome(server, key, "ordinary", 1).status_code == 409
    finally:
        judge.stop()


def test_one_user_cannot_fill_a_shared_batch_while_others_train_it(server_factory):
    server = learning_server(server_factory, max_user_share=0.5)
    server.key("alice"), server.key("bob")
    # bob trains the shared adapter too: one of his samples was trained a moment ago
    store = server.app.state.services.samples
    (earlier,) = served_samples(server, 1, user="bob", seed0=90)
    store.mark_consumed([store.add_sample(earlier.model_copy(update={"created_at": time.time()})).id])
    feed(server, served_samples(server, 6, user="alice"))
    server.call(_sleep(1.5))
    assert server.app.state.services.policies.current("bob").version == 0, "alice alone published a version for bob"
    feed(server, served_samples(server, 2, user="bob", seed0=50))
    wait_for(lambda: server.app.state.services.policies.current("bob").version == 1)
    (step,) = [r for r in server.records() if r["kind"] == "train_step"]
    assert len(step["sample_ids"]) == 4
    users = [s.user for s in server.app.state.services.samples.samples("consumed") if s.id in step["sample_ids"]]
    assert sorted(users) == ["alice", "alice", "bob", "bob"]


def test_a_single_user_server_trains_on_its_own(server_factory):
    server = learning_server(server_factory, max_user_share=0.5)
    feed(server, served_samples(server, 4, user="alice"))
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 1)


def test_keys_alone_do_not_make_other_users(server_factory):
    """An admin key for the dashboard, a colleague's idle key: neither trains the adapter, so
    neither holds back the one user who does (it stalled a lone user's training for good)."""
    server = learning_server(server_factory, max_user_share=0.5)
    server.key("alice"), server.key("root", admin=True), server.key("bob")
    feed(server, served_samples(server, 4, user="alice"))
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 1)


def test_a_batch_without_signal_publishes_nothing(server_factory):
    server = learning_server(server_factory)
    feed(server, served_samples(server, 4, advantage=0.0))
    # with no KL term they carry nothing to learn: dropped before batching, no step at all
    wait_for(lambda: len(server.app.state.services.samples.samples("dropped")) == 4)
    assert all(s.reason.startswith("no signal") for s in server.app.state.services.samples.samples("dropped"))
    assert not [r for r in server.records() if r["kind"] == "train_step"]
    assert server.app.state.services.policies.current("alice").version == 0
    assert not (server.settings.adapters_dir / "shared").exists()


def test_a_sample_with_non_finite_values_is_dropped_alone(server_factory):
    server = learning_server(server_factory)
    samples = served_samples(server, 4)
    samples[1] = samples[1].model_copy(update={"advantages": [float("inf")] * len(samples[1].response_ids)})
    samples[2] = samples[2].model_copy(update={"old_logprobs": [float("nan")] * len(samples[2].response_ids)})
    feed(server, samples)
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 1)
    dropped = server.app.state.services.samples.samples("dropped")
    assert sorted(s.id for s in dropped) == [2, 3] and all("not finite" in s.reason for s in dropped)
    assert [s.id for s in server.app.state.services.samples.samples("consumed")] == [1, 4], "the rest of the batch trained"


async def test_advantages_are_clipped_in_training(tiny_model_dir):
    """An advantage of a million moves the weights exactly as one at the clip does."""
    from nextstate.engine.local import LocalEngine

    engine = await LocalEngine.open(tiny_model_dir, device="cpu")
    try:
        toks = (await generate(engine, 1))[0]
    finally:
        await engine.close()
    weights = []
    for advantage in (1e6, 5.0):
        torch.manual_seed(0)
        trainer = LoraTrainer(tiny_model_dir, LearnerSettings(lr=1e-2, lora_r=4, lora_alpha=8, max_advantage=5.0, max_kl=1e9))
        trainer.step("shared", [make_sample(toks, prompt=PROMPT, advantage=advantage)])
        weights.append([p.detach().clone() for p in trainer._params(trainer.ensure_scope("shared"))])
    assert all(torch.allclose(a, b) for a, b in zip(*weights))


async def _sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)
