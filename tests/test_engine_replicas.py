"""Engine replicas behind SGLang's router: nextstate → the real router (sglang-router) → two workers.

The workers are SGLang stand-ins (tests/fake_sglang.py: real HTTP, SGLang's shapes and adapter
behaviour, the embedded engine inside) so that the test is fast; the router is the real one.
What is pinned: a published version is loaded on every worker before it serves (the router does
not pass adapter loads on), each user's requests stay on one worker while users spread over
both, every request is served by the version it names whichever worker takes it, a worker that
restarts empty or joins later gets the current version, and old versions leave every worker.
The same module has the serving processes beside the learning one: a process that does not learn
serves each version the learner publishes to the shared adapters folder, and unloads what it
loaded again itself.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from nextstate.engine.sglang_router import ROUTING_KEY_HEADER
from tests.fake_sglang import FakeSGLang
from tests.real_engines.router_process import SGLangRouter
from tests.test_learner import feed, served_samples, wait_for

pytestmark = pytest.mark.distributed


@pytest.fixture
def workers(tiny_model_dir):
    started = [FakeSGLang(tiny_model_dir), FakeSGLang(tiny_model_dir)]
    yield started
    for worker in started:
        worker.stop()


@pytest.fixture
def router(workers, tmp_path):
    process = SGLangRouter([w.url for w in workers], tmp_path)
    wait_for(lambda: len(process.listed()) == 2, timeout=30)
    yield process
    process.stop()


def generations(worker: FakeSGLang) -> list[dict]:
    return [body for path, body in worker.requests if path == "/generate" and body["sampling_params"].get("max_new_tokens")]


def ask(server, user: str, seed: int = 0):
    client = server.client(server.key(user))
    return client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": f"hello from {user}"}], max_tokens=3, temperature=1.0, seed=seed)


def test_versions_reach_every_worker_and_each_user_stays_on_one(server_factory, router, workers, tiny_model_dir):
    server = server_factory(engine="sglang", sglang_url=router.url, sglang_router=True, judge_enabled=False,
                            batch_size=2, min_batch_size=2, lr=5e-3, lora_r=4, lora_alpha=8, max_staleness=0)
    services = server.app.state.services
    users = [f"user{i}" for i in range(8)]  # where a new user goes is the router's choice: several, to see both

    def publish(version: int) -> str:
        feed(server, served_samples(server, 2, seed0=10 * version))
        wait_for(lambda: services.policies.current("alice").version == version, timeout=120)
        return services.policies.current("alice").adapter

    v1 = publish(1)
    for worker in workers:  # loaded everywhere before it served anyone
        assert v1 in worker.loaded_adapters()
        worker.requests.clear()  # what they served before v1 (base-model requests)
    # the users' first requests at once: min_load places a new user by the requests in flight,
    # and one at a time every worker has none (a tie the router may break the same way each time)
    with concurrent.futures.ThreadPoolExecutor(len(users)) as pool:
        for answer in pool.map(lambda user: ask(server, user, seed=0), users):
            assert answer.headers["x-policy-version"] == "1"
    for user in users:
        assert ask(server, user, seed=1).headers["x-policy-version"] == "1"
    # each user's requests went to one worker, and the users spread over both
    homes = {}
    for index, worker in enumerate(workers):
        for body in generations(worker):
            assert body.get("lora_path") == v1, "every request served by the version it names"
            homes.setdefault(tuple(body["input_ids"]), set()).add(index)  # one prompt per user
    assert len(homes) == len(users) and all(len(h) == 1 for h in homes.values()), homes
    assert {i for h in homes.values() for i in h} == {0, 1}, "users spread over both workers"

    # a worker restarts empty: the next request that reaches it is still served by v1
    workers[0].restart()
    assert v1 not in workers[0].loaded_adapters()
    for user in users:
        assert ask(server, user, seed=7).headers["x-policy-version"] == "1"
    assert v1 in workers[0].loaded_adapters()
    assert all(b.get("lora_path") == v1 for w in workers for b in generations(w))

    # the next version replaces it on every worker
    v2 = publish(2)
    wait_for(lambda: all(set(w.loaded_adapters()) == {v2} for w in workers), timeout=30)

    # a worker that joins later gets the current version before it is asked for it
    joined = FakeSGLang(tiny_model_dir)
    try:
        router.add_worker(joined.url)
        wait_for(lambda: joined.url in router.listed(), timeout=30)
        engine = services.engine
        assert server.call(engine.sync_workers()) == 1
        assert set(joined.loaded_adapters()) == {v2}
    finally:
        joined.stop()


def test_requests_carry_their_users_routing_key_and_cache_scope(server_factory, router, workers):
    """The header the router pins on is the user's opaque cache salt, the same on every request
    of that user and different between users; the judge's own calls carry none. The router
    (0.3.2) re-encodes requests by its own schema and drops the body's `cache_salt` (pinned here,
    so that a router that passes it on is noticed), but passes `extra_key`, which carries the
    salt to the worker's prefix cache."""
    server = server_factory(engine="sglang", sglang_url=router.url, sglang_router=True, judge_enabled=False, learn=False)
    engine = server.app.state.services.engine
    assert engine._headers({"cache_salt": "abc"})[ROUTING_KEY_HEADER] == "abc"
    assert ROUTING_KEY_HEADER not in engine._headers({"cache_salt": None})
    for worker in workers:
        worker.requests.clear()
    for user in ("alice", "bob", "alice"):
        ask(server, user)
    bodies = [b for w in workers for b in generations(w)]
    assert len(bodies) == 3 and all("cache_salt" not in b for b in bodies)
    scopes = [b.get("extra_key") for b in bodies]
    assert None not in scopes and len(set(scopes)) == 2


