"""`POST /v1/feedback`: a person rates one of their replies, and may say how it should have been.

The one direct way to teach the model: no judge is asked (judge/feedback.py says how a rating
and a correction become a sample). The reply is named by the `id` its client got, from any of
the three APIs: a chat completion's `chatcmpl-…`, a Messages reply's `msg_…`, a Response's
`resp_…`. Only the user it was served to may rate it, and for anyone else it does not exist
(404, as for an unknown id).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from nextstate.proxy.app_state import services
from nextstate.proxy.auth import authenticate
from nextstate.proxy.errors import ApiError
from nextstate.core.stores.keys import ApiKey
from nextstate.proxy.request_body import read_model, request_body_schema

router = APIRouter()

MAX_CORRECTION_CHARS = 4000
RESPONSE_ID_PATTERN = r"^(chatcmpl-|msg_|resp_)[A-Za-z0-9]{1,64}$"


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    response_id: str = Field(
        pattern=RESPONSE_ID_PATTERN,
        description="The `id` of the reply being rated: `chatcmpl-…` (chat completions), `msg_…` (Messages) or `resp_…` (Responses).",
    )
    rating: Literal[1, -1] = Field(description="1: good, do more of this. -1: bad, do less of this.")
    correction: str | None = Field(
        None, min_length=1, max_length=MAX_CORRECTION_CHARS,
        description="How the reply should have been, in words (becomes the hint the OPD teacher reads).",
    )

    @field_validator("correction")
    @classmethod
    def _no_nul(cls, value: str | None) -> str | None:
        # PostgreSQL's text cannot hold a NUL character: refused here, for both backends alike
        if value is not None and "\x00" in value:
            raise ValueError("must not contain a NUL character (\\u0000)")
        return value

    @field_validator("rating", mode="before")
    @classmethod
    def _an_integer(cls, value: Any) -> Any:
        # a Literal matches by equality, and True == 1.0 == 1: a rating is the integer itself
        if type(value) is not int:
            raise ValueError("must be the integer 1 or -1")
        return value


class FeedbackResponse(BaseModel):
    object: Literal["feedback"] = "feedback"
    response_id: str
    rating: int
    correction: str | None
    status: Literal["accepted", "already_trained"] = Field(
        description="accepted: the rating is stored and its turn will train on it (the sample is made in the "
        "background, a correction scored by the OPD teacher first). already_trained: that turn was trained on "
        "before the rating came; it is recorded, not trained again."
    )
    session_id: str | None = None
    turn_index: int | None = None


@router.post("/v1/feedback", openapi_extra=request_body_schema(FeedbackRequest), response_model=FeedbackResponse)
async def post_feedback(request: Request, key: ApiKey = Depends(authenticate)) -> FeedbackResponse:
    """Rate one reply (+1 / −1), optionally with a correction; rating it again replaces the rating."""
    body = await read_model(request, FeedbackRequest)
    # a rating counts as a request against the key's limit: a correction costs a teacher pass
    state = services(request)
    await state.turns.limiter.admit(key, 0)
    await state.sessions.refresh(key.user, every=True)  # the turn may be open in another process's session
    open_turn = state.sessions.find_turn(key.user, body.response_id)
    result = await state.feedback.apply(
        key.user, body.response_id, body.rating, body.correction, open_turn=open_turn
    )
    if result.status == "not_found" and (legacy := _stored_before_api_ids(body.response_id)) is not None:
        # Messages and Responses turns served before their ids were kept were stored under the
        # chat completion id with the same key
        open_turn = state.sessions.find_turn(key.user, legacy)
        result = await state.feedback.apply(key.user, legacy, body.rating, body.correction, open_turn=open_turn)
    if result.status == "not_found":
        raise ApiError(
            404, f"No reply '{body.response_id}' of yours is known here: only the main turns of your own "
            "conversations can be rated, until records retention removes them.",
            param="response_id", code="response_not_found",
        )
    return FeedbackResponse(
        response_id=body.response_id, rating=body.rating, correction=body.correction, status=result.status,
        session_id=result.session_id, turn_index=result.turn_index,
    )


def _stored_before_api_ids(response_id: str) -> str | None:
    for prefix in ("msg_", "resp_"):
        if response_id.startswith(prefix):
            return "chatcmpl-" + response_id.removeprefix(prefix)
    return None
