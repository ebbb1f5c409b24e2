"""The policy loss: PPO's clipped surrogate with asymmetric bounds, token-mean.

    ρ_t = π_θ(a_t|s_t) / π_old(a_t|s_t)
    L_pg = −mean_t min(ρ_t A_t, clip(ρ_t, 1 − ε, 1 + ε_high) A_t)

No KL-to-base term: the learner anchors with the replay prose (NEXTSTATE_REPLAY_COEF) and holds
each update's distance with the KL brake (NEXTSTATE_MAX_KL); a β·KL term was tried and turned
down (docs/benchmark-log.md, "Decided levers").

Two guards for samples far off-policy (sampled some versions ago, or by an engine whose
numbers differ from the learner's): the log-ratio is clamped to ±`LOG_RATIO_CLAMP` before the
exponential, so one token cannot overflow ρ; and for negative advantages the dual clip of Ye
et al. (2020, "Mastering Complex Control in MOBA Games with Deep RL") bounds the term by
`DUAL_CLIP` · |A_t|, so a token the current policy likes far more than the sampler did cannot
contribute an unbounded loss (as in verl and AReaL). `k3_kl` is the step's KL measure
(learner/trainer.py `_policy_kl`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class TokenLosses(NamedTuple):
    loss: torch.Tensor  # what is minimised, per token
    clipped: torch.Tensor  # 1.0 where the ratio was clipped


def k3_kl(logprobs: torch.Tensor, other_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π ‖ π_other) from π's samples: unbiased, always ≥ 0, low variance."""
    log_ratio = other_logprobs - logprobs
    return torch.exp(log_ratio) - 1 - log_ratio


LOG_RATIO_CLAMP = 20.0
DUAL_CLIP = 3.0


def ppo_token_losses(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps: float = 0.2,
    eps_high: float = 0.28,
) -> TokenLosses:
    ratio = torch.exp(torch.clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - eps, 1 + eps_high) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    # dual clip: with A < 0, min(ρA, clip(ρ)A) is unbounded below as ρ grows; floor it at c·A
    surrogate = torch.where(advantages < 0, torch.maximum(surrogate, DUAL_CLIP * advantages), surrogate)
    pg = -surrogate
    was_clipped = ((clipped < unclipped) | ((advantages < 0) & (ratio > DUAL_CLIP))).float()
    return TokenLosses(pg, was_clipped)