@pytest.mark.real_engine
def test_real_sglang_workers_behind_the_router_serve_every_version(server_factory, tiny_model_dir, tmp_path):
    """The same with two real SGLang workers (.ci/real-engines): each version reaches both before
    it serves, and a worker restarted empty gets the version again: every request is served by
    the version it names (which worker took which user is the stand-in test's to show)."""
    from tests.real_engines.sglang_server import RealSGLang

    real: list[RealSGLang] = []
    process = None
    try:
        for i in range(2):
            (tmp_path / f"w{i}").mkdir()
            real.append(RealSGLang(tiny_model_dir, tmp_path / f"w{i}"))
        process = SGLangRouter([w.url for w in real], tmp_path)
        wait_for(lambda: len(process.listed()) == 2, timeout=60)
        server = server_factory(engine="sglang", sglang_url=process.url, sglang_router=True, judge_enabled=False,
                                batch_size=2, min_batch_size=2, lr=5e-3, lora_r=4, lora_alpha=8, max_staleness=0)
        services = server.app.state.services
        users = [f"user{i}" for i in range(4)]
        for version in (1, 2):
            feed(server, served_samples(server, 2, seed0=10 * version))
            wait_for(lambda: services.policies.current("alice").version == version, timeout=180)
            name = services.policies.current("alice").adapter
            wait_for(lambda: all(set(w.loaded_adapters()) == {name} for w in real), timeout=60)
            for user in users:
                assert ask(server, user, seed=version).headers["x-policy-version"] == str(version)
        real[0].restart()  # empty at its start (the 10 s worker sync may load v2 on it before the next line)
        for user in users:
            assert ask(server, user, seed=9).headers["x-policy-version"] == "2"
        wait_for(lambda: name in real[0].loaded_adapters(), timeout=30)
        served = [r for r in server.records() if r["kind"] == "request" and r.get("adapter") == name]
        assert len(served) >= 2 * len(users)
    finally:
        if process is not None:
            process.stop()
        for worker in real:
            worker.stop()


@pytest.mark.real_engine
async def test_users_on_one_real_worker_behind_the_router_never_share_cached_prefixes(tiny_model_dir, tmp_path):
    """Through the router, which drops `cache_salt`, the salt still scopes the worker's prefix
    cache (as `extra_key`): two users on the same worker, the same long prompt — only the user
    who sent it before finds it cached."""
    from nextstate.engine.base import SamplingParams
    from nextstate.engine.sglang_router import SGLangRouterEngine
    from tests.real_engines.sglang_server import RealSGLang

    worker = RealSGLang(tiny_model_dir, tmp_path)
    process = None
    try:
        process = SGLangRouter([worker.url], tmp_path)
        wait_for(lambda: len(process.listed()) == 1, timeout=60)
        client = SGLangRouterEngine(process.url, tiny_model_dir, timeout_s=120.0, retries=0)
        prompt = list(range(5, 300))

        async def cached(salt: str) -> int:
            params = SamplingParams(max_new_tokens=1, temperature=0.0, cache_salt=salt)
            tokens = [t async for t in client.generate(prompt, params)]
            return tokens[0].cached_prompt_tokens or 0

        try:
            assert await cached("alice-salt") == 0
            assert await cached("bob-salt") == 0, "another user on the same worker finds nothing"
            assert await cached("alice-salt") > 200, "the same user finds their own prefix"
        finally:
            await client.close()
    finally:
        if process is not None:
            process.stop()
        worker.stop()


def test_a_proxy_that_does_not_learn_serves_the_versions_the_learner_publishes(server_factory, workers, tmp_path, monkeypatch):
    """Two nextstate processes in front of one engine, one adapters folder between them: the one
    that learns publishes, the other (NEXTSTATE_LEARN=false) serves each version within seconds,
    by the same name, and stops sending the version before it."""
    from nextstate.learner import follower

    monkeypatch.setattr(follower, "FOLLOW_S", 0.2)
    shared = tmp_path / "adapters"
    engine = dict(engine="sglang", sglang_url=workers[0].url, judge_enabled=False, adapters_dir=shared)
    learning = server_factory(**engine, batch_size=2, min_batch_size=2, lr=5e-3, lora_r=4, lora_alpha=8, max_staleness=0)
    serving = server_factory(**engine, learn=False)
    for version in (1, 2):
        feed(learning, served_samples(learning, 2, seed0=10 * version))
        wait_for(lambda: learning.app.state.services.policies.current("alice").version == version, timeout=120)
        name = learning.app.state.services.policies.current("alice").adapter
        wait_for(lambda: serving.app.state.services.policies.current("alice").adapter == name, timeout=10)
        workers[0].requests.clear()
        assert ask(serving, "carol").headers["x-policy-version"] == str(version)
        # The serving proxy also reads carol's last conversation with the new version when it moves
        # (prefix warm-up, a one-token generation) and that read may land after the clear above.
        sent = generations(workers[0])
        assert {b.get("lora_path") for b in sent} == {name}
        assert sorted(b["sampling_params"]["max_new_tokens"] for b in sent) in ([3], [1, 3]), \
            "carol's question, and at most the warm-up's read beside it"
        assert serving.app.state.services.engine.adapters == [name], "the version before is no longer sent"


