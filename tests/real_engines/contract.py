"""Helpers the engine contract tests share (tests/test_sglang_contract.py, tests/test_vllm_contract.py)."""

from __future__ import annotations

import uuid
from pathlib import Path

PROMPT = list(range(5, 40))
# fp32 on both sides; a server's CPU attention and the embedded engine differ by rounding
TOLERANCE = 2e-3


def write_adapters(model_dir: Path, root: Path) -> dict[str, Path]:
    """Two peft adapters with non-zero weights, as the learner writes them: "a" and "b"."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = {}
    for seed, name in enumerate("ab"):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
                       ).save_pretrained(root / name)
        out[name] = root / name
    return out


def unique(name: str) -> str:
    """A name this server has never seen (SGLang never forgets one; a server lives for a module)."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


async def generate(engine, params, adapter=None, prompt=PROMPT):
    return [t async for t in engine.generate(prompt, params, adapter)]


# A forced tool call whose JSON is short whatever the (random) model prefers: one of two words.
ENUM_TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"n": {"enum": ["x", "y"]}}, "required": ["n"], "additionalProperties": False}}}
