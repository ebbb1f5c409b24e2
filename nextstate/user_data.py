"""Every place a user's data lives, listed once.

Forgetting a user (online through the running components, offline on a stopped server's data
dir), records retention and shutdown all walk `USER_DATA`, so a store added to nextstate is
added here once and cannot be forgotten by one of them (as stored responses once were).
Each entry says how to reach its store in each of those situations; `None` where one does not
apply (keys do not expire; nothing of an adapter waits to be written at shutdown). The stores
themselves are opened and closed in one place (core/stores/opener.py, `Stores`).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nextstate.core.records import purge_records
from nextstate.core.stores.samples import SampleStore
from nextstate.core.settings import Settings
from nextstate.learner.versions import AdapterVersions
from nextstate.core.stores.keys import KeyStore
from nextstate.core.stores.responses import ResponseStore
from nextstate.core.stores.opener import Stores
from nextstate.core.stores.sessions import SessionDB

if TYPE_CHECKING:  # the running server's objects; offline use (status, forget) loads no model code
    from nextstate.services import Services

# How long forgetting waits for judgements of the user's turns in progress to land first.
FORGET_DRAIN_S = 30.0


@dataclass(frozen=True)
class UserDataStore:
    name: str  # its count's key in forget's summary
    forget_online: Callable[[Services, str], Awaitable[int | bool]]
    forget_offline: Callable[[Settings, str], int | bool]
    expire: Callable[[Services, float], Awaitable[int]] | None = None  # delete what is older than a time
    # at shutdown, after the workers stopped and before the stores close (core/stores/opener.py)
    close: Callable[[Services], Awaitable[None]] | None = None


def not_of(*users: str) -> Callable[[dict[str, Any]], bool]:
    """The records to keep when `users` are forgotten: everyone else's."""
    return lambda record: record.get("user") not in users


def _offline(store_of: Callable[[Stores], Any], forget: Callable[[Any, str], int]) -> Callable[[Settings, str], int]:
    def run(settings: Settings, user: str) -> int:
        stores = Stores(settings)
        try:
            return forget(store_of(stores), user)
        finally:
            stores.close()

    return run


# ---------------------------------------------------------------------------- keys


async def _forget_keys(s: Services, user: str) -> int:
    return await asyncio.to_thread(s.keys.forget, user)


# ---------------------------------------------------------------------------- sessions


def forget_conversations(s: Services, user: str) -> int:
    """What this process holds of `user`'s conversations in memory: its copies of their open
    sessions, and their replies kept as sampled for their next prompts (modelio/prompt_encoder.py)."""
    s.turns.renderer.forget_replies(user)
    return s.sessions.forget(user)


async def _forget_sessions(s: Services, user: str) -> int:
    await s.sessions.refresh(user, every=True)  # shared: those open in other processes too
    count = forget_conversations(s, user)
    await s.sessions.save()
    return count


def _forget_sessions_offline(db: SessionDB, user: str) -> int:
    count = sum(1 for _ in db.load(user))
    db.forget(user)
    return count


async def _save_sessions(s: Services) -> None:
    await s.sessions.save()  # open sessions stay open: a restart continues them


# ---------------------------------------------------------------------------- samples


async def _forget_samples(s: Services, user: str) -> int:
    await s.judge.drain(timeout=FORGET_DRAIN_S)  # what is being judged for them lands, then goes
    return await asyncio.to_thread(s.samples.forget, user)


async def _expire_samples(s: Services, cutoff: float) -> int:
    return await asyncio.to_thread(s.samples.expire, cutoff)


# ---------------------------------------------------------------------------- records


async def _forget_records(s: Services, user: str) -> int:
    return await s.records.purge(not_of(user))


def _forget_records_offline(settings: Settings, user: str) -> int:
    return purge_records(settings.records_dir, not_of(user)) if settings.records_dir.is_dir() else 0


async def _expire_records(s: Services, cutoff: float) -> int:
    return await s.records.purge(lambda record: record.get("ts", cutoff) >= cutoff)


async def _close_records(s: Services) -> None:
    await s.records.aclose()


# ---------------------------------------------------------------------------- stored responses


async def _forget_responses(s: Services, user: str) -> int:
    return await asyncio.to_thread(s.stores.responses.forget, user)


async def _expire_responses(s: Services, cutoff: float) -> int:
    return await asyncio.to_thread(s.stores.responses.expire, cutoff)


# ---------------------------------------------------------------------------- own adapters


async def _forget_adapters(s: Services, user: str) -> bool:
    if s.learner is not None:
        return await s.learner.forget(user)
    if s.stores.versions is None or not s.policies.per_user:
        return False
    # the learner runs elsewhere: it is asked through the database, and deletes the versions
    # within seconds; every process stops serving them as soon as they are unpublished
    had = await asyncio.to_thread(s.stores.versions.forget, user)
    if s.follower is not None:
        await s.follower.follow()
    return had


def _forget_adapters_offline(settings: Settings, user: str) -> bool:
    scope_root = AdapterVersions(settings.adapters_dir).scope_root(user)
    existed = scope_root.is_dir()
    shutil.rmtree(scope_root, ignore_errors=True)
    if settings.server.database_url and settings.learner.adapter_scope == "user":
        # a learner running elsewhere drops what it holds of them too
        stores = Stores(settings)
        try:
            stores.versions.forget(user)
        finally:
            stores.close()
    return existed


USER_DATA: tuple[UserDataStore, ...] = (
    UserDataStore("keys", _forget_keys, _offline(lambda stores: stores.keys, KeyStore.forget)),
    UserDataStore("sessions", _forget_sessions, _offline(lambda stores: stores.sessions, _forget_sessions_offline),
                  close=_save_sessions),
    UserDataStore("samples", _forget_samples, _offline(lambda stores: stores.samples, SampleStore.forget),
                  expire=_expire_samples),
    UserDataStore("records", _forget_records, _forget_records_offline, expire=_expire_records, close=_close_records),
    UserDataStore("responses", _forget_responses, _offline(lambda stores: stores.responses, ResponseStore.forget),
                  expire=_expire_responses),
    UserDataStore("adapter_deleted", _forget_adapters, _forget_adapters_offline),
)
