"""Forgetting a user, and records retention: their data deleted wherever it lives (user_data.py).

Online (`DELETE /v1/admin/users/{name}`, admin key) through the running components, so nothing
writes while their data goes; or offline (`nextstate forget --user NAME`) on the data dir of a
stopped server. A shared adapter keeps what it learned from the user: it cannot be unlearned,
only rolled back, and the answer says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from nextstate.core.settings import Settings
from nextstate.user_data import USER_DATA, forget_conversations, not_of

if TYPE_CHECKING:  # the running server's objects; offline use (status, forget) loads no model code
    from nextstate.services import Services

log = logging.getLogger(__name__)

SHARED_NOTE = "the shared adapter keeps what it learned from this user (roll it back to undo that)"


# How often a process sharing a database looks for users forgotten through another one.
FOLLOW_FORGETS_S = 2.0
# Forget events are kept this long: a process down for less purges, when it starts again,
# what it still holds of a user forgotten meanwhile.
FORGET_EVENTS_KEPT_S = 30 * 86400


async def forget_online(services: Services, user: str) -> dict[str, Any]:
    counts = {store.name: await store.forget_online(services, user) for store in USER_DATA}
    if (events := services.stores.forget_events) is not None:  # the other processes purge what they alone hold
        await asyncio.to_thread(events.add, user)
    return _summary(user, counts, services.settings.learner.adapter_scope)


async def purge_local(services: Services, users: set[str]) -> None:
    """What this process alone holds of `users`, forgotten through another process: its request
    records (one pass over them for all) and what it holds of their conversations in memory
    (the database's rows are gone already)."""
    await services.records.purge(not_of(*users))
    for user in users:
        forget_conversations(services, user)


async def follow_forgets(services: Services, every_s: float = FOLLOW_FORGETS_S) -> None:
    """Purge, within `every_s`, what this process holds of every user forgotten through any
    process on the shared database; at start, of those forgotten in the last
    FORGET_EVENTS_KEPT_S (this process may have been down then)."""
    events = services.stores.forget_events
    if events is None:
        return
    await asyncio.to_thread(events.expire, time.time() - FORGET_EVENTS_KEPT_S)
    last = 0
    while True:
        try:
            if forgotten := await asyncio.to_thread(events.since, last):
                await purge_local(services, {user for _, user in forgotten})
                last = forgotten[-1][0]
        except Exception:  # noqa: BLE001 - the database may be back next round
            log.warning("could not read the users forgotten through other processes", exc_info=True)
        await asyncio.sleep(every_s)


def forget_offline(settings: Settings, user: str) -> dict[str, Any]:
    counts = {store.name: store.forget_offline(settings, user) for store in USER_DATA}
    return _summary(user, counts, settings.learner.adapter_scope)


def _summary(user: str, counts: dict[str, int | bool], scope: str) -> dict[str, Any]:
    out: dict[str, Any] = {"object": "user.forgotten", "user": user, **counts}
    out["adapter_deleted"] = bool(out.get("adapter_deleted"))
    if scope == "shared":
        out["note"] = SHARED_NOTE
    return out


async def keep_for(services: Services, days: float, every_s: float = 6 * 3600) -> None:
    """Delete what every store holds that is older than `days`, now and every `every_s`."""
    while True:
        cutoff = time.time() - days * 86400
        deleted = {store.name: await store.expire(services, cutoff) for store in USER_DATA if store.expire is not None}
        if any(deleted.values()):
            log.info("retention (%g days): deleted %s", days, ", ".join(f"{n} {name}" for name, n in deleted.items()))
        await asyncio.sleep(every_s)
