"""Tools: rendered through the chat template, tool calls parsed back into OpenAI's shape."""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from proxy.chat_template import ChatRenderer, normalize_message
from proxy.schemas import ChatCompletionRequest
from proxy.tool_calls import ToolCallParser
from tests.openai_schema import assert_valid

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
CALL_TEXT = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_call_comes_back_as_tool_calls(scripted):
    server, engine = scripted
    engine.script(CALL_TEXT)
    client = server.client(server.key("alice"))
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=ASK, tools=[WEATHER])
    assert_valid("CreateChatCompletionResponse", raw.http_response.json())
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_tools_are_rendered_into_the_prompt(scripted):
    server, engine = scripted
    client = server.client(server.key("alice"))
    client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER])
    prompt = engine.tokenizer.decode(engine.prompts[-1])
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and "Current weather for a city" in prompt
    client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none")
    assert "get_weather" not in engine.tokenizer.decode(engine.prompts[-1])


def test_streamed_tool_call_deltas(scripted):
    server, engine = scripted
    engine.script(CALL_TEXT + "\n" + CALL_TEXT.split("\n", 1)[1].replace("Paris", "Rome"))
    client = server.client(server.key("alice"))
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], stream=True))
    for c in chunks:
        assert_valid("CreateChatCompletionStreamResponse", c.model_dump(exclude_unset=True))
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
            entry["id"] = entry["id"] or d.id
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
    assert [json.loads(calls[i]["arguments"])["city"] for i in sorted(calls)] == ["Paris", "Rome"]
    assert all(c["name"] == "get_weather" and c["id"] for c in calls.values())
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Let me check."


def test_follow_up_with_tool_results(scripted):
    server, engine = scripted
    engine.script(CALL_TEXT, "It is sunny in Paris.")
    client = server.client(server.key("alice"))
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER])
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "celsius": 21}'},
    ]
    second = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER])
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert second.choices[0].finish_reason == "stop"
    prompt = engine.tokenizer.decode(engine.prompts[-1])
    assert "<tool_response>" in prompt and '"celsius": 21' in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    # the tool result continued the same session and became the next state of the first turn
    transitions = [r for r in server.records() if r["kind"] == "transition"]
    assert transitions[-1]["next_state"][0]["role"] == "tool"
    assert transitions[-1]["turn_index"] == 1


def test_forced_tool_choice_prefills_the_call(scripted):
    server, engine = scripted
    engine.script('{"city": "Oslo"}}\n</tool_call>')
    client = server.client(server.key("alice"))
    reply = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    assert engine.tokenizer.decode(engine.prompts[-1]).endswith('<tool_call>\n{"name": "get_weather", "arguments": ')


def test_invalid_tool_call_json_stays_content(scripted):
    server, engine = scripted
    engine.script("<tool_call>\n{not json}\n</tool_call>")
    client = server.client(server.key("alice"))
    msg = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER]).choices[0]
    assert msg.message.tool_calls is None and msg.finish_reason == "stop"
    assert "{not json}" in msg.message.content


def test_tool_calls_are_not_parsed_without_tools(scripted):
    server, engine = scripted
    engine.script(CALL_TEXT)
    client = server.client(server.key("alice"))
    msg = client.chat.completions.create(model="tiny", messages=ASK).choices[0]
    assert msg.message.tool_calls is None and "<tool_call>" in msg.message.content


def test_parser_handles_split_tags_and_unclosed_block():
    parser = ToolCallParser()
    pieces = ["Hi <tool", "_c", 'all>{"name": "f", "arguments": {"x": [1, 2]}}</tool_call', "> ok <tool_call>", '{"name": "g"}']
    content = "".join(parser.push(p).content for p in pieces)
    tail = parser.flush()
    assert content + tail.content == "Hi ok"
    assert [(c.index, c.name, json.loads(c.arguments)) for c in parser.calls] == [(0, "f", {"x": [1, 2]}), (1, "g", {})]


def test_templates_without_tool_support_get_tools_inlined(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    # SmolLM2's template: plain ChatML, no notion of tools or tool messages
    tok.chat_template = (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    renderer = ChatRenderer(tok)
    assert not renderer.template_knows_tools
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "tools": [WEATHER],
            "messages": ASK
            + [
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
        }
    )
    prompt = renderer.render([normalize_message(m) for m in req.messages], req.tools, None)
    text = tok.decode(prompt.ids)
    assert text.startswith("<|im_start|>system\n# Tools")
    assert '"name": "get_weather"' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
