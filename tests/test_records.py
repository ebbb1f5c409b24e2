"""Records: every request, turn and next state lands in JSONL, with the exact tokens."""

from __future__ import annotations

import asyncio
import json

import pytest

from nextstate.engine.local import LocalEngine
from nextstate.modelio.chat_template import ChatRenderer
from nextstate.core.records import RecordWriter
from tests.tiny_model import SERVED_TOLERANCE


def test_main_turn_records_hold_exactly_the_sampled_tokens(server, alice, tiny_model_dir):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    reply = alice.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0.8, seed=7)
    (record,) = [r for r in server.records() if r["kind"] == "request"]
    renderer = ChatRenderer.from_dir(tiny_model_dir)
    assert record["prompt_ids"] == renderer.render(record["messages"]).ids
    text = renderer.tokenizer.decode(record["response_ids"], skip_special_tokens=True)
    assert text == reply.choices[0].message.content
    assert len(record["response_logprobs"]) == len(record["response_ids"]) == reply.usage.completion_tokens

    async def rescore():
        engine = await LocalEngine.open(tiny_model_dir, device="cpu")
        try:
            ids = record["prompt_ids"] + record["response_ids"]
            return await engine.score(ids, len(record["prompt_ids"]), temperature=0.8)
        finally:
            await engine.close()

    # the recorded sampling logprobs are what a training forward pass recomputes (to float16's
    # rounding where llama.cpp serves)
    assert asyncio.run(rescore()) == pytest.approx(record["response_logprobs"], abs=SERVED_TOLERANCE)
    assert record["user"] == "alice" and record["turn_type"] == "main" and record["policy_version"] == 0


def test_side_turns_are_recorded_without_training_tokens(server, alice):
    alice.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "title?"}], max_tokens=3, extra_headers={"X-Turn-Type": "side"}
    )
    (record,) = [r for r in server.records() if r["kind"] == "request"]
    assert record["turn_type"] == "side" and "response_ids" not in record


def test_records_are_split_by_policy_version(server, alice):
    alice.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    server.records()
    assert [p.name for p in server.settings.records_dir.glob("*.jsonl")] == ["policy-v0000.jsonl"]


async def test_writer_appends_and_never_truncates(tmp_path):
    writer = RecordWriter(tmp_path)
    await writer.start()
    writer.write("a", {"n": 1}, version=0)
    writer.write("b", {"n": 2}, version=3)
    writer.write("bad", {"x": object()}, version=0)  # serialisable via str(): kept, not fatal
    await writer.aclose()
    writer = RecordWriter(tmp_path)
    await writer.start()
    writer.write("c", {"n": 3}, version=0)
    await writer.flush()
    await writer.aclose()
    v0 = [json.loads(line) for line in (tmp_path / "policy-v0000.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in v0] == ["a", "bad", "c"]
    assert [json.loads(line)["n"] for line in (tmp_path / "policy-v0003.jsonl").read_text().splitlines()] == [2]


async def test_a_full_disk_never_leaves_a_torn_line_and_counts_what_it_lost(tmp_path, monkeypatch):
    """The disk fills in the middle of a batch: it took half the bytes, then refused. Readers
    must meet only whole records, and what was lost is counted and recorded once it is over."""
    import errno

    import nextstate.core.records as records_module

    writer = RecordWriter(tmp_path)
    await writer.start()
    writer.write("before", {"n": 0})
    await writer.flush()
    full = True
    real = records_module._write

    def cramped(fd, data):
        if full:
            real(fd, bytes(data[: len(data) // 2]))  # the disk takes half a batch, then is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(records_module, "_write", cramped)
    for i in range(3):
        writer.write("during", {"n": i, "text": "x" * 1000})
        await writer.flush()
    full = False
    writer.write("after", {"n": 9})
    await writer.aclose()
    written = [json.loads(line) for line in (tmp_path / "policy-v0000.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in written] == ["before", "records_lost", "after"], "every line whole, nothing torn"
    assert written[1]["count"] == 3 and writer.lost == 3 and writer.written == 2
