"""The `sglang` engine against a server speaking SGLang's documented API (tests/fake_sglang.py).

What this proves: the client sends the fields SGLang expects, parses both streaming modes,
aligns logprobs with sampled ids, scores with the right offset, manages adapters by name and
turns every failure into a clean error — and nextstate recovers when SGLang comes back.
That a real SGLang matches these shapes is tests/test_engine_contract.py's job (on the CPU, in
CI through .ci/real-engines) and the gpu-marked test's (against a running GPU server).
"""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest

from nextstate.engine.base import (
    EngineBadGateway, EngineError, EngineTimeout, EngineUnavailable, SamplingParams, UnknownAdapterError,
)
from nextstate.engine.sglang import SGLangEngine
from tests.fake_sglang import FakeSGLang

PROMPT = list(range(5, 40))


@pytest.fixture(params=[False, True], ids=["cumulative", "incremental"])
def sglang(request, tiny_model_dir):
    fake = FakeSGLang(tiny_model_dir, incremental=request.param)
    yield fake
    fake.stop()


@pytest.fixture
async def client(sglang, tiny_model_dir):
    engine = SGLangEngine(sglang.url, tiny_model_dir, timeout_s=2.0, retries=2, backoff_s=0.01)
    yield engine
    await engine.close()


async def collect(engine, params, adapter=None):
    return [t async for t in engine.generate(PROMPT, params, adapter)]


async def test_streamed_tokens_and_logprobs_match_the_model(client, direct, sglang):
    params = SamplingParams(max_new_tokens=20, temperature=0.8, seed=3, top_logprobs=2, stop_token_ids=(7,))
    via_sglang = await collect(client, params)
    expected = await collect(direct, params)
    assert [t.token_id for t in via_sglang] == [t.token_id for t in expected]
    # the convention on SGLang: logprobs at temperature 1 (SGLANG_RETURN_ORIGINAL_LOGPROB=1)
    raw = await direct.score(PROMPT + [t.token_id for t in expected], len(PROMPT))
    assert [t.logprob for t in via_sglang] == pytest.approx(raw, abs=1e-5)
    assert client.info.raw_logprobs is True
    assert [len(t.top_logprobs) for t in via_sglang] == [2] * len(via_sglang)
    assert via_sglang[-1].finish_reason == expected[-1].finish_reason
    assert all(t.finish_reason is None for t in via_sglang[:-1])
    _, sent = sglang.requests[-1]
    assert sent["input_ids"] == PROMPT and sent["stream"] is True and sent["return_logprob"] is True
    assert "lora_path" in sent and sent["lora_path"] is None, "always sent: a missing lora_path silently means base"
    assert sent["sampling_params"] == {
        "max_new_tokens": 20, "temperature": 0.8, "top_p": 1.0, "stop_token_ids": [7], "no_stop_trim": True,
        "skip_special_tokens": False, "sampling_seed": 3,
    }
    assert sent["top_logprobs_num"] == 2


async def test_one_connection_serves_generation_after_generation(client, sglang):
    """Each stream is read to its end, so the client keeps the connection: a new TCP connection per
    request cost ~2 ms of the proxy's CPU per reply (bench/proxy_overhead)."""
    for seed in range(3):
        tokens = await collect(client, SamplingParams(max_new_tokens=6, temperature=1.0, seed=seed))
        assert tokens[-1].finish_reason is not None
    assert len(sglang.generate_peers) == 3 and len(set(sglang.generate_peers)) == 1


async def test_scoring_is_aligned_one_logprob_per_token(client, direct, sglang):
    for start in (1, 10, len(PROMPT) - 1):
        scored = await client.score(PROMPT, start)
        assert len(scored) == len(PROMPT) - start
        assert scored == pytest.approx(await direct.score(PROMPT, start), abs=1e-5)
    _, sent = sglang.requests[-1]
    assert sent["sampling_params"]["max_new_tokens"] == 0 and sent["logprob_start_len"] == len(PROMPT) - 2
    # stock SGLang scores prompt tokens at temperature 1 whatever it is asked: asking otherwise is a bug
    with pytest.raises(ValueError, match="temperature 1"):
        await client.score(PROMPT, 5, temperature=0.7)


