"""The running server's long-lived objects, typed: built once by the app's lifespan.

The routes see them as `proxy.app_state.ProxyServices` (the judge and learner through the
protocols the proxy declares); forgetting a user, retention, the progress report and shutdown
see the concrete classes here.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from nextstate.core.stores.opener import Stores
from nextstate.engine.base import Engine
from nextstate.judge.feedback import ExplicitFeedback
from nextstate.judge.inbox import JudgeInbox
from nextstate.judge.service import Judge
from nextstate.learner.follower import VersionFollower
from nextstate.learner.service import Learner
from nextstate.proxy.app_state import ProxyServices


@dataclass
class Services(ProxyServices):
    judge: Judge
    feedback: ExplicitFeedback
    learner: Learner | None
    follower: VersionFollower | None
    engine: Engine
    inbox: JudgeInbox
    stores: Stores  # every store this process opened (the keys and samples above among them)


def app_services(request: Request) -> Services:
    return request.app.state.services
