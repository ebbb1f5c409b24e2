"""Structured outputs through the stock SDKs: `chat.completions.parse(response_format=Model)`,
`response_format={"type": "json_object"}` and `responses.parse(text_format=Model)`, streamed and
not. The reply is decoded under the schema, so even the random tiny model's reply parses."""

from __future__ import annotations

import json

import httpx
from typing import Literal

import pytest
from pydantic import BaseModel

ASK = [{"role": "user", "content": "Pick a colour."}]


class Colour(BaseModel):
    name: Literal["red", "green", "blue"]
    bright: bool


def test_chat_parse_returns_the_model_and_the_turn_is_kept(server):
    client = server.client(server.key("alice"))
    done = client.chat.completions.parse(model="tiny", messages=ASK, response_format=Colour, max_tokens=60, seed=1)
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Colour) and done.choices[0].finish_reason == "stop"
    assert Colour.model_validate_json(done.choices[0].message.content) == parsed
    record = [r for r in server.records() if r["kind"] == "request"][-1]
    assert record["response"]["content"] == done.choices[0].message.content, "recorded as served, to train on"


def test_chat_parse_streamed(server):
    client = server.client(server.key("alice"))
    with client.chat.completions.stream(model="tiny", messages=ASK, response_format=Colour, max_tokens=60, seed=2) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Colour)


def test_json_object_is_an_object_and_a_reply_cut_short_says_length(server):
    client = server.client(server.key("alice"))
    done = client.chat.completions.create(model="tiny", messages=ASK, response_format={"type": "json_object"},
                                          max_tokens=200, seed=3)
    assert done.choices[0].finish_reason == "stop"  # (seeded: this one ends within its 200 tokens)
    assert isinstance(json.loads(done.choices[0].message.content), dict)
    short = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=3, seed=4,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "colour", "schema": Colour.model_json_schema()}})
    assert short.choices[0].finish_reason == "length", "as OpenAI's: the JSON is incomplete, and says so"


@pytest.mark.parametrize("stream", [False, True])
def test_responses_parse_returns_the_model(server, stream):
    client = server.client(server.key("alice"))
    if stream:
        with client.responses.stream(model="tiny", input="Pick a colour.", text_format=Colour, max_output_tokens=60) as events:
            final = events.get_final_response()
    else:
        final = client.responses.parse(model="tiny", input="Pick a colour.", text_format=Colour, max_output_tokens=60)
    assert isinstance(final.output_parsed, Colour)
    assert final.text.format.type == "json_schema"


HOSTILE = {
    "branches": {"type": "object", "properties": {"n": {"anyOf": [{"const": i} for i in range(300)]}}, "required": ["n"]},
    "repeat": {"type": "object", "properties": {"a": {"type": "string", "pattern": "^a{1000000}$"}}, "required": ["a"]},
    "recursive": {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_schema_the_grammar_engine_cannot_serve_is_the_clients_400_naming_it(server, name):
    """Each was a 500 ("token N left the grammar"): now refused before or while decoding, as a
    400 that says what in the schema is too much, on chat, Responses and forced tool calls; and
    the server goes on serving."""
    key = server.key("alice")
    headers = {"Authorization": f"Bearer {key}"}
    schema = HOSTILE[name]
    bodies = {
        "chat/completions": {"model": "tiny", "messages": ASK, "max_tokens": 400, "seed": 1,
                             "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
        "responses": {"model": "tiny", "input": "Pick one.", "max_output_tokens": 400,
                      "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}},
        "chat/completions#tools": {"model": "tiny", "messages": ASK, "max_tokens": 50, "seed": 1, "tool_choice": "required",
                                   "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]},
    }
    for route, body in bodies.items():
        answer = httpx.post(f"{server.base_url}/{route.split('#')[0]}", json=body, headers=headers, timeout=120)
        if name == "recursive" and answer.status_code == 200:
            continue  # an endless schema may also just run out of tokens: a reply cut short, not a failure
        assert answer.status_code == 400, (route, answer.status_code, answer.text[:300])
        assert "JSON schema" in answer.text, answer.text
        if name != "recursive":
            assert {"branches": "anyOf", "repeat": "pattern"}[name] in answer.text, answer.text
    assert server.client(key).chat.completions.create(model="tiny", messages=ASK, max_tokens=2).choices
