"""The one settings object. Every knob is a `NEXTSTATE_*` environment variable.

Defaults are chosen so that `nextstate serve` with nothing set runs the embedded model on the
CPU, bound to loopback. The README's configuration table mirrors this file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="NEXTSTATE_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    data_dir: Path = Path("~/.nextstate")

    model: str | None = Field(
        None,
        description="Local Hugging Face model directory; unset = the embedded SmolLM2-135M-Instruct.",
    )
    served_model_name: str | None = Field(
        None, description="Model id shown by /v1/models; defaults to the model directory's name."
    )
    engine: Literal["local"] = "local"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    default_max_tokens: int = Field(512, ge=1, description="Used when a request sets no max_tokens.")
    max_concurrent_generations: int = Field(
        8, ge=1, description="Generations decoded at once by the local engine; the rest queue."
    )

    session_idle_s: float = Field(1800.0, gt=0, description="An idle session closes after this.")
    max_sessions: int = Field(10000, ge=1, description="Open sessions kept; the least recent closes.")

    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("data_dir")
    @classmethod
    def _expand(cls, value: Path) -> Path:
        return value.expanduser()

    @property
    def keys_db(self) -> Path:
        return self.data_dir / "nextstate.sqlite3"

    @property
    def records_dir(self) -> Path:
        return self.data_dir / "records"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"
