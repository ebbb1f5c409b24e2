"""The server clients' contract (SGLang, vLLM), checked against their fakes and the real servers.

Every test here runs on four servers: tests/fake_sglang.py and tests/fake_vllm.py (kept for
fault injection and speed), and a real SGLang and a real vLLM, started on the CPU by
tests/real_engines/ (`real_engine`: run by .ci/real-engines, which installs the pinned
versions). vLLM's CPU attention needs head_dim 64, so this module's tiny model is a wider one
(hidden size 256) than the rest of the suite's.

Each way a real server once disagreed with its fake has a test here. SGLang: the unknown-adapter
error in its JSON and streamed forms (reload after a restart), unload that is not final (names
never reused, a restarted nextstate finding its adapter loaded), logprobs under a grammar mask
(constrained replies scored again), the lifecycle of 20 versions on one server. vLLM: unload that
is final (404 "does not exist", also what a restarted vLLM answers), the same masked logprobs,
cached prompt tokens told only after the last token.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import httpx
import pytest

from nextstate.engine.base import EngineError, SamplingParams, UnknownAdapterError
from nextstate.engine.sglang import SGLangEngine
from nextstate.engine.vllm import VLLMEngine
from tests.fake_sglang import FakeSGLang
from tests.fake_vllm import FakeVLLM
from tests.tiny_model import build_tiny_model

PROMPT = list(range(5, 40))
# fp32 on both sides; a server's CPU attention and the embedded engine differ by rounding
TOLERANCE = 2e-3


def write_adapters(model_dir: Path, root: Path) -> dict[str, Path]:
    """Two peft adapters with non-zero weights, as the learner writes them: "a" and "b"."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = {}
    for seed, name in enumerate("ab"):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
                       ).save_pretrained(root / name)
        out[name] = root / name
    return out


def unique(name: str) -> str:
    """A name this server has never seen (SGLang never forgets one; a server lives for a module)."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


async def generate(engine, params, adapter=None, prompt=PROMPT):
    return [t async for t in engine.generate(prompt, params, adapter)]


# A forced tool call whose JSON is short whatever the (random) model prefers: one of two words.
ENUM_TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"n": {"enum": ["x", "y"]}}, "required": ["n"], "additionalProperties": False}}}


CLIENTS = {"sglang": SGLangEngine, "vllm": VLLMEngine}
# Versions published into one server by the lifecycle test: SGLang's leak was one adapter per step.
VERSIONS = {"sglang": 20, "vllm": 4}  # real servers; the fakes show the bound on fewer
FAKE_VERSIONS = 6


def servers():
    """(kind, fake) for each server the tests run on; the real ones are `real_engine`."""
    for kind in CLIENTS:
        yield pytest.param((kind, True), id=f"{kind}-fake")
        yield pytest.param((kind, False), marks=pytest.mark.real_engine, id=f"{kind}-real")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """This module's model, for every fixture that asks for the tiny one (direct, server_factory)."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-h256", hidden_size=256)


@pytest.fixture(scope="module", params=list(servers()))
def server(request, tiny_model_dir, tmp_path_factory):
    """A server of kind `server.kind` (sglang, vllm); `server.fake` says whether it is a fake."""
    kind, fake = request.param
    if fake:
        process = FakeSGLang(tiny_model_dir) if kind == "sglang" else FakeVLLM(tiny_model_dir)
    else:
        from tests.real_engines.sglang_server import RealSGLang
        from tests.real_engines.vllm_server import RealVLLM

        process = (RealSGLang if kind == "sglang" else RealVLLM)(tiny_model_dir, tmp_path_factory.mktemp(kind))
        print(f"real {process.name} {process.version} at {process.url}")
    process.kind, process.fake = kind, fake
    yield process
    process.stop()


@pytest.fixture
async def client(server, tiny_model_dir):
    engine = CLIENTS[server.kind](server.url, tiny_model_dir, timeout_s=120.0, retries=1, backoff_s=0.2)
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    return write_adapters(tiny_model_dir, tmp_path_factory.mktemp("adapters"))


