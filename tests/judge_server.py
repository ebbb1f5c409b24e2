"""A real OpenAI-compatible HTTP judge that answers with scripted, rule-based verdicts.

PRM prompt: the next state decides — thanks/great → \\boxed{1}; no/wrong/error → \\boxed{-1};
anything else → \\boxed{0}. Hint prompt: a user correction ("no, ...") → \\boxed{1} with a hint
whose length depends on the vote (so "longest wins" is observable); otherwise \\boxed{-1}.
Modes "hang", "garbage" and "error" simulate a broken judge; "echo" quotes what it judged after
its own verdict, as judges do.
"""

from __future__ import annotations

import asyncio
import re
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.background_server import STAND_IN_GRACE_S, free_port, serve_in_thread

HINTS = ["Use French.", "Answer in French, not English.", "Answer in French, not English, and keep it to one short sentence."]
_NEXT_STATE = re.compile(r"\[role: (\w+)\]\n<data (\w+)>\n(.*?)\n</data \2>", re.DOTALL)


class ScriptedJudge:
    def __init__(self, serve: bool = True) -> None:
        self.mode = "rules"
        self.calls: list[list[dict]] = []
        self._hint_calls = 0
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def complete(request: Request):
            body = await request.json()
            self.calls.append(body["messages"])
            if self.mode == "hang":
                await asyncio.sleep(3600)
            if self.mode == "error":
                return JSONResponse({"error": {"message": "boom", "type": "server_error", "param": None, "code": None}}, 500)
            texts = []
            for _ in range(body.get("n") or 1):  # n answers to one prompt, as OpenAI's endpoint gives
                if self.mode == "garbage":
                    texts.append("I am not sure what to say here.")
                elif self.mode == "echo":  # a judge that quotes the text it judges after its verdict
                    texts.append("My verdict: \\boxed{0}. For the record, the text was: " + body["messages"][-1]["content"])
                else:
                    texts.append(self.verdict(body["messages"]))
            return {
                "id": "judge-1", "object": "chat.completion", "created": int(time.time()), "model": body["model"],
                "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                            for i, text in enumerate(texts)],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }

        self.app = app
        self.port = free_port()
        if serve:
            self.server, self.thread, _ = serve_in_thread(app, self.port, name="scripted-judge", grace_s=STAND_IN_GRACE_S)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def verdict(self, messages: list[dict]) -> str:
        system, user = messages[0]["content"], messages[-1]["content"]
        match = _NEXT_STATE.search(user)
        role, raw = (match.group(1), match.group(3)) if match else ("user", user)
        text = raw.lower()
        if "hindsight hint extraction" in system:
            if role == "user" and text.startswith("no"):
                return f"The user corrected the assistant. \\boxed{{1}}\n[HINT_START]{self.hint(raw)}[HINT_END]"
            return "Nothing to learn here. \\boxed{-1}"
        if "thank" in text or "great" in text:
            return "The user is satisfied. \\boxed{1}"
        if text.startswith("no") or "wrong" in text or "error" in text:
            return "Step 1: the user objects. \\boxed{0} was my first guess, but final: \\boxed{-1}"
        return "Unclear. \\boxed{0}"

    def hint(self, next_state: str) -> str:
        """The hint for a correction; rotates through HINTS (so "longest wins" is observable)."""
        hint = HINTS[self._hint_calls % len(HINTS)]
        self._hint_calls += 1
        return hint

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


if __name__ == "__main__":  # python -m tests.judge_server PORT: the same judge in its own process
    import sys

    import uvicorn

    uvicorn.run(ScriptedJudge(serve=False).app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
