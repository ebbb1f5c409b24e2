"""Structured outputs through the stock SDKs: `chat.completions.parse(response_format=Model)`,
`response_format={"type": "json_object"}` and `responses.parse(text_format=Model)`, streamed and
not. The reply is decoded under the schema, so even the random tiny model's reply parses."""

from __future__ import annotations

import json
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
