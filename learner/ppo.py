"""The policy loss: PPO's clipped surrogate with asymmetric bounds, token-mean, optional KL.

    ρ_t = π_θ(a_t|s_t) / π_old(a_t|s_t)
    L_pg = −mean_t min(ρ_t A_t, clip(ρ_t, 1 − ε, 1 + ε_high) A_t)
    L    = L_pg + β · mean_t k3(π_θ ‖ π_base),  k3 = e^{b−θ} − 1 − (b − θ)

Two guards for samples far off-policy (sampled some versions ago, or by an engine whose
numbers differ from the learner's): the log-ratio is clamped to ±`LOG_RATIO_CLAMP` before the
exponential, so one token cannot overflow ρ; and for negative advantages the dual clip of Ye
et al. (2020, "Mastering Complex Control in MOBA Games with Deep RL") bounds the term by
`DUAL_CLIP` · |A_t|, so a token the current policy likes far more than the sampler did cannot
contribute an unbounded loss (as in verl and AReaL).

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


LOG_RATIO_CLAMP = 20.0
DUAL_CLIP = 3.0


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
    ratio = torch.exp(torch.clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - eps, 1 + eps_high) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    # dual clip: with A < 0, min(ρA, clip(ρ)A) is unbounded below as ρ grows; floor it at c·A
    surrogate = torch.where(advantages < 0, torch.maximum(surrogate, DUAL_CLIP * advantages), surrogate)
    loss = -surrogate
    was_clipped = ((clipped < unclipped) | ((advantages < 0) & (ratio > DUAL_CLIP))).float()
    if base_logprobs is not None:
        kl = k3_kl(logprobs, base_logprobs)
        loss = loss + kl_coef * kl
    else:
        kl = torch.zeros_like(loss)
    return loss, was_clipped, kl
