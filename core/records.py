"""Append-only JSONL records of everything that happens, written off the request path.

Requests hand a record to `write()`, which only enqueues it; one writer thread serialises and
appends records to `records/policy-v<N>.jsonl`, one file per policy version, so the records of
a version sit together and nothing is ever truncated or purged.

A thread of its own rather than the event loop's executor: a record costs the request a queue
put and nothing else, while a write through `asyncio.to_thread` (or aiofiles, one hop per
call) cost two executor round trips per record, each waking the event loop on completion —
a fifth of the serving loop's busy time in a profile of one streamed reply. Serialising on the
thread keeps `json.dumps` of the whole conversation off the loop too; callers hand over dicts
they no longer change.

The thread is not woken per record either: it drains what piled up every `interval_s` (or at
once when someone waits in `flush()`). Waking a thread is a futex call, and on a busy machine
the woken thread takes a core and the GIL in the middle of the reply that wrote the record;
with `py-spy --gil` the bare queue put was a tenth of the serving loop's GIL time.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Characters other than "\n" that text tools split lines at (Python's str.splitlines among them),
# escaped inside JSON strings, so one record is always exactly one line.
_LINE_BREAKS = (("\x85", "\\u0085"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))


def _escape_line_breaks(line: str) -> str:
    """Three `str.replace` scans, not one `str.translate`: translate looks every character up
    in a dict, 5.3 ms (GIL held) for the 60 kB request record of one OpenClaw turn against 0.2."""
    for char, escaped in _LINE_BREAKS:
        if char in line:
            line = line.replace(char, escaped)
    return line


DRAIN_INTERVAL_S = 0.05  # records reach the disk this long after they were written, at most


def record_line(record: dict[str, Any]) -> str | None:
    """One record as one line of valid UTF-8 JSON, whatever it holds: text UTF-8 cannot carry
    (a lone surrogate) is written escaped, anything else stringified; None if it cannot be."""
    try:
        line = _escape_line_breaks(json.dumps(record, ensure_ascii=False, default=str))
        line.encode("utf-8")
        return line
    except UnicodeEncodeError:
        return json.dumps(record, ensure_ascii=True, default=str)
    except (TypeError, ValueError, RecursionError):
        log.error("record of kind %s is not serialisable; dropped", record.get("kind"))
        return None


class RecordWriter:
    def __init__(self, directory: Path, interval_s: float = DRAIN_INTERVAL_S) -> None:
        self.directory = directory
        self.interval_s = interval_s
        self._pending: collections.deque[tuple[int, dict[str, Any]]] = collections.deque()  # append/popleft are thread-safe
        self._drain_now = threading.Event()  # flush() and aclose() do not wait for the interval
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._enqueued = 0
        self._handled = 0  # advanced by the writer thread only
        self.written = 0
        self._files: dict[int, int] = {}  # open append descriptors, one per policy version
        self.lost = 0  # records a full (or failing) disk did not take, since the start
        self._outage: tuple[float, int] | None = None  # since when, and how many lost since
        self._writing = threading.Lock()  # held while a batch is appended, or the files rewritten

    def path_for(self, version: int) -> Path:
        return self.directory / f"policy-v{version:04d}.jsonl"

    async def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="nextstate-records", daemon=True)
        self._thread.start()

    def write(self, kind: str, payload: dict[str, Any], version: int = 0) -> None:
        """Never blocks and never raises into the caller: records must not cost a request."""
        self._pending.append((version, {"ts": time.time(), "kind": kind, **payload}))
        self._enqueued += 1

    async def flush(self) -> None:
        """Wait until everything written so far is on disk (tests and shutdown use this)."""
        target = self._enqueued
        while self._handled < target and self._thread is not None and self._thread.is_alive():
            self._drain_now.set()
            await asyncio.sleep(0.005)

    async def aclose(self) -> None:
        if self._thread is None:
            return
        self._stopping = True
        self._drain_now.set()
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    async def purge(self, keep: Callable[[dict[str, Any]], bool]) -> int:
        """Rewrite the records without those `keep` rejects (a user's data forgotten, records
        past their retention); returns how many went. Writing pauses meanwhile."""
        await self.flush()
        return await asyncio.to_thread(self._purge, keep)

    def _purge(self, keep: Callable[[dict[str, Any]], bool]) -> int:
        with self._writing:
            self._close_files()
            return purge_records(self.directory, keep)

    def _close_files(self) -> None:
        files, self._files = self._files, {}
        for fd in files.values():
            with contextlib.suppress(OSError):
                os.close(fd)

    def _run(self) -> None:
        """Append batches of lines; a batch that cannot be written is logged and skipped, and
        the writer goes on: one bad record must never silence the records of everyone."""
        try:
            while True:
                self._drain_now.wait(self.interval_s)
                self._drain_now.clear()
                stopping = self._stopping  # read before draining: nothing written before aclose() is left behind
                batch = []
                with contextlib.suppress(IndexError):
                    while True:
                        batch.append(self._pending.popleft())
                by_version: dict[int, list[str]] = {}
                for version, record in batch:
                    if (line := record_line(record)) is not None:
                        by_version.setdefault(version, []).append(line)
                with self._writing:
                    for version, lines in by_version.items():
                        self._append(version, lines)
                self._handled += len(batch)
                if stopping:
                    return
        finally:
            with self._writing:
                self._close_files()

    def _append(self, version: int, lines: list[str]) -> None:
        """Append whole lines or none: a write the disk cut short is cut back to where it
        began, so no reader ever meets a torn line. Records lost to a full disk are counted,
        logged when the outage starts and ends, and recorded (`records_lost`) once it ends."""
        if self._outage is not None and self._write_lines(version, [record_line(self._lost_record()) or ""]):
            since, count = self._outage
            log.warning("records are written again; %d record(s) were lost to the disk for %.0f s", count, time.time() - since)
            self._outage = None
        if self._write_lines(version, lines):
            self.written += len(lines)
            return
        self.lost += len(lines)
        if self._outage is None:
            log.error("could not write records (disk full?): they are dropped, and counted, until it takes them again")
            self._outage = (time.time(), 0)
        self._outage = (self._outage[0], self._outage[1] + len(lines))

    def _lost_record(self) -> dict[str, Any]:
        since, count = self._outage or (time.time(), 0)
        return {"ts": time.time(), "kind": "records_lost", "count": count, "since": since,
                "reason": "the disk refused them (full or failing)"}

    def _write_lines(self, version: int, lines: list[str]) -> bool:
        data = "".join(line + "\n" for line in lines).encode("utf-8")
        try:
            if version not in self._files:
                self._files[version] = os.open(self.path_for(version), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            fd = self._files[version]
        except OSError:
            return False
        start = os.lseek(fd, 0, os.SEEK_END)
        view = memoryview(data)
        try:
            while view:
                view = view[_write(fd, view):]
            return True
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)  # the part that did get written goes: whole lines or none
            return False


_write = os.write  # one name for the writes, so a test can make the disk full


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
