"""Every place a user's data lives, listed once.

Forgetting a user (online through the running components, offline on a stopped server's data
dir), records retention and shutdown all walk `USER_DATA`, so a store added to nextstate is
added here once and cannot be forgotten by one of them (as stored responses once were).
Each entry says how to reach its store in each of those situations; `None` where one does not
apply (keys do not expire; an adapter is not a file to close).
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
from nextstate.core.stores.versions import VersionRegistry
from nextstate.learner.versions import AdapterVersions
from nextstate.core.stores.keys import KeyStore
from nextstate.core.stores.responses import ResponseStore
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
    close: Callable[[Services], Awaitable[None]] | None = None  # at shutdown, after the workers stopped


def _of(user: str) -> Callable[[dict[str, Any]], bool]:
    return lambda record: record.get("user") != user


def _offline(open_store: Callable[[Settings], Any], forget: Callable[[Any, str], int]) -> Callable[[Settings, str], int]:
    def run(settings: Settings, user: str) -> int:
        store = open_store(settings)
        try:
            return forget(store, user)
        finally:
            store.close()

    return run


# ---------------------------------------------------------------------------- keys


async def _forget_keys(s: Services, user: str) -> int:
    return await asyncio.to_thread(s.keys.forget, user)


async def _close_keys(s: Services) -> None:
    s.keys.close()


# ---------------------------------------------------------------------------- sessions


async def _forget_sessions(s: Services, user: str) -> int:
    await s.sessions.refresh(user, every=True)  # shared: those open in other processes too
    count = s.sessions.forget(user)
    await s.sessions.save()
    return count


def _forget_sessions_offline(db: SessionDB, user: str) -> int:
    count = sum(1 for _ in db.load(user))
    db.forget(user)
    return count


async def _close_sessions(s: Services) -> None:
    await s.sessions.save()
    s.session_db.close()  # open sessions stay open: a restart continues them


# ---------------------------------------------------------------------------- samples


async def _forget_samples(s: Services, user: str) -> int:
    await s.judge.drain(timeout=FORGET_DRAIN_S)  # what is being judged for them lands, then goes
    return await asyncio.to_thread(s.samples.forget, user)


async def _expire_samples(s: Services, cutoff: float) -> int:
    return await asyncio.to_thread(s.samples.expire, cutoff)


async def _close_samples(s: Services) -> None:
    s.samples.close()


# ---------------------------------------------------------------------------- records


async def _forget_records(s: Services, user: str) -> int:
    return await s.records.purge(_of(user))


def _forget_records_offline(settings: Settings, user: str) -> int:
    return purge_records(settings.records_dir, _of(user)) if settings.records_dir.is_dir() else 0


async def _expire_records(s: Services, cutoff: float) -> int:
    return await s.records.purge(lambda record: record.get("ts", cutoff) >= cutoff)


async def _close_records(s: Services) -> None:
    await s.records.aclose()


# ---------------------------------------------------------------------------- stored responses


async def _forget_responses(s: Services, user: str) -> int:
    return await asyncio.to_thread(s.stored_responses.forget, user)


async def _expire_responses(s: Services, cutoff: float) -> int:
    return await asyncio.to_thread(s.stored_responses.expire, cutoff)


async def _close_responses(s: Services) -> None:
    s.stored_responses.close()


# ---------------------------------------------------------------------------- own adapters


async def _forget_adapters(s: Services, user: str) -> bool:
    if s.learner is not None:
        return await s.learner.forget(user)
    if s.registry is None or not s.policies.per_user:
        return False
    # the learner runs elsewhere: it is asked through the database, and deletes the versions
    # within seconds; every process stops serving them as soon as they are unpublished
    had = await asyncio.to_thread(s.registry.forget, user)
    if s.follower is not None:
        await s.follower.follow()
    return had


def _forget_adapters_offline(settings: Settings, user: str) -> bool:
    scope_root = AdapterVersions(settings.adapters_dir).scope_root(user)
    existed = scope_root.is_dir()
    shutil.rmtree(scope_root, ignore_errors=True)
    if settings.server.database_url and settings.learner.adapter_scope == "user":
        # a learner running elsewhere drops what it holds of them too
        registry = VersionRegistry(settings.data_dir / "versions.sqlite3", settings.server.database_url)
        try:
            registry.forget(user)
        finally:
            registry.close()
    return existed


USER_DATA: tuple[UserDataStore, ...] = (
    UserDataStore("keys", _forget_keys, _offline(lambda st: KeyStore(st.keys_db, st.server.database_url), KeyStore.forget), close=_close_keys),
    UserDataStore("sessions", _forget_sessions, _offline(lambda st: SessionDB(st.sessions_db, st.server.database_url), _forget_sessions_offline),
                  close=_close_sessions),
    UserDataStore("samples", _forget_samples, _offline(lambda st: SampleStore(st.samples_db, st.server.database_url), SampleStore.forget),
                  expire=_expire_samples, close=_close_samples),
    UserDataStore("records", _forget_records, _forget_records_offline, expire=_expire_records, close=_close_records),
    UserDataStore("responses", _forget_responses, _offline(lambda st: ResponseStore(st.responses_db, st.server.database_url), ResponseStore.forget),
                  expire=_expire_responses, close=_close_responses),
    UserDataStore("adapter_deleted", _forget_adapters, _forget_adapters_offline),
)
