"""A logging pass-through proxy: what a real agent sends nextstate and what it gets back.

    python -m bench.agent_traffic --upstream http://127.0.0.1:8000 --port 8100 --out traffic.jsonl

Point the agent at the proxy's port instead of nextstate's; every exchange is one JSON line:
`method`, `path`, `req_headers`, `req_body`, `status`, `resp_headers`, `resp_body` (a streamed
body as it came, events and all), `ttfb_s`, `total_s` — the shape of the OpenClaw captures in
tests/data. Keys are redacted. bench.coding_agents runs it in-process beside each CLI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import threading
import time
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout, web

# headers that describe one hop, not the request
HOP = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding", "content-encoding"}
SECRET = re.compile(r"(ns-|sk-)[A-Za-z0-9_\-]+")


def redacted(value: str) -> str:
    return SECRET.sub(lambda m: m.group(1) + "REDACTED", value)


class TrafficLog:
    """The proxy's app and what it has seen so far."""

    def __init__(self, upstream: str, out: Path) -> None:
        self.upstream = upstream.rstrip("/")
        self.out = out
        self.count = 0
        self.open = 0  # exchanges under way (an interactive agent is idle when none is, for a while)
        self.last = time.monotonic()  # when the last exchange began or ended
        self._session: ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        return app

    async def forward(self, request: web.Request) -> web.StreamResponse:
        if self._session is None:
            self._session = ClientSession(timeout=ClientTimeout(total=None, sock_read=3600), auto_decompress=True)
        started = self.last = time.monotonic()
        self.open += 1
        try:
            body = await request.read()
            headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
            async with self._session.request(request.method, self.upstream + request.path_qs, data=body,
                                             headers=headers) as upstream:
                ttfb = time.monotonic() - started
                response = web.StreamResponse(status=upstream.status, headers={
                    k: v for k, v in upstream.headers.items() if k.lower() not in HOP})
                await response.prepare(request)
                received = bytearray()
                async for chunk in upstream.content.iter_any():
                    received += chunk
                    await response.write(chunk)
                await response.write_eof()
                self._keep(request, body, upstream, bytes(received), ttfb, time.monotonic() - started)
                return response
        finally:
            self.open -= 1
            self.last = time.monotonic()

    def _keep(self, request, body: bytes, upstream, received: bytes, ttfb: float, total: float) -> None:
        self.count += 1
        try:
            req_body = json.loads(body) if body else None
        except ValueError:
            req_body = body.decode("utf-8", "replace")
        row = {"n": self.count, "t": time.time(), "method": request.method, "path": request.path_qs,
               "req_headers": {k.lower(): redacted(v) for k, v in request.headers.items()},
               "req_body": req_body, "status": upstream.status,
               "resp_headers": {k.lower(): v for k, v in upstream.headers.items()},
               "resp_body": received.decode("utf-8", "replace"), "ttfb_s": round(ttfb, 3), "total_s": round(total, 3)}
        with self.out.open("a") as f:
            f.write(json.dumps(row) + "\n")


class RunningProxy:
    """The proxy on 127.0.0.1:`port` in a thread of its own, until `close`."""

    def __init__(self, upstream: str, out: Path, port: int) -> None:
        self.log = TrafficLog(upstream, out)
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the traffic proxy did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        runner = web.AppRunner(self.log.app())
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._runner = runner
        self._ready.set()
        self._loop.run_forever()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        async def stop() -> None:
            await self._runner.cleanup()
            if self.log._session is not None:
                await self.log._session.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    web.run_app(TrafficLog(args.upstream, args.out).app(), host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()
