"""A model the person already has: a GGUF file, or a model Ollama pulled (NEXTSTATE_MODEL).

`NEXTSTATE_MODEL=/path/model.gguf` or `NEXTSTATE_MODEL=ollama:NAME[:TAG]` is converted once into
the data dir, by the path the embedded default takes (engine/default_model.py), into a folder
named after the file and its size and time, so that a new file is converted anew. Ollama's
models are found through its own manifests under OLLAMA_MODELS or ~/.ollama/models — the
manifest names the GGUF blob; nothing is downloaded. The chat template comes with the GGUF
(its `tokenizer.chat_template`), as transformers reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from nextstate.engine.default_model import DefaultModelUnavailable, ensure_converted

OLLAMA_PREFIX = "ollama:"
OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"


def ollama_models_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def ollama_blob(name: str, models_dir: Path | None = None) -> Path:
    """The GGUF blob of Ollama model `NAME[:TAG]` (`library/` for names without a namespace,
    tag `latest` when none is given), from its manifest."""
    models_dir = models_dir or ollama_models_dir()
    model, _, tag = name.partition(":")
    path = model if "/" in model else f"library/{model}"
    manifest = models_dir / "manifests" / OLLAMA_REGISTRY / path / (tag or "latest")
    if not manifest.is_file():
        raise DefaultModelUnavailable(
            f"no Ollama model '{name}' under {models_dir} (no {manifest}); `ollama pull {name}` first, or set "
            "OLLAMA_MODELS to the folder Ollama keeps its models in"
        )
    layers = json.loads(manifest.read_text()).get("layers", [])
    digest = next((layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER), None)
    if digest is None:
        raise DefaultModelUnavailable(f"Ollama's manifest of '{name}' names no model layer ({manifest})")
    blob = models_dir / "blobs" / digest.replace(":", "-")
    if not blob.is_file():
        raise DefaultModelUnavailable(f"Ollama's blob of '{name}' is missing: {blob}")
    return blob


def brought_model(spec: str, models_dir: Path) -> Path | None:
    """The converted folder for a GGUF path or an `ollama:` name; None for anything else (a
    Hugging Face folder)."""
    if spec.startswith(OLLAMA_PREFIX):
        name = spec.removeprefix(OLLAMA_PREFIX)
        gguf = ollama_blob(name)
        label = "ollama-" + name.replace("/", "-").replace(":", "-")
    elif spec.endswith(".gguf"):
        gguf = Path(spec).expanduser()
        if not gguf.is_file():
            raise DefaultModelUnavailable(f"NEXTSTATE_MODEL names a GGUF file that does not exist: {gguf}")
        label = gguf.stem
    else:
        return None
    stat = gguf.stat()
    stamp = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:8]
    return ensure_converted(gguf, models_dir / f"{label}-{stamp}")
