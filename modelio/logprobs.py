"""The one definition of a token's log-probability, shared by serving, judging and training.

PPO's ratio π_θ/π_old and OPD's teacher − old gap are only meaningful if the learner computes
log-probabilities exactly as the engine recorded them when it sampled. Both therefore call
these two functions: log-softmax of the logits divided by the sampling temperature, in fp32
whatever the model's dtype (bf16 logprobs drift by up to 0.13 nats between batched and
unbatched runs).
"""

from __future__ import annotations

import torch


def tempered_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log π(· | s) at `temperature` over the last dimension, in fp32."""
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log π(targets[i] | s_i) at `temperature`: `logits[i]` is the prediction for `targets[i]`.

    logits: [n, vocab]; targets: [n] token ids on the same device. Returns [n] fp32.
    """
    return tempered_log_softmax(logits, temperature).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
