"""Append-only JSONL records of everything that happens, written off the request path.

Requests hand a record to `write()`, which only enqueues it; one background task appends
records to `records/policy-v<N>.jsonl`, one file per policy version, so the records of a
version sit together and nothing is ever truncated or purged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiofiles

log = logging.getLogger(__name__)

# Characters other than "\n" that text tools split lines at (Python's str.splitlines among them),
# escaped inside JSON strings, so one record is always exactly one line.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


class RecordWriter:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._queue: asyncio.Queue[tuple[int, str] | None] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._enqueued = 0
        self._handled = 0
        self.written = 0
        self._files: dict[int, Any] = {}  # open append handles, one per policy version
        self._writing = asyncio.Lock()  # held while a batch is appended, or the files rewritten

    def path_for(self, version: int) -> Path:
        return self.directory / f"policy-v{version:04d}.jsonl"

    async def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._task = asyncio.create_task(self._run(), name="record-writer")

    def write(self, kind: str, payload: dict[str, Any], version: int = 0) -> None:
        """Never blocks and never raises into the caller: records must not cost a request.
        Whatever the payload holds, the line written is valid UTF-8 JSON: text UTF-8 cannot
        carry (a lone surrogate) is written escaped, and anything else is stringified."""
        record = {"ts": time.time(), "kind": kind, **payload}
        try:
            line = json.dumps(record, ensure_ascii=False, default=str).translate(_LINE_BREAKS)
            line.encode("utf-8")
        except UnicodeEncodeError:
            line = json.dumps(record, ensure_ascii=True, default=str)
        except (TypeError, ValueError, RecursionError):
            log.error("record of kind %s is not serialisable; dropped", kind)
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

    async def purge(self, keep: Callable[[dict[str, Any]], bool]) -> int:
        """Rewrite the records without those `keep` rejects (a user's data forgotten, records
        past their retention); returns how many went. Writing pauses meanwhile."""
        await self.flush()
        async with self._writing:
            await self._close_files()
            return await asyncio.to_thread(purge_records, self.directory, keep)

    async def _close_files(self) -> None:
        files, self._files = self._files, {}
        for handle in files.values():
            with contextlib.suppress(OSError, ValueError):
                await handle.close()

    async def _run(self) -> None:
        """Append batches of lines; a batch that cannot be written is logged and skipped, and
        the writer goes on: one bad record must never silence the records of everyone."""
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
                async with self._writing:
                    for version, lines in by_version.items():
                        await self._append(version, lines)
                if stop:
                    return
        finally:
            await self._close_files()

    async def _append(self, version: int, lines: list[str]) -> None:
        try:
            if version not in self._files:
                self._files[version] = await aiofiles.open(self.path_for(version), "a", encoding="utf-8")
            await self._files[version].write("".join(line + "\n" for line in lines))
            await self._files[version].flush()
            self.written += len(lines)
        except (OSError, ValueError):
            log.exception("could not write %d records", len(lines))
            broken = self._files.pop(version, None)  # reopened for the next batch
            if broken is not None:
                with contextlib.suppress(OSError, ValueError):
                    await broken.close()
        self._handled += len(lines)


def purge_records(directory: Path, keep: Callable[[dict[str, Any]], bool]) -> int:
    """Rewrite every record file in `directory` without the records `keep` rejects (each file
    replaced atomically; a file left empty is removed). Returns how many records went."""
    removed = 0
    for path in sorted(directory.glob("*.jsonl")):
        kept: list[str] = []
        for line in path.read_text(encoding="utf-8").split("\n"):
            if not line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                kept.append(line)  # not ours to judge: kept as it is
                continue
            if keep(record):
                kept.append(line)
            else:
                removed += 1
        if not kept:
            path.unlink()
            continue
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)
    return removed
