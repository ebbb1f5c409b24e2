"""The learning rate `NEXTSTATE_LR=auto` picks: one that fits the model being trained.

A single number cannot fit every model: the paper's 1e-5 (for a 4B model) moves SmolLM2-135M
nowhere in a hundred updates, while ~1e-3 teaches it a preference in fifteen (BENCHMARKS.md,
Personalization). The rule is the one Thinking Machines fitted to LoRA sweeps across Llama and
Qwen models ("LoRA Without Regret", 2025, and `hyperparam_utils.get_lr` in their
tinker-cookbook):

    lr = 5e-5 × 10 × (2000 / hidden_size) ** p

5e-5 is their full fine-tuning rate at hidden size 2000, LoRA's best rate is ~10× full
fine-tuning's at any rank (with α fixed, as here), and the rate falls with the hidden size with
a family exponent p: 0.781 for Llama-like models (SmolLM2 is one), 0.0775 for Qwen. Models of
other families take the Llama exponent, the more cautious of the two for large models.

It gives 1.3e-3 for SmolLM2-135M (hidden 576), what the personalization bench found by hand,
and ~5e-4 for Qwen3-4B to 32B. Those rates were fitted on supervised fine-tuning; the learner's
own brake — an update that moves the policy further than `NEXTSTATE_MAX_KL` on its batch is
undone — stays on.
"""

from __future__ import annotations

from typing import Any

BASE_LR = 5e-5
LORA_MULTIPLIER = 10.0
REFERENCE_HIDDEN = 2000
EXPONENTS = {"qwen": 0.0775, "llama": 0.781}


def family_exponent(model_type: str) -> float:
    kind = model_type.lower()
    return EXPONENTS["qwen"] if kind.startswith("qwen") else EXPONENTS["llama"]


def auto_learning_rate(hidden_size: int, model_type: str) -> float:
    return BASE_LR * LORA_MULTIPLIER * (REFERENCE_HIDDEN / hidden_size) ** family_exponent(model_type)


def resolve_learning_rate(setting: float | str, model_config: Any) -> float:
    """The configured rate, or the rule's for this model when it is "auto"."""
    if setting != "auto":
        return float(setting)
    config = getattr(model_config, "text_config", None) or model_config  # multimodal configs nest it
    return auto_learning_rate(int(config.hidden_size), str(getattr(config, "model_type", "")))


def warmed_up(lr: float, steps_taken: int, warmup_steps: int) -> float:
    """The rate for an optimizer's next step after `steps_taken`: rising linearly to `lr` over
    its first `warmup_steps` (NEXTSTATE_LR_WARMUP_STEPS; core/settings.py says why)."""
    return lr if warmup_steps <= 0 else lr * min(1.0, (steps_taken + 1) / warmup_steps)
