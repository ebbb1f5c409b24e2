"""What the routes may use of the running server: one typed object, built once by the app.

The app's lifespan builds every long-lived object and hands the routes this `ProxyServices`
as `app.state.services` (`services(request)` reads it). The judge, explicit feedback and the
learner live in sibling packages the proxy never imports, so the routes see them through the
small protocols below: only what a route calls.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request

from nextstate.core.metrics import Metrics
from nextstate.core.policy import PolicyDirectory
from nextstate.core.records import RecordWriter
from nextstate.core.stores.samples import SampleStore
from nextstate.core.settings import JudgeSettings, Settings
from nextstate.core.types import FeedbackResult, Turn
from nextstate.proxy.chat_completion.serving import ChatCompletionServing
from nextstate.core.stores.keys import KeyStore
from nextstate.proxy.messages.serving import MessagesServing
from nextstate.proxy.responses.serving import ResponsesServing
from nextstate.proxy.sessions import SessionStore
from nextstate.proxy.turns import TurnService


class JudgeView(Protocol):
    """The judge as the admin routes report it."""

    settings: JudgeSettings

    def report(self) -> dict[str, Any]: ...


class FeedbackDesk(Protocol):
    """Where explicit signals go: a person's rating of a reply, an environment's outcome."""

    async def apply(
        self, user: str, response_id: str, rating: int, correction: str | None, open_turn: Turn | None = None
    ) -> FeedbackResult: ...

    async def record_outcome(self, user: str, session_id: str, outcome: float) -> int: ...


class LearnerView(Protocol):
    """The learner as the admin routes see it."""

    steps: list[dict[str, Any]]

    async def adapters(self) -> list[dict[str, Any]]: ...

    async def rollback(self, scope: str, version: int) -> int: ...


@dataclass
class ProxyServices:
    settings: Settings
    keys: KeyStore
    records: RecordWriter
    metrics: Metrics
    sessions: SessionStore
    policies: PolicyDirectory
    samples: SampleStore
    turns: TurnService
    chat: ChatCompletionServing
    messages: MessagesServing
    responses: ResponsesServing
    judge: JudgeView
    feedback: FeedbackDesk
    learner: LearnerView | None
    # deletes one user's data everywhere it lives (nextstate/forget.py); the answer's summary
    forget_user: Callable[[str], Awaitable[dict[str, Any]]]


def services(request: Request) -> ProxyServices:
    """The running server's services (a FastAPI dependency, or called from a route)."""
    return request.app.state.services