async def test_a_stock_sglang_with_tempered_sampled_logprobs_is_refused(client, tiny_model_dir):
    """Stock SGLang without SGLANG_RETURN_ORIGINAL_LOGPROB tempers sampled-token logprobs but not
    prompt-token ones: a turn's old logprobs and its teacher's would be at two temperatures."""
    await client.check_logprobs(PROMPT)  # the fixture's server runs the way deploy/ launches it
    stock = FakeSGLang(tiny_model_dir, return_original_logprob=False)
    engine = SGLangEngine(stock.url, tiny_model_dir, timeout_s=5.0, retries=0)
    try:
        with pytest.raises(EngineError, match="SGLANG_RETURN_ORIGINAL_LOGPROB=1"):
            await engine.check_logprobs(PROMPT)
    finally:
        await engine.close()
        stock.stop()


async def test_adapters_by_name(client, direct, sglang, tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    ).save_pretrained(tmp_path / "a")
    with pytest.raises(UnknownAdapterError):
        await collect(client, SamplingParams(max_new_tokens=2), adapter="user-v1")
    await client.load_adapter("user-v1", str(tmp_path / "a"))
    await direct.load_adapter("user-v1", str(tmp_path / "a"))
    assert sglang.requests[-1] == ("/load_lora_adapter", {"lora_name": "user-v1", "lora_path": str(tmp_path / "a")})
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=1)
    assert [t.token_id for t in await collect(client, params, "user-v1")] == [t.token_id for t in await collect(direct, params, "user-v1")]
    assert sglang.requests[-1][1]["lora_path"] == "user-v1"
    assert await client.score(PROMPT, 5, adapter="user-v1") == pytest.approx(await direct.score(PROMPT, 5, adapter="user-v1"), abs=1e-5)
    with pytest.raises(Exception, match="could not load"):
        await client.load_adapter("user-v1", str(tmp_path / "b"))  # a name never changes its weights
    # a client that restarted while SGLang ran on finds its adapter there, under the same path
    again = SGLangEngine(sglang.url, tiny_model_dir, timeout_s=2.0, retries=0)
    await again.load_adapter("user-v1", str(tmp_path / "a"))
    assert again.adapters == ["user-v1"]
    await again.close()
    await client.unload_adapter("user-v1")
    assert client.adapters == [] and sglang.requests[-1] == ("/unload_lora_adapter", {"lora_name": "user-v1"})
    with pytest.raises(UnknownAdapterError):  # unloaded names are never sent: SGLang would load them again
        await collect(client, SamplingParams(max_new_tokens=2), adapter="user-v1")