def engine_settings(server) -> dict:
    return {"engine": server.kind, f"{server.kind}_url": server.url}


async def test_sampled_logprobs_are_the_models_own_at_temperature_one(client, direct, server):
    tokens = await generate(client, SamplingParams(max_new_tokens=12, temperature=0.8, seed=3, top_logprobs=2))
    ids = [t.token_id for t in tokens]
    assert 1 <= len(ids) <= 12 and tokens[-1].finish_reason in ("stop", "length")
    assert all(t.finish_reason is None for t in tokens[:-1])
    raw = await direct.score(PROMPT + ids, len(PROMPT))
    assert [t.logprob for t in tokens] == pytest.approx(raw, abs=TOLERANCE)
    assert [len(t.top_logprobs) for t in tokens] == [2] * len(tokens)
    assert all(a[1] >= b[1] for t in tokens for a, b in zip(t.top_logprobs, t.top_logprobs[1:])), "best first"
    await client.check_server(PROMPT)  # the start-up checks pass on a server launched as deploy/ does
    if server.kind == "vllm":
        assert client.info.max_context == (4096 if server.fake else 2048), "the context vLLM serves"


async def test_a_stop_token_is_kept_with_its_logprob(client, direct):
    """The learner trains on the token that ended the reply: it stays in the reply's ids."""
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


async def test_the_vocabularys_last_tokens_are_scored(client, direct):
    """SGLang echoes the vocabulary's last id as 0 beside its logprob (an off-by-one of its
    image-token clip); the start-up probe sampled that id now and then, and nextstate refused
    a sound server for it (CI, 2026-12-01, and most likely 2026-11-27)."""
    vocab = client.info.vocab_size
    assert vocab > 0
    ids = PROMPT[:10] + [vocab - 1, vocab - 2, 7, vocab - 1]
    scored = await client.score(ids, 10)
    assert scored == pytest.approx(await direct.score(ids, 10), abs=TOLERANCE)


async def test_greedy_replies_are_the_models(client, direct):
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    assert [t.token_id for t in await generate(client, params)] == [t.token_id for t in await generate(direct, params)]


async def test_an_adapter_is_served_by_its_name_and_a_name_never_changes_weights(client, direct, server, adapters, tiny_model_dir):
    name = unique("a")
    await client.load_adapter(name, str(adapters["a"]))
    await direct.load_adapter(name, str(adapters["a"]))
    tokens = await generate(client, SamplingParams(max_new_tokens=8, temperature=1.0, seed=5), name)
    ids = [t.token_id for t in tokens]
    assert [t.logprob for t in tokens] == pytest.approx(await direct.score(PROMPT + ids, len(PROMPT), adapter=name), abs=TOLERANCE)
    assert await client.score(PROMPT, 5, adapter=name) == pytest.approx(await direct.score(PROMPT, 5, adapter=name), abs=TOLERANCE)
    assert await client.score(PROMPT, 5) != pytest.approx(await client.score(PROMPT, 5, adapter=name), abs=TOLERANCE)
    assert server.loaded_adapters()[name] == str(adapters["a"])
    # nextstate restarted while the server ran on: loading its adapter again finds it there
    restarted = CLIENTS[server.kind](server.url, tiny_model_dir, timeout_s=60.0, retries=0)
    try:
        await restarted.load_adapter(name, str(adapters["a"]))
        assert restarted.adapters == [name]
        with pytest.raises(EngineError, match="could not load"):
            await restarted.load_adapter(name, str(adapters["b"]))  # a name is never given other weights
    finally:
        await restarted.close()
    await client.unload_adapter(name)
    assert name not in server.loaded_adapters()
    if server.kind == "sglang":
        # SGLang's unload is not final: a request naming the adapter loads it again from its path...
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}, "lora_path": name}
        assert httpx.post(f"{server.url}/generate", json=body, timeout=60).status_code == 200
    else:
        # vLLM's is: a request naming it is refused
        body = {"model": name, "prompt": PROMPT, "max_tokens": 1}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 404 and "does not exist" in answer.text
    # either way the client never sends a name it unloaded (versions get new names instead)
    with pytest.raises(UnknownAdapterError):
        await generate(client, SamplingParams(max_new_tokens=2), name)
    await client.load_adapter(name, str(adapters["a"]))  # and may take it up again, as it is
    await client.unload_adapter(name)


