"""Which model a benchmark runs on, chosen the same way by every bench script."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests.background_server import RunningServer, free_port, start_server
from nextstate.core.settings import Settings


def bench_model(model: str | None = None, smol: bool = False, peaked: bool = False) -> Path:
    """A local model dir if given, else the embedded SmolLM2 with `smol`, else a fresh tiny
    model (`peaked`: with a trained-model-like next-token distribution, for learning runs).
    Also quiets transformers' logs and progress bars, which would drown the bench output."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if model:
        return Path(model)
    if smol:
        from nextstate.engine.default_model import ensure_default_model
        from nextstate.core.settings import Settings

        return ensure_default_model(Settings().models_dir)
    from tests.tiny_model import build_tiny_model

    name = "tiny-peaked" if peaked else "tiny"
    return build_tiny_model(Path(tempfile.mkdtemp()) / name, init_std=0.4 if peaked else 0.02)


@contextlib.contextmanager
def bench_server(model_dir: Path, name: str = "m", **overrides) -> Iterator[RunningServer]:
    """nextstate on `model_dir`, in a thread on a free loopback port, with a throwaway data dir;
    `overrides` are Settings fields. Stopped, and its data removed, on leaving."""
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(Settings(data_dir=Path(tmp), model=str(model_dir), port=free_port(),
                                       served_model_name=name, **overrides))
        try:
            yield server
        finally:
            server.stop()
