"""Run a nextstate app in a background thread on a free loopback port.

Tests and benchmarks drive the real server over real HTTP with this, without a subprocess:
the app's state (sessions, records) stays inspectable and the server stops cleanly.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field

import httpx
import uvicorn
from openai import OpenAI

from nextstate.core.stores.opener import Stores
from nextstate.app import create_app
from nextstate.assembly import EngineFactory, open_engine
from nextstate.core.settings import Settings
from nextstate.core.stores.keys import KeyStore
from tests.forked_process import ForkedCommand


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(root: str, proc: subprocess.Popen | ForkedCommand, timeout: float = 90) -> None:
    """Wait until a server started as a subprocess answers /healthz; fail with its output if
    it exits first or takes longer than `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{root}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            said = proc.output() if isinstance(proc, ForkedCommand) else proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{said}")
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not come up")
        time.sleep(0.2)


@dataclass
class RunningServer:
    app: object
    base_url: str
    settings: Settings
    server: uvicorn.Server
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop = field(repr=False)

    @property
    def root(self) -> str:
        return self.base_url.removesuffix("/v1")

    def key(self, user: str, admin: bool = False) -> str:
        store = Stores(self.settings).keys
        try:
            return store.create(user, admin=admin)[1]
        finally:
            store.close()

    def client(self, key: str, **kwargs) -> OpenAI:
        return OpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=60, **kwargs)

    def call(self, coro, timeout: float = 60):
        """Run a coroutine on the server's event loop (to inspect or wait on its state)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def metrics(self) -> str:
        """/metrics, read with an admin key (it needs one)."""
        return httpx.get(f"{self.root}/metrics", headers={"Authorization": f"Bearer {self.key('metrics-reader', admin=True)}"}).text

    def end_conversations(self) -> None:
        """Close every open session, as the idle timeout would: provisional next states are
        confirmed and handed to the judge, last turns get none; returns once the judge has
        them on disk (and recorded), as the sweeper's save waits for."""

        async def close_all() -> None:
            self.app.state.services.sessions.close_all()
            await self.app.state.services.sessions.save()

        self.call(close_all())

    def drain_judge(self, timeout: float = 60) -> None:
        """Wait until every transition handed to the judge has been judged and stored."""
        self.call(self.app.state.services.judge.drain(timeout), timeout + 5)

    def records(self) -> list[dict]:
        """All JSONL records written so far (waits for the background writer to catch up)."""
        self.call(self.app.state.services.records.flush(), 10)
        out = []
        for path in sorted(self.settings.records_dir.glob("*.jsonl")):
            out += [json.loads(line) for line in path.read_text().splitlines() if line]
        return out

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        if self.thread.is_alive():
            raise RuntimeError("server did not stop within 30 s")


# A stand-in (a scripted judge, a fake engine) that was told to hang holds its request forever:
# waiting on it at stop would add the whole grace to every test of a hang.
STAND_IN_GRACE_S = 0.5


def serve_in_thread(app, port: int, name: str = "nextstate-server", grace_s: float = 5,
                    ) -> tuple[uvicorn.Server, threading.Thread, asyncio.AbstractEventLoop]:
    """Start any ASGI app with uvicorn on 127.0.0.1:port in a daemon thread; return once it
    listens. At stop, requests still running get `grace_s` to finish before they are cancelled."""
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", timeout_graceful_shutdown=grace_s,
        proxy_headers=False,  # as `nextstate serve` runs it: the app reads them (proxy/client_address.py)
    )
    server = uvicorn.Server(config)
    holder: dict = {}

    def run() -> None:
        loop = asyncio.new_event_loop()
        holder["loop"] = loop
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.serve())

    thread = threading.Thread(target=run, daemon=True, name=name)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("server failed to start (see the log above)")
        time.sleep(0.02)
    return server, thread, holder["loop"]


class AppInThread:
    """A stand-in server (tests/fake_sglang.py, tests/fake_vllm.py): an ASGI app served by
    uvicorn in a thread of the test process, on a loopback port, with its own event loop."""

    def serve(self, app, port: int, name: str) -> None:
        self.app = app
        self.port = port or free_port()
        self.server, self.thread, self.loop = serve_in_thread(app, self.port, name=name, grace_s=STAND_IN_GRACE_S)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)

    def run(self, coro, timeout: float = 30):
        """Run `coro` in the server's loop (where its engine lives) and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


def start_server(settings: Settings, engine_factory: EngineFactory = open_engine) -> RunningServer:
    app = create_app(settings, engine_factory=engine_factory)
    server, thread, loop = serve_in_thread(app, settings.server.port)
    return RunningServer(app, f"http://127.0.0.1:{settings.server.port}/v1", settings, server, thread, loop)
