"""Real traffic: an unmodified OpenClaw's requests, replayed in order against nextstate.

tests/data/openclaw-2026.9.6/ is a capture of OpenClaw 2026.9.6 talking to nextstate (see its
README). Its requests are sent again as captured, to a server whose engine "generates" what
the model generated then (a scripted engine: the recorded reply text, and for the requests
that force the `read` tool, the valid call that constrained decoding produces). Two things
differ from the capture: the key, and `max_completion_tokens`, lifted because the test's tiny
tokenizer needs about twice SmolLM2's tokens for the same text (cut short, every recorded
reply would read differently from what OpenClaw echoed back).
The client's requests do not depend on the replies here, so what nextstate must make of them
is fixed: one session for the conversation, its main turns in order, and as each turn's next
state exactly the messages OpenClaw added after it, the user's words, while OpenClaw's own
retry notice is a format failure and never user feedback.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.background_server import start_server
from tests.conftest import scripted_factory
from tests.judge_server import ScriptedJudge
from tests.scripted_engine import ScriptedEngine
from tests.test_learner import wait_for

CAPTURE = Path(__file__).parent / "data" / "openclaw-2026.9.6" / "traffic.jsonl"
CONVERSATION = range(4, 17)  # rows of the one trimmed-setup conversation; row 3 is a probe of its own
FORCED_CALL = '{"name": "read", "arguments": {"path": "notes.txt"}}'
KEEP_HEADERS = {"content-type", "user-agent", "accept", "traceparent"}


def rows() -> list[dict]:
    return [json.loads(line) for line in CAPTURE.read_text().splitlines()]


def recorded_reply(row: dict) -> str:
    """What the model wrote: the streamed content, with any tool call as the text it came from."""
    text = ""
    for line in row["resp_body"].splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[6:]).get("choices", []):
            delta = choice["delta"]
            text += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                fn = call["function"]
                text += f'<tool_call>\n{{"name": "{fn["name"]}", "arguments": {fn["arguments"]}}}\n</tool_call>\n'
    return text


def new_messages(body: dict) -> list[dict]:
    """The messages a request adds after its last assistant message."""
    messages = body["messages"]
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[last + 1 :]


class Replay:
    """A nextstate server with a scripted engine, that can be restarted on the same data."""

    def __init__(self, server_factory, **settings) -> None:
        self.judge = ScriptedJudge()
        self.engine_factory, self._engines = scripted_factory(max_context=65536)
        self.server = server_factory(
            engine_factory=self.engine_factory, served_model_name="SmolLM2-135M-Instruct",
            judge_base_url=self.judge.base_url, prm_votes=1, learn=False, **settings,
        )
        self.key = self.server.key("sam")

    @property
    def engine(self) -> ScriptedEngine:
        return self._engines["engine"]

    def restart(self) -> None:
        self.server.stop()
        self.server = start_server(self.server.settings, self.engine_factory)

    def send(self, row: dict, max_tokens: int = 1024) -> tuple[int, str | None, str | None]:
        body = {**row["req_body"], "max_completion_tokens": max_tokens}
        self.engine.script(FORCED_CALL if isinstance(body.get("tool_choice"), dict) else recorded_reply(row))
        headers = {k: v for k, v in row["req_headers"].items() if k in KEEP_HEADERS}
        with httpx.stream("POST", f"{self.server.base_url}/chat/completions", json=body, timeout=60,
                          headers={**headers, "Authorization": f"Bearer {self.key}"}) as response:
            response.read()
        return response.status_code, response.headers.get("x-session-id"), response.headers.get("x-turn-type")

    def hang_up_mid_stream(self, body: dict, reply: str) -> None:
        """The client reads the stream's start and hangs up, as a person's stop does. The engine
        stays slow until the server has recorded the abort: sped up at once, on a starved machine
        it wrote the rest of the reply before the hang-up was noticed, and the turn counted as
        delivered."""
        def aborted() -> int:
            return sum(r["kind"] == "aborted" for r in self.server.records())

        before = aborted()
        self.engine.delay_s = 0.05
        self.engine.script(reply)
        with httpx.stream("POST", f"{self.server.base_url}/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {self.key}"}) as response:
            lines = response.iter_lines()
            next(lines), next(lines)  # the stream started
        wait_for(lambda: aborted() > before, timeout=30)
        self.engine.delay_s = 0.0


@pytest.fixture
def replay(server_factory):
    r = Replay(server_factory)
    yield r
    r.server.stop()
    r.judge.stop()


def test_an_openclaw_conversation_is_one_session_with_the_users_next_states(replay):
    """...and a restart of nextstate in the middle of it loses nothing."""
    captured = rows()
    answered = []
    for i in [3, *CONVERSATION]:
        if i == 10:
            replay.restart()
        answered.append((i, *replay.send(captured[i])))
    server = replay.server
    # rows 5-8 echo our replies: the line goes on. From row 9 on, OpenClaw shows the replies to
    # its forced tool calls as the text it got when it was captured, not as our calls; row 10
    # also merged two attempts and dropped the retry notice. All edits of our replies.
    matches = [r["session_match"] for r in server.records() if r["kind"] == "request"]
    assert matches[:6] == ["new", "new", "extend", "extend", "extend", "extend"], matches
    assert set(matches[6:]) == {"edited"}, matches
    assert [status for _, status, _, _ in answered] == [200] * len(answered), answered
    probe, *conversation = answered
    sessions = {session for _, _, session, _ in conversation}
    assert len(sessions) == 1 and probe[2] not in sessions, "one conversation, one session (and the probe its own)"
    assert {turn_type for _, _, _, turn_type in answered} == {"main"}
    (session,) = sessions

    server.end_conversations()
    server.drain_judge()
    records = server.records()
    requests = [r for r in records if r["kind"] == "request" and r["session_id"] == session]
    assert [r["turn_index"] for r in requests] == list(range(1, len(CONVERSATION) + 1))
    transitions = sorted(
        (r for r in records if r["kind"] == "transition" and r["session_id"] == session), key=lambda r: r["turn_index"]
    )
    assert [t["turn_index"] for t in transitions] == list(range(1, len(CONVERSATION) + 1))
    *with_next, last = transitions
    assert last["reason"] == "session_closed" and last["next_state"] is None
    expected = [new_messages(captured[i]["req_body"]) for i in list(CONVERSATION)[1:]]
    assert [t["next_state"] for t in with_next] == expected
    assert all(t["reason"] == "next_state" for t in with_next)
    assert any(t["edited"] for t in with_next), "OpenClaw rewrote our replies; those turns say so"

    samples = {s.turn_index: s for s in server.app.state.services.samples.samples()
               if s.session_id == session and s.accepted_from is None}
    retry_turns = [t["turn_index"] for t in with_next if "did not produce a user-visible answer" in json.dumps(t["next_state"])]
    assert len(retry_turns) == 1
    for index, sample in samples.items():
        if index in retry_turns:
            assert "format failure" in sample.reason and sample.reward == -1 and sample.votes == []
        else:
            assert "format failure" not in sample.reason and sample.votes, f"turn {index} was judged as user feedback"


@pytest.mark.distributed
def test_an_openclaw_conversation_alternating_between_two_processes_is_one_session(server_factory, postgres):
    """The same traffic, each request sent to the other of two nextstate processes sharing one
    PostgreSQL (as a round-robin load balancer would): still one session, its turns numbered in
    order across both, and each confirmed turn's next state exactly the messages OpenClaw added."""
    import uuid

    url = postgres.fresh_database(f"o{uuid.uuid4().hex[:12]}")
    pair = [Replay(server_factory, database_url=url) for _ in range(2)]
    try:
        captured = rows()
        answered = [pair[n % 2].send(captured[i]) for n, i in enumerate(CONVERSATION)]
        assert [status for status, _, _ in answered] == [200] * len(answered), answered
        assert len({session for _, session, _ in answered}) == 1, "one conversation, one session"
        for replay in pair:
            replay.server.drain_judge()
        records = [r for replay in pair for r in replay.server.records()]
    finally:
        for replay in pair:
            replay.judge.stop()
    requests = sorted(r["turn_index"] for r in records if r["kind"] == "request")
    assert requests == list(range(1, len(CONVERSATION) + 1))
    transitions = sorted((r for r in records if r["kind"] == "transition"), key=lambda r: r["turn_index"])
    # the last turn is pending and the one before provisional: the session is still open
    expected = [new_messages(captured[i]["req_body"]) for i in list(CONVERSATION)[1:-1]]
    assert [t["turn_index"] for t in transitions] == list(range(1, len(CONVERSATION) - 1))
    assert [t["next_state"] for t in transitions] == expected