async def test_adapters_come_back_after_sglang_restarts(client, direct, sglang, tiny_model_dir, tmp_path):
    """SGLang keeps adapters in memory only: after its restart the engine loads the lost one
    again and the request goes through, for generation and for scoring alike."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    ).save_pretrained(tmp_path / "a")
    await client.load_adapter("shared-v3", str(tmp_path / "a"))
    await direct.load_adapter("shared-v3", str(tmp_path / "a"))
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=2)
    sglang.restart()
    got = await collect(client, params, "shared-v3")
    assert [t.token_id for t in got] == [t.token_id for t in await collect(direct, params, "shared-v3")]
    loads = [body for path, body in sglang.requests if path == "/load_lora_adapter"]
    assert loads == [{"lora_name": "shared-v3", "lora_path": str(tmp_path / "a")}] * 2, "loaded once more"
    sglang.restart()
    assert await client.score(PROMPT, 5, adapter="shared-v3") == pytest.approx(
        await direct.score(PROMPT, 5, adapter="shared-v3"), abs=1e-5)
    # an adapter this engine never loaded is not conjured up
    with pytest.raises(UnknownAdapterError):
        await collect(client, params, "shared-v9")


async def test_server_errors_are_retried_then_reported(client, sglang):
    sglang.mode = "500"
    before = len(sglang.requests)
    with pytest.raises(EngineBadGateway):
        await collect(client, SamplingParams(max_new_tokens=3))
    assert len(sglang.requests) - before == 3, "one try and two retries"
    with pytest.raises(EngineBadGateway):
        await client.score(PROMPT, 3)
    sglang.mode = "ok"
    assert len(await collect(client, SamplingParams(max_new_tokens=3))) == 3, "recovers by itself"


async def test_a_scoring_answer_that_skips_tokens_is_asked_for_again_then_refused(client, direct, sglang):
    expected = await direct.score(PROMPT, 5)
    sglang.truncated_scores = 1
    assert await client.score(PROMPT, 5) == pytest.approx(expected, abs=1e-5), "asked once more, answered whole"
    sglang.truncated_scores = 2
    with pytest.raises(EngineBadGateway, match=r"not input_ids\[5:\] \(\d+ entries for \d+ tokens"):
        await client.score(PROMPT, 5)
    sglang.truncated_scores = 0


@pytest.mark.parametrize("mode, error", [("hang", EngineTimeout), ("garbage", EngineBadGateway), ("drop", EngineBadGateway), ("abort", EngineBadGateway)])
async def test_broken_answers_become_clean_errors(client, sglang, mode, error):
    sglang.mode = mode
    with pytest.raises(error):
        await collect(client, SamplingParams(max_new_tokens=6, temperature=0))
    sglang.mode = "ok"
    assert len(await collect(client, SamplingParams(max_new_tokens=3))) == 3


async def test_no_retry_once_tokens_reached_the_caller(client, sglang):
    sglang.mode = "drop"
    before = len(sglang.requests)
    got = []
    with pytest.raises(EngineBadGateway):
        async for tok in client.generate(PROMPT, SamplingParams(max_new_tokens=10, temperature=0)):
            got.append(tok)
    assert len(got) == 2 and len(sglang.requests) - before == 1, "a half-streamed reply is not silently restarted"


async def test_unreachable_server_is_unavailable(tiny_model_dir):
    from tests.background_server import free_port

    engine = SGLangEngine(f"http://127.0.0.1:{free_port()}", tiny_model_dir, retries=1, backoff_s=0.01)
    try:
        assert not await engine.healthy()
        with pytest.raises(EngineUnavailable):
            await collect(engine, SamplingParams(max_new_tokens=2))
    finally:
        await engine.close()


# ---------------------------------------------------------------------------- through nextstate


@pytest.mark.parametrize("sglang", [False], indirect=True, ids=["cumulative"])
def test_nextstate_serves_through_sglang_and_maps_failures(server_factory, sglang):
    server = server_factory(engine="sglang", sglang_url=sglang.url, engine_retries=1, judge_enabled=False, learn=False)
    client = server.client(server.key("alice"))
    ask = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0)
    reply = client.chat.completions.create(**ask)
    assert reply.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(**ask, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    generations = [p for p in sglang.generate_peers if p]
    assert len(generations) >= 2 and len(set(generations)) == 1, "one connection to SGLang serves reply after reply"
    key = server.key("bob")

    def status(stream: bool) -> tuple[int, dict]:
        r = httpx.post(f"{server.base_url}/chat/completions", json={**ask, "stream": stream},
                       headers={"Authorization": f"Bearer {key}"}, timeout=30)
        return r.status_code, r.json()

    sglang.mode = "500"
    for stream in (False, True):
        code, body = status(stream)
        assert code == 502 and body["error"]["type"] == "server_error" and body["error"]["code"] == "engine_error"
    sglang.mode = "ok"
    assert status(False)[0] == 200
    sglang.stop()
    code, body = status(True)
    assert code == 503 and "unreachable" in body["error"]["message"]


@pytest.mark.parametrize("sglang", [False], indirect=True, ids=["cumulative"])
def test_a_turn_served_by_sglang_keeps_old_and_teacher_logprobs_on_one_footing(server_factory, sglang):
    server = server_factory(engine="sglang", sglang_url=sglang.url, judge_enabled=False, learn=False)
    reply = server.client(server.key("alice")).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0.7, seed=1)
    turn = server.app.state.services.sessions.find_turn("alice", reply.id)
    assert turn.logprob_temperature == 1.0 and turn.sampling["temperature"] == 0.7
    # what the OPD teacher pass computes (scoring the response as prompt tokens) without a hint
    engine = server.app.state.services.turns.engine
    scored = server.call(engine.score(turn.prompt_ids + turn.response_ids, len(turn.prompt_ids), temperature=1.0))
    assert scored == pytest.approx(turn.response_logprobs, abs=1e-5), "teacher - old is 0 without a hint"


@pytest.mark.gpu
@pytest.mark.skipif(not shutil.which("nvidia-smi"), reason="needs a GPU")
def test_real_sglang_on_gpu():
    """Run with a real SGLang (see deploy/README.md): NEXTSTATE_SGLANG_URL and NEXTSTATE_MODEL set."""
    import os

    url, model = os.environ.get("NEXTSTATE_SGLANG_URL"), os.environ.get("NEXTSTATE_MODEL")
    if not url or not model:
        pytest.skip("set NEXTSTATE_SGLANG_URL and NEXTSTATE_MODEL to a running SGLang and its model dir")

    async def check():
        engine = SGLangEngine(url, model)
        try:
            toks = [t async for t in engine.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=0.7, seed=1))]
            ids = PROMPT + [t.token_id for t in toks]
            # SGLang scores at temperature 1 only (the client refuses anything else); sampled
            # logprobs are raw too (SGLANG_RETURN_ORIGINAL_LOGPROB=1), whatever the sampling temperature
            scored = await engine.score(ids, len(PROMPT))
            assert scored == pytest.approx([t.logprob for t in toks], abs=0.05)
        finally:
            await engine.close()

    asyncio.run(check())


@pytest.mark.parametrize("sglang", [False], indirect=True, ids=["cumulative"])
def test_per_user_adapters_on_one_sglang_server(server_factory, sglang):
    """The learner publishes alice's adapter to SGLang by name; her requests carry it in
    lora_path, bob's carry null (the base model)."""
    from tests.test_learner import feed, served_samples, wait_for

    server = server_factory(
        engine="sglang", sglang_url=sglang.url, judge_enabled=False, adapter_scope="user",
        batch_size=4, lr=5e-3, lora_r=4, lora_alpha=8,
    )
    feed(server, served_samples(server, 4, user="alice"))
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 1)
    name = server.app.state.services.policies.current("alice").adapter
    assert name.startswith("alice-v1-")
    assert ("/load_lora_adapter", {"lora_name": name, "lora_path": str(server.settings.adapters_dir / "alice" / "v1")}) in sglang.requests
    ask = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    raw = server.client(server.key("alice")).chat.completions.with_raw_response.create(**ask)
    assert raw.headers["x-policy-version"] == "1" and sglang.requests[-1][1]["lora_path"] == name
    raw = server.client(server.key("bob")).chat.completions.with_raw_response.create(**ask)
    assert raw.headers["x-policy-version"] == "0" and sglang.requests[-1][1]["lora_path"] is None
    # SGLang restarts: alice's published version serves again without restarting nextstate
    sglang.restart()
    raw = server.client(server.key("alice")).chat.completions.with_raw_response.create(**ask)
    assert raw.status_code == 200 and raw.headers["x-policy-version"] == "1"
    assert sglang.requests[-2] == ("/load_lora_adapter", {"lora_name": name, "lora_path": str(server.settings.adapters_dir / "alice" / "v1")})


