"""The chat API through the official openai SDK, checked against OpenAI's own schemas."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.conftest import raw_post, scripted_factory
from tests.openai_schema import assert_valid

HELLO = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]


def test_completion_has_openai_shape_and_real_usage(server, alice):
    raw = alice.chat.completions.with_raw_response.create(model="tiny", messages=HELLO, max_tokens=12)
    completion = raw.parse()
    assert_valid("CreateChatCompletionResponse", raw.http_response.json())
    assert completion.id.startswith("chatcmpl-")
    assert completion.object == "chat.completion"
    assert completion.model == "tiny"
    assert abs(completion.created - time.time()) < 60
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = completion.usage
    assert usage.completion_tokens >= 1 and usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # prompt_tokens is the real rendered prompt length, not a guess
    record = [r for r in server.records() if r["kind"] == "request"][-1]
    assert usage.prompt_tokens == len(record["prompt_ids"])
    assert usage.completion_tokens == len(record["response_ids"])
    assert raw.headers["x-policy-version"] == "0"
    assert raw.headers["x-session-id"].startswith("sess_")


def test_streaming_is_token_by_token_with_usage_and_done(server, alice):
    stream = alice.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=40, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    for chunk in chunks:
        assert_valid("CreateChatCompletionStreamResponse", chunk.model_dump(exclude_unset=True))
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) > 5, "text must arrive in many deltas, not one"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("stop", "length")
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens >= len(content_chunks)
    # the streamed text is exactly what the non-streamed path would have recorded
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    record = [r for r in server.records() if r["kind"] == "request"][-1]
    assert record["response"]["content"] == text


def test_stream_ends_with_done_marker(server):
    key = server.key("alice")
    with httpx.stream(
        "POST",
        f"{server.base_url}/chat/completions",
        json={"model": "tiny", "messages": HELLO, "max_tokens": 5, "stream": True},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_first_chunk_arrives_before_generation_ends(scripted):
    server, engine = scripted
    engine.delay_s = 0.05
    engine.script("one two three four five six seven eight nine ten eleven twelve")
    client = server.client(server.key("alice"))
    started = time.monotonic()
    arrivals = []
    for chunk in client.chat.completions.create(model="tiny", messages=HELLO, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic() - started)
    total = time.monotonic() - started
    assert len(arrivals) > 5
    assert arrivals[0] < total / 3, f"first content after {arrivals[0]:.2f}s of {total:.2f}s"


def test_usage_says_how_much_of_the_prompt_was_cached(server, alice):
    """The next request of a conversation is prefilled from the last one's KV cache."""
    messages = [{"role": "system", "content": "You are terse. " * 20}, *HELLO]
    first = alice.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
    stream = alice.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, stream=True, stream_options={"include_usage": True})
    usage = list(stream)[-1].usage
    assert_valid("CompletionUsage", usage.model_dump(exclude_unset=True))
    assert first.usage.prompt_tokens < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


def test_tokens_that_arrive_together_go_out_in_one_chunk_with_all_their_logprobs(scripted):
    """An engine faster than the client: the ready tokens are joined, nothing is lost."""
    server, engine = scripted
    reply = "one two three four five six seven eight nine ten eleven twelve"
    engine.script(reply)
    client = server.client(server.key("alice"))
    chunks = list(client.chat.completions.create(model="tiny", messages=HELLO, stream=True, logprobs=True))
    content = [c.choices[0] for c in chunks if c.choices and c.choices[0].delta.content]
    record = [r for r in server.records() if r["kind"] == "request"][-1]
    assert "".join(c.delta.content for c in content) == reply == record["response"]["content"]
    assert len(content) < len(record["response_ids"]), "ready tokens were sent one chunk each"
    streamed = [e.logprob for c in content for e in c.logprobs.content]
    assert streamed == pytest.approx(record["response_logprobs"][: len(streamed)])
    assert len(streamed) >= len(record["response_ids"]) - 1  # all but a stop token


