"""How every process is put together: `nextstate serve` (nextstate/app.py), `nextstate judge` and
`nextstate learn` (nextstate/workers.py) build their engine, judge, learner and version follower
here, from the settings, so the three differ only in which parts they start and never in how a
part is made.
"""

from __future__ import annotations

import asyncio

import functools
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

from nextstate.core.activity import Activity
from nextstate.core.policy import PolicyDirectory
from nextstate.core.private import DataDirUnusable, prepare_data_dir
from nextstate.core.records import RecordWriter
from nextstate.core.stores.samples import SampleStore
from nextstate.core.settings import Settings
from nextstate.core.types import Sample
from nextstate.engine.base import Engine
from nextstate.engine.brought_models import brought_model
from nextstate.engine.default_model import DefaultModelUnavailable, ensure_default_model
from nextstate.judge.advantages import prepare_batch
from nextstate.judge.client import EngineJudgeClient, JudgeClient, OpenAIJudgeClient
from nextstate.judge.prompts import PromptLibrary
from nextstate.judge.service import Judge
from nextstate.learner.follower import VersionFollower
from nextstate.core.stores.versions import VersionRegistry
from nextstate.learner.service import Learner
from nextstate.learner.versions import AdapterVersions, LearnerRunning
from nextstate.modelio.chat_template import ChatRenderer

log = logging.getLogger(__name__)

EngineFactory = Callable[[Path, Settings], Awaitable[Engine]]


class ConfigError(RuntimeError):
    """A setting that cannot work; reported at start-up, before anything is served."""


def preflight(settings: Settings) -> Path:
    """Everything that can be checked before serving: a private, writable data dir, the model
    folder (converting the default once) and the judge prompts. Returns the model folder."""
    try:
        prepare_data_dir(settings.data_dir)
    except DataDirUnusable as exc:
        raise ConfigError(str(exc)) from exc
    model_dir = resolve_model_dir(settings)
    try:
        PromptLibrary(settings.judge.prompts_dir).require(settings.judge.prm_prompt)
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from exc
    return model_dir


def check_no_other_learner(settings: Settings) -> None:
    """`nextstate serve` with its learner on, before it binds its port: a learner elsewhere
    (`nextstate learn`) holding the adapters folder is said as a reason, not as a failed
    start-up. Not part of `preflight`: judge processes run that beside the learner."""
    if settings.learner.learn:
        try:
            AdapterVersions(settings.adapters_dir).hold_learner().close()
        except LearnerRunning as exc:
            raise ConfigError(f"{exc}. Serve with NEXTSTATE_LEARN=false beside it.") from exc


def resolve_model_dir(settings: Settings) -> Path:
    if settings.engine.model:
        try:
            brought = brought_model(settings.engine.model, settings.models_dir)  # a GGUF file, or ollama:NAME
        except DefaultModelUnavailable as exc:
            raise ConfigError(str(exc)) from exc
        if brought is not None:
            return brought
        path = Path(settings.engine.model).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"NEXTSTATE_MODEL={settings.engine.model!r} is not a Hugging Face model directory (no config.json). "
                "Point it at a local folder with config.json, weights and tokenizer files, a .gguf file, or an "
                "Ollama model as ollama:NAME[:TAG]."
            )
        return path
    return ensure_default_model(settings.models_dir)


# A short prompt of ordinary token ids for a server's logprob check (any ids of any vocabulary).
LOGPROB_PROBE = list(range(10, 42))


async def open_engine(model_dir: Path, settings: Settings) -> Engine:
    """The engine NEXTSTATE_ENGINE names: in-process, or a client of an SGLang or vLLM server."""
    es = settings.engine
    if es.engine in ("sglang", "vllm"):
        if es.engine == "sglang" and es.sglang_router:
            from nextstate.engine.sglang_router import SGLangRouterEngine as Client
        elif es.engine == "sglang":
            from nextstate.engine.sglang import SGLangEngine as Client
        else:
            from nextstate.engine.vllm import VLLMEngine as Client
        url = es.sglang_url if es.engine == "sglang" else es.vllm_url
        engine = Client(url, model_dir, timeout_s=es.engine_timeout_s, retries=es.engine_retries)
        if not await engine.healthy():
            log.warning("%s at %s is not answering yet; requests get 503 until it does (its logprob convention "
                        "is not checked: see deploy/README.md for how to start it)", engine.server, url)
            return engine
        try:
            await engine.check_server(LOGPROB_PROBE)
        except Exception:
            await engine.close()
            raise
        return engine
    from nextstate.engine.local import LocalEngine

    return await LocalEngine.open(
        model_dir, device=es.device, dtype=es.dtype, max_active=es.max_concurrent_generations, kv_cache_mb=es.kv_cache_mb,
        gguf=await asyncio.to_thread(llama_cpp_model, settings, model_dir),
    )


