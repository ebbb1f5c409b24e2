"""Admin routes (admin keys only)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request

from proxy.auth import authenticate_admin
from proxy.keys import ApiKey

router = APIRouter(prefix="/v1/admin")


@router.get("/stats")
async def stats(request: Request, _: ApiKey = Depends(authenticate_admin)) -> dict:
    """What the judge has done: samples judged/accepted/dropped per mode (and why), mean
    reward per policy version, judge latency."""
    judge = request.app.state.judge
    return {
        "object": "nextstate.stats",
        "mode": judge.config.mode,
        "samples": await asyncio.to_thread(request.app.state.samples.stats),
        "judge": judge.stats.snapshot(),
        "sessions_open": len(request.app.state.sessions),
    }
