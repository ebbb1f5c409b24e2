"""Admin routes (admin keys only): judge stats, adapter versions, rollback."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from nextstate.proxy.app_state import services
from nextstate.proxy.auth import authenticate_admin
from nextstate.proxy.errors import ApiError
from nextstate.core.stores.keys import ApiKey

router = APIRouter(prefix="/v1/admin")


@router.get("/stats")
async def stats(request: Request, _: ApiKey = Depends(authenticate_admin)) -> dict:
    """What the judge has done: samples judged/accepted/dropped per mode (and why), mean
    reward per policy version, judge latency; and the learner's recent steps."""
    state = services(request)
    learner = state.learner
    return {
        "object": "nextstate.stats",
        "mode": state.judge.settings.mode,
        "samples": await asyncio.to_thread(state.samples.stats),
        "judge": state.judge.report(),
        "learner": {"enabled": learner is not None, "steps": learner.steps[-20:] if learner else []},
        "sessions_open": len(state.sessions),
    }


@router.get("/adapters")
async def adapters(request: Request, _: ApiKey = Depends(authenticate_admin)) -> dict:
    learner = services(request).learner
    return {"object": "list", "data": await learner.adapters() if learner is not None else []}


class RollbackRequest(BaseModel):
    version: int = Field(ge=1)
    scope: str = Field("shared", description="'shared', or a user's name when adapters are per user.")


@router.post("/adapters/rollback")
async def rollback(body: RollbackRequest, request: Request, _: ApiKey = Depends(authenticate_admin)) -> dict:
    learner = services(request).learner
    if learner is None:
        raise ApiError(409, "The learner is off (NEXTSTATE_LEARN=0): there are no adapters to roll back.", code="learner_disabled")
    try:
        new_version = await learner.rollback(body.scope, body.version)
    except KeyError:
        raise ApiError(404, f"Scope '{body.scope}' has no adapter version {body.version}.", param="version", code="version_not_found") from None
    return {"object": "adapter.rollback", "scope": body.scope, "restored": body.version, "version": new_version}


@router.delete("/users/{user}")
async def forget_user(user: str, request: Request, _: ApiKey = Depends(authenticate_admin)) -> dict:
    """Delete everything of one user: keys, open sessions, records, samples, their own adapter."""
    return await services(request).forget_user(user)
