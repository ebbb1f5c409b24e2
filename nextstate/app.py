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
from judge.client import EngineJudgeClient, JudgeClient, OpenAIJudgeClient
from judge.prompts import PromptLibrary
from judge.service import Judge, JudgeConfig
from learner.service import Learner
from nextstate.sample_store import SampleStore
from nextstate import __version__
from nextstate.activity import Activity
from nextstate.policy import PolicyDirectory
from nextstate.settings import Settings
from nextstate.types import Sample, Transition
from proxy.chat_template import ChatRenderer
from proxy.completions import ChatService
from proxy.errors import install_error_handlers
from proxy.keys import KeyStore
from proxy.metrics import Metrics
from proxy.records import RecordWriter
from proxy.admin_routes import router as admin_router
from proxy.routes import router
from proxy.session_routes import router as session_router
from proxy.sessions import SessionStore

log = logging.getLogger(__name__)

EngineFactory = Callable[[Path, Settings], Awaitable[Engine]]


class ConfigError(RuntimeError):
    """A setting that cannot work; reported at start-up, before anything is served."""


def preflight(settings: Settings) -> Path:
    """Everything that can be checked before serving: the model folder (converting the
    default once) and the judge prompts. Returns the model folder."""
    model_dir = resolve_model_dir(settings)
    try:
        PromptLibrary(settings.prompts_dir).require(settings.prm_prompt)
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from exc
    return model_dir


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


async def open_engine(model_dir: Path, settings: Settings) -> Engine:
    """The engine NEXTSTATE_ENGINE names: in-process, or a client of an SGLang server."""
    if settings.engine == "sglang":
        from engine.sglang import SGLangEngine

        engine = SGLangEngine(
            settings.sglang_url, model_dir, timeout_s=settings.sglang_timeout_s, retries=settings.sglang_retries
        )
        if not await engine.healthy():
            log.warning("SGLang at %s is not answering yet; requests get 503 until it does", settings.sglang_url)
        return engine
    from engine.local import LocalEngine

    return await LocalEngine.open(
        model_dir, device=settings.device, dtype=settings.dtype, max_active=settings.max_concurrent_generations
    )


def make_judge_client(settings: Settings, engine: Engine, renderer: ChatRenderer, model_name: str) -> JudgeClient:
    if settings.judge_base_url:
        return OpenAIJudgeClient(
            settings.judge_base_url, settings.judge_model or model_name, settings.judge_api_key, settings.judge_timeout_s
        )
    return EngineJudgeClient(engine, renderer)


def create_app(settings: Settings | None = None, *, engine_factory: EngineFactory = open_engine) -> FastAPI:
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        model_dir = await asyncio.to_thread(preflight, settings)
        engine = await engine_factory(model_dir, settings)
        renderer = await asyncio.to_thread(ChatRenderer.from_dir, model_dir)
        model_name = settings.served_model_name or model_dir.name
        prompts = PromptLibrary(settings.prompts_dir)
        keys = KeyStore(settings.keys_db)
        samples = SampleStore(settings.samples_db)
        records = RecordWriter(settings.records_dir)
        await records.start()
        metrics = Metrics()
        activity = Activity()
        policies = PolicyDirectory(per_user=settings.adapter_scope == "user")
        learner = Learner(settings, model_dir, engine, samples, policies, records) if settings.learn else None

        def on_sample(sample: Sample) -> None:
            metrics.judged.labels(sample.mode, sample.status).inc()
            if learner is not None:
                learner.notify(sample)

        judge = Judge(
            JudgeConfig.from_settings(settings),
            make_judge_client(settings, engine, renderer, model_name),
            prompts,
            engine,
            renderer,
            samples,
            records,
            on_sample=on_sample,
            activity=activity,
        )

        def emit(transition: Transition) -> None:
            metrics.transitions.labels(transition.reason).inc()
            judge.submit(transition)

        sessions = SessionStore(emit, idle_s=settings.session_idle_s, max_sessions=settings.max_sessions)
        chat = ChatService(
            engine=engine,
            renderer=renderer,
            sessions=sessions,
            records=records,
            policies=policies,
            metrics=metrics,
            model_name=model_name,
            default_max_tokens=settings.default_max_tokens,
            activity=activity,
        )
        app.state.settings = settings
        app.state.keys = keys
        app.state.records = records
        app.state.metrics = metrics
        app.state.sessions = sessions
        app.state.judge = judge
        app.state.learner = learner
        app.state.policies = policies
        app.state.samples = samples
        app.state.chat = chat
        sweeper = asyncio.create_task(_sweep(sessions, metrics), name="session-sweeper")
        if learner is not None:
            await learner.start()
        await judge.start()
        log.info("serving %s on %s (%s)", chat.model_name, engine.info.device, engine.info.dtype)
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            sessions.close_all()
            if learner is not None:
                await learner.aclose()
            await judge.aclose()
            await records.aclose()
            await engine.close()
            samples.close()
            keys.close()

    app = FastAPI(title="nextstate", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(session_router)
    app.include_router(admin_router)
    return app


async def _sweep(sessions: SessionStore, metrics: Metrics) -> None:
    interval = max(0.05, min(30.0, sessions.idle_s / 4))
    while True:
        await asyncio.sleep(interval)
        if sessions.sweep():
            metrics.sessions_open.set(len(sessions))
