"""The tests' tiny Qwen2 model written as a GGUF file, with the `gguf` package's writer.

A person brings a GGUF (NEXTSTATE_MODEL=….gguf, or an Ollama model); the suite needs one it can
make from nothing, as llama.cpp's converter would write it: the tensors under llama.cpp's names in
float32, the hyperparameters under `qwen2.*`, and the byte-level BPE tokenizer (tokens, merges,
special ids, chat template) under `tokenizer.ggml.*`. Qwen2's query and key rows are not reordered
in a GGUF (llama's are), so the weights go in as they are.
"""

from __future__ import annotations

import json
from pathlib import Path

# transformers' Qwen2 parameter names → llama.cpp's tensor names (per layer where {i})
TENSOR_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "blk.{i}.attn_q.bias",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.k_proj.bias": "blk.{i}.attn_k.bias",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.v_proj.bias": "blk.{i}.attn_v.bias",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}


def gguf_name(name: str) -> str:
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers":
        i = parts[2]
        return TENSOR_NAMES[".".join(parts[:2] + ["{i}"] + parts[3:])].format(i=i)
    return TENSOR_NAMES[name]


def write_tiny_gguf(model_dir: Path, path: Path) -> Path:
    """`model_dir` (tests/tiny_model.py's Qwen2) as a float32 GGUF at `path`."""
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name(model_dir.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = set(tokenizer.all_special_tokens)
    added = set(tokenizer.get_added_vocab())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.USER_DEFINED if t in added
                            else gguf.TokenType.NORMAL for t in tokens])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)

    weights = load_file(str(model_dir / "model.safetensors"))
    for name, array in weights.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        writer.add_tensor(gguf_name(name), array.astype("float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