QUEUED = ("[Queued user message from a previous active turn; preserved as context only. "
          "Continue with the active prompt below.]")


def test_an_aborted_reply_and_openclaws_merge_and_rewrite_keep_every_turn_and_only_the_users_words(replay):
    """OpenClaw's abort sequence, built from the capture's real requests: the user's second
    message is answered, the stream aborted mid-way; OpenClaw sends the next message with the
    aborted one folded in under its queued-message notice; on the turn after, it rewrites that
    entry to the new message alone. Every transition's next state holds no reply of ours (the
    superseded reply once sat between two user messages), the turn that answered the merged
    message is kept (edited, not dropped), and the judge never reads OpenClaw's notice."""
    captured = rows()
    first, second, third, fourth = (captured[i]["req_body"] for i in (4, 5, 6, 7))
    u2, u3, u4 = (body["messages"][-1] for body in (second, third, fourth))
    assert replay.send(captured[4])[0] == 200
    a1 = second["messages"][2]

    # the reply to u2 is aborted mid-stream (the engine is slow; the client hangs up)
    replay.hang_up_mid_stream({**second, "max_completion_tokens": 1024},
                              "A long answer that the user will never see to its end. " * 4)

    merged = {"role": "user", "content": f"{QUEUED}\n{u2['content']}\n\n{u3['content']}"}
    reply3 = "Paris is the capital of France, and I will read notes.txt now."
    replay.engine.script(reply3)
    body3 = {**first, "messages": [*first["messages"], a1, merged], "max_completion_tokens": 1024}
    replay.send({"req_body": body3, "req_headers": captured[6]["req_headers"], "resp_body": ""})
    replay.engine.script("Noted.")
    body4 = {**first, "messages": [*first["messages"], a1, u3, {"role": "assistant", "content": reply3}, u4],
             "max_completion_tokens": 1024}
    status, session, _ = replay.send({"req_body": body4, "req_headers": captured[7]["req_headers"], "resp_body": ""})
    assert status == 200

    server = replay.server
    server.end_conversations()
    server.drain_judge()
    records = server.records()
    matches = [r["session_match"] for r in records if r["kind"] == "request"]
    assert matches == ["new", "extend", "edited"], matches
    assert [r["reason"] for r in records if r["kind"] == "aborted"] == ["the client closed the stream before its end"]
    transitions = sorted((r for r in records if r["kind"] == "transition"), key=lambda r: r["turn_index"])
    assert [(t["turn_index"], t["reason"]) for t in transitions] == [
        (1, "next_state"), (2, "next_state"), (3, "session_closed")], "no turn dropped as superseded"
    for t in transitions:
        assert not any(m["role"] == "assistant" for m in t["next_state"] or []), t
    assert transitions[0]["next_state"] == [merged], "the reaction to the first reply: both of the user's messages"
    assert transitions[1]["next_state"] == [u4] and transitions[1]["edited"], "the merged turn goes on, edited"
    judged = [json.dumps(call) for call in replay.judge.calls]
    assert judged and not any("Queued user message" in text for text in judged), "the judge reads the user, not OpenClaw"
    assert any(u2["content"].split("] ", 1)[1][:40] in text for text in judged)