def test_logprobs_have_openai_shape(server, alice):
    raw = alice.chat.completions.with_raw_response.create(
        model="tiny", messages=HELLO, max_tokens=6, logprobs=True, top_logprobs=3
    )
    body = raw.http_response.json()
    assert_valid("CreateChatCompletionResponse", body)
    content = raw.parse().choices[0].logprobs.content
    assert len(content) >= 1
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.bytes == list(entry.token.encode("utf-8"))
    record = [r for r in server.records() if r["kind"] == "request"][-1]
    assert [e.logprob for e in content] == pytest.approx(record["response_logprobs"][: len(content)])


def test_streamed_logprobs(server, alice):
    chunks = list(
        alice.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, stream=True, logprobs=True, top_logprobs=2)
    )
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert 1 <= len(entries) <= 8 and all(len(e.top_logprobs) == 2 for e in entries)


def test_seed_makes_sampling_reproducible(alice):
    kwargs = dict(model="tiny", messages=HELLO, max_tokens=15, temperature=1.0, seed=1234)
    first = alice.chat.completions.create(**kwargs).choices[0].message.content
    second = alice.chat.completions.create(**kwargs).choices[0].message.content
    other = alice.chat.completions.create(**{**kwargs, "seed": 99}).choices[0].message.content
    assert first == second
    assert first != other


def test_models_list(server, alice):
    models = alice.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    key = server.key("bob")
    body = httpx.get(f"{server.base_url}/models", headers={"Authorization": f"Bearer {key}"}).json()
    assert_valid("ListModelsResponse", body)
    assert alice.models.retrieve("tiny").id == "tiny"
    (card,) = body["data"]
    assert card["max_model_len"] == card["context_length"] == card["context_window"] == 4096  # the tiny model's


def test_stop_strings_cut_the_reply(scripted):
    server, engine = scripted
    engine.script("alpha beta STOP gamma", "alpha beta STOP gamma")
    client = server.client(server.key("alice"))
    reply = client.chat.completions.create(model="tiny", messages=HELLO, stop=["STOP"])
    assert reply.choices[0].message.content == "alpha beta "
    assert reply.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model="tiny", messages=HELLO, stop="STOP", stream=True)
        if c.choices
    )
    assert streamed == "alpha beta "


def test_concurrent_requests_do_not_interfere(server_factory):
    import concurrent.futures

    server = server_factory(max_parallel_per_user=8)
    alice = server.client(server.key("alice"))

    def ask(seed: int) -> str:
        return alice.chat.completions.create(
            model="tiny", messages=HELLO, max_tokens=20, temperature=1.0, seed=seed, extra_headers={"X-Turn-Type": "side"}
        ).choices[0].message.content

    alone = {seed: ask(seed) for seed in (1, 2, 3)}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        together = list(pool.map(ask, [1, 2, 3, 1, 2, 3]))
    assert together == [alone[1], alone[2], alone[3]] * 2


# ---------------------------------------------------------------------------- errors


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert_valid("ErrorResponse", body)
    return body["error"]


def test_missing_and_wrong_keys_get_401(server):
    assert _error(raw_post(server, {"model": "tiny", "messages": HELLO}, None), 401)["code"] == "missing_api_key"
    assert _error(raw_post(server, {"model": "tiny", "messages": HELLO}, "ns-wrong"), 401)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        server.client("ns-nope").chat.completions.create(model="tiny", messages=HELLO)
    with pytest.raises(openai.AuthenticationError):
        server.client("ns-nope").models.list()


def test_auth_is_checked_before_the_body(server):
    assert _error(raw_post(server, "{not json", None), 401)["code"] == "missing_api_key"


