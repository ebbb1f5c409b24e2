"""Hostile or broken requests: each is a 4xx in OpenAI's shape, and the server stays up.

Every probe here once made the server answer 500, drop the connection, stop writing records
for everyone, or hold gigabytes of memory.
"""

from __future__ import annotations

import json

import httpx
import pytest

from nextstate.core.records import RecordWriter
from tests.conftest import raw_post

HELLO = [{"role": "user", "content": "hi"}]


def body(**extra) -> dict:
    return {"model": "tiny", "messages": HELLO, "max_tokens": 3, **extra}


def assert_refused(resp: httpx.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("session_id", ["sess\u0000nul", "a\r\nSet-Cookie: x", "€uro", "with space", "x" * 201, ""])
def test_session_ids_that_cannot_be_a_header_are_refused_before_any_work(scripted, session_id):
    server, engine = scripted
    error = assert_refused(raw_post(server, body(session_id=session_id), server.key("alice")))
    assert "session_id" in (error["param"] or "").lower() or "session" in error["message"].lower()
    assert engine.prompts == [], "nothing was generated"
    assert not [r for r in server.records() if r["kind"] == "request"]


def test_bounded_seed(scripted):
    server, _ = scripted
    key = server.key("alice")
    assert_refused(raw_post(server, body(seed=2**64), key))
    assert raw_post(server, body(seed=2**63 - 1), key).status_code == 200
    assert raw_post(server, body(seed=-(2**63)), key).status_code == 200


@pytest.mark.parametrize("where", ["content", "name", "tool", "key"])
def test_lone_surrogates_are_refused_and_records_keep_flowing(scripted, where):
    server, _ = scripted
    key = server.key("alice")
    message = {"role": "user", "content": "a\\ud800b" if where == "content" else "hi"}
    if where == "name":
        message["name"] = "x\\udfffy"
    extra = ""
    if where == "tool":
        extra = ', "tools": [{"type": "function", "function": {"name": "f", "description": "\\udc00"}}]'
    if where == "key":
        extra = ', "tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"\\udc00": {}}}}}]'
    text = '{"model": "tiny", "max_tokens": 3, "messages": [' + json.dumps(message).replace("\\\\u", "\\u") + "]" + extra + "}"
    error = assert_refused(raw_post(server, text, key))
    assert "surrogate" in error["message"]
    assert raw_post(server, body(), key).status_code == 200
    assert [r["kind"] for r in server.records()].count("request") == 1, "the record writer is alive"


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("place", ["top", "extra_field", "tool_parameters"])
def test_deep_nesting_is_refused(scripted, place):
    server, _ = scripted
    key = server.key("alice")
    if place == "top":
        text = nested(1000)
    elif place == "extra_field":
        text = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "junk": ' + nested(1000) + "}"
    else:
        text = ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
                '"function": {"name": "f", "parameters": {"x": ' + nested(1000) + "}}}]}")
    assert_refused(raw_post(server, text, key))
    resp = httpx.post(f"{server.base_url}/sessions/s/outcome", content='{"reward": ' + nested(1000) + "}",
                      headers={"Authorization": f"Bearer {key}"})
    assert_refused(resp)


def test_big_bodies_are_refused_before_they_are_read(server_factory):
    from tests.conftest import scripted_factory

    factory, _ = scripted_factory()
    server = server_factory(engine_factory=factory, max_body_bytes=64 * 1024)
    key = server.key("alice")
    big = json.dumps(body(messages=[{"role": "user", "content": "x" * 5_000_000}]))
    error = assert_refused(raw_post(server, big, key), 413)
    assert error["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(200):
            yield b"x" * 32_768
        yield b'"}]}'

    resp = httpx.post(f"{server.base_url}/chat/completions", content=chunks(),
                      headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}, timeout=30)
    assert_refused(resp, 413)
    assert raw_post(server, body(), key).status_code == 200


@pytest.mark.parametrize("extra", [{"stream": "yes"}, {"stream": 1}, {"max_tokens": "3"}, {"temperature": "0.5"},
                                   {"messages": [{"role": "user", "content": []}]}, {"logprobs": "true"}])
def test_openai_strict_types(scripted, extra):
    server, _ = scripted
    assert_refused(raw_post(server, body(**extra), server.key("alice")))


async def test_the_record_writer_survives_any_value(tmp_path):
    writer = RecordWriter(tmp_path)
    await writer.start()
    writer.write("odd", {"text": "a\ud800b", "obj": object(), "deep": None})
    writer.write("fine", {"text": "ok"})
    writer.write("breaks", {"text": "a\u2028b\x85c\u2029d\ne"})  # what str.splitlines splits at
    await writer.flush()
    await writer.aclose()
    lines = [json.loads(line) for line in (tmp_path / "policy-v0000.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["kind"] for r in lines] == ["odd", "fine", "breaks"] and lines[0]["text"] == "a\ud800b"
    assert lines[2]["text"] == "a\u2028b\x85c\u2029d\ne"


def test_a_nul_byte_in_any_text_is_stored_safely_on_both_backends(server_factory, database_url):
    """PostgreSQL's text columns cannot hold NUL: every request's texts reach them inside JSON,
    where it is the escape \\u0000. Messages, instructions, names, metadata and tool results with
    one are served, stored and read back whole on SQLite and PostgreSQL alike (a correction, a
    bare text column, is a 400 instead: tests/test_feedback.py)."""
    server = server_factory(database_url=database_url, learn=False)
    headers = {"Authorization": f"Bearer {server.key('alice')}"}
    probes = [
        ("/chat/completions", body(messages=[{"role": "user", "content": "hi\x00there", "name": "a\x00b"}], user="u\x00")),
        ("/chat/completions", body(messages=[*HELLO, {"role": "assistant", "content": "x\x00y"}, {"role": "user", "content": "more\x00"}])),
        ("/chat/completions", body(messages=[*HELLO, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": "\\u0000"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "r\x00"}])),
        ("/messages", {"model": "tiny", "max_tokens": 3, "system": "s\x00", "messages": [{"role": "user", "content": "hi\x00"}]}),
    ]
    for path, request in probes:
        assert httpx.post(server.base_url + path, json=request, headers=headers, timeout=60).status_code == 200, path
    stored = httpx.post(f"{server.base_url}/responses", headers=headers, timeout=60, json={
        "model": "tiny", "input": "keep\x00me", "instructions": "be\x00brief", "metadata": {"k": "v\x00"}, "max_output_tokens": 3})
    assert stored.status_code == 200
    items = httpx.get(f"{server.base_url}/responses/{stored.json()['id']}/input_items", headers=headers).json()
    assert items["data"][0]["content"][0]["text"] == "keep\x00me", "read back whole"
    follow = httpx.post(f"{server.base_url}/responses", headers=headers, timeout=60, json={
        "model": "tiny", "input": "and\x00more", "previous_response_id": stored.json()["id"], "max_output_tokens": 3})
    assert follow.status_code == 200
    assert httpx.get(f"{server.root}/readyz").status_code == 200