def llama_cpp_model(settings: Settings, model_dir: Path) -> Path | None:
    """The GGUF file the local engine serves on llama.cpp, or None for transformers
    (NEXTSTATE_LOCAL_RUNTIME; `auto` falls back to transformers, saying why)."""
    from nextstate.engine.devices import resolve_device
    from nextstate.engine.llama_cpp_runner import available
    from nextstate.modelio.gguf_lora import CannotExportGguf
    from nextstate.modelio.gguf_model import gguf_copy

    es = settings.engine
    if es.local_runtime == "transformers":
        return None
    if es.local_runtime == "auto":
        if resolve_device(es.device) != "cpu":
            return None
        if not available():
            log.warning("serving on transformers: llama-cpp-python is not installed (pip install llama-cpp-python "
                        "makes a CPU decode 5-7x faster)")
            return None
    elif not available():
        raise RuntimeError("NEXTSTATE_LOCAL_RUNTIME=llama.cpp needs llama-cpp-python: pip install llama-cpp-python")
    try:
        gguf = gguf_copy(model_dir, settings.models_dir / "gguf")
    except CannotExportGguf as exc:
        if es.local_runtime == "llama.cpp":
            raise RuntimeError(f"NEXTSTATE_LOCAL_RUNTIME=llama.cpp: {exc}") from exc
        log.warning("serving on transformers: %s", exc)
        return None
    log.info("the local engine serves on llama.cpp, from %s", gguf)
    return gguf


def make_judge_client(settings: Settings, engine: Engine, renderer: ChatRenderer, model_name: str) -> JudgeClient:
    js = settings.judge
    if js.judge_base_url:
        return OpenAIJudgeClient(js.judge_base_url, js.judge_model or model_name, js.judge_api_key, js.judge_timeout_s)
    return EngineJudgeClient(engine, renderer)


def worker_name(kind: str, instance: int | None = None) -> str:
    """This process among those sharing a database: its claims on shared work carry the name,
    `host:kind:instance`. A serving process is its port, so that the same server restarted
    takes its claims back at once; a judge process its pid."""
    return f"{socket.gethostname()}:{kind}:{os.getpid() if instance is None else instance}"


def policy_directory(settings: Settings) -> PolicyDirectory:
    return PolicyDirectory(per_user=settings.learner.adapter_scope == "user")


def build_judge(settings: Settings, engine: Engine, renderer: ChatRenderer, model_name: str, samples: SampleStore,
                records: RecordWriter, policies: PolicyDirectory, activity: Activity | None = None,
                on_sample: Callable[[Sample], None] | None = None) -> Judge:
    """The judge: its client (an endpoint, or the served model), prompts, and the serving
    adapter of each user as the policy teacher's fallback."""
    return Judge(
        settings.judge, make_judge_client(settings, engine, renderer, model_name), PromptLibrary(settings.judge.prompts_dir),
        engine, renderer, samples, records, on_sample=on_sample, activity=activity or Activity(),
        current_adapter=lambda user: policies.current(user).adapter,
    )


def build_learner(settings: Settings, model_dir: Path, engine: Engine | None, samples: SampleStore,
                  policies: PolicyDirectory, records: RecordWriter, registry: VersionRegistry | None,
                  activity: Activity | None = None) -> Learner:
    """The learner, with the judge's batch-time advantages (outcome rewards standardised); beside
    serving (`activity`), it makes way for the person's requests."""
    return Learner(
        settings.learner, model_dir, settings.adapters_dir, engine, samples, policies, records,
        prepare_batch=functools.partial(prepare_batch, settings=settings.judge), registry=registry, activity=activity,
    )


def build_follower(settings: Settings, engine: Engine, policies: PolicyDirectory,
                   registry: VersionRegistry | None) -> VersionFollower:
    """What serves the versions a learner elsewhere publishes."""
    return VersionFollower(settings.adapters_dir, engine, policies, registry)
