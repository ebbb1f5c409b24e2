"""`GET /v1/me/progress`: a user key reads what each version of its own model gained and forgot.

A person who lets a proxy retrain the model they depend on asks two questions: is the new
version better at what I want, and what did it get worse at. This answers both for the caller's
scope only (their own adapter; the team's one adapter in the shared scope): the figures of
learner/held_out.py per published version, and how many of their turns are held out to measure
them. Other users' figures are the admin's (`/v1/admin/progress`).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from nextstate.core.stores.keys import ApiKey
from nextstate.learner.versions import AdapterVersions
from nextstate.progress import version_figures
from nextstate.proxy.auth import authenticate
from nextstate.services import app_services

router = APIRouter()


class VersionProgress(BaseModel):
    version: int
    serving: bool = Field(description="This version answers your requests now.")
    gain: float | None = Field(description="Nats per token this version moved your held-out replies the way your "
                               "ratings and reactions point, against the base model (0); None: nothing held out yet.")
    forgetting: float | None = Field(description="Its perplexity on plain general text over the base model's, as a "
                                     "share: 0.05 is 5% more surprised by ordinary text.")
    kl: float | None = Field(description="KL from the base model on your held-out replies, nats per token.")
    held_out: int | None = Field(description="Held-out turns it was scored on.")


class MyProgress(BaseModel):
    object: str = "nextstate.me.progress"
    user: str
    scope: str = Field(description="Your own adapter's scope, or 'shared' when one adapter serves everyone.")
    serving: int = Field(description="The version serving you now (0: the base model).")
    held_out: int = Field(description="Your turns held out: never trained on, what each version is scored on.")
    versions: list[VersionProgress]


@router.get("/v1/me/progress", response_model=MyProgress)
async def my_progress(request: Request, key: ApiKey = Depends(authenticate)) -> MyProgress:
    """What each version of your model gained for you and what it forgot."""
    services = app_services(request)
    scope = services.policies.scope_of(key.user)
    versions = AdapterVersions(services.settings.adapters_dir)
    figures = await asyncio.to_thread(version_figures, versions, scope)
    held = await asyncio.to_thread(services.samples.held_out_count, key.user)
    return MyProgress(
        user=key.user, scope=scope, serving=services.policies.current_scope(scope).version, held_out=held,
        versions=[VersionProgress(**{k: v for k, v in f.items() if k != "scope"}) for f in figures],
    )