async def test_a_users_exported_adapter_serves_there_as_nextstate_serves_it(client, direct, server, tiny_model_dir, tmp_path):
    """Take your adapter with you (issue 42): the learner's own adapter (its LoRA config: rank 16
    on every attention and MLP projection), written by `nextstate export` as a standard PEFT
    adapter, is loaded by the server from the export's folder — as `--lora-modules NAME=DIR`
    (vLLM) or `--lora-paths NAME=DIR` (SGLang) would — and scores there as nextstate serves it."""
    from nextstate.export import build_export, write_export
    from tests.learner_adapters import publish_random_adapter

    settings = publish_random_adapter(tmp_path / "data", tiny_model_dir)
    out = write_export(build_export(settings, "alice"), tmp_path / "alice-adapter")
    name = unique("exported")
    await client.load_adapter(name, str(out))
    await direct.load_adapter(name, str(out))
    tokens = await generate(client, SamplingParams(max_new_tokens=8, temperature=1.0, seed=11), name)
    ids = [t.token_id for t in tokens]
    assert [t.logprob for t in tokens] == pytest.approx(await direct.score(PROMPT + ids, len(PROMPT), adapter=name), abs=TOLERANCE)
    assert await client.score(PROMPT, 5, adapter=name) != pytest.approx(await client.score(PROMPT, 5), abs=TOLERANCE), \
        "the adapter changes what is served"
    await client.unload_adapter(name)


async def test_an_adapter_lost_in_a_restart_is_loaded_again_streamed_or_scored(client, direct, server, adapters):
    """Servers keep adapters in memory: after a restart, a request naming one fails (SGLang 0.5.23:
    "has never been loaded", a 400 or a 200 whose stream's first event is the error; vLLM: a 404
    "does not exist"). The client loads it again and the request goes through."""
    name = unique("lost")
    await client.load_adapter(name, str(adapters["b"]))
    await direct.load_adapter(name, str(adapters["b"]))
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=2)
    server.restart()
    tokens = await generate(client, params, name)
    ids = [t.token_id for t in tokens]
    assert [t.logprob for t in tokens] == pytest.approx(await direct.score(PROMPT + ids, len(PROMPT), adapter=name), abs=TOLERANCE)
    server.restart()
    assert await client.score(PROMPT, 5, adapter=name) == pytest.approx(await direct.score(PROMPT, 5, adapter=name), abs=TOLERANCE)
    await client.unload_adapter(name)


async def test_a_restarted_nextstate_unloads_the_versions_its_predecessor_left(client, server, adapters, tiny_model_dir, tmp_path):
    """nextstate crashed (or was stopped) between publishing a version and unloading the one
    before it: the next nextstate unloads such leftovers from under its adapters folder, and
    nothing of anyone else's."""
    root = tmp_path / "adapters"
    old, current, foreign = unique("old"), unique("current"), unique("foreign")
    for name, source in ((old, "a"), (current, "b")):
        shutil.copytree(adapters[source], root / name)
        await client.load_adapter(name, str(root / name))
    await client.load_adapter(foreign, str(adapters["a"]))  # not under this nextstate's folder
    restarted = CLIENTS[server.kind](server.url, tiny_model_dir, timeout_s=60.0, retries=0)
    try:
        await restarted.load_adapter(current, str(root / current))
        assert await restarted.unload_leftovers(root, set(restarted.adapters)) == [old]
        loaded = server.loaded_adapters()
        assert current in loaded and foreign in loaded and old not in loaded
    finally:
        await restarted.close()
    for name in (current, foreign):
        await client.unload_adapter(name)