def test_a_reply_ending_on_its_stop_token_keeps_the_connection_to_sglang(server_factory, tiny_model_dir):
    """A stop-token finish ends the turn only once the engine's stream ended (SGLang's [DONE],
    here 0.2 s late): the stream is never cut short, so its connection serves the next reply."""
    from transformers import AutoTokenizer

    from tests.scripted_engine import ScriptedEngine

    async def scripted():
        return ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model_dir), default_reply="Hello there, friend.")

    fake = FakeSGLang(tiny_model_dir, incremental=True, engine_factory=scripted)
    fake.done_delay_s = 0.2  # the stop token is decoded well before the stream's end arrives
    try:
        server = server_factory(engine="sglang", sglang_url=fake.url, judge_enabled=False, learn=False)
        client = server.client(server.key("alice"))
        for question in ("Hi.", "And now?", "Once more."):
            chunks = list(client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": question}], max_tokens=50, stream=True))
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        replies = fake.generate_peers[-3:]
        assert len(replies) == 3 and len(set(replies)) == 1
    finally:
        fake.stop()


async def test_sse_data_splits_events_on_bytes_whatever_the_chunking():
    """Events cut across network chunks, CRLF line ends, comments and a last line without its
    newline: each `data:` value comes out whole, in order, as bytes."""
    from nextstate.engine.sse import read_sse_data

    body = b': ping\r\ndata: {"a": 1}\r\n\r\nevent: x\ndata:{"b": "\xc3\xa9"}\n\ndata: [DONE]'
    for size in (1, 3, 7, len(body)):

        async def chunks(size=size):
            for i in range(0, len(body), size):
                yield body[i : i + size]

        got = [d async for d in read_sse_data(chunks())]
        assert got == [b'{"a": 1}', b'{"b": "\xc3\xa9"}', b"[DONE]"]
