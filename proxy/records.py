"""Append-only JSONL records of everything that happens, written off the request path.

Requests hand a record to `write()`, which only enqueues it; one background task appends
records to `records/policy-v<N>.jsonl`, one file per policy version, so the records of a
version sit together and nothing is ever truncated or purged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import aiofiles

log = logging.getLogger(__name__)


class RecordWriter:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._queue: asyncio.Queue[tuple[int, str] | None] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._enqueued = 0
        self._handled = 0
        self.written = 0

    def path_for(self, version: int) -> Path:
        return self.directory / f"policy-v{version:04d}.jsonl"

    async def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._task = asyncio.create_task(self._run(), name="record-writer")

    def write(self, kind: str, payload: dict[str, Any], version: int = 0) -> None:
        """Never blocks and never raises into the caller: records must not cost a request."""
        try:
            line = json.dumps({"ts": time.time(), "kind": kind, **payload}, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            log.exception("record of kind %s is not serialisable; dropped", kind)
            return
        self._queue.put_nowait((version, line))
        self._enqueued += 1

    async def flush(self) -> None:
        """Wait until everything written so far is on disk (tests and shutdown use this)."""
        target = self._enqueued
        while self._handled < target and self._task is not None and not self._task.done():
            await asyncio.sleep(0.005)

    async def aclose(self) -> None:
        if self._task is None:
            return
        self._queue.put_nowait(None)
        await self._task
        self._task = None

    async def _run(self) -> None:
        files: dict[int, Any] = {}
        try:
            while True:
                item = await self._queue.get()
                batch = [item]
                while not self._queue.empty():  # write whatever piled up in one go
                    batch.append(self._queue.get_nowait())
                stop = None in batch
                by_version: dict[int, list[str]] = {}
                for entry in batch:
                    if entry is not None:
                        by_version.setdefault(entry[0], []).append(entry[1])
                for version, lines in by_version.items():
                    try:
                        if version not in files:
                            files[version] = await aiofiles.open(self.path_for(version), "a", encoding="utf-8")
                        await files[version].write("".join(line + "\n" for line in lines))
                        await files[version].flush()
                        self.written += len(lines)
                    except OSError:
                        log.exception("could not write %d records", len(lines))
                    self._handled += len(lines)
                if stop:
                    return
        finally:
            for handle in files.values():
                await handle.close()
