"""Tools: rendered through the chat template, tool calls parsed back into OpenAI's shape."""

from __future__ import annotations

import json

import httpx
from transformers import AutoTokenizer

from nextstate.modelio.chat_template import ChatRenderer
from nextstate.proxy.chat_completion.protocol import ChatCompletionRequest
from tests.conftest import raw_post
from nextstate.modelio.tool_calls import ToolCallParser
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
    server.end_conversations()
    transitions = [r for r in server.records() if r["kind"] == "transition" and r["reason"] == "next_state"]
    assert transitions[-1]["next_state"][0]["role"] == "tool"
    assert transitions[-1]["turn_index"] == 1


def test_forced_tool_choice_prefills_the_tag_and_constrains_the_call(scripted):
    server, engine = scripted
    engine.script('{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    client = server.client(server.key("alice"))
    reply = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    assert reply.choices[0].finish_reason == "tool_calls" and not reply.choices[0].message.content
    assert engine.tokenizer.decode(engine.prompts[-1]).endswith("<tool_call>\n")
    schema = json.loads(engine.samplings[-1].json_schema)
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["arguments"] == WEATHER["function"]["parameters"]


def test_a_forced_call_the_model_cannot_finish_is_an_error_not_text(scripted):
    server, engine = scripted
    engine.script('{"name": "get_weather", "arguments": {"city": "Os')
    key = server.key("alice")
    body = {"model": "tiny", "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 40}
    resp = raw_post(server, body, key)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "tool_call_incomplete"
    assert "<tool_call>" not in resp.text
    engine.script('{"name": "get_weather", "arguments": {"city": "Os')
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {key}"}, timeout=30) as streamed:
        text = streamed.read().decode()
    assert "tool_call_incomplete" in text and "<tool_call>" not in text.replace("tool_call_incomplete", "")


def test_stops_after_the_calls_and_drops_what_follows(scripted):
    """A model that writes a valid call and then rambles (or starts a broken second call)
    still returns the valid call, finish_reason tool_calls, and decoding stops there."""
    server, engine = scripted
    valid = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    client = server.client(server.key("alice"))
    for tail in ("\nNow I will also say many more things " * 20, '\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'):
        engine.script(valid + tail)
        reply = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=60)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        assert not choice.message.content
    engine.script(valid + "\nNow I will also say many more things " * 20)
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=200)
    assert reply.usage.completion_tokens < 60, "decoding went on after the call"


def test_parallel_tool_calls_false_stops_after_one(scripted):
    server, engine = scripted
    engine.script(CALL_TEXT + "\n" + CALL_TEXT.split("\n", 1)[1].replace("Paris", "Rome"))
    client = server.client(server.key("alice"))
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], parallel_tool_calls=False)
    assert [json.loads(c.function.arguments)["city"] for c in reply.choices[0].message.tool_calls] == ["Paris"]


def test_constrained_decoding_makes_even_a_random_model_call_the_tool(server):
    """The tiny model's weights are random: unconstrained, it writes gibberish. Forced with a
    named tool choice, the embedded engine decodes under the call's JSON schema (llguidance)
    and every reply is a valid call with arguments that fit the schema."""
    units = {
        "type": "function",
        "function": {
            "name": "set_units",
            "parameters": {
                "type": "object",
                "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "label": {"type": "string", "maxLength": 6}},
                "required": ["unit", "label"],
                "additionalProperties": False,
            },
        },
    }
    weather = json.loads(json.dumps(WEATHER))
    weather["function"]["parameters"]["properties"]["city"]["maxLength"] = 8  # a random model never stops a string
    client = server.client(server.key("alice"))
    for seed, choice in enumerate(["required", {"type": "function", "function": {"name": "set_units"}}] * 2):
        reply = client.chat.completions.create(
            model="tiny", messages=ASK, tools=[weather, units], seed=seed, max_tokens=120, tool_choice=choice
        )
        (call,) = reply.choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        assert reply.choices[0].finish_reason == "tool_calls"
        if call.function.name == "set_units":
            assert args["unit"] in ("celsius", "fahrenheit") and len(args["label"]) <= 6 and set(args) == {"unit", "label"}
        else:
            assert choice == "required" and call.function.name == "get_weather" and isinstance(args, dict)


def test_the_grammar_mask_unpacks_llguidances_bitmask_as_llguidance_does(tiny_model_dir):
    """The mask is unpacked with plain torch ops (no torch.compile); it must allow exactly the
    tokens llguidance's own reference kernel allows, and never the model's padding rows."""
    import llguidance.numpy as lln
    import numpy as np
    import torch

    from nextstate.engine.constraints import ConstraintCompiler

    compiler = ConstraintCompiler(tiny_model_dir)
    constraint = compiler.compile(json.dumps(WEATHER["function"]["parameters"]))
    vocab = constraint._vocab
    for _ in range(6):  # a few steps into the object
        logits = torch.randn(vocab + 7)  # models pad their output rows past the tokenizer's
        masked = constraint.apply(logits)
        reference = logits[:vocab].numpy().copy()[None]
        lln.apply_token_bitmask_inplace(reference, constraint._bitmask.numpy())
        assert np.array_equal(np.isfinite(masked[:vocab].numpy()), np.isfinite(reference[0]))
        assert torch.isinf(masked[vocab:]).all() and 0 < int(torch.isfinite(masked).sum()) < vocab
        allowed = torch.isfinite(masked).nonzero().flatten().tolist()
        constraint.advance(allowed[0])


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
    pieces = ["Hi <tool", "_c", 'all>{"name": "f", "arguments": {"x": [1, 2]}}</tool_call', ">\n <tool_call>", '{"name": "g"}']
    content = "".join(parser.push(p).content for p in pieces)
    tail = parser.flush()
    assert content + tail.content == "Hi"
    assert [(c.index, c.name, json.loads(c.arguments)) for c in parser.calls] == [(0, "f", {"x": [1, 2]}), (1, "g", {})]


def test_text_after_a_call_ends_the_reply():
    parser = ToolCallParser()
    pieces = ['<tool_call>{"name": "f", "arguments": {}}</tool_call>', "\n<tool", "_call", " ok then", "<tool_call>{}"]
    outputs = [parser.push(p) for p in pieces]
    assert [bool(o.content) for o in outputs] == [False] * 5 and parser.ended
    assert [c.name for c in parser.calls] == ["f"] and parser.flush().content == ""


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
    prompt = renderer.render([m.to_plain() for m in req.messages], req.tool_dicts(), None)
    text = tok.decode(prompt.ids)
    assert text.startswith("<|im_start|>system\n# Tools")
    assert '"name": "get_weather"' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
