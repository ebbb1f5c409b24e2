"""The FastAPI app and its lifespan, which builds the serving process's long-lived objects (its
parts shared with `nextstate judge` and `nextstate learn` through nextstate/assembly.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from nextstate.judge.feedback import ExplicitFeedback
from nextstate.judge.inbox import JudgeInbox
from nextstate.lifecycle import Process
from nextstate.judge.startup_check import StartupCheck
from nextstate.learner.service import Learner
from nextstate.assembly import (
    EngineFactory, build_follower, build_judge, build_learner, open_engine, policy_directory,
)
from nextstate import __version__
from nextstate.core.activity import Activity
from nextstate.engine.base import SharedCores
from nextstate.core.memory import total_bytes
from nextstate.core.settings import Settings
from nextstate.forget import follow_forgets, forget_online, keep_for
from nextstate.server_marker import mark_running, mark_stopped
from nextstate.services import Services
from nextstate.user_data import USER_DATA
from nextstate.core.types import Sample, Transition
from nextstate.proxy import access_log
from nextstate.proxy.body_limit import BodyLimitMiddleware
from nextstate.proxy.chat_completion.api_router import router as chat_router
from nextstate.proxy.chat_completion.serving import ChatCompletionServing
from nextstate.proxy.messages.api_router import router as messages_router
from nextstate.proxy.messages.serving import MessagesServing
from nextstate.proxy.responses.api_router import router as responses_router
from nextstate.proxy.responses.serving import ResponsesServing
from nextstate.proxy.turns import TurnService
from nextstate.proxy.errors import install_error_handlers
from nextstate.proxy.rate_limits import RateLimiter
from nextstate.core.metrics import Metrics
from nextstate.proxy.admin_routes import router as admin_router
from nextstate.proxy.info_routes import router as info_router
from nextstate.dashboard import router as dashboard_router
from nextstate.me_routes import router as me_router
from nextstate.proxy.feedback_routes import router as feedback_router
from nextstate.proxy.session_routes import router as session_router
from nextstate.proxy.session_chain import VolatileText
from nextstate.proxy.harness_turns import HarnessTurns
from nextstate.proxy.sessions import SessionStore

log = logging.getLogger(__name__)

def create_app(settings: Settings | None = None, *, engine_factory: EngineFactory = open_engine) -> FastAPI:
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        access_log.install()
        # a process that leaves judging to `nextstate judge` writes the inbox unclaimed
        async with Process(settings, "serve", engine_factory=engine_factory, port=settings.server.port,
                           claims_inbox=settings.judge.judge_in_process) as process:
            services = build_services(settings, process)
            app.state.services = services
            background = [asyncio.create_task(_sweep(services.sessions, services.metrics), name="session-sweeper"),
                          asyncio.create_task(follow_forgets(services), name="follow-forgets")]
            if settings.server.records_retention_days > 0:
                background.append(asyncio.create_task(keep_for(services, settings.server.records_retention_days),
                                                      name="retention"))
            mark_running(settings, settings.server.port)
            try:
                await start(services, process)
                log.info("serving %s on %s (%s)", process.model_name, process.engine.info.device,
                         process.engine.info.dtype)
                yield
            finally:
                for task in background:
                    task.cancel()
                await asyncio.gather(*background, return_exceptions=True)
                mark_stopped(settings)

    docs = settings.server.docs  # off by default: the API's shape is no business of strangers
    app = FastAPI(
        title="nextstate", version=__version__, lifespan=lifespan,
        docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.server.max_body_bytes)
    install_error_handlers(app)
    app.include_router(chat_router)
    app.include_router(messages_router)
    app.include_router(responses_router)
    app.include_router(info_router)
    app.include_router(session_router)
    app.include_router(feedback_router)
    app.include_router(dashboard_router)
    app.include_router(me_router)
    app.include_router(admin_router)
    return app


def build_services(settings: Settings, process: Process) -> Services:
    """The serving process's parts over the base `process` opened, wired together (not started)."""
    engine, stores, records = process.engine, process.stores, process.records
    samples = stores.samples
    metrics = Metrics()
    activity = Activity()
    if isinstance(engine, SharedCores):  # the judge's calls wait while the learner computes beside them
        engine.hold_background(activity.learning_now)
    policies = policy_directory(settings)
    learner: Learner | None = None

    def on_sample(sample: Sample) -> None:
        metrics.judged.labels(sample.mode, sample.status).inc()
        if learner is not None:
            learner.notify(sample)

    judge = build_judge(settings, engine, process.renderer, process.model_name, samples, records, policies, activity,
                        on_sample)
    inbox = JudgeInbox(judge, judge.desk, samples, here=settings.judge.judge_in_process)

    def emit(transition: Transition) -> asyncio.Future[None]:
        metrics.transitions.labels(transition.reason).inc()
        return inbox.submit(transition)

    registry = stores.versions
    if settings.learner.learn:
        learner = build_learner(settings, process.model_dir, engine, samples, policies, records, registry, activity)
    sessions = SessionStore(
        emit,
        idle_s=settings.server.session_idle_s,
        settle_s=settings.server.session_settle_s,
        max_sessions=settings.server.max_sessions,
        max_per_user=settings.server.max_sessions_per_user,
        volatile=VolatileText(settings.server.session_volatile_patterns),
        harness=HarnessTurns(settings.server.harness_turns),
        db=stores.sessions,
        worker=process.worker,
        rehand=lambda transition: inbox.submit(transition, again=True),  # counted when first handed over
    )
    turns = TurnService(
        engine=engine,
        limiter=RateLimiter(stores.windows),
        slots=stores.slots,
        renderer=process.renderer,
        sessions=sessions,
        records=records,
        policies=policies,
        metrics=metrics,
        model_name=process.model_name,
        default_max_tokens=settings.server.default_max_tokens,
        activity=activity,
        keepalive_s=settings.server.stream_keepalive_s,
        max_parallel_per_user=settings.server.max_parallel_per_user,
        max_memory_bytes=settings.server.max_memory_mb << 20 or int(total_bytes() * 0.9),
        harness_max_tokens=settings.server.harness_max_tokens,
    )
    services = Services(
        settings=settings, keys=stores.keys, records=records, metrics=metrics, sessions=sessions, policies=policies,
        samples=samples, turns=turns, chat=ChatCompletionServing(turns), messages=MessagesServing(turns),
        responses=ResponsesServing(turns, stores.responses), judge=judge,
        feedback=ExplicitFeedback(judge, judge.desk, inbox, samples, records), learner=learner,
        # a process that does not learn serves what the learner elsewhere publishes
        follower=None if learner is not None else build_follower(settings, engine, policies, registry),
        forget_user=lambda user: forget_online(services, user),
        engine=engine, inbox=inbox, stores=stores,
    )
    return services


