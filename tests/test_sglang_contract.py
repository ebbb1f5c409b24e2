"""The SGLang client's contract, checked against the fake and against a real SGLang server.

Every test here runs twice: on tests/fake_sglang.py (kept for fault injection and speed) and on a
real SGLang, started on the CPU by tests/real_engines/sglang_server.py (`real_engine`: run by
.ci/real-engines, which installs the pinned version). Each of the four ways the real server once
disagreed with the fake has a test here: the unknown-adapter error in its JSON and streamed
forms (reload after SGLang restarts), unload that is not final (names never reused, a restarted
nextstate finding its adapter loaded), logprobs under a grammar mask (constrained replies scored
again), and the lifecycle of many versions on one long-running server.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from nextstate.engine.base import EngineError, SamplingParams, UnknownAdapterError
from nextstate.engine.sglang import SGLangEngine
from tests.fake_sglang import FakeSGLang
from tests.real_engines.contract import ENUM_TOOL, PROMPT, TOLERANCE, generate, unique, write_adapters
from tests.real_engines.sglang_server import RealSGLang


@pytest.fixture(scope="module", params=["fake", pytest.param("real", marks=pytest.mark.real_engine)])
def sglang(request, tiny_model_dir, tmp_path_factory):
    if request.param == "fake":
        server = FakeSGLang(tiny_model_dir)
    else:
        server = RealSGLang(tiny_model_dir, tmp_path_factory.mktemp("sglang"))
        print(f"real SGLang {server.version} at {server.url}")
    yield server
    server.stop()


@pytest.fixture
async def client(sglang, tiny_model_dir):
    engine = SGLangEngine(sglang.url, tiny_model_dir, timeout_s=120.0, retries=1, backoff_s=0.2)
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    return write_adapters(tiny_model_dir, tmp_path_factory.mktemp("adapters"))


async def test_sampled_logprobs_are_the_models_own_at_temperature_one(client, direct):
    tokens = await generate(client, SamplingParams(max_new_tokens=12, temperature=0.8, seed=3, top_logprobs=2))
    ids = [t.token_id for t in tokens]
    assert 1 <= len(ids) <= 12 and tokens[-1].finish_reason in ("stop", "length")
    assert all(t.finish_reason is None for t in tokens[:-1])
    raw = await direct.score(PROMPT + ids, len(PROMPT))
    assert [t.logprob for t in tokens] == pytest.approx(raw, abs=TOLERANCE)
    assert [len(t.top_logprobs) for t in tokens] == [2] * len(tokens)
    await client.check_logprobs(PROMPT)  # the start-up check passes on a server launched as deploy/ does


async def test_scores_are_aligned_one_per_token(client, direct):
    for start in (1, 10, len(PROMPT) - 1):
        scored = await client.score(PROMPT, start)
        assert len(scored) == len(PROMPT) - start
        assert scored == pytest.approx(await direct.score(PROMPT, start), abs=TOLERANCE)


async def test_greedy_replies_are_the_models(client, direct):
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    assert [t.token_id for t in await generate(client, params)] == [t.token_id for t in await generate(direct, params)]


async def test_an_adapter_is_served_by_its_name_and_a_name_never_changes_weights(client, direct, sglang, adapters, tiny_model_dir):
    name = unique("a")
    await client.load_adapter(name, str(adapters["a"]))
    await direct.load_adapter(name, str(adapters["a"]))
    tokens = await generate(client, SamplingParams(max_new_tokens=8, temperature=1.0, seed=5), name)
    ids = [t.token_id for t in tokens]
    assert [t.logprob for t in tokens] == pytest.approx(await direct.score(PROMPT + ids, len(PROMPT), adapter=name), abs=TOLERANCE)
    assert await client.score(PROMPT, 5, adapter=name) == pytest.approx(await direct.score(PROMPT, 5, adapter=name), abs=TOLERANCE)
    assert await client.score(PROMPT, 5) != pytest.approx(await client.score(PROMPT, 5, adapter=name), abs=TOLERANCE)
    assert sglang.loaded_adapters()[name] == str(adapters["a"])
    # nextstate restarted while SGLang ran on: loading its adapter again finds it there
    restarted = SGLangEngine(sglang.url, tiny_model_dir, timeout_s=60.0, retries=0)
    try:
        await restarted.load_adapter(name, str(adapters["a"]))
        assert restarted.adapters == [name]
        with pytest.raises(EngineError, match="could not load"):
            await restarted.load_adapter(name, str(adapters["b"]))  # a name is never given other weights
    finally:
        await restarted.close()
    await client.unload_adapter(name)
    assert name not in sglang.loaded_adapters()
    # SGLang's unload is not final: a request naming the adapter loads it again from its path...
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}, "lora_path": name}
    assert httpx.post(f"{sglang.url}/generate", json=body, timeout=60).status_code == 200
    # ...so the client never sends a name it unloaded (versions get new names instead)
    with pytest.raises(UnknownAdapterError):
        await generate(client, SamplingParams(max_new_tokens=2), name)
    await client.load_adapter(name, str(adapters["a"]))  # and may take it up again, as it is
    await client.unload_adapter(name)


async def test_an_adapter_lost_in_a_restart_is_loaded_again_streamed_or_scored(client, direct, sglang, adapters):
    """SGLang keeps adapters in memory: after it restarts, a request naming one fails with
    "has never been loaded" (0.5.23; a 400, or a 200 whose stream's first event is the error).
    The client loads it again and the request goes through, for generation and scoring alike."""
    name = unique("lost")
    await client.load_adapter(name, str(adapters["b"]))
    await direct.load_adapter(name, str(adapters["b"]))
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=2)
    sglang.restart()
    tokens = await generate(client, params, name)
    ids = [t.token_id for t in tokens]
    assert [t.logprob for t in tokens] == pytest.approx(await direct.score(PROMPT + ids, len(PROMPT), adapter=name), abs=TOLERANCE)
    sglang.restart()
    assert await client.score(PROMPT, 5, adapter=name) == pytest.approx(await direct.score(PROMPT, 5, adapter=name), abs=TOLERANCE)
    await client.unload_adapter(name)


def test_a_forced_tool_call_is_kept_with_the_models_own_logprobs(server_factory, sglang, direct):
    """SGLang reports a constrained reply's logprobs after the grammar mask (near 0 where the
    model's own are -6 to -9); the learner computes the model's own, so the turn must keep those."""
    if isinstance(sglang, FakeSGLang):
        pytest.skip("the fake does not constrain decoding (tests/fake_sglang.py says what it imitates)")
    server = server_factory(engine="sglang", sglang_url=sglang.url, judge_enabled=False, learn=False)
    reply = server.client(server.key("alice")).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "look it up"}], tools=[ENUM_TOOL], tool_choice="required",
        max_tokens=200, temperature=1.0, seed=1)
    assert reply.choices[0].message.tool_calls, "a constrained reply is a tool call"
    turn = server.app.state.services.sessions.find_turn("alice", reply.id)
    model_own = server.call(direct.score(turn.prompt_ids + turn.response_ids, len(turn.prompt_ids)))
    assert turn.response_logprobs == pytest.approx(model_own, abs=TOLERANCE) and not turn.logprobs_masked


def test_twenty_versions_on_one_server_stay_bounded_and_serve_by_name(server_factory, sglang, direct):
    """A peer's learner leaked one adapter per step into its server until SGLang hung. Here each
    of 20 published versions serves the requests that name it, and the server holds at most the
    serving version and the one before it (unloaded once its requests finish)."""
    from tests.test_learner import feed, served_samples, wait_for

    server = server_factory(engine="sglang", sglang_url=sglang.url, judge_enabled=False, batch_size=2,
                            min_batch_size=2, lr=5e-3, lora_r=4, lora_alpha=8, max_staleness=0)
    services = server.app.state.services
    client = server.client(server.key("alice"))
    ask = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=1.0)
    for version in range(1, 21):
        feed(server, served_samples(server, 2, seed0=10 * version))
        wait_for(lambda: services.policies.current("alice").version == version, timeout=120)
        name = services.policies.current("alice").adapter
        raw = client.chat.completions.with_raw_response.create(**ask, seed=version)
        assert raw.headers["x-policy-version"] == str(version)
        wait_for(lambda: set(sglang.loaded_adapters()) == {name}, timeout=60)
        if version in (1, 20):  # the reply is the named version's: its logprobs are that adapter's
            path = server.settings.adapters_dir / "shared" / f"v{version}"
            turn = services.sessions.find_turn("alice", raw.parse().id)
            server.call(direct.load_adapter(name, str(path)))
            own = server.call(direct.score(turn.prompt_ids + turn.response_ids, len(turn.prompt_ids), adapter=name))
            assert turn.response_logprobs == pytest.approx(own, abs=TOLERANCE)
    names = [r["adapter"] for r in server.records() if r["kind"] == "request" and r.get("adapter")]
    assert len(set(names)) == 20, "every version served under a name of its own"


async def test_a_restarted_nextstate_unloads_the_versions_its_predecessor_left(client, sglang, adapters, tiny_model_dir, tmp_path):
    """nextstate crashed (or was stopped) between publishing a version and unloading the one
    before it: the next nextstate unloads such leftovers from under its adapters folder, and
    nothing of anyone else's."""
    import shutil

    root = tmp_path / "adapters"
    old, current, foreign = unique("old"), unique("current"), unique("foreign")
    for name, source in ((old, "a"), (current, "b")):
        shutil.copytree(adapters[source], root / name)
        await client.load_adapter(name, str(root / name))
    await client.load_adapter(foreign, str(adapters["a"]))  # not under this nextstate's folder
    restarted = SGLangEngine(sglang.url, tiny_model_dir, timeout_s=60.0, retries=0)
    try:
        await restarted.load_adapter(current, str(root / current))
        assert await restarted.unload_leftovers(root, set(restarted.adapters)) == [old]
        loaded = sglang.loaded_adapters()
        assert current in loaded and foreign in loaded and old not in loaded
    finally:
        await restarted.close()
    for name in (current, foreign):
        await client.unload_adapter(name)


async def test_cached_prefixes_stay_within_their_salt(client, sglang):
    """Each user's requests carry their own cache salt (proxy/turns.py): the server's prefix
    cache then never reports — nor speeds up — one user's prompt for another."""
    if isinstance(sglang, FakeSGLang):
        pytest.skip("the fake has no prefix cache")
    prompt = list(range(5, 300))
    params = dict(max_new_tokens=1, temperature=0.0)

    async def cached(salt: str) -> int:
        tokens = await generate(client, SamplingParams(**params, cache_salt=salt), prompt=prompt)
        return tokens[0].cached_prompt_tokens or 0

    alice, bob = unique("alice"), unique("bob")
    assert await cached(alice) == 0
    assert await cached(bob) == 0, "another salt finds nothing"
    assert await cached(alice) > 200, "the same salt finds its own prefix"
