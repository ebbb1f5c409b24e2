"""Feedback about a whole session: the verifiable outcome an environment reports."""

from __future__ import annotations

import asyncio
import math

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field, field_validator

from proxy.auth import authenticate
from proxy.errors import OpenAIError
from proxy.keys import ApiKey

router = APIRouter()


class OutcomeRequest(BaseModel):
    reward: float = Field(description="The session's verifiable outcome o, e.g. 1 for success, -1 or 0 for failure.")

    @field_validator("reward")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("reward must be a finite number")
        return value


@router.post("/v1/sessions/{session_id}/outcome")
async def post_outcome(session_id: str, body: OutcomeRequest, request: Request, key: ApiKey = Depends(authenticate)) -> dict:
    """Step reward of each judged turn of the session becomes o + mean(PRM votes) (paper §4.4)."""
    samples = request.app.state.samples
    open_session = request.app.state.sessions.get(key.user, session_id) is not None
    if not open_session and not await asyncio.to_thread(samples.session_known, key.user, session_id):
        raise OpenAIError(404, f"No session '{session_id}' of yours is known here.", param="session_id", code="session_not_found")
    updated = await asyncio.to_thread(samples.set_outcome, key.user, session_id, body.reward)
    request.app.state.records.write("outcome", {"user": key.user, "session_id": session_id, "reward": body.reward, "samples_updated": updated})
    return {"object": "session.outcome", "session_id": session_id, "reward": body.reward, "samples_updated": updated}
