"""How much memory this process holds and the machine (or its container) has: cheap reads of
/proc and the cgroup, for the learner's memory plan and the server's admission guard.

Inside a container /proc/meminfo shows the host's memory, so the cgroup's limit, when lower,
is what counts. On systems without /proc the C library's figures are used, or none.
"""

from __future__ import annotations

import os
from pathlib import Path

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_CGROUP = Path("/sys/fs/cgroup")


def resident_bytes() -> int:
    """This process's resident set now (0 where it cannot be read)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def free_bytes() -> int:
    """Memory available to this process now: MemAvailable, or the container's room if lower."""
    available = _meminfo("MemAvailable")
    room = _cgroup_room()
    return min(available, room) if room is not None else available


def total_bytes() -> int:
    """The memory this process may use at most: the machine's, or the container's limit."""
    total = _meminfo("MemTotal")
    limit = _cgroup_limit()
    return min(total, limit) if limit is not None else total


def process_status_bytes(field: str) -> int | None:
    """A "Field: N kB" figure of /proc/self/status (VmRSS, VmHWM: the peak resident set), or None."""
    return _kib_field(Path("/proc/self/status"), field)


def _kib_field(path: Path, field: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return None


def _meminfo(field: str) -> int:
    if (found := _kib_field(Path("/proc/meminfo"), field)) is not None:
        return found
    try:  # not Linux: physical memory, as far as the C library tells
        pages = os.sysconf("SC_AVPHYS_PAGES" if field == "MemAvailable" else "SC_PHYS_PAGES")
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: only explicit caps bound anything


def _cgroup_limit() -> int | None:
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        return None if limit == "max" else int(limit)
    except (OSError, ValueError):
        return None


def _cgroup_room() -> int | None:
    """limit − usage of the container's cgroup (v2), or None without a limit. The page cache it
    counts as used (inactive files) is given back under pressure, so it counts as room."""
    limit = _cgroup_limit()
    if limit is None:
        return None
    try:
        used = int((_CGROUP / "memory.current").read_text())
        stat = dict(line.split() for line in (_CGROUP / "memory.stat").read_text().splitlines())
        return max(0, limit - used + int(stat.get("inactive_file", 0)))
    except (OSError, ValueError):
        return None
