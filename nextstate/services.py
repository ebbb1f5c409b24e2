"""The running server's long-lived objects, typed: built once by the app's lifespan.

The routes see them as `proxy.app_state.ProxyServices` (the judge and learner through the
protocols the proxy declares); forgetting a user, retention, the progress report and shutdown
see the concrete classes here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from nextstate.core.stores.dashboard_sessions import DashboardSessions
from nextstate.engine.base import Engine
from nextstate.judge.feedback import ExplicitFeedback
from nextstate.judge.inbox import JudgeInbox
from nextstate.judge.service import Judge
from nextstate.learner.follower import VersionFollower
from nextstate.core.stores.versions import VersionRegistry
from nextstate.learner.service import Learner
from nextstate.proxy.app_state import ProxyServices
from nextstate.core.stores.responses import ResponseStore
from nextstate.core.stores.sessions import SessionDB


@dataclass
class Services(ProxyServices):
    judge: Judge
    feedback: ExplicitFeedback
    learner: Learner | None
    follower: VersionFollower | None
    engine: Engine
    inbox: JudgeInbox
    session_db: SessionDB
    stored_responses: ResponseStore
    dashboard_sessions: DashboardSessions = field(default_factory=DashboardSessions)
    registry: VersionRegistry | None = None  # each scope's serving version, in a shared database


def app_services(request: Request) -> Services:
    return request.app.state.services
