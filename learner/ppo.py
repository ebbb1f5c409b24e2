"""The policy loss: PPO's clipped surrogate with asymmetric bounds, token-mean, optional KL.

    ρ_t = π_θ(a_t|s_t) / π_old(a_t|s_t)
    L_pg = −mean_t min(ρ_t A_t, clip(ρ_t, 1 − ε, 1 + ε_high) A_t)
    L    = L_pg + β · mean_t sg(ρ_t) · ½ (θ_t − b_t)²       (θ_t, b_t: log π_θ, log π_base)

The KL term is there for its gradient, and the gradient is what decides which KL it is. Put
into the loss, k3 (Schulman's unbiased, low-variance *value* estimate) has the gradient of the
forward KL(π_base ‖ π_θ) in expectation: mass-covering, it pulls up every token the base model
liked, so it resists a policy that learns a preference by pushing its old habits down.
½ (θ − b)² has, in expectation over tokens sampled from π_θ, exactly the gradient of the
reverse KL(π_θ ‖ π_base) that KL-regularised RL means (mode-seeking: the policy may settle on
what the base model already found plausible, but not drift to what it did not). Samples come
from π_old, so the term is weighted by the importance ratio, held constant and truncated at
`KL_WEIGHT_CAP` (Liu et al. 2025, "Rethinking KL Regularization in RLHF: From Value
Estimation to Gradient Optimization"; Tang & Munos 2025, "On a few pitfalls in KL divergence
gradient estimation for RL"). k3 is still what is reported as the KL to the base model.

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

from typing import NamedTuple

import torch


class TokenLosses(NamedTuple):
    loss: torch.Tensor  # what is minimised: the surrogate plus β times the KL term
    clipped: torch.Tensor  # 1.0 where the ratio was clipped
    kl: torch.Tensor  # k3 value of KL(π_θ ‖ π_base), for the record (zeros without a base)
    pg: torch.Tensor  # the surrogate alone


def k3_kl(logprobs: torch.Tensor, base_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π_θ ‖ π_base): unbiased, always ≥ 0, low variance."""
    log_ratio = base_logprobs - logprobs
    return torch.exp(log_ratio) - 1 - log_ratio


def reverse_kl_surrogate(logprobs: torch.Tensor, base_logprobs: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """Per-token term whose gradient, over tokens sampled from π_old, is that of KL(π_θ ‖ π_base)."""
    weight = ratio.detach().clamp(max=KL_WEIGHT_CAP)
    return weight * 0.5 * (logprobs - base_logprobs) ** 2


LOG_RATIO_CLAMP = 20.0
DUAL_CLIP = 3.0
KL_WEIGHT_CAP = DUAL_CLIP  # a stale token weighs at most as much in the KL term as the dual clip lets it in the surrogate


def ppo_token_losses(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps: float = 0.2,
    eps_high: float = 0.28,
    base_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> TokenLosses:
    ratio = torch.exp(torch.clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - eps, 1 + eps_high) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    # dual clip: with A < 0, min(ρA, clip(ρ)A) is unbounded below as ρ grows; floor it at c·A
    surrogate = torch.where(advantages < 0, torch.maximum(surrogate, DUAL_CLIP * advantages), surrogate)
    pg = -surrogate
    was_clipped = ((clipped < unclipped) | ((advantages < 0) & (ratio > DUAL_CLIP))).float()
    if base_logprobs is None:
        return TokenLosses(pg, was_clipped, torch.zeros_like(pg), pg)
    loss = pg + kl_coef * reverse_kl_surrogate(logprobs, base_logprobs, ratio)
    return TokenLosses(loss, was_clipped, k3_kl(logprobs, base_logprobs), pg)
