"""Anthropic's Messages API, driven by the official `anthropic` client: plain and streamed
replies, tool use over several turns, its auth header and error shapes, and a conversation
that gives the same sessions, transitions and samples as through chat completions."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.turn_summary import (
    CALL_TEXT, FIRST, FOLLOW_UPS, SYSTEM, TOOL_RESULT, WEATHER, conversation_summary, judged_scripted_server, play_chat,
)

HELLO = [{"role": "user", "content": "Say hello."}]
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def claude(server, key: str | None = None, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.root, api_key=key or server.key("alice"), max_retries=0, **kwargs)


def last_request(server) -> dict:
    return [r for r in server.records() if r["kind"] == "request"][-1]


def test_a_reply_has_anthropic_shape_and_is_recorded_as_a_turn(server):
    message = claude(server).messages.create(model="tiny", max_tokens=12, system="Be brief.", messages=HELLO)
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason in ("end_turn", "max_tokens")
    record = last_request(server)
    assert message.content[0].text == record["response"]["content"]
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == record["usage"]["prompt_tokens"]
    assert message.usage.output_tokens == record["usage"]["completion_tokens"]
    assert record["messages"][0] == {"role": "system", "content": "Be brief."}


def test_a_streamed_reply_gives_the_same_text_as_the_record(server):
    with claude(server).messages.stream(model="tiny", max_tokens=16, messages=HELLO) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    record = last_request(server)
    assert text == final.content[0].text == record["response"]["content"]
    assert final.usage.output_tokens == record["usage"]["completion_tokens"]
    assert final.stop_reason in ("end_turn", "max_tokens")
    # the same prompt again: its prefix comes from the cache, and a streamed reply says so
    with claude(server).messages.stream(model="tiny", max_tokens=4, messages=HELLO) as stream:
        again = stream.get_final_message()
    cached = last_request(server)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert again.usage.cache_read_input_tokens == cached > 0
    # as Anthropic counts: input_tokens are the prompt tokens not read from the cache
    assert again.usage.input_tokens + cached == final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)


def test_stop_sequences_are_reported_as_anthropic_does(scripted):
    server, engine = scripted
    engine.script("one two three STOP four five")
    message = claude(server).messages.create(model="tiny", max_tokens=30, messages=HELLO, stop_sequences=["STOP"])
    assert message.content[0].text == "one two three "
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "STOP"


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_over_several_turns(scripted, stream):
    server, engine = scripted
    engine.script(CALL_TEXT, "It is sunny in Paris.")
    client = claude(server)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    request = {"model": "tiny", "max_tokens": 60, "tools": [WEATHER_TOOL]}
    if stream:
        with client.messages.stream(messages=messages, **request) as s:
            first = s.get_final_message()
    else:
        first = client.messages.create(messages=messages, **request)
    assert first.stop_reason == "tool_use"
    text, call = first.content
    assert text.type == "text" and text.text.strip() == "Let me check."
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Paris"}
    # the agent runs the tool and sends its result, with our reply as it came back
    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "22 C, sunny"}]},
    ]
    second = client.messages.create(messages=messages, **request)
    assert second.content[0].text == "It is sunny in Paris." and second.stop_reason == "end_turn"
    records = [r for r in server.records() if r["kind"] == "request"]
    assert records[-1]["session_id"] == records[-2]["session_id"], "the tool result continues the session"
    assert records[-1]["turn_type"] == "main" and records[-1]["turn_index"] == records[-2]["turn_index"] + 1
    assert records[-1]["messages"][-1] == {"role": "tool", "tool_call_id": call.id, "content": "22 C, sunny"}
    # the tools reached the template in chat completions' form
    assert records[-1]["tools"][0]["function"]["parameters"] == WEATHER_TOOL["input_schema"]


def test_forced_tool_choice_is_decoded_under_the_tools_schema(scripted):
    server, engine = scripted
    engine.script('{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    message = claude(server).messages.create(
        model="tiny", max_tokens=80, messages=HELLO, tools=[WEATHER_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    (call,) = message.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Oslo"}
    assert message.stop_reason == "tool_use"
    schema = json.loads(engine.samplings[-1].json_schema)
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["arguments"] == WEATHER_TOOL["input_schema"]


def test_keys_work_as_x_api_key_and_as_bearer_and_errors_have_anthropic_shape(server):
    key = server.key("alice")
    assert claude(server, key).messages.create(model="tiny", max_tokens=3, messages=HELLO).content
    bearer = anthropic.Anthropic(base_url=server.root, auth_token=key, max_retries=0)
    assert bearer.messages.create(model="tiny", max_tokens=3, messages=HELLO).content
    with pytest.raises(anthropic.AuthenticationError):
        claude(server, "ns-wrong").messages.create(model="tiny", max_tokens=3, messages=HELLO)
    with pytest.raises(anthropic.NotFoundError):
        claude(server, key).messages.create(model="claude-opus", max_tokens=3, messages=HELLO)
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude(server, key).messages.create(model="tiny", max_tokens=3, messages=HELLO, extra_body={"top_k": 5})
    assert "top_k" in str(refused.value)
    raw = httpx.post(f"{server.root}/v1/messages", headers={"x-api-key": key},
                     json={"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
                           "max_tokens": 3})
    body = raw.json()
    assert raw.status_code == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and "image" in body["error"]["message"]
    missing = httpx.post(f"{server.root}/v1/messages", json={"model": "tiny", "messages": HELLO})
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("thinking", [{"type": "adaptive"}, {"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}])
def test_thinking_in_every_form_is_served_without_thinking_blocks(server, thinking):
    """Claude Code sends `thinking: {"type": "adaptive"}` on every request (and a system message
    among its messages); refused, it retried six times and exited. This model has no thinking:
    the reply comes as it would with thinking off."""
    message = claude(server).messages.create(
        model="tiny", max_tokens=6, thinking=thinking, system="Be brief.",
        messages=[{"role": "system", "content": "You are in a terminal."}, *HELLO])
    assert message.content and all(block.type == "text" for block in message.content)
    assert [m["role"] for m in last_request(server)["messages"]] == ["system", "system", "user"]


def test_the_same_conversation_through_both_apis_gives_the_same_sessions_transitions_and_samples(
    server_factory, judge,
):
    """Turn for turn: identical prompt ids, sessions, next states and judged samples."""
    server = judged_scripted_server(server_factory, judge)
    play_chat(server, "chat-user")
    client = claude(server, server.key("claude-user"))
    tools = [{"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}]
    messages = [{"role": "user", "content": FIRST}]
    for follow_up in FOLLOW_UPS:
        reply = client.messages.create(model="tiny", system=SYSTEM, messages=messages, tools=tools, max_tokens=60)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        if follow_up == "tool":
            call = next(b for b in reply.content if b.type == "tool_use")
            messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": TOOL_RESULT}]})
        elif follow_up:
            messages.append({"role": "user", "content": follow_up})
    server.end_conversations()
    server.drain_judge()

    via_chat = conversation_summary(server, "chat-user")
    via_messages = conversation_summary(server, "claude-user")
    assert via_chat["sessions"] == via_messages["sessions"] == 1
    assert len(via_chat["turns"]) == 4
    assert via_messages == via_chat
    assert len(via_chat["samples"]) == 3 and "ready" in {s[1] for s in via_chat["samples"]}


def test_count_tokens_gives_the_prompt_length_a_reply_reports(server):
    client = claude(server)
    request = {"model": "tiny", "system": "Be brief.", "messages": HELLO, "tools": [
        {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}]}
    counted = client.messages.count_tokens(**request)
    used = client.messages.create(max_tokens=2, **request).usage
    assert counted.input_tokens == used.input_tokens + (used.cache_read_input_tokens or 0)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-opus", messages=HELLO)
