"""Forgetting a user: their keys, sessions, records, samples, stored responses and own adapters, deleted.

Online (`DELETE /v1/admin/users/{name}`, admin key) through the running components, so nothing
writes while their data goes; or offline (`nextstate forget --user NAME`) on the data dir of a
stopped server. A shared adapter keeps what it learned from the user: it cannot be unlearned,
only rolled back, and the answer says so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from typing import Any

from nextstate.core.records import purge_records
from nextstate.core.sample_store import SampleStore
from nextstate.core.settings import Settings
from nextstate.learner.versions import AdapterVersions
from nextstate.proxy.keys import KeyStore
from nextstate.proxy.responses.store import ResponseStore
from nextstate.proxy.session_db import SessionDB

log = logging.getLogger(__name__)

SHARED_NOTE = "the shared adapter keeps what it learned from this user (roll it back to undo that)"


def _of(user: str):
    return lambda record: record.get("user") != user


async def forget_online(state: Any, user: str) -> dict[str, Any]:
    keys = await asyncio.to_thread(state.keys.forget, user)
    sessions = state.sessions.forget(user)
    await state.sessions.save()
    await state.judge.drain(timeout=30)  # what is being judged for them lands, then goes
    samples = await asyncio.to_thread(state.samples.forget, user)
    records = await state.records.purge(_of(user))
    responses = await asyncio.to_thread(state.responses.store.forget, user)
    adapters = await state.learner.forget(user) if state.learner is not None else False
    return _summary(user, keys, sessions, samples, records, adapters, state.settings.learner.adapter_scope, responses)


def forget_offline(settings: Settings, user: str) -> dict[str, Any]:
    keys = KeyStore(settings.keys_db)
    try:
        deleted_keys = keys.forget(user)
    finally:
        keys.close()
    db = SessionDB(settings.sessions_db)
    try:
        sessions = sum(1 for s in db.load() if s["user"] == user)
        db.forget(user)
    finally:
        db.close()
    store = SampleStore(settings.samples_db)
    try:
        samples = store.forget(user)
    finally:
        store.close()
    records = purge_records(settings.records_dir, _of(user)) if settings.records_dir.is_dir() else 0
    stored = ResponseStore(settings.responses_db)
    try:
        responses = stored.forget(user)
    finally:
        stored.close()
    scope_root = AdapterVersions(settings.adapters_dir).scope_root(user)
    adapters = scope_root.is_dir()
    shutil.rmtree(scope_root, ignore_errors=True)
    return _summary(user, deleted_keys, sessions, samples, records, adapters, settings.learner.adapter_scope, responses)


def _summary(user, keys, sessions, samples, records, adapters, scope, responses=0) -> dict[str, Any]:
    out = {"object": "user.forgotten", "user": user, "keys": keys, "sessions": sessions, "samples": samples,
           "records": records, "responses": responses, "adapter_deleted": bool(adapters)}
    if scope == "shared":
        out["note"] = SHARED_NOTE
    return out


# ---------------------------------------------------------------------------- is a server running?


def server_file(settings: Settings):
    return settings.data_dir / "server.json"


def mark_running(settings: Settings, port: int) -> None:
    server_file(settings).write_text(json.dumps({"pid": os.getpid(), "port": port}))


def mark_stopped(settings: Settings) -> None:
    path = server_file(settings)
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def running_server(settings: Settings) -> dict | None:
    """The pid and port of a server on this data dir that is still alive, if any."""
    try:
        info = json.loads(server_file(settings).read_text())
        os.kill(int(info["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return info


# ---------------------------------------------------------------------------- retention


async def keep_for(state: Any, days: float, every_s: float = 6 * 3600) -> None:
    """Delete records and finished samples older than `days`, now and every `every_s`."""
    while True:
        cutoff = time.time() - days * 86400
        records = await state.records.purge(lambda record: record.get("ts", cutoff) >= cutoff)
        samples = await asyncio.to_thread(state.samples.expire, cutoff)
        responses = await asyncio.to_thread(state.responses.store.expire, cutoff)
        if records or samples or responses:
            log.info("retention (%g days): deleted %d records, %d samples and transitions, %d stored responses",
                     days, records, samples, responses)
        await asyncio.sleep(every_s)
