"""A new version reads its users' conversations before they next write.

The engine keeps each conversation's keys and values after a reply, so an agent's next turn reads
only what is new (~0.3 s before its first token instead of ~14 s for OpenClaw's 3.8k-token setup
on two cores). A LoRA changes the keys and values, so what the old version read serves nobody
once a new version serves: the first turn after every version would read the agent's whole
context again. So when a version starts to serve, each of its scope's recent users has the
conversation they are in (the last turn of their most recently active session: its prompt and our
reply) read by the new version at background priority, under their own cache partition. A
request that comes while that read runs joins it (the engine shares a running read with a later
one on the same prompt); one that comes after finds it done.

Only the users' cache partitions (a hash of user and key age, no content) are kept here, the
last MAX_USERS of them; the conversations are the session store's, which a forgotten user's
sessions leave with them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from nextstate.core.policy import PolicyDirectory, PolicyRef
from nextstate.engine.base import Engine, SamplingParams
from nextstate.proxy.sessions import SessionStore

log = logging.getLogger(__name__)

# Users whose conversations a new version reads: the most recently served.
MAX_USERS = 8


class PrefixWarmup:
    def __init__(self, engine: Engine, sessions: SessionStore, policies: PolicyDirectory,
                 stop_token_ids: list[int]) -> None:
        self.engine = engine
        self.sessions = sessions
        self.policies = policies
        self.stop_token_ids = tuple(stop_token_ids)
        self._salts: OrderedDict[str, str] = OrderedDict()  # user -> their prefix-cache partition
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        policies.on_publish(self._published)

    def served(self, user: str, salt: str) -> None:
        """A main turn of `user` was served under `salt`."""
        self._loop = asyncio.get_running_loop()
        self._salts[user] = salt
        self._salts.move_to_end(user)
        while len(self._salts) > MAX_USERS:
            self._salts.popitem(last=False)

    def _published(self, scope: str, ref: PolicyRef) -> None:
        if ref.adapter is None or self._loop is None or self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._start, scope, ref.adapter)

    def _start(self, scope: str, adapter: str) -> None:
        task = asyncio.create_task(self.warm(scope, adapter), name=f"warm-{adapter}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def warm(self, scope: str, adapter: str) -> int:
        """Read each of the scope's recent users' conversations with `adapter`; returns how many."""
        read = 0
        for user, salt in list(self._salts.items())[::-1]:
            turn = self.sessions.latest_pending(user)
            if self.policies.scope_of(user) != scope or turn is None:
                continue
            ids = turn.prompt_ids + turn.response_ids
            if not ids or len(ids) >= self.engine.info.max_context:
                continue
            params = SamplingParams(max_new_tokens=1, stop_token_ids=self.stop_token_ids, cache_salt=salt)
            try:
                async for _ in self.engine.generate(ids, params, adapter, background=True):
                    pass
                read += 1
            except Exception:  # noqa: BLE001 - a cold first turn, not a failure of anything asked
                log.warning("could not read %s's conversation with the new version", user, exc_info=True)
        return read

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