async def start(services: Services, process: Process) -> None:
    """Start the parts, each handing `process` its close: the last started closes first, and what
    holds user data finishes its writes (nextstate/user_data.py) after every part, before the
    stores close. Open sessions stay open on disk: a restart continues them."""
    process.started(lambda: close_user_data(services))
    process.started(services.turns.warmup.aclose)
    process.started(services.inbox.aclose)  # after the judge's own close: what it did not judge goes back
    process.started(services.judge.aclose)
    if services.follower is not None:
        await services.follower.start()
        process.started(services.follower.aclose)
    if services.learner is not None:
        await services.learner.start()
        process.started(services.learner.aclose)
    if services.inbox.here:
        await StartupCheck(services.judge).start()
    await services.inbox.resume()
    if resumed := services.sessions.resume():
        log.info("handed the judge %d transitions again that were on their way when the last run stopped", resumed)


async def close_user_data(services: Services) -> None:
    for store in USER_DATA:
        if store.close is not None:
            await store.close(services)


async def _sweep(sessions: SessionStore, metrics: Metrics) -> None:
    interval = max(0.05, min(30.0, sessions.idle_s / 4, (sessions.settle_s or sessions.idle_s) / 4))
    while True:
        await asyncio.sleep(interval)
        try:
            changed = await sessions.sweep_shared() if sessions.shared else sessions.sweep()
        except Exception:  # noqa: BLE001 - the shared database was unreachable: the next round tries again
            log.exception("could not sweep the shared sessions")
            continue
        if changed:
            metrics.sessions_open.set(len(sessions))
            await sessions.save()
