"""The policy loss: PPO's clipped surrogate with asymmetric bounds, token-mean, optional KL.

    ρ_t = π_θ(a_t|s_t) / π_old(a_t|s_t)
    L_pg = −mean_t min(ρ_t A_t, clip(ρ_t, 1 − ε, 1 + ε_high) A_t)
    L    = L_pg + β · mean_t k3(π_θ ‖ π_base),  k3 = e^{b−θ} − 1 − (b − θ)

Old logprobs are the sampling logprobs recorded with the turn; the base logprobs come from the
same model with the adapter disabled (free with LoRA: no second model in memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossParts:
    loss: torch.Tensor
    pg_loss: float
    kl: float
    clip_fraction: float
    tokens: int


def k3_kl(logprobs: torch.Tensor, base_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π_θ ‖ π_base): unbiased, always ≥ 0, low variance."""
    log_ratio = base_logprobs - logprobs
    return torch.exp(log_ratio) - 1 - log_ratio


def ppo_token_losses(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps: float = 0.2,
    eps_high: float = 0.28,
    base_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loss, per-token clipped indicator, per-token KL (zeros when no base given)."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - eps, 1 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = (clipped < unclipped).float()
    if base_logprobs is not None:
        kl = k3_kl(logprobs, base_logprobs)
        loss = loss + kl_coef * kl
    else:
        kl = torch.zeros_like(loss)
    return loss, was_clipped, kl
