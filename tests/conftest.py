"""Shared fixtures: a tiny model built once, and real servers on free loopback ports."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn
from openai import OpenAI

from engine.tiny_model import build_tiny_model
from nextstate.app import create_app, open_local_engine
from nextstate.settings import Settings
from proxy.keys import KeyStore
from tests.scripted_engine import ScriptedEngine


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    app: object
    base_url: str
    settings: Settings
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def root(self) -> str:
        return self.base_url.removesuffix("/v1")

    def key(self, user: str, admin: bool = False) -> str:
        store = KeyStore(self.settings.keys_db)
        try:
            return store.create(user, admin=admin)[1]
        finally:
            store.close()

    def client(self, key: str, **kwargs) -> OpenAI:
        return OpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=60, **kwargs)

    def records(self) -> list[dict]:
        """All JSONL records written so far (waits for the background writer to catch up)."""
        fut = asyncio.run_coroutine_threadsafe(self.app.state.records.flush(), self.loop)
        fut.result(10)
        out = []
        for path in sorted(self.settings.records_dir.glob("*.jsonl")):
            out += [json.loads(line) for line in path.read_text().splitlines() if line]
        return out

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "server did not stop"


def start_server(settings: Settings, engine_factory=open_local_engine) -> RunningServer:
    app = create_app(settings, engine_factory=engine_factory)
    config = uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    holder: dict = {}

    def run() -> None:
        loop = asyncio.new_event_loop()
        holder["loop"] = loop
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.serve())

    thread = threading.Thread(target=run, daemon=True, name="test-server")
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server failed to start")
        time.sleep(0.02)
    running = RunningServer(app, f"http://127.0.0.1:{settings.port}/v1", settings, server, thread)
    running._loop = holder["loop"]
    return running


def make_settings(tmp_path: Path, model_dir: Path, **overrides) -> Settings:
    return Settings(
        data_dir=tmp_path / "data", model=str(model_dir), port=free_port(), served_model_name="tiny", **overrides
    )


@pytest.fixture
def server_factory(tmp_path, tiny_model_dir) -> Iterator:
    started: list[RunningServer] = []

    def factory(engine_factory=open_local_engine, **overrides) -> RunningServer:
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


@pytest.fixture
def scripted(server_factory):
    """A real nextstate server whose engine replies with scripted text: (server, engine)."""
    holder: dict = {}

    async def factory(model_dir: Path, settings: Settings):
        from transformers import AutoTokenizer

        holder["engine"] = ScriptedEngine(AutoTokenizer.from_pretrained(model_dir))
        return holder["engine"]

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
