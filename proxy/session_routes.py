"""Feedback about a whole session: the verifiable outcome an environment reports."""

from __future__ import annotations

import asyncio
import math

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from nextstate.proxy.app_state import services
from nextstate.proxy.auth import authenticate
from nextstate.proxy.errors import ApiError
from nextstate.core.stores.keys import ApiKey
from nextstate.proxy.request_body import read_model, request_body_schema

router = APIRouter()


class OutcomeRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    reward: float = Field(description="The session's verifiable outcome o, e.g. 1 for success, -1 for failure.")

    @field_validator("reward")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("reward must be a finite number")
        return value


@router.post("/v1/sessions/{session_id}/outcome", openapi_extra=request_body_schema(OutcomeRequest))
async def post_outcome(session_id: str, request: Request, key: ApiKey = Depends(authenticate)) -> dict:
    """Step reward of each judged turn of the session becomes o + mean(PRM votes) (paper §4.4).

    Only for a session whose requests declared X-Outcome-Expected (an environment's episode),
    and only within the configured bounds: an outcome is a reward, and an unbounded or
    undeclared one would let any user steer the adapter."""
    body = await read_model(request, OutcomeRequest)
    judge = services(request).judge.settings
    if not judge.outcome_min <= body.reward <= judge.outcome_max:
        raise ApiError(
            400, f"reward must be between {judge.outcome_min:g} and {judge.outcome_max:g} (NEXTSTATE_OUTCOME_MIN/MAX).",
            param="reward", code="reward_out_of_range",
        )
    await services(request).sessions.refresh(key.user, session_id=session_id)
    session = services(request).sessions.get(key.user, session_id)
    samples = services(request).samples
    if session is not None:
        declared = session.outcome_expected
    else:
        declared = await asyncio.to_thread(samples.session_expects_outcome, key.user, session_id)
        if not declared and not await asyncio.to_thread(samples.session_known, key.user, session_id):
            raise ApiError(404, f"No session '{session_id}' of yours is known here.", param="session_id", code="session_not_found")
    if not declared:
        raise ApiError(
            409, f"Session '{session_id}' did not declare an outcome: send X-Outcome-Expected: true with its requests.",
            param="session_id", code="outcome_not_expected",
        )
    updated = await services(request).feedback.record_outcome(key.user, session_id, body.reward)
    if session is not None:
        # The outcome ends the episode: its last step, still pending, takes the outcome as its
        # next state (the judge stores it, after this answer, with reward o).
        services(request).sessions.close(session)
    return {"object": "session.outcome", "session_id": session_id, "reward": body.reward, "samples_updated": updated}
