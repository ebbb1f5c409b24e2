"""The base model's readings a bench run starts from, kept on disk by everything they depend on.

Every `bench.personalization` run of a kind begins by reading the base model: its perplexity on
the held-out prose, its own replies to the asked and held-out questions and how it reads them
(what bench/reply_surprise.py compares a version's replies with). Those readings are the same in
every run on the same model and engine — v0's held-out reading was 0.167 with a surprise of 0.004
in all 27 saved 24-task runs — yet they took 5 minutes of a 25-minute run alone and 31 minutes
with three runs and a fourth process on two cores (2026-12-02). So they are computed once and
kept under `~/.cache/nextstate/bench/` (or `$XDG_CACHE_HOME`), keyed by a hash of what could
change them: the model's files, the engine settings, the sampling and reading parameters and
texts, the source of the code that samples and reads (the engine, model I/O, the bench's own
functions that sample and read, by their source), and the torch and transformers versions. A
change to any of them is a new key, so a stale reading is never used; `--fresh-base` ignores
the cache.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# the code whose behaviour the readings record: sampling, scoring, rendering (the bench's own
# functions that call them are named by the caller, so an edit elsewhere in a bench keeps its cache)
SOURCES = ("engine", "modelio", "bench/reply_surprise.py", "bench/models.py")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nextstate" / "bench"


def source_digest(root: Path = ROOT) -> str:
    digest = hashlib.sha256()
    for name in SOURCES:
        path = root / name
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(str(file.relative_to(root)).encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def model_digest(model_dir: Path) -> str:
    """The model's files by name and size, and its config and tokenizer by content: weights are
    large and a different model has a different config or size."""
    digest = hashlib.sha256()
    for file in sorted(p for p in Path(model_dir).rglob("*") if p.is_file() and not p.name.startswith(".")):
        digest.update(f"{file.relative_to(model_dir)}:{file.stat().st_size}".encode())
        if file.suffix in (".json", ".jinja", ".txt"):
            digest.update(file.read_bytes())
    return digest.hexdigest()


def key(model_dir: Path, parameters: dict[str, Any], code: tuple[Callable, ...] = ()) -> str:
    import torch
    import transformers

    described = {"model": model_digest(model_dir), "source": source_digest(), "torch": torch.__version__,
                 "transformers": transformers.__version__, "code": [inspect.getsource(f) for f in code],
                 **parameters}
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cached(name: str, model_dir: Path, parameters: dict[str, Any], compute: Callable[[], dict],
           code: tuple[Callable, ...] = (), fresh: bool = False) -> tuple[dict, bool]:
    """`compute()`'s result for these inputs, read from the cache when it holds them (and not
    `fresh`), else computed and kept; with whether it came from the cache. `code`: the caller's
    functions `compute` runs, keyed by their source. A cache file that cannot be read is computed
    again, never trusted. What is returned is always the JSON round trip (tuples read as lists)."""
    path = cache_dir() / f"{name}-{key(model_dir, parameters, code)}.json"
    if not fresh and path.exists():
        try:
            return json.loads(path.read_text()), True
        except (OSError, ValueError):
            pass
    value = json.loads(json.dumps(compute()))  # as a later run will read it: the same run, hit or miss
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as out:
        json.dump(value, out)
    os.replace(out.name, path)  # whole or not at all, also beside other runs writing the same key
    return value, False
