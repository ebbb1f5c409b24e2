"""The FastAPI app and its lifespan: the only place long-lived objects are created."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from fastapi import FastAPI

from engine.base import Engine
from engine.default_model import ensure_default_model
from nextstate import __version__
from nextstate.policy import PolicyDirectory
from nextstate.settings import Settings
from nextstate.types import Transition
from proxy.chat_template import ChatRenderer
from proxy.completions import ChatService
from proxy.consumers import RecordingConsumer, TransitionConsumer
from proxy.errors import install_error_handlers
from proxy.keys import KeyStore
from proxy.metrics import Metrics
from proxy.records import RecordWriter
from proxy.routes import router
from proxy.sessions import SessionStore

log = logging.getLogger(__name__)

EngineFactory = Callable[[Path, Settings], Awaitable[Engine]]


class ConfigError(RuntimeError):
    """A setting that cannot work; reported at start-up, before anything is served."""


def resolve_model_dir(settings: Settings) -> Path:
    if settings.model:
        path = Path(settings.model).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"NEXTSTATE_MODEL={settings.model!r} is not a Hugging Face model directory (no config.json). "
                "Point it at a local folder with config.json, weights and tokenizer files."
            )
        return path
    return ensure_default_model(settings.models_dir)


async def open_local_engine(model_dir: Path, settings: Settings) -> Engine:
    from engine.local import LocalEngine

    return await LocalEngine.open(
        model_dir, device=settings.device, dtype=settings.dtype, max_active=settings.max_concurrent_generations
    )


def create_app(
    settings: Settings | None = None,
    *,
    engine_factory: EngineFactory = open_local_engine,
    consumer: Callable[[RecordWriter], TransitionConsumer] = RecordingConsumer,
) -> FastAPI:
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        model_dir = await asyncio.to_thread(resolve_model_dir, settings)
        engine = await engine_factory(model_dir, settings)
        renderer = await asyncio.to_thread(ChatRenderer.from_dir, model_dir)
        keys = KeyStore(settings.keys_db)
        records = RecordWriter(settings.records_dir)
        await records.start()
        metrics = Metrics()
        sink = consumer(records)

        def emit(transition: Transition) -> None:
            metrics.transitions.labels(transition.reason).inc()
            sink.submit(transition)

        sessions = SessionStore(emit, idle_s=settings.session_idle_s, max_sessions=settings.max_sessions)
        chat = ChatService(
            engine=engine,
            renderer=renderer,
            sessions=sessions,
            records=records,
            policies=PolicyDirectory(),
            metrics=metrics,
            model_name=settings.served_model_name or model_dir.name,
            default_max_tokens=settings.default_max_tokens,
        )
        app.state.settings = settings
        app.state.keys = keys
        app.state.records = records
        app.state.metrics = metrics
        app.state.sessions = sessions
        app.state.consumer = sink
        app.state.chat = chat
        sweeper = asyncio.create_task(_sweep(sessions, metrics), name="session-sweeper")
        log.info("serving %s on %s (%s)", chat.model_name, engine.info.device, engine.info.dtype)
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            sessions.close_all()
            await records.aclose()
            await engine.close()
            keys.close()

    app = FastAPI(title="nextstate", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(router)
    return app


async def _sweep(sessions: SessionStore, metrics: Metrics) -> None:
    interval = max(0.05, min(30.0, sessions.idle_s / 4))
    while True:
        await asyncio.sleep(interval)
        if sessions.sweep():
            metrics.sessions_open.set(len(sessions))
