"""One conversation with a tool call, played through any API, and what nextstate made of it
in a form two APIs' runs can be compared in."""

from __future__ import annotations

SYSTEM = "You are a helpful assistant."
FIRST = "Weather in Paris?"
# after each reply: run the tool, then a correction, then praise, then nothing (the end)
FOLLOW_UPS = ("tool", "No, say it in French.", "Thanks, that's great!", None)
TOOL_RESULT = "22 C, sunny"
CALL_TEXT = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REPLIES = [CALL_TEXT, "It is sunny in Paris.", "Bonjour !", "You are welcome."]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def judged_scripted_server(server_factory, judge, times: int = 2):
    """A server whose engine answers REPLIES `times` over, judged by the rule judge."""
    from tests.conftest import scripted_factory

    factory, holder = scripted_factory()
    # the learner off: the judge's samples as stored, not as a batch the learner happened to take
    # meanwhile left them (it drops a sample with nothing to teach when it takes it)
    server = server_factory(engine_factory=factory, judge_base_url=judge.base_url, judge_model="judge", prm_votes=3,
                            learn=False)
    holder["engine"].script(*REPLIES * times)
    return server


def play_chat(server, user: str) -> None:
    """The conversation through chat completions, as a stock client plays it."""
    chat = server.client(server.key(user))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST}]
    for follow_up in FOLLOW_UPS:
        reply = chat.chat.completions.create(
            model="tiny", messages=messages, tools=[{"type": "function", "function": WEATHER}], max_tokens=60)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if follow_up == "tool":
            messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": TOOL_RESULT})
        elif follow_up:
            messages.append({"role": "user", "content": follow_up})


def conversation_summary(server, user: str) -> dict:
    """Sessions, turns (prompt and response ids), transitions and judged samples of `user`."""
    records = [r for r in server.records() if r.get("user") == user]
    requests = [r for r in records if r["kind"] == "request"]
    transitions = [r for r in records if r["kind"] == "transition"]
    samples = [s for s in server.app.state.services.samples.samples() if s.user == user]
    return {
        "sessions": len({r["session_id"] for r in requests}),
        "turns": [(r["turn_type"], r["turn_index"], r["prompt_ids"], r["response_ids"]) for r in requests],
        "transitions": sorted((t["turn_index"], t["reason"], _texts(t["next_state"])) for t in transitions),
        "samples": sorted((s.turn_index, s.status, s.reward, s.hint) for s in samples),
    }


def _texts(next_state: list[dict] | None) -> str:
    """A next state's roles and texts (tool call ids are each API's own)."""
    return repr([(m["role"], m.get("content")) for m in next_state or []])
