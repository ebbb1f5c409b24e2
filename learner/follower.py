"""Serving the versions another process's learner publishes (NEXTSTATE_LEARN=false).

Several nextstate processes may serve one deployment while one of them learns. The learner
publishes a version by writing its folder and pointing the scope's `CURRENT` at it
(learner/versions.py) in the adapters folder, which every process and every engine worker
reads at the same path (NEXTSTATE_ADAPTERS_DIR, a shared volume). A follower looks there every
`FOLLOW_S` seconds and moves its own requests to each scope's current version: it loads the
version into its engine (an engine server that has it already, from the learner's load,
answers that it does) and then publishes it to its own policy directory. What it stops serving
it releases from its own engine client only; unloading from a shared server is the learner's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from nextstate.core.policy import PolicyDirectory, PolicyRef
from nextstate.engine.base import AdapterServer, Engine
from nextstate.core.stores.versions import VersionRegistry
from nextstate.learner.versions import AdapterVersions

log = logging.getLogger(__name__)

# How often the adapters folder is looked at: a new version serves here within this time of its
# publication by the learner.
FOLLOW_S = 2.0


async def load_version(engine: Engine, name: str, path: str, attempts: int = 3) -> None:
    """Load a version into the engine, tolerating a load of the same version under way from
    another process (the learner and a follower both load a version just published): a server
    refuses the second while the first is in flight, and answers "already loaded" after."""
    for attempt in range(attempts):
        try:
            await engine.load_adapter(name, path)
            return
        except Exception:
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(0.5 * (attempt + 1))


class VersionFollower:
    def __init__(self, adapters_dir: Path, engine: Engine, policies: PolicyDirectory,
                 registry: VersionRegistry | None = None) -> None:
        """`registry`: with a shared database, each scope's serving version is read there
        (core/stores/versions.py) instead of from the adapters folder's CURRENT files."""
        self.versions = AdapterVersions(adapters_dir)
        self.engine = engine
        self.policies = policies
        self.registry = registry
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.follow()
        self._task = asyncio.create_task(self._run(), name="version-follower")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def follow(self) -> int:
        """Serve each scope's current version; returns how many scopes moved."""
        if self.registry is not None:
            return await self._follow_registry()
        moved = 0
        for scope in await asyncio.to_thread(self.versions.scopes):
            version = await asyncio.to_thread(self.versions.current, scope)
            if version is None or version == self.policies.current_scope(scope).version:
                continue
            name = await asyncio.to_thread(self.versions.serving_name, scope, version)
            moved += await self._move(scope, version, name, str(self.versions.path(scope, version)))
        return moved

    async def _follow_registry(self) -> int:
        published = await asyncio.to_thread(self.registry.published)
        moved = 0
        for scope, current in published.items():
            if current.version != self.policies.current_scope(scope).version:
                moved += await self._move(scope, current.version, current.name, current.path)
        for scope in self.policies.scopes() - published.keys():  # forgotten: the base model serves them
            old = self.policies.forget(scope)
            if old is not None and old.adapter:
                await self._release(old.adapter)
                moved += 1
                log.info("stopped serving the adapter of %s, forgotten", scope)
        return moved

    async def _move(self, scope: str, version: int, name: str, path: str) -> int:
        old = self.policies.current_scope(scope)
        if name not in self.engine.adapters:
            await load_version(self.engine, name, path)
        self.policies.publish(scope, PolicyRef(version=version, adapter=name))
        log.info("serving %s version %d, published by the learner elsewhere", scope, version)
        if old.adapter and old.adapter != name:
            await self._release(old.adapter)
        return 1

    async def _release(self, name: str) -> None:
        """Stop holding `name`: an engine server's client forgets it (the learner unloads it
        from the server); an in-process engine frees it."""
        try:
            if isinstance(self.engine, AdapterServer):
                await self.engine.release_adapter(name)
            else:
                await self.engine.unload_adapter(name)
        except Exception:  # noqa: BLE001 - a version not freed costs memory, not service
            log.exception("could not release adapter %s", name)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(FOLLOW_S)
            try:
                await self.follow()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("could not follow the published versions")