DAY = Path(__file__).parent / "data" / "openclaw-2026.9.6-abort-flush-compaction" / "traffic.jsonl"
HARNESS_TEXTS = ("Pre-compaction memory flush", "context summarization assistant", "<conversation>",
                 "Queued user message", "[Thu 2026-11-26")


def test_a_day_with_an_abort_a_memory_flush_and_a_compaction_keeps_only_the_persons_words(replay):
    """Issue 43's capture, replayed: the person cuts a reply off (n 4) and aborts the next
    message (n 5), OpenClaw folds it into the following one after its timestamp (n 6) and then
    rewrites it (n 7); near the end of its context it sends its memory flush as the last user
    message (n 8) and seven compaction requests (n 9-15, one cut off). The person's turns are one
    session; the flush and the summaries are side turns, no one's reaction and no session; the
    judge reads the person's words without OpenClaw's timestamps, runtime line or notice."""
    day = [json.loads(line) for line in DAY.read_text().splitlines()]
    answered = {}
    for row in day:
        if row.get("client_gone"):  # the client hung up mid-stream: abort it the same way
            replay.hang_up_mid_stream({**row["req_body"], "max_completion_tokens": 1024},
                                      "A long answer that the person will never see to its end. " * 4)
            continue
        answered[row["n"]] = replay.send(row, max_tokens=4096)  # these replies are long: never cut, as they were not
    assert all(status == 200 for status, _, _ in answered.values()), answered
    person = {n: a for n, a in answered.items() if n <= 7}
    harness = {n: a for n, a in answered.items() if n >= 8}
    assert {turn_type for _, _, turn_type in person.values()} == {"main"}
    assert len({session for _, session, _ in person.values()}) == 1, "the person's day is one session"
    assert {turn_type for _, _, turn_type in harness.values()} == {"side"}, "the flush and the summaries are OpenClaw's"
    (session,) = {session for _, session, _ in person.values()}
    assert {s for n, (_, s, _) in harness.items() if n >= 9} <= {None}, "a summary opens no session"

    server = replay.server
    server.end_conversations()
    server.drain_judge()
    records = server.records()
    assert {r["session_id"] for r in records if r["kind"] == "transition"} == {session}
    transitions = sorted((r for r in records if r["kind"] == "transition"), key=lambda r: r["turn_index"])
    # n 1, 2, 3, 6 (the merged message) and 7 are the person's five turns; the last has no next state
    assert [(t["turn_index"], t["reason"]) for t in transitions] == [
        (1, "next_state"), (2, "next_state"), (3, "next_state"), (4, "next_state"), (5, "session_closed")]
    for t in transitions:
        text = json.dumps(t["next_state"] or [])
        assert "Pre-compaction memory flush" not in text and "<conversation>" not in text, t
        assert not any(m["role"] == "assistant" for m in t["next_state"] or []), t
    reaction = transitions[3]["next_state"]
    assert [m["content"].split("] ", 1)[1][:25] for m in reaction] == ["Too long. One sentence pl"]
    judged = [json.dumps(call) for call in replay.judge.calls]
    assert judged and not any(text in call for call in judged for text in HARNESS_TEXTS), "the judge reads the person"
    assert any("Sorry, I cut you off." in call for call in judged), "the person's own words are read"
    assert not any("Runtime: agent=" in call for call in judged)


