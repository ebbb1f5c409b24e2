"""Real traffic from three coding agents, replayed against nextstate: every request accepted, one
session per conversation, the harness's own requests side turns, next states the tool's results.

tests/data/coding-agents/ holds what Codex CLI 0.171.0 (Responses API), Claude Code 2.1.332
(Messages API) and opencode 1.18.33 (Chat Completions) sent nextstate when each was set up as
docs/agents.md says and asked "List the files here." (`python -m bench.coding_agents --scripted
--keep ...`; its docstring says how), run non-interactively (`<agent>.jsonl`) and in the terminal
interface a person types into (`<agent>-interactive.jsonl`, `--interactive`). The model was
scripted: a call to the agent's own shell tool, then an answer; each agent ran the call and sent
its result back (Codex's terminal interface also asks for the new thread's title). Here each
request is sent again as captured (headers included: opencode's session id is one), to a server
whose engine writes what was written then, read back from the captured response.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.conftest import scripted_factory

DATA = Path(__file__).parent / "data" / "coding-agents"
DROP_HEADERS = {"authorization", "x-api-key", "host", "content-length", "accept-encoding", "connection"}


def rows(agent: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / f"{agent}.jsonl").read_text().splitlines()]


def call_text(name: str, arguments: str) -> str:
    return f'\n<tool_call>\n{{"name": "{name}", "arguments": {arguments or "{}"}}}\n</tool_call>'


def events(row: dict) -> list[dict]:
    return [json.loads(line[6:]) for line in row["resp_body"].splitlines() if line.startswith("data: {")]


def written(row: dict) -> str:
    """What the model wrote for a captured reply, in any of the three APIs' streams, tool calls
    as the text they came from."""
    text = ""
    if row["path"].startswith("/v1/chat/completions"):
        calls: dict[int, list[str]] = {}
        for event in events(row):
            for choice in event.get("choices", []):
                text += choice["delta"].get("content") or ""
                for call in choice["delta"].get("tool_calls") or []:
                    part = calls.setdefault(call["index"], ["", ""])
                    part[0] += call["function"].get("name") or ""
                    part[1] += call["function"].get("arguments") or ""
        return text + "".join(call_text(*calls[i]) for i in sorted(calls))
    if row["path"].startswith("/v1/responses"):
        (done,) = [e["response"] for e in events(row) if e["type"] in ("response.completed", "response.incomplete")]
        for item in done["output"]:
            if item["type"] == "message":
                text += "".join(part["text"] for part in item["content"])
            elif item["type"] == "function_call":
                name = f"{item['namespace']}.{item['name']}" if item.get("namespace") else item["name"]
                text += call_text(name, item["arguments"])
        return text
    blocks: dict[int, list[str]] = {}
    for event in events(row):
        if event["type"] == "content_block_start":
            block = event["content_block"]
            blocks[event["index"]] = [block["type"], block.get("name", ""), block.get("text", "")]
        elif event["type"] == "content_block_delta":
            delta = event["delta"]
            blocks[event["index"]][2] += delta.get("text") or delta.get("partial_json") or ""
    return "".join(body if kind == "text" else call_text(name, body) for kind, name, body in blocks.values())


@pytest.fixture
def replayed(server_factory):
    def replay(agent: str):
        factory, engines = scripted_factory(max_context=65536)
        # the judge off: the transitions are still recorded, and no vote takes a scripted reply
        server = server_factory(engine_factory=factory, served_model_name="scripted-64k", learn=False,
                                judge_enabled=False)
        key = server.key("alice")
        answered = []
        for row in rows(agent):
            engines["engine"].script(written(row))
            headers = {k: v for k, v in row["req_headers"].items() if k not in DROP_HEADERS}
            headers["x-api-key" if row["path"].startswith("/v1/messages") else "authorization"] = (
                key if row["path"].startswith("/v1/messages") else f"Bearer {key}")
            with httpx.stream("POST", server.root + row["path"], json=row["req_body"], headers=headers,
                              timeout=60) as response:
                response.read()
            answered.append(response.status_code)
        server.end_conversations()
        return server, answered

    return replay


@pytest.mark.parametrize("agent, turn_types, tool, known_as", [
    ("codex", ["main", "main"], "exec_command", "codex"),
    ("claude", ["main", "main"], "Bash", "claude-code"),
    # opencode's title generator asks first, with the conversation's own session id
    ("opencode", ["side", "main", "main"], "bash", "opencode"),
    # Codex's terminal interface asks for the new thread's title in a thread of its own
    ("codex-interactive", ["main", "side", "main"], "exec_command", "codex"),
    ("claude-interactive", ["main", "main"], "Bash", "claude-code"),
    ("opencode-interactive", ["side", "main", "main"], "bash", "opencode"),
])
def test_a_coding_agents_tool_loop_is_one_session_whose_next_state_is_the_tools_result(replayed, agent, turn_types, tool,
                                                                                     known_as):
    captured = rows(agent)
    server, answered = replayed(agent)
    assert answered == [row["status"] for row in captured] == [200] * len(captured)
    requests = [r for r in server.records() if r["kind"] == "request"]
    assert [r["turn_type"] for r in requests] == turn_types
    main = [r for r in requests if r["turn_type"] == "main"]
    assert len({r["session_id"] for r in main}) == 1 and [r["turn_index"] for r in main] == [1, 2]
    assert [c["function"]["name"] for c in main[0]["response"]["tool_calls"]] == [tool]
    transitions = sorted((r for r in server.records() if r["kind"] == "transition"), key=lambda r: r["turn_index"])
    assert [t["turn_index"] for t in transitions] == [1, 2]
    first, last = transitions
    (result,) = first["next_state"]
    assert result["role"] == "tool", "the call's result (its id is the capture's: ids differ per run, matching ignores them)"
    assert "README.md" in result["content"] and "notes.txt" in result["content"], "the tool's own output"
    assert last["next_state"] is None and last["reason"] == "session_closed"
    assert first["agent"] == known_as, "known by its User-Agent: its tool steps get the general-agent PRM"


def test_a_coding_agents_tool_step_is_judged_with_the_general_agent_prm():
    """A coding agent's step answered by its tool is the environment's feedback on a
    software-engineering step (the paper's general agents, appendix C); its person's own reply,
    and every step of other clients, are judged with NEXTSTATE_PRM_PROMPT."""
    from types import SimpleNamespace

    from nextstate.core.agent_texts import CODING_AGENT_TOOL_PRM, coding_agent
    from nextstate.core.types import NextState
    from nextstate.judge.service import Judge

    assert [coding_agent((row["req_headers"] or {}).get("user-agent")) for row in (rows(a)[0] for a in
            ("codex", "claude", "opencode"))] == ["codex", "claude-code", "opencode"]
    assert coding_agent("openclaw/2026.9.6") is None and coding_agent(None) is None and coding_agent("OpenAI/Python 2.8") is None
    judge = SimpleNamespace(_tool_prm=CODING_AGENT_TOOL_PRM, settings=SimpleNamespace(prm_prompt="prm_personal"))
    tool = NextState(messages=[{"role": "tool", "content": "README.md notes.txt"}])
    person = NextState(messages=[{"role": "user", "content": "No, only the text files."}])
    for agent, next_state, expected in ((("codex", tool, "prm_swe")), ("codex", person, "prm_personal"),
                                        (None, tool, "prm_personal")):
        assert Judge.prm_prompt(judge, SimpleNamespace(agent=agent), next_state) == expected


def test_harness_text_is_matched_and_left_out_of_what_the_judge_reads():
    """Claude Code's continuation notice is a format failure, its and Codex's context blocks are
    not the person's words, and each harness's own requests are side turns (core/agent_texts.py)."""
    import re

    from nextstate.core.agent_texts import HARNESS_NOTICES, HARNESS_TURNS, HARNESS_WRAPPERS
    from nextstate.proxy.harness_turns import HarnessTurns

    def removed(text: str) -> str:
        for pattern in HARNESS_WRAPPERS:
            text = re.sub(pattern, "", text)
        return text

    assert removed("<system-reminder>\nToday is Sunday.\n</system-reminder>\nWhy did it fail?") == "Why did it fail?"
    assert removed("<environment_context>\n  <cwd>/w</cwd>\n</environment_context>") == ""
    assert any(re.search(p, "Output token limit hit. Your caller does not receive an answer in pieces.")
               for p in HARNESS_NOTICES)
    turns = HarnessTurns(HARNESS_TURNS)
    title = rows("opencode")[0]["req_body"]["messages"]
    assert turns.matches(title) and not turns.matches(rows("opencode")[1]["req_body"]["messages"])
    codex_title = rows("codex-interactive")[1]["req_body"]["input"][-1]["content"][0]["text"]
    assert turns.matches([{"role": "user", "content": codex_title}]), "without its header too"
    assert turns.matches([{"role": "user", "content": "Your task is to create a detailed summary of the conversation so far."}])


def test_codex_requests_of_its_own_kind_are_side_turns():
    """Codex names each request's purpose in x-codex-turn-metadata: "turn" for the person's turn
    and its tool loop (the captures' kind), any other (compacting the history, say) is its own."""
    from nextstate.core.agent_texts import harness_turn_type
    from nextstate.proxy.wire import TurnHints

    captured = rows("codex")[0]["req_headers"]
    assert json.loads(captured["x-codex-turn-metadata"])["request_kind"] == "turn"
    assert harness_turn_type(captured) is None
    own = {**captured, "x-codex-turn-metadata": captured["x-codex-turn-metadata"].replace('"turn"', '"compact"', 1)}
    assert harness_turn_type(own) == "side" and TurnHints.from_request(own, None).turn_type == "side"
    # its terminal interface's title request: request_kind "turn", in a thread of the title's own
    sources = [json.loads(row["req_headers"]["x-codex-turn-metadata"]) for row in rows("codex-interactive")]
    assert [(m["request_kind"], m["thread_source"]) for m in sources] == [("turn", "user"), ("turn", "thread_title"),
                                                                          ("turn", "user")]
    assert [harness_turn_type(row["req_headers"]) for row in rows("codex-interactive")] == [None, "side", None]
    assert TurnHints.from_request({**own, "x-turn-type": "main"}, None).turn_type == "main", "the client's own word wins"
    assert harness_turn_type({"x-codex-turn-metadata": "not json"}) is None
