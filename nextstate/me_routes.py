"""A user key's own model: what each version gained and forgot (`GET /v1/me/progress`), and the
adapter itself to take elsewhere (`GET /v1/me/adapter`; an admin's `/v1/admin/users/NAME/adapter`).

A person who lets a proxy retrain the model they depend on asks two questions: is the new
version better at what I want, and what did it get worse at. This answers both for the caller's
scope only (their own adapter; the team's one adapter in the shared scope): the figures of
learner/held_out.py per published version, and how many of their turns are held out to measure
them. Other users' figures are the admin's (`/v1/admin/progress`).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from nextstate.core.settings import Settings
from nextstate.core.stores.keys import ApiKey
from nextstate.export import Format, NothingToExport, build_export, export_tar
from nextstate.modelio.gguf_lora import CannotExportGguf
from nextstate.learner.versions import AdapterVersions
from nextstate.progress import version_figures
from nextstate.proxy.auth import authenticate, authenticate_admin
from nextstate.proxy.errors import ApiError
from nextstate.services import app_services

router = APIRouter()


class VersionProgress(BaseModel):
    version: int
    serving: bool = Field(description="This version answers your requests now.")
    gain: float | None = Field(description="Nats per token this version moved your held-out replies the way your "
                               "ratings and reactions point, from where the version that wrote each had it; None: "
                               "nothing held out yet.")
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


ADAPTER_RESPONSES = {200: {"content": {"application/x-tar": {}}, "description": "A tar of one folder: a PEFT adapter "
                            "(adapter_config.json, adapter_model.safetensors), or with format=gguf a llama.cpp LoRA "
                            "adapter (one .gguf file), and a README with how to serve it."}}


def adapter_response(settings: Settings, user: str, version: int | None, format: Format) -> Response:
    try:
        export = build_export(settings, user, version, format)
    except NothingToExport as exc:
        raise ApiError(404, str(exc), code="adapter_not_found") from exc
    except CannotExportGguf as exc:
        raise ApiError(400, str(exc), param="format", code="unsupported_format") from exc
    name = f"nextstate-{export.scope}-v{export.version}.tar"
    return Response(export_tar(export), media_type="application/x-tar",
                    headers={"Content-Disposition": f'attachment; filename="{name}"'})


@router.get("/v1/me/adapter", response_class=Response, responses=ADAPTER_RESPONSES)
async def my_adapter(request: Request, version: int | None = None, format: Format = "peft",
                     key: ApiKey = Depends(authenticate)) -> Response:
    """Your adapter, to take with you: the version serving you (or `version`), as a standard
    PEFT adapter in a tar (`format=gguf`: a llama.cpp one). In the shared scope the adapter is everyone's: an admin's to export."""
    services = app_services(request)
    if services.policies.scope_of(key.user) != key.user:
        raise ApiError(403, "One adapter serves every user here (NEXTSTATE_ADAPTER_SCOPE=shared): an admin exports it "
                       "(GET /v1/admin/users/NAME/adapter).", type="permission_error", code="shared_adapter")
    return await asyncio.to_thread(adapter_response, services.settings, key.user, version, format)


@router.get("/v1/admin/users/{user}/adapter", response_class=Response, responses=ADAPTER_RESPONSES)
async def user_adapter(user: str, request: Request, version: int | None = None, format: Format = "peft",
                       _: ApiKey = Depends(authenticate_admin)) -> Response:
    """A user's adapter (the shared one in the shared scope), as `GET /v1/me/adapter` gives it."""
    return await asyncio.to_thread(adapter_response, app_services(request).settings, user, version, format)


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
