"""OpenAI's Responses API, driven by the official `openai` client's `responses`: plain and
streamed replies, function calls over several turns, `previous_response_id` and `store`, the
errors, and a conversation that gives the same sessions, transitions and samples as through
chat completions."""

from __future__ import annotations

import openai
import pytest

from tests.turn_summary import (
    CALL_TEXT, FIRST, FOLLOW_UPS, SYSTEM, TOOL_RESULT, WEATHER, conversation_summary, judged_scripted_server, play_chat,
)

TOOLS = [{"type": "function", **WEATHER}]


def last_request(server) -> dict:
    return [r for r in server.records() if r["kind"] == "request"][-1]


def ask(client, tools: list[dict], stream: bool, **kwargs):
    """A response with `tools`, created or streamed to its end."""
    if not stream:
        return client.responses.create(model="tiny", tools=tools, max_output_tokens=60, **kwargs)
    with client.responses.stream(model="tiny", tools=tools, max_output_tokens=60, **kwargs) as s:
        return s.get_final_response()


def test_a_reply_has_the_responses_shape_and_is_recorded_as_a_turn(server, alice):
    response = alice.responses.create(model="tiny", input="Say hello.", instructions="Be brief.", max_output_tokens=12)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete") and response.model == "tiny"
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    record = last_request(server)
    assert response.output_text == record["response"]["content"]
    assert response.usage.input_tokens == record["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == record["usage"]["completion_tokens"]
    assert record["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"


def test_a_streamed_reply_gives_the_same_text_as_the_record(scripted):
    server, engine = scripted
    engine.script("Hello there, my friend.", "Hello there, my friend.")
    client = server.client(server.key("alice"))
    deltas, kinds = [], []
    with client.responses.stream(model="tiny", input="Say hello.", max_output_tokens=40) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert "".join(deltas) == final.output_text == "Hello there, my friend." == last_request(server)["response"]["content"]
    # cut at max_output_tokens: the stream ends with response.incomplete, as OpenAI's does
    with client.responses.stream(model="tiny", input="Say hello.", max_output_tokens=2) as stream:
        last = [event for event in stream][-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_function_calls_over_several_turns_by_resending_and_by_previous_response_id(scripted, stream):
    server, engine = scripted
    engine.script(CALL_TEXT, "It is sunny in Paris.", CALL_TEXT, "It is sunny in Paris.")
    client = server.client(server.key("alice"))

    def ask_weather(**kwargs):
        return ask(client, TOOLS, stream, **kwargs)

    first = ask_weather(input=FIRST)
    message, call = first.output
    assert message.type == "message" and message.content[0].text.strip() == "Let me check."
    assert call.type == "function_call" and call.name == "get_weather" and call.arguments == '{"city": "Paris"}'
    result = {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}
    # the client resends everything ...
    resent = ask_weather(input=[{"role": "user", "content": FIRST}, *[item.model_dump(exclude_none=True) for item in first.output], result])
    assert resent.output_text == "It is sunny in Paris."
    requests = [r for r in server.records() if r["kind"] == "request"]
    assert requests[-1]["session_id"] == requests[-2]["session_id"]
    assert requests[-1]["messages"][-1] == {"role": "tool", "tool_call_id": call.call_id, "content": TOOL_RESULT}
    # ... or only what is new, after the stored response: the model sees the same prompt
    again = ask_weather(input=FIRST)
    chained = ask_weather(input=[{**result, "call_id": again.output[1].call_id}], previous_response_id=again.id)
    assert chained.output_text == "It is sunny in Paris." and chained.previous_response_id == again.id
    requests = [r for r in server.records() if r["kind"] == "request"]
    assert requests[-1]["prompt_ids"] == requests[-3]["prompt_ids"]


def test_previous_response_ids_are_per_user_and_store_false_keeps_nothing(server, alice):
    kept = alice.responses.create(model="tiny", input="Remember me.", max_output_tokens=4)
    unkept = alice.responses.create(model="tiny", input="Forget me.", max_output_tokens=4, store=False)
    # (its output may be empty: the random tiny model can end its reply at once)
    assert alice.responses.create(model="tiny", input="And?", previous_response_id=kept.id, max_output_tokens=4).status
    bob = server.client(server.key("bob"))
    with pytest.raises(openai.NotFoundError):
        bob.responses.create(model="tiny", input="Steal.", previous_response_id=kept.id, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        alice.responses.create(model="tiny", input="And?", previous_response_id=unkept.id, max_output_tokens=4)


def test_what_cannot_be_honoured_is_a_400_that_says_so(server, alice):
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}]
    cases = [
        ({"input": image}, "input_image"),
        ({"input": "Hi", "background": True}, "background"),
        ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "schema"),
        ({"input": "Hi", "text": {"format": {"type": "grammar"}}}, "format"),
    ]
    for request, word in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            alice.responses.create(model="tiny", max_output_tokens=4, **request)
        assert word in str(refused.value)
    # an unknown role points at itself, not at `input` as if it had to be a string
    with pytest.raises(openai.BadRequestError) as refused:
        alice.responses.create(model="tiny", max_output_tokens=4, input=[{"role": "robot", "content": "Hi"}])
    assert refused.value.body["param"] == "input[0].role" and "'user', 'assistant'" in refused.value.body["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_codexs_tools_are_served_a_namespace_as_its_functions_and_web_search_left_out(scripted, stream):
    """Codex CLI sends its sub-agent tools as a `namespace` group and the built-in `web_search`;
    both were refused on its first request. The namespace's functions are offered by their full
    name, a call to one comes back with `name` and `namespace` apart, and sent back so it renders
    as it was offered."""
    server, engine = scripted
    spawn = 'Spawning.\n<tool_call>\n{"name": "collaboration.spawn_agent", "arguments": {"message": "look"}}\n</tool_call>'
    engine.script(spawn, "Done.")
    client = server.client(server.key("alice"))
    tools = [{"type": "function", **WEATHER}, {"type": "web_search", "external_web_access": False},
             {"type": "namespace", "name": "collaboration", "description": "Sub-agents.", "tools": [
                 {"type": "function", "name": "spawn_agent", "description": "Spawns an agent.", "strict": False,
                  "parameters": {"type": "object", "properties": {"message": {"type": "string"}}}}]}]

    first = ask(client, tools, stream, input=FIRST)
    call = first.output[-1]
    assert call.type == "function_call" and call.name == "spawn_agent" and call.namespace == "collaboration"
    offered = [t["function"]["name"] for t in last_request(server)["tools"]]
    assert offered == ["get_weather", "collaboration.spawn_agent"], "web_search is left out"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "started"}
    ask(client, tools, stream, input=[{"role": "user", "content": FIRST}, *[item.model_dump(exclude_none=True) for item in first.output], result])
    sent_back = last_request(server)["messages"][-2]
    assert sent_back["tool_calls"][0]["function"]["name"] == "collaboration.spawn_agent"


def test_the_same_conversation_through_responses_and_chat_gives_the_same_sessions_transitions_and_samples(
    server_factory, judge,
):
    server = judged_scripted_server(server_factory, judge)
    play_chat(server, "chat-user")
    client = server.client(server.key("responses-user"))
    items: list = [{"role": "user", "content": FIRST}]
    for follow_up in FOLLOW_UPS:
        reply = client.responses.create(model="tiny", instructions=SYSTEM, input=items, tools=TOOLS, max_output_tokens=60)
        items += [item.model_dump(exclude_none=True) for item in reply.output]
        if follow_up == "tool":
            call = next(item for item in reply.output if item.type == "function_call")
            items.append({"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT})
        elif follow_up:
            items.append({"role": "user", "content": follow_up})
    server.end_conversations()
    server.drain_judge()

    via_chat = conversation_summary(server, "chat-user")
    via_responses = conversation_summary(server, "responses-user")
    assert via_chat["sessions"] == 1 and len(via_chat["turns"]) == 4
    assert via_responses == via_chat


def test_a_conversation_that_switches_api_keeps_its_session(server):
    """Chat completions, then Anthropic Messages, then Responses: one session, one turn each.
    Greedy: a sampled reply of the random tiny model may be empty, or text that does not read
    back as the same tokens, and the test is about the session, not about that."""
    import anthropic

    key = server.key("alice")
    chat = server.client(key).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi."}], max_tokens=5,
                                                     temperature=0)
    first = chat.choices[0].message.content
    claude = anthropic.Anthropic(base_url=server.root, api_key=key, max_retries=0)
    second = claude.messages.create(model="tiny", max_tokens=5, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": "Hi."}, {"role": "assistant", "content": first}, {"role": "user", "content": "More."},
    ]).content[0].text
    server.client(key).responses.create(model="tiny", max_output_tokens=5, temperature=0, input=[
        {"role": "user", "content": "Hi."}, {"role": "assistant", "content": first}, {"role": "user", "content": "More."},
        {"role": "assistant", "content": second}, {"role": "user", "content": "Again."},
    ])
    requests = [r for r in server.records() if r["kind"] == "request"]
    assert len({r["session_id"] for r in requests}) == 1
    assert [r["turn_index"] for r in requests] == [requests[0]["turn_index"] + i for i in range(3)]
    assert {r["turn_type"] for r in requests} == {"main"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_stored_response_can_be_retrieved_listed_and_deleted_by_its_user_only(server, stream):
    """The SDK's responses.retrieve / input_items.list / delete, as OpenAI documents them; another
    user's id is a 404 like one that never existed."""
    alice, bob = server.client(server.key("alice")), server.client(server.key("bob"))
    if stream:
        events = alice.responses.create(model="tiny", input="Name a colour.", max_output_tokens=6, stream=True)
        (created,) = [e.response for e in events if e.type in ("response.completed", "response.incomplete")]
    else:
        created = alice.responses.create(model="tiny", input="Name a colour.", max_output_tokens=6)
    fetched = alice.responses.retrieve(created.id)
    assert fetched.id == created.id and fetched.output_text == created.output_text
    assert fetched.usage.output_tokens == created.usage.output_tokens and fetched.status == created.status
    items = alice.responses.input_items.list(created.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Name a colour.")]
    for other in (lambda: bob.responses.retrieve(created.id), lambda: bob.responses.delete(created.id),
                  lambda: bob.responses.input_items.list(created.id)):
        with pytest.raises(openai.NotFoundError):
            other()
    alice.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.create(model="tiny", input="and another?", previous_response_id=created.id, max_output_tokens=4)


def test_stored_responses_are_found_by_any_process_on_either_backend(tmp_path, database_url):
    """On PostgreSQL a response stored by one process continues (previous_response_id) on another;
    on both backends a user finds only their own, a second save replaces the first, and
    forget and expiry delete them."""
    from nextstate.core.stores.responses import ResponseStore

    here, there = ResponseStore(tmp_path / "r.sqlite3", database_url), ResponseStore(tmp_path / "r.sqlite3", database_url)
    try:
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        here.save("alice", "resp_1", messages, {"id": "resp_1", "object": "response"}, [{"type": "message"}])
        assert there.conversation("alice", "resp_1") == messages
        assert there.response("alice", "resp_1") == ({"id": "resp_1", "object": "response"}, [{"type": "message"}])
        assert there.conversation("bob", "resp_1") is None, "another user's id is not found"
        here.save("alice", "resp_1", messages[:1])
        assert there.conversation("alice", "resp_1") == messages[:1] and there.response("alice", "resp_1") is None
        here.save("alice", "resp_2", messages)
        here.save("bob", "resp_3", messages)
        assert there.delete("alice", "resp_2") and not there.delete("alice", "resp_2")
        assert here.forget("alice") == 1 and there.conversation("bob", "resp_3") == messages
        import time

        assert here.expire(time.time() + 1) == 1 and there.conversation("bob", "resp_3") is None
    finally:
        here.close()
        there.close()
