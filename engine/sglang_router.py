"""Several SGLang workers behind SGLang's model gateway (the `sglang-router` package).

Requests go to the router, which picks a worker; adapters do not: the router does not pass
`/load_lora_adapter` on (it answers 404), so a published version is loaded on **every** worker
the router lists — directly, worker by worker — before `load_adapter` returns, and so before any
proxy serves it. A version that one worker failed to load is not published.

* Affinity: each request carries its user's cache salt (`SamplingParams.cache_salt`, opaque) as
  the router's routing key (`x-smg-routing-key`), so with the router's `manual` policy (or its
  sticky sessions) a user's requests stay on one worker, whose prefix cache holds their
  conversation. The judge's requests carry none and go where the router's policy sends them.
* Privacy: the router drops the body's `cache_salt`, so the salt is also sent as `extra_key`,
  which it passes on and SGLang's radix cache is scoped by: users sharing a worker still never
  share cached prefixes (checked with a real SGLang worker behind the real router).
* A worker that joins, or restarts and comes back empty: every `WORKER_SYNC_S` seconds the
  engine lists the workers and loads on each the versions it lacks. A request that reaches such
  a worker first fails with SGLang's unknown-adapter error; the client then loads the version on
  every worker lacking it and retries (engine/remote.py) — a request is never served by the
  base model instead of its version.
* Unloading: on each worker that holds the version. Leftovers of an earlier nextstate are looked
  for on every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import aiohttp

from nextstate.engine.base import SamplingParams
from nextstate.engine.remote import JSON_HEADERS
from nextstate.engine.sglang import SGLangEngine

log = logging.getLogger(__name__)

ROUTING_KEY_HEADER = "x-smg-routing-key"
# How often the workers are compared with the published versions (a joined or restarted worker
# gets them within this time, or sooner, on its first request naming one).
WORKER_SYNC_S = 10.0


class SGLangRouterEngine(SGLangEngine):
    server = "SGLang router"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.info.device = "sglang-router"
        self._sync_task: asyncio.Task | None = None

    def _generate_payload(self, input_ids: list[int], sampling: SamplingParams, adapter: str | None) -> dict[str, Any]:
        """The router (0.3.2) re-encodes requests by its own schema and drops `cache_salt`; it
        passes `extra_key`, which SGLang's radix cache scopes its prefixes by as it does the
        salt, so the user's salt travels as that too."""
        payload = super()._generate_payload(input_ids, sampling, adapter)
        if sampling.cache_salt is not None:
            payload["extra_key"] = sampling.cache_salt
        return payload

    def _headers(self, payload: dict[str, Any]) -> dict[str, str]:
        key = payload.get("cache_salt")
        return JSON_HEADERS | {ROUTING_KEY_HEADER: key} if key else JSON_HEADERS

    async def workers(self) -> list[str]:
        """The URLs of the healthy workers the router lists (its `GET /workers`)."""
        try:
            async with self._http.session().get(f"{self.base_url}/workers", timeout=aiohttp.ClientTimeout(total=10.0)) as response:
                body = await response.json() if response.status == 200 else {}
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.warning("could not list the router's workers: %s", exc)
            return []
        return sorted(w["url"] for w in body.get("workers", []) if isinstance(w, dict) and w.get("url") and w.get("is_healthy", True))

    def _keep_in_sync(self) -> None:
        """Start the periodic sync, once, in the running loop (the engine is built before it)."""
        if self._sync_task is None:
            self._sync_task = asyncio.create_task(self._keep_workers_in_sync(), name="sglang-worker-sync")

    async def check_server(self, probe_ids: list[int]) -> None:
        await super().check_server(probe_ids)
        self._keep_in_sync()

    async def close(self) -> None:
        if self._sync_task is not None:
            self._sync_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sync_task
            self._sync_task = None
        await super().close()

    async def _server_load(self, name: str, path: str, retry: bool) -> str | None:
        self._keep_in_sync()  # also when the router was not up for the start-up check
        urls = await self.workers()
        if not urls:
            return f"the router at {self.base_url} lists no healthy worker"
        results = await asyncio.gather(*(self._load_on(url, name, path, retry) for url in urls), return_exceptions=True)
        failures = [f"{url}: {result}" for url, result in zip(urls, results) if result is not None]
        return "; ".join(failures) or None

    async def _server_unload(self, name: str) -> str | None:
        failures = []
        for url in await self.workers():
            held = await self.served_adapters(url)
            if held is not None and name not in held:
                continue  # this worker never had it (it joined after, or restarted)
            failure = await self._unload_on(url, name)
            if failure is not None:
                failures.append(f"{url}: {failure}")
        return "; ".join(failures) or None

    async def served_adapters(self, base_url: str | None = None) -> dict[str, str] | None:
        """What the workers hold, together (or what `base_url`, one of them, holds)."""
        if base_url is not None:
            return await super().served_adapters(base_url)
        held: dict[str, str] = {}
        for url in await self.workers():
            held |= await super().served_adapters(url) or {}
        return held

    async def sync_workers(self) -> int:
        """Load on every worker the published versions it lacks; returns how many loads that
        took. A worker that cannot say what it holds is left for the next round."""
        loads = 0
        wanted = dict(self._paths)
        for url in await self.workers():
            held = await self.served_adapters(url)
            if held is None:
                continue
            for name, path in wanted.items():
                if name in held:
                    continue
                failure = await self._load_on(url, name, path, retry=False)
                if failure is None:
                    loads += 1
                    log.info("loaded %s on worker %s, which lacked it (joined or restarted)", name, url)
                else:
                    log.warning("could not load %s on worker %s: %s", name, url, failure)
        return loads

    async def _keep_workers_in_sync(self) -> None:
        while True:
            await asyncio.sleep(WORKER_SYNC_S)
            try:
                await self.sync_workers()
            except Exception:  # noqa: BLE001 - a failed round is retried by the next one
                log.exception("could not bring the router's workers up to date")
