"""The OPD teacher: the same response, scored under a prompt that knows the hint.

With NEXTSTATE_OPD_LOSS=topk the judge scores nothing: it hands the learner the teacher's
prompt, and the learner distils the teacher's whole next-token distribution after it
(learner/distillation.py). `TeacherSignal` is what a hint adds to a sample either way.

The hint is appended to the last user message as "\\n\\n[user's hint / instruction]\\n{hint}"
and the turn is re-rendered with its own tools and tool choice, so the only difference from
the prompt that produced the response is the hint. The response tokens are then scored, one
logprob per response token: `score(teacher_prompt + response, start=len(teacher_prompt))`
returns exactly `len(response)` values, aligned with the sampling logprobs (the reference's
off-by-one came from dropping a first entry that this interface never returns).
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass
from typing import Any

from nextstate.engine.base import Engine
from nextstate.core.types import Turn
from nextstate.judge.advantages import opd_delta
from nextstate.modelio.chat_template import ChatRenderer

HINT_HEADER = "\n\n[user's hint / instruction]\n"


def enhanced_messages(messages: list[dict], hint: str) -> list[dict]:
    out = copy.deepcopy(messages)
    if not hint:
        return out
    for message in reversed(out):
        if message["role"] == "user":
            message["content"] = f"{message.get('content') or ''}{HINT_HEADER}{hint}"
            return out
    out.append({"role": "user", "content": HINT_HEADER.lstrip("\n") + hint})
    return out


async def teacher_prompt_ids(renderer: ChatRenderer, turn: Turn, hint: str) -> list[int]:
    messages = enhanced_messages(turn.messages, hint)
    prompt = await asyncio.to_thread(renderer.render, messages, turn.tools, turn.tool_choice, turn.user)
    return prompt.ids


async def teacher_logprobs(engine: Engine, renderer: ChatRenderer, turn: Turn, hint: str, adapter: str | None) -> list[float]:
    """The response's logprobs after the teacher's prompt."""
    prompt = await teacher_prompt_ids(renderer, turn, hint)
    scores = await engine.score(
        prompt + turn.response_ids, len(prompt), adapter=adapter, temperature=turn.logprob_temperature, background=True
    )
    if len(scores) != len(turn.response_ids):
        raise RuntimeError(f"teacher returned {len(scores)} logprobs for {len(turn.response_ids)} response tokens")
    return scores


@dataclass(frozen=True)
class TeacherSignal:
    """What a hint adds to a sample: the teacher's logprobs of the sampled tokens (`sampled`:
    their gap to the sampler's is an advantage) or the prompt the learner's teacher reads
    (`topk`: the gap is a loss of its own, weighted in the sample)."""

    logprobs: list[float] | None = None
    prompt_ids: list[int] | None = None
    # What the hint's effect is measured against, where not the turn's own prompt and its
    # sampler: the same teacher reading a placebo of the hint (judge/hindsight.py).
    contrast_logprobs: list[float] | None = None
    contrast_prompt_ids: list[int] | None = None

    def against(self, placebo: TeacherSignal) -> TeacherSignal:
        """This hint's signal, measured against `placebo`'s instead of the turn's own prompt."""
        return TeacherSignal(self.logprobs, self.prompt_ids, placebo.logprobs, placebo.prompt_ids)

    def delta(self, old: list[float], clip: float) -> list[float] | None:
        """The per-token advantage term (teacher − `old`, the sampler's logprobs, or teacher −
        placebo), or None when the learner distils instead."""
        if self.logprobs is None:
            return None
        return opd_delta(self.logprobs, self.contrast_logprobs if self.contrast_logprobs is not None else old, clip)

    def sample_fields(self, w_opd: float) -> dict[str, Any]:
        return {"teacher_logprobs": self.logprobs, "teacher_prompt_ids": self.prompt_ids,
                "contrast_prompt_ids": self.contrast_prompt_ids,
                "distill_weight": w_opd if self.prompt_ids is not None else None}