def test_malformed_bodies_get_400(server):
    key = server.key("alice")
    assert "JSON" in _error(raw_post(server, "{not json", key), 400)["message"]
    assert _error(raw_post(server, "[1, 2]", key), 400)["message"]
    err = _error(raw_post(server, {"model": "tiny"}, key), 400)
    assert err["param"] == "messages" and "Missing" in err["message"]
    err = _error(raw_post(server, {"model": "tiny", "messages": "hi"}, key), 400)
    assert err["param"] == "messages"
    err = _error(raw_post(server, {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, key), 400)
    assert err["param"] == "messages[0].role"
    err = _error(raw_post(server, {"model": "tiny", "messages": HELLO, "temperature": 7}, key), 400)
    assert err["param"] == "temperature"


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"n": 2}, "n=1"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"presence_penalty": 1.0}, "penalties"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"top_logprobs": 3}, "logprobs"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "4 stop"),
    ],
)
def test_unsupported_values_get_a_clear_400(server, extra, needle):
    err = _error(raw_post(server, {"model": "tiny", "messages": HELLO, **extra}, server.key("a")), 400)
    assert needle in err["message"]
    with pytest.raises(openai.BadRequestError):
        server.client(server.key("b")).chat.completions.create(model="tiny", messages=HELLO, **extra)


def test_image_content_is_refused_clearly(server):
    msg = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    err = _error(raw_post(server, {"model": "tiny", "messages": msg}, server.key("a")), 400)
    assert "image_url" in err["message"] and err["param"].startswith("messages[0]")


def test_text_content_parts_are_accepted(alice):
    msg = [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": " hello."}]}]
    assert alice.chat.completions.create(model="tiny", messages=msg, max_tokens=3).choices[0].message is not None


def test_unknown_model_is_404(server):
    with pytest.raises(openai.NotFoundError) as info:
        server.client(server.key("a")).chat.completions.create(model="gpt-4o", messages=HELLO)
    assert "tiny" in str(info.value)


def test_context_length_is_checked(server):
    long = [{"role": "user", "content": "hello " * 3000}]
    err = _error(raw_post(server, {"model": "tiny", "messages": long, "max_tokens": 100}, server.key("a")), 400)
    assert err["code"] == "context_length_exceeded"


def test_a_reply_limit_past_the_window_gets_what_the_window_leaves(scripted):
    """opencode asks for 32,000 tokens whatever the model: served with the room the window
    leaves (4,096 here), as llama.cpp's and Ollama's servers do. A limit the window cannot give
    even ROOM_FOR_A_REPLY of is still the error an agent compacts on."""
    from nextstate.proxy.turns import ROOM_FOR_A_REPLY

    server, engine = scripted
    client = server.client(server.key("a"))
    reply = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=32_000)
    assert engine.samplings[-1].max_new_tokens == 4096 - reply.usage.prompt_tokens
    client.chat.completions.create(model="tiny", messages=HELLO)
    assert engine.samplings[-1].max_new_tokens == 512, "no limit: NEXTSTATE_DEFAULT_MAX_TOKENS"
    client.responses.create(model="tiny", input="Say hello.")
    assert engine.samplings[-1].max_new_tokens > 4000, "no limit on the Responses API: the window's room, as OpenAI's"
    filler = "word " * (4096 - ROOM_FOR_A_REPLY // 2)
    err = _error(raw_post(server, {"model": "tiny", "messages": [{"role": "user", "content": filler}], "max_tokens": 1000},
                          server.key("a")), 400)
    assert err["code"] == "context_length_exceeded"


def test_unknown_route_is_404_in_openai_shape(server):
    resp = httpx.get(f"{server.base_url}/nope", headers={"Authorization": "Bearer x"})
    _error(resp, 404)


def test_health_and_metrics(server, alice):
    assert httpx.get(f"{server.root}/healthz").json()["status"] == "ok"
    alice.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3)
    assert httpx.get(f"{server.root}/metrics").status_code == 401, "metrics tell who uses the server: they need a key"
    user_key = server.key("bob")
    assert httpx.get(f"{server.root}/metrics", headers={"Authorization": f"Bearer {user_key}"}).status_code == 403
    text = server.metrics()
    assert 'nextstate_requests_total{status="200",stream="false"} 1.0' in text
    assert "nextstate_completion_tokens_total 3.0" in text


