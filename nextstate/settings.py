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
    engine: Literal["local", "sglang"] = Field("local", description="local = in-process; sglang = an SGLang server.")
    sglang_url: str = Field("http://127.0.0.1:30000", description="SGLang's native API (keep it on loopback).")
    sglang_timeout_s: float = Field(300.0, gt=0, description="Longest wait for an SGLang answer.")
    sglang_retries: int = Field(2, ge=0, description="Retries of SGLang calls while safe (before any token).")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    default_max_tokens: int = Field(512, ge=1, description="Used when a request sets no max_tokens.")
    max_concurrent_generations: int = Field(
        8, ge=1, description="Generations decoded at once by the local engine; the rest queue."
    )

    session_idle_s: float = Field(1800.0, gt=0, description="An idle session closes after this.")
    max_sessions: int = Field(10000, ge=1, description="Open sessions kept; the least recent closes.")

    log_level: Literal["debug", "info", "warning", "error"] = "info"

    # ---- judge: next states → rewards, hints, advantages
    judge_enabled: bool = Field(True, description="Off: transitions are recorded but not judged or trained.")
    mode: Literal["binary", "opd", "combined"] = Field(
        "combined", description="binary = judged scalar reward, opd = hindsight distillation, combined = both."
    )
    judge_base_url: str | None = Field(
        None, description="OpenAI-compatible judge endpoint; unset = the served base model, in-process."
    )
    judge_model: str | None = Field(None, description="Model name sent to the judge endpoint.")
    judge_api_key: str | None = None
    judge_timeout_s: float = Field(120.0, gt=0, description="Per judge call; a late vote counts as no vote.")
    judge_concurrency: int = Field(4, ge=1, description="Judge calls in flight at once.")
    judge_temperature: float = Field(0.6, ge=0, le=2)
    judge_max_tokens: int = Field(512, ge=16)
    judge_max_chars: int = Field(6000, ge=200, description="Each text shown to the judge is cut to this.")
    prm_votes: int = Field(3, ge=1, le=16, description="m: judge votes per turn (PRM and hint each).")
    prm_prompt: str = Field("prm_personal", description="Prompt in prompts/ for the PRM judge.")
    min_hint_chars: int = Field(10, ge=0, description="A hint must be longer than this to count.")
    w_binary: float = 1.0
    w_opd: float = 1.0
    opd_clip: float = Field(2.0, gt=0, description="Per-token |teacher - old| is clipped to this.")
    opd_teacher: Literal["base", "policy"] = Field(
        "base", description="Teacher = the base model, or the adapter that served the turn."
    )
    prompts_dir: Path | None = Field(None, description="Judge prompt folder; unset = the bundled prompts/.")

    # ---- learner: samples → LoRA updates → hot-swapped adapters
    learn: bool = Field(True, description="Run the co-located learner.")
    adapter_scope: Literal["shared", "user"] = Field("shared", description="One adapter for all, or one per user.")
    batch_size: int = Field(16, ge=1, description="Ready samples per update.")
    lr: float = Field(
        1e-5, gt=0, description="AdamW learning rate (the paper's, for 4B-32B models; ~1e-3 for SmolLM2)."
    )
    kl_coef: float = Field(0.0, ge=0, description="β of the k3 KL to the base model (adapter off).")
    max_kl: float = Field(1.0, gt=0, description="An update moving the policy further than this is skipped.")
    ppo_epochs: int = Field(1, ge=1)
    minibatch_size: int = Field(0, ge=0, description="Samples per optimizer step; 0 = the whole batch.")
    lora_r: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    lora_target_modules: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    learner_device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the learner's model copy lives.")

    @field_validator("data_dir")
    @classmethod
    def _expand(cls, value: Path) -> Path:
        return value.expanduser()

    @property
    def keys_db(self) -> Path:
        return self.data_dir / "nextstate.sqlite3"

    @property
    def adapters_dir(self) -> Path:
        return self.data_dir / "adapters"

    @property
    def learner_device_resolved(self) -> str:
        from engine.local import resolve_device

        return resolve_device(self.learner_device)

    @property
    def samples_db(self) -> Path:
        return self.data_dir / "samples.sqlite3"

    @property
    def records_dir(self) -> Path:
        return self.data_dir / "records"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"
