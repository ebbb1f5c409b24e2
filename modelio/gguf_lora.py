"""A user's adapter as a llama.cpp LoRA adapter: `nextstate export --format gguf`, and the embedded
llama.cpp engine's copy of every published version.

llama.cpp (`llama-server --lora FILE`) and Ollama (`ADAPTER FILE` in a Modelfile) load LoRA
adapters as GGUF files: `general.type` "adapter", `adapter.type` "lora", `adapter.lora.alpha`,
and for each adapted weight of the base model two tensors named after the GGUF name of that
weight, `<name>.lora_a` (rank × in) and `<name>.lora_b` (out × rank) — the layout llama.cpp's
own `convert_lora_to_gguf.py` writes. Names come from the `gguf` package's TensorNameMap, the
table llama.cpp's converters use, so a module is named as the base GGUF file names it.

One subtlety: llama.cpp's converter stores the query and key projections of Llama-family models
with the rows of each head reordered (its `permute`, for its rotary embedding's layout), and
nextstate's models are the Hugging Face layout (the default model is converted back from its
GGUF). A LoRA delta B·A changes rows as its B does, so B of q_proj and k_proj gets the same
reordering (A, acting on the input, keeps its columns), as llama.cpp's LoRA converter does.
Qwen2 and Qwen3 files keep the Hugging Face order (no reordering). Other architectures are
refused by name: their reorderings differ.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

PEFT_PREFIX = "base_model.model."
# model_type → (llama.cpp's architecture name, whether its q/k rows are reordered)
ARCHITECTURES = {"llama": ("LLAMA", True), "mistral": ("LLAMA", True), "qwen2": ("QWEN2", False), "qwen3": ("QWEN3", False)}


class CannotExportGguf(ValueError):
    """The adapter's base model is of an architecture this export does not write."""


def permute_rows(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for a query or key projection of `heads` heads: within each head,
    the two rotary halves interleaved (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def gguf_adapter(adapter_dir: Path, base_config: dict, alpha: float) -> bytes:
    """The PEFT adapter in `adapter_dir` (safetensors) as the bytes of a llama.cpp LoRA GGUF."""
    import gguf
    from safetensors.numpy import load_file

    model_type = str(base_config.get("model_type") or "")
    if model_type not in ARCHITECTURES:
        raise CannotExportGguf(f"a '{model_type or 'unknown'}' model's adapter cannot be written as GGUF here "
                               f"(supported: {', '.join(ARCHITECTURES)}); export it as --format peft")
    arch_name, reordered = ARCHITECTURES[model_type]
    arch = getattr(gguf.MODEL_ARCH, arch_name)
    layers = int(base_config["num_hidden_layers"])
    heads = int(base_config["num_attention_heads"])
    kv_heads = int(base_config.get("num_key_value_heads") or heads)
    names = gguf.TensorNameMap(arch, layers)
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        module, _, part = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if part not in ("A.weight", "B.weight"):
            raise CannotExportGguf(f"unexpected tensor {key!r} in the adapter (only LoRA A and B matrices are written)")
        pairs.setdefault(module, {})[part[0]] = value.astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "adapter.gguf"
        writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
        for module in sorted(pairs):
            a, b = pairs[module].get("A"), pairs[module].get("B")
            if a is None or b is None:
                raise CannotExportGguf(f"{module} has only one of its two LoRA matrices")
            name = names.get_name(module + ".weight", try_suffixes=(".weight",))
            if name is None:
                raise CannotExportGguf(f"no GGUF name for {module} of a {model_type} model")
            if reordered and module.endswith("q_proj"):
                b = permute_rows(b, heads)
            elif reordered and module.endswith("k_proj"):
                b = permute_rows(b, kv_heads)
            writer.add_tensor(f"{name}.lora_a", np.ascontiguousarray(a))
            writer.add_tensor(f"{name}.lora_b", np.ascontiguousarray(b))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path.read_bytes()


def base_config_of(adapter_dir: Path) -> dict:
    """The base model's config.json, from where the adapter says it was trained."""
    folder = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not folder or not (Path(folder) / "config.json").is_file():
        raise CannotExportGguf(f"the base model's config.json was not found (at {folder!r}): the GGUF export needs its shape")
    return json.loads((Path(folder) / "config.json").read_text())