# ---------------------------------------------------------------------------- streams that take long, fail or are abandoned


def stream_lines(server, key, body, read_lines: int | None = None) -> list[tuple[float, str]]:
    """(seconds since the request, line) for each SSE line, stopping after `read_lines`."""
    started = time.monotonic()
    out = []
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {key}"}, timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line:
                out.append((time.monotonic() - started, line))
            if read_lines is not None and len(out) >= read_lines:
                break
    return out


def test_a_stream_starts_at_once_and_stays_alive_through_a_long_prefill(server_factory):
    factory, holder = scripted_factory()
    server = server_factory(engine_factory=factory, stream_keepalive_s=0.25)
    engine = holder["engine"]
    engine.prefill_s = 1.5
    engine.script("finally here")
    lines = stream_lines(server, server.key("alice"), {"model": "tiny", "messages": HELLO})
    first_at, first = lines[0]
    assert first.startswith("data: ") and '"role":"assistant"' in first.replace(" ", "") and first_at < 1.0
    content_at = next(t for t, line in lines[1:] if line.startswith("data: {") and '"content":"' in line)
    comments = [t for t, line in lines if line.startswith(":")]
    assert len(comments) >= 3 and all(t < content_at for t in comments)
    assert lines[-1][1] == "data: [DONE]"
    engine.prefill_s = 1.0
    engine.script("parsed fine")
    client = server.client(server.key("bob"))
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(model="tiny", messages=HELLO, stream=True) if c.choices)
    assert text == "parsed fine", "the OpenAI SDK reads past the keep-alive comments"


def test_an_engine_failure_after_the_stream_started_is_an_error_event(scripted):
    from nextstate.engine.base import EngineBadGateway

    server, engine = scripted
    engine.fail_after_admit = EngineBadGateway("the model server crashed")
    lines = [line for _, line in stream_lines(server, server.key("alice"), {"model": "tiny", "messages": HELLO})]
    assert '"role":"assistant"' in lines[0].replace(" ", "")
    error = json.loads(lines[-1].removeprefix("data: "))
    assert error["error"]["code"] == "engine_error" and "crashed" in error["error"]["message"]
    assert "data: [DONE]" not in lines


def test_an_abandoned_stream_is_recorded_and_never_trained(scripted):
    server, engine = scripted
    engine.delay_s = 0.05
    engine.script(" ".join(f"word{i}" for i in range(200)))
    key = server.key("alice")
    stream_lines(server, key, {"model": "tiny", "messages": HELLO, "max_tokens": 400}, read_lines=4)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not [r for r in server.records() if r["kind"] == "aborted"]:
        time.sleep(0.05)
    (aborted,) = [r for r in server.records() if r["kind"] == "aborted"]
    assert aborted["user"] == "alice" and aborted["turn_type"] == "main"
    assert not [r for r in server.records() if r["kind"] == "request"], "an abandoned reply is not a turn"
    assert len(server.app.state.services.sessions) == 0, "and it opened no session"
    metrics = server.metrics()
    assert 'nextstate_requests_aborted_total{turn_type="main"} 1.0' in metrics


def test_refused_requests_are_recorded_and_counted(server):
    key = server.key("alice")
    assert raw_post(server, {"model": "gpt-4o", "messages": HELLO}, key).status_code == 404
    assert raw_post(server, {"model": "tiny", "messages": HELLO}, "ns-wrong").status_code == 401
    refused = [r for r in server.records() if r["kind"] == "refused"]
    assert [(r["status"], r["code"], r["user"]) for r in refused] == [(404, "model_not_found", "alice"), (401, "invalid_api_key", None)]
    metrics = server.metrics()
    assert 'nextstate_requests_refused_total{code="model_not_found",status="404"} 1.0' in metrics