COMPACTIONS = Path(__file__).parent / "data" / "openclaw-2026.9.6-day-compactions" / "requests.jsonl"


def test_a_conversation_goes_on_across_openclaws_compactions(replay):
    """Issue 43's day: OpenClaw compacts after nearly every long reply and sends the summary,
    our last reply and the person's next message. That request shares no prefix with the
    conversation, and every compaction began a new session: the turn before it lost its next
    state (20 turns, 16 sessions). It is the same conversation, resumed from our last reply."""
    day = [json.loads(line) for line in COMPACTIONS.read_text().splitlines()]
    answered = {}
    for row in day:
        replay.engine.script(row["reply"])
        with httpx.stream("POST", f"{replay.server.base_url}/chat/completions", timeout=60,
                          json={**row["req_body"], "max_completion_tokens": 4096},
                          headers={"Authorization": f"Bearer {replay.key}"}) as response:
            response.read()
        assert response.status_code == 200, response.text
        answered[row["n"]] = response.headers.get("x-session-id"), response.headers.get("x-turn-type")
    assert [answered[n][1] for n in (3, 4, 5, 7, 9, 11)] == ["side"] * 6, "the summaries are OpenClaw's"
    first, second = answered[1][0], answered[10][0]
    assert [answered[n][0] for n in (1, 2, 6, 8)] == [first] * 4, "resumed after each compaction"
    assert second != first, "n 10 carries none of our replies: a conversation of its own"
    assert answered[12][0] == second, "and it is resumed in turn"

    server = replay.server
    server.end_conversations()
    server.drain_judge()
    transitions = {(r["session_id"], r["turn_index"]): r for r in server.records() if r["kind"] == "transition"}
    said = {key: [m["content"].split("] ", 1)[1][:28] for m in t["next_state"] or []] for key, t in transitions.items()}
    assert said == {
        (first, 1): ["How do I remove a coffee sta"],
        (first, 2): ["What is a good stretch for a"],  # the person's message after the first compaction
        (first, 3): ["Give me an idea for a quick "],  # after the second
        (first, 4): [],  # its reply was compacted away with the overflowing question: no next state
        (second, 1): ["What should I say in an emai"],
        (second, 2): [],
    }, said
    assert all(transitions[key]["reason"] == "next_state" for key, words in said.items() if words)


def test_openclaws_summary_requests_are_answered_at_most_harness_max_tokens_long(server_factory):
    """A compaction summary is kept in place of the history: SmolLM2's ran on to OpenClaw's
    limit (256-409 tokens, several a compaction), which filled the context again within a few
    turns and took minutes of a CPU each. The agent's own requests get NEXTSTATE_HARNESS_MAX_TOKENS
    at most; the person's turns keep what they ask for."""
    replay = Replay(server_factory, harness_max_tokens=12)
    try:
        day = {row["n"]: row for row in map(json.loads, COMPACTIONS.read_text().splitlines())}
        usage = {}
        for n in (1, 3):  # a person's turn, then a summary request
            replay.engine.script("word " * 200)
            response = httpx.post(f"{replay.server.base_url}/chat/completions", timeout=60,
                                  json={**day[n]["req_body"], "max_completion_tokens": 100, "stream": False},
                                  headers={"Authorization": f"Bearer {replay.key}"})
            assert response.status_code == 200, response.text
            usage[response.headers["x-turn-type"]] = response.json()["usage"]["completion_tokens"], response.json()["choices"][0]["finish_reason"]
        assert usage == {"main": (100, "length"), "side": (12, "length")}
    finally:
        replay.server.stop()
        replay.judge.stop()
