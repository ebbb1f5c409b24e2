"""Shared fixtures: a tiny model built once, real servers on free loopback ports, and a
scripted HTTP judge."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.tiny_model import TINY_PPO_EPOCHS, build_tiny_model
from nextstate.assembly import open_engine
from tests.background_server import RunningServer, free_port, start_server
from nextstate.core.settings import Settings
from tests.judge_server import ScriptedJudge
from tests.scripted_engine import ScriptedEngine

__all__ = ["RunningServer", "free_port", "make_settings", "raw_post", "start_server"]


@pytest.fixture
def judge() -> Iterator[ScriptedJudge]:
    """A real OpenAI-compatible judge with rule verdicts (tests/judge_server.py)."""
    j = ScriptedJudge()
    yield j
    j.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture
async def direct(tiny_model_dir):
    """The embedded engine on the tiny model, called directly: what an engine behind HTTP
    (SGLang, its fake) is checked against."""
    from nextstate.engine.local import LocalEngine

    engine = await LocalEngine.open(tiny_model_dir, device="cpu")
    yield engine
    await engine.close()


def make_settings(tmp_path: Path, model_dir: Path, **overrides) -> Settings:
    # No judge calibration and no publish gate here: tests of other things script their judge and
    # expect their updates to serve; tests/test_calibration.py and tests/test_gate.py check those.
    # One shared adapter unless a test asks for per-user ones (the default): most tests train
    # and check one adapter, and the shared scope is the one whose batches mix users. One user
    # may train it alone here (tests/test_batching.py checks the rule that keeps that from happening),
    # and no turn is held out: tests count the samples they feed into versions (tests/test_held_out.py
    # and tests/test_sample_store.py check holding out). Passes over a batch: TINY_PPO_EPOCHS.
    values = {"data_dir": tmp_path / "data", "model": str(model_dir), "port": free_port(), "served_model_name": "tiny",
              "judge_calibration": False, "publish_gate": False, "adapter_scope": "shared", "shared_min_contributors": 1,
              "held_out_every": 0, "ppo_epochs": TINY_PPO_EPOCHS}
    return Settings(**{**values, **overrides})


@pytest.fixture
def server_factory(tmp_path, tiny_model_dir) -> Iterator:
    started: list[RunningServer] = []

    def factory(engine_factory=open_engine, **overrides) -> RunningServer:
        srv = start_server(make_settings(tmp_path / f"s{len(started)}", tiny_model_dir, **overrides), engine_factory)
        started.append(srv)
        return srv

    yield factory
    for srv in started:
        srv.stop()


@pytest.fixture
def server(server_factory) -> RunningServer:
    """A real nextstate server on the tiny model, embedded engine."""
    return server_factory()


def scripted_factory(**engine_kwargs):
    """An engine factory that makes a ScriptedEngine over the model's tokenizer, and a dict
    whose "engine" is the latest one made (a restarted server gets a new one)."""
    holder: dict = {}

    async def factory(model_dir: Path, settings: Settings):
        from transformers import AutoTokenizer

        holder["engine"] = ScriptedEngine(AutoTokenizer.from_pretrained(model_dir), **engine_kwargs)
        return holder["engine"]

    return factory, holder


@pytest.fixture
def scripted(server_factory):
    """A real nextstate server whose engine replies with scripted text: (server, engine)."""
    factory, holder = scripted_factory()
    srv = server_factory(engine_factory=factory)
    return srv, holder["engine"]


@pytest.fixture
def alice(server) -> OpenAI:
    return server.client(server.key("alice"))


def raw_post(server: RunningServer, body, key: str | None, headers: dict | None = None) -> httpx.Response:
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{server.base_url}/chat/completions", content=content, headers=h, timeout=60)


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server for the session (tests/real_engines/postgres_server.py)."""
    from tests.real_engines.postgres_server import PostgresServer

    server = PostgresServer()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request) -> str | None:
    """Each backend a store runs on: None (its SQLite file) or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return None
    import uuid

    return request.getfixturevalue("postgres").fresh_database(f"t{uuid.uuid4().hex[:12]}")