def test_a_follower_that_loaded_an_old_version_again_unloads_it_when_it_moves(server_factory, tiny_model_dir, tmp_path, monkeypatch):
    """vLLM forgets an unloaded adapter for good. Between the learner's publish of v2 (which
    unloads v1) and a follower's move, a request of the follower's on v1 finds it gone and loads it
    again, to be served; when the follower moves to v2 it unloads v1 itself, so the server does
    not keep a version nobody will unload."""
    from nextstate.learner import follower
    from tests.fake_vllm import FakeVLLM

    monkeypatch.setattr(follower, "FOLLOW_S", 3600.0)  # the test moves the follower itself
    engine = FakeVLLM(tiny_model_dir)
    try:
        shared = tmp_path / "adapters"
        settings = dict(engine="vllm", vllm_url=engine.url, judge_enabled=False, adapters_dir=shared)
        learning = server_factory(**settings, batch_size=2, min_batch_size=2, lr=5e-3, lora_r=4, lora_alpha=8,
                                  max_staleness=0)
        serving = server_factory(**settings, learn=False)
        services = serving.app.state.services
        names = []
        for version in (1, 2):
            feed(learning, served_samples(learning, 2, seed0=10 * version))
            wait_for(lambda: learning.app.state.services.policies.current("alice").version == version, timeout=120)
            names.append(learning.app.state.services.policies.current("alice").adapter)
            wait_for(lambda: set(engine.loaded_adapters()) == {names[-1]}, timeout=30)
            if version == 1:
                assert serving.call(services.follower.follow()) == 1
        # the follower still serves v1, which the learner has unloaded: its request loads it again
        assert ask(serving, "carol").headers["x-policy-version"] == "1"
        assert set(engine.loaded_adapters()) == set(names)
        assert serving.call(services.follower.follow()) == 1
        assert ask(serving, "carol").headers["x-policy-version"] == "2"
        assert set(engine.loaded_adapters()) == {names[1]}, "the follower unloaded the v1 it had loaded again"
    finally:
        engine.stop()


def test_with_a_shared_database_versions_and_forgetting_go_through_it(server_factory, workers, tmp_path, postgres, monkeypatch):
    """On PostgreSQL the serving version of each scope is published in the database once the
    learner loaded it, and followers read it there. Forgetting a user on a process that does not
    learn stops their adapter being served at once, everywhere, and the learner, asked through
    the database, deletes their versions."""
    import uuid

    import httpx

    from nextstate.learner import follower
    from nextstate.core.stores.versions import VersionRegistry

    monkeypatch.setattr(follower, "FOLLOW_S", 0.2)
    url = postgres.fresh_database(f"v{uuid.uuid4().hex[:12]}")
    engine = dict(engine="sglang", sglang_url=workers[0].url, judge_enabled=False, adapters_dir=tmp_path / "adapters",
                  database_url=url, adapter_scope="user")
    learning = server_factory(**engine, batch_size=2, min_batch_size=2, lr=5e-3, lora_r=4, lora_alpha=8, max_staleness=0)
    serving = server_factory(**engine, learn=False)
    feed(learning, served_samples(learning, 2, user="alice"))
    wait_for(lambda: learning.app.state.services.policies.current("alice").version == 1, timeout=120)
    name = learning.app.state.services.policies.current("alice").adapter
    registry = VersionRegistry(tmp_path / "unused.sqlite3", url)
    try:
        assert {s: (p.version, p.name) for s, p in registry.published().items()} == {"alice": (1, name)}
        wait_for(lambda: serving.app.state.services.policies.current("alice").adapter == name, timeout=10)
        assert ask(serving, "alice").headers["x-policy-version"] == "1"
        assert ask(serving, "bob").headers["x-policy-version"] == "0", "bob has no adapter of his own"

        admin = serving.key("root", admin=True)
        answer = httpx.delete(f"{serving.base_url}/admin/users/alice", headers={"Authorization": f"Bearer {admin}"}, timeout=60)
        assert answer.status_code == 200 and answer.json()["adapter_deleted"] is True, answer.text
        assert serving.app.state.services.policies.current("alice").adapter is None, "served the base model at once"
        scope_root = learning.app.state.services.learner.versions.scope_root("alice")
        wait_for(lambda: not scope_root.exists() and not registry.forgotten(), timeout=30)
        assert registry.published() == {}
        assert learning.app.state.services.policies.current("alice").adapter is None
    finally:
        registry.close()
