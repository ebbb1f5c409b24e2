"""Agent frameworks' own tool loops through nextstate: what they send must be taken, and what
they hold must be one conversation to nextstate, with judged transitions.

Each drives a two-request, tool-using exchange (the model calls a tool, the framework runs it
and sends the result, the model answers) and a follow-up, against a scripted engine (the tiny
model would not call tools on its own) and the rule judge.
"""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel

from tests.conftest import scripted_factory
from tests.turn_summary import CALL_TEXT, FIRST, SYSTEM, TOOL_RESULT


class Forecast(BaseModel):
    city: str
    summary: str


FINAL = '{"city": "Paris", "summary": "sunny"}'
FRENCH = '{"city": "Paris", "summary": "ensoleillé"}'


def scripted_judged(server_factory, judge, *replies: str):
    factory, holder = scripted_factory()
    server = server_factory(engine_factory=factory, judge_base_url=judge.base_url, judge_model="judge", prm_votes=3)
    holder["engine"].script(*replies)
    return server


def one_judged_conversation(server, user: str, turns: int) -> None:
    server.end_conversations()
    server.drain_judge()
    requests = [r for r in server.records() if r["kind"] == "request" and r["user"] == user]
    assert len(requests) == turns and all(r["turn_type"] == "main" for r in requests), [r["turn_type"] for r in requests]
    sessions = {r["session_id"] for r in requests}
    assert len(sessions) == 1, "the framework's conversation is one session"
    transitions = [r for r in server.records() if r["kind"] == "transition" and r.get("session_id") in sessions]
    assert sorted(t["turn_index"] for t in transitions) == list(range(1, turns + 1))
    # every turn that had a next state (all but the last, closed with the session) was judged
    followed = sorted(t["turn_index"] for t in transitions if t["reason"] == "next_state")
    assert followed == list(range(1, turns)), [(t["turn_index"], t["reason"]) for t in transitions]
    judged = {s.turn_index: s for s in server.app.state.services.samples.samples() if s.user == user}
    assert all(judged[i].votes or "format failure" in judged[i].reason for i in followed), judged


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_the_openai_agents_sdk_with_a_function_tool_and_an_output_type(server_factory, judge, api):
    from agents import (Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    server = scripted_judged(server_factory, judge, CALL_TEXT, FINAL, FRENCH)

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return TOOL_RESULT

    async def run() -> tuple:
        client = AsyncOpenAI(base_url=server.base_url, api_key=server.key("alice"), max_retries=0)
        model = OpenAIResponsesModel("tiny", client) if api == "responses" else OpenAIChatCompletionsModel("tiny", client)
        agent = Agent(name="weather", instructions=SYSTEM, tools=[get_weather], output_type=Forecast, model=model)
        first = await Runner.run(agent, FIRST)
        second = await Runner.run(agent, first.to_input_list() + [{"role": "user", "content": "No, say it in French."}])
        return first, second

    first, second = asyncio.run(run())
    assert first.final_output == Forecast(city="Paris", summary="sunny")
    assert second.final_output == Forecast(city="Paris", summary="ensoleillé")
    one_judged_conversation(server, "alice", 3)


def test_langchain_bind_tools_and_with_structured_output(server_factory, judge):
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    server = scripted_judged(server_factory, judge, CALL_TEXT, "It is sunny in Paris.", FRENCH)
    llm = ChatOpenAI(model="tiny", base_url=server.base_url, api_key=server.key("bob"), max_retries=0, max_tokens=60)

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return TOOL_RESULT

    messages = [SystemMessage(SYSTEM), HumanMessage(FIRST)]
    call = llm.bind_tools([get_weather]).invoke(messages)
    assert call.tool_calls and call.tool_calls[0]["name"] == "get_weather" and call.tool_calls[0]["args"] == {"city": "Paris"}
    messages += [call, ToolMessage(TOOL_RESULT, tool_call_id=call.tool_calls[0]["id"])]
    answer = llm.bind_tools([get_weather]).invoke(messages)
    assert answer.content == "It is sunny in Paris."
    messages += [answer, HumanMessage("No, say it in French, as JSON.")]
    structured = llm.with_structured_output(Forecast).invoke(messages)
    assert structured == Forecast(city="Paris", summary="ensoleillé")
    one_judged_conversation(server, "bob", 3)
