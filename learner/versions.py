"""Adapter versions on disk: `adapters/<scope>/v<N>/`, peft format, never overwritten.

A version is written into a temporary folder and renamed into place, then `CURRENT` is
replaced atomically, so a crash leaves either the old or the new version current, never a
half-written one. Each version keeps a manifest (the sample ids it trained on, the step's
numbers) and the optimizer state, so training resumes exactly where it stopped.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

_SAFE = re.compile(r"[^A-Za-z0-9_.@-]")


def scope_dir_name(scope: str) -> str:
    """A folder name for a scope; user names with odd characters get a short hash suffix."""
    safe = _SAFE.sub("_", scope)
    if safe != scope or safe in (".", ".."):
        safe = f"{safe}-{hashlib.sha256(scope.encode()).hexdigest()[:8]}"
    return safe


class LearnerRunning(RuntimeError):
    """Another learner trains this adapters folder."""


class AdapterVersions:
    def __init__(self, root: Path) -> None:
        self.root = root

    def hold_learner(self) -> IO[str]:
        """Become the one learner of this folder: an exclusive lock on `LEARNER.lock` for as
        long as the returned file stays open (the kernel drops it when the process dies, even
        by kill -9). Two learners would train the same samples into two version N+1s."""
        self.root.mkdir(parents=True, exist_ok=True)
        handle = (self.root / "LEARNER.lock").open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise LearnerRunning(f"another learner ({holder}) trains the adapters in {self.root}; one at a time") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        return handle

    def write_training(self, state: dict[str, Any] | None) -> None:
        """Say which update runs now (`TRAINING.json`, replaced atomically), or that none does:
        `nextstate status` reads the data dir, not the server, and would otherwise show only
        what the update waited for before it started."""
        path = self.root / "TRAINING.json"
        if state is None:
            path.unlink(missing_ok=True)
            return
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".TRAINING-")
        with os.fdopen(fd, "w") as handle:
            json.dump({**state, "pid": os.getpid(), "host": socket.gethostname()}, handle)
        os.replace(tmp, path)

    def read_training(self) -> dict[str, Any] | None:
        """The update running now, if the learner that wrote it still lives (on this host)."""
        try:
            state = json.loads((self.root / "TRAINING.json").read_text())
        except (OSError, ValueError):
            return None
        if state.get("host") != socket.gethostname():
            return state  # another machine's learner: nothing here can check it
        try:
            os.kill(int(state.get("pid", 0)), 0)
        except (OSError, ValueError):
            return None  # a learner that died mid-update left it
        return state

    def scope_root(self, scope: str) -> Path:
        return self.root / scope_dir_name(scope)

    def path(self, scope: str, version: int) -> Path:
        return self.scope_root(scope) / f"v{version}"

    def versions(self, scope: str) -> list[int]:
        root = self.scope_root(scope)
        if not root.is_dir():
            return []
        return sorted(int(p.name[1:]) for p in root.iterdir() if p.is_dir() and re.fullmatch(r"v\d+", p.name))

    def current(self, scope: str) -> int | None:
        marker = self.scope_root(scope) / "CURRENT"
        if marker.is_file():
            version = int(marker.read_text().strip())
            if self.path(scope, version).is_dir():
                return version
        versions = self.versions(scope)
        return versions[-1] if versions else None

    def next_version(self, scope: str) -> int:
        """One past the highest version on disk: a version published just before a crash, with
        CURRENT not yet pointing at it, is never written over."""
        return max(self.versions(scope), default=0) + 1

    def adopt_latest(self, scope: str) -> int | None:
        """Make the newest complete version current, if a crash left CURRENT behind it; returns it.
        Version folders appear by an atomic rename of a finished one, so any vN folder is whole."""
        versions = self.versions(scope)  # rollbacks publish new versions: the newest is meant to serve
        if versions and self.current(scope) != versions[-1]:
            self.set_current(scope, versions[-1])
            return versions[-1]
        return None

    def remove_unfinished(self, scope: str) -> list[str]:
        """Delete the temporary folders of versions whose writing a crash cut short (`.vN-…`:
        never renamed into place, so never served or trained from). Called at start, before any
        version is written. Returns the names removed."""
        root = self.scope_root(scope)
        gone = [p.name for p in root.glob(".v*-*") if p.is_dir()] if root.is_dir() else []
        for name in gone:
            shutil.rmtree(root / name, ignore_errors=True)
        return gone

    def scopes(self) -> list[str]:
        """Scopes with a current version (their manifest names the scope exactly)."""
        out = []
        if self.root.is_dir():
            for child in sorted(self.root.iterdir()):
                manifest = child / "scope.json"
                if manifest.is_file():
                    out.append(json.loads(manifest.read_text())["scope"])
        return out

    def serving_name(self, scope: str, version: int) -> str:
        """The name a version is served under: `<scope>-v<N>-<digest of its weights>`.

        A serving engine may never forget a name: SGLang 0.5.23 loads an unloaded adapter again
        from its old path when a request names it, and refuses to load other weights under a
        name it has seen. Versions restart at v1 after a user is forgotten, so `<scope>-v<N>`
        alone would be given to other weights; with the digest a name means one set of weights,
        and an old version cannot be served by mistake whatever the engine keeps."""
        digest = hashlib.sha256()
        folder = self.path(scope, version)
        for item in sorted(folder.iterdir()):
            if item.is_file() and item.name.startswith("adapter_"):  # weights and their config
                digest.update(item.name.encode())
                with item.open("rb") as handle:
                    for block in iter(lambda: handle.read(1 << 20), b""):
                        digest.update(block)
        return f"{scope_dir_name(scope)}-v{version}-{digest.hexdigest()[:8]}"

    def manifest(self, scope: str, version: int) -> dict[str, Any]:
        return json.loads((self.path(scope, version) / "manifest.json").read_text())

    def publish(self, scope: str, version: int, write: Callable[[Path], None], manifest: dict[str, Any]) -> Path:
        root = self.scope_root(scope)
        root.mkdir(parents=True, exist_ok=True)
        (root / "scope.json").write_text(json.dumps({"scope": scope}))
        target = self.path(scope, version)
        if target.exists():
            raise FileExistsError(f"adapter version {target} already exists")
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".v{version}-"))
        try:
            write(tmp)
            (tmp / "manifest.json").write_text(json.dumps({"scope": scope, "version": version, **manifest}, indent=1))
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.set_current(scope, version)
        return target

    def set_current(self, scope: str, version: int) -> None:
        root = self.scope_root(scope)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".CURRENT-")
        with os.fdopen(fd, "w") as handle:
            handle.write(f"{version}\n")
        os.replace(tmp, root / "CURRENT")