def test_a_forced_tool_call_is_kept_with_the_models_own_logprobs(server_factory, server, direct):
    """Both servers report a constrained reply's logprobs after the grammar mask (near 0 where the
    model's own are -6 to -9); the learner computes the model's own, so the turn must keep those."""
    if server.fake:
        pytest.skip("the fakes do not constrain decoding (each says what it imitates)")
    nextstate = server_factory(**engine_settings(server), judge_enabled=False, learn=False)
    reply = nextstate.client(nextstate.key("alice")).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "look it up"}], tools=[ENUM_TOOL], tool_choice="required",
        max_tokens=200, temperature=1.0, seed=1)
    assert reply.choices[0].message.tool_calls, "a constrained reply is a tool call"
    turn = nextstate.app.state.services.sessions.find_turn("alice", reply.id)
    model_own = nextstate.call(direct.score(turn.prompt_ids + turn.response_ids, len(turn.prompt_ids)))
    assert turn.response_logprobs == pytest.approx(model_own, abs=TOLERANCE) and not turn.logprobs_masked


def test_many_versions_on_one_server_stay_bounded_and_serve_by_name(server_factory, server, direct):
    """A peer's learner leaked one adapter per step into its server until SGLang hung. Here each
    published version serves the requests that name it, and the server holds at most the
    serving version and the one before it (unloaded once its requests finish)."""
    from tests.test_learner import feed, served_samples, wait_for

    nextstate = server_factory(**engine_settings(server), judge_enabled=False, batch_size=2,
                               min_batch_size=2, lr=5e-3, lora_r=4, lora_alpha=8, max_staleness=0)
    services = nextstate.app.state.services
    client = nextstate.client(nextstate.key("alice"))
    ask = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=1.0)
    last = min(FAKE_VERSIONS, VERSIONS[server.kind]) if server.fake else VERSIONS[server.kind]
    for version in range(1, last + 1):
        feed(nextstate, served_samples(nextstate, 2, seed0=10 * version))
        wait_for(lambda: services.policies.current("alice").version == version, timeout=120)
        name = services.policies.current("alice").adapter
        raw = client.chat.completions.with_raw_response.create(**ask, seed=version)
        assert raw.headers["x-policy-version"] == str(version)
        wait_for(lambda: set(server.loaded_adapters()) == {name}, timeout=60)
        if version in (1, last):  # the reply is the named version's: its logprobs are that adapter's
            path = nextstate.settings.adapters_dir / "shared" / f"v{version}"
            turn = services.sessions.find_turn("alice", raw.parse().id)
            nextstate.call(direct.load_adapter(name, str(path)))
            own = nextstate.call(direct.score(turn.prompt_ids + turn.response_ids, len(turn.prompt_ids), adapter=name))
            assert turn.response_logprobs == pytest.approx(own, abs=TOLERANCE)
    names = [r["adapter"] for r in nextstate.records() if r["kind"] == "request" and r.get("adapter")]
    assert len(set(names)) == last, "every version served under a name of its own"


async def test_cached_prefixes_stay_within_their_salt(client, server):
    """Each user's requests carry their own cache salt (proxy/turns.py): the server's prefix
    cache then never reports — nor speeds up — one user's prompt for another."""
    if server.fake:
        pytest.skip("the fakes have no prefix cache")
    prompt = list(range(5, 300))
    params = dict(max_new_tokens=1, temperature=0.0)

    async def cached(salt: str) -> int:
        tokens = await generate(client, SamplingParams(**params, cache_salt=salt), prompt=prompt)
        return tokens[-1].cached_prompt_tokens or tokens[0].cached_prompt_tokens or 0

    alice, bob = unique("alice"), unique("bob")
    assert await cached(alice) == 0
    assert await cached(bob) == 0, "another salt finds nothing"
    assert await cached(alice) > 200, "the same salt finds its own prefix"
