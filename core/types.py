"""Data types that cross package boundaries: what the proxy hands to the judge.

A `Turn` holds exactly what the engine saw and sampled (token ids and sampling logprobs), so
nothing downstream ever re-tokenises text. A `Transition` pairs a turn with the next state that
followed it, or with none when its session closed first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field


class Turn(BaseModel):
    session_id: str
    user: str
    turn_index: int = Field(description="1 for the first main turn of a session.")
    messages: list[dict[str, Any]] = Field(description="The request's messages, normalised.")
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    logprob_temperature: float = Field(description="Temperature the logprobs were taken at.")
    sampling: dict[str, Any]
    policy_version: int
    adapter: str | None
    response_message: dict[str, Any] = Field(description="The assistant message the client got.")
    finish_reason: str
    created_at: float
    track: Literal["personal", "outcome"] = Field(
        "personal", description="'outcome': an environment will post a verifiable outcome for the session."
    )
    agent: str | None = Field(
        None, description="The coding agent that sent it, by its User-Agent (core/agent_texts.py CODING_AGENTS); None: any other client."
    )
    response_id: str | None = Field(None, description="The id of the reply its client got (`chatcmpl-…`, `msg_…` or `resp_…` by API): what feedback names.")
    logprobs_masked: bool = Field(
        False, description="Its logprobs are the engine's after a grammar mask (it could not be scored again): never trained."
    )


class NextState(BaseModel):
    """The messages that followed a turn: the user's reply and/or tool results."""

    messages: list[dict[str, Any]]

    @property
    def role(self) -> str:
        return self.messages[-1]["role"] if self.messages else "user"

    @property
    def text(self) -> str:
        return "\n\n".join(str(m.get("content") or "") for m in self.messages)


class Transition(BaseModel):
    turn: Turn
    next_state: NextState | None
    reason: Literal["next_state", "session_closed", "superseded"]
    edited: bool = Field(False, description="The client went on from an edited copy of the turn's reply.")
    revises: bool = Field(
        False, description="Replaces the next state handed over when the session settled: judged instead, unless trained."
    )

    def record(self) -> dict[str, Any]:
        """The `transition` record: who, which turn, why, and the next state itself."""
        turn = self.turn
        return {
            "user": turn.user,
            "session_id": turn.session_id,
            "turn_index": turn.turn_index,
            "policy_version": turn.policy_version,
            "reason": self.reason,
            "next_state": self.next_state.messages if self.next_state else None,
            "edited": self.edited,
            "revises": self.revises,
            "response_tokens": len(turn.response_ids),
            **({"agent": turn.agent} if turn.agent else {}),
        }


# held_out: never trained; what each version of its user's scope is scored on (learner/held_out.py)
SampleStatus = Literal["ready", "dropped", "awaiting_outcome", "consumed", "held_out"]


class Sample(BaseModel):
    """One judged turn, ready for the learner (or dropped, with the reason kept)."""

    id: int | None = None
    user: str
    session_id: str
    turn_index: int
    policy_version: int
    adapter: str | None
    mode: Literal["binary", "opd", "combined"]
    track: Literal["personal", "outcome"] = "personal"
    status: SampleStatus
    reason: str = Field("", description="Why the sample was dropped, or how it was accepted.")
    prompt_ids: list[int]
    response_ids: list[int]
    old_logprobs: list[float]
    logprob_temperature: float
    advantages: list[float] = Field(description="Per response token; for outcome samples, set per batch.")
    loss_mask: list[int]
    reward: float = Field(description="Scalar reward: majority vote, or o + mean votes for outcome samples.")
    votes: list[int | None] = Field(default_factory=list)
    hint: str | None = None
    teacher_logprobs: list[float] | None = None
    outcome: float | None = None
    response_id: str | None = None
    feedback: dict[str, Any] | None = Field(None, description="The explicit rating and correction it was built from.")
    created_at: float
    tries: int = Field(0, description="Updates that trained on it and were not published (it waited again each time).")
    accepted_from: int | None = Field(
        None, description="Built from the reply of this later turn, accepted after a correction of this one (no longer made: old rows only)."
    )
    teacher_prompt_ids: list[int] | None = Field(
        None, description="The prompt with the hint, as the OPD teacher reads it: the learner distils the teacher's "
        "next-token distribution after it (NEXTSTATE_OPD_LOSS=topk, learner/distillation.py)."
    )
    contrast_prompt_ids: list[int] | None = Field(
        None, description="What the hint's shift is measured against in the base model, where not the sample's own "
        "prompt: the same hint's placebo (judge/hindsight.py)."
    )
    distill_weight: float | None = Field(
        None, description="Weight of the reverse KL to the teacher's distribution in its loss; None: the teacher's "
        "gap, if any, is in its advantages (NEXTSTATE_OPD_LOSS=sampled)."
    )


# accepted: the rating is on disk, its sample is being made; applied: it was made (records only);
# already_trained: the turn was trained on before the rating came (recorded, not trained again)
FeedbackStatus = Literal["accepted", "applied", "already_trained", "not_found"]


@dataclass(frozen=True)
class FeedbackResult:
    """What became of a person's rating of a reply (`POST /v1/feedback`)."""

    status: FeedbackStatus
    sample_id: int | None = None
    session_id: str | None = None
    turn_index: int | None = None
