"""On-policy distillation over the teacher's distribution.

The paper's OPD (§4.2) makes the teacher an advantage of the token that was sampled:
log π_T(a_t) − log π_old(a_t). That term can only say "more" or "less" of what was written.
Under a hint such as "answer in one short sentence" the teacher, reading a long reply, lowers
nearly every token of it; what it would have written instead (an end of the reply after the
first sentence) was never sampled, so no advantage can raise it. Measured on SmolLM2, the
sampled term's mean was −0.12 to −0.25 per token on every update of a run that did not learn.

Here every response position also compares whole distributions: the policy's next-token
distribution is pulled towards the teacher's by the reverse KL(π_θ ‖ π_T), over the teacher's
top K tokens and one bin for all the others (OpenClaw-RL's OEL track, after SDFT and SDPO;
Agarwal et al. 2024, "On-Policy Distillation of Language Models"; Thinking Machines 2025,
"On-Policy Distillation"). Reverse, as on-policy distillation uses it: mode-seeking, the
policy gives its mass to what the teacher finds likely rather than spreading over everything
the teacher does not rule out. The positions are the ones the policy visited (its own
sampled reply), so this is still on-policy. The tail bin keeps the loss a true divergence
between two distributions over K + 1 outcomes, whatever mass the top K leave out.

The target is not the hinted base model itself but the policy as it stands, moved by what the
hint changes in the base model: log π_θ₀ + (log π_base(·|hint) − log π_base(·|no hint)),
renormalised over the same K + 1 bins. The hinted base pulls every position back to the base
model's habits, also where the hint says nothing (a length the policy had learnt, the reply's
wording); the shift pulls only where the hint moves something, and by as much as it moves it
(the idea of contrastive decoding and of "proxy tuning", Liu et al. 2024: the difference of two
prompts' logits as the steering signal). The hinted base model as the target (OEL's) capped the
opening word at the hinted model's own 0.60 and held the length wish back (0.37 against the
shift's 0.80); anchoring the shift back towards the base, or scaling it as guidance, traded the
wish for nothing (docs/benchmark-log.md, "Decided levers").
"""

from __future__ import annotations

import torch

from nextstate.modelio.logprobs import tempered_log_softmax

# log(1 − p) of a top-K mass p that rounds to 1 would be −inf: the tail keeps at least this.
TAIL_FLOOR = -1e-7


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x < 0, stable for x near 0."""
    return torch.log(-torch.expm1(x.clamp(max=TAIL_FLOOR)))


def with_tail(topk_logprobs: torch.Tensor) -> torch.Tensor:
    """[n, K] log-probabilities of K tokens → [n, K + 1], the last the mass of all others."""
    tail = log1mexp(torch.logsumexp(topk_logprobs, dim=-1, keepdim=True))
    return torch.cat([topk_logprobs, tail], dim=-1)


def teacher_topk(logits: torch.Tensor, temperature: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's K likeliest next tokens at each position: (log-probabilities, token ids),
    each [n, K], at the temperature the reply was sampled at (as every logprob here is)."""
    logprobs = tempered_log_softmax(logits, temperature)
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return values, ids


def shifted_target(policy: torch.Tensor, hinted: torch.Tensor, unhinted: torch.Tensor) -> torch.Tensor:
    """The policy moved by the hint's effect on the base model, over the K + 1 bins.

    policy, hinted, unhinted: [n, K] log-probabilities of the hinted base model's top K tokens
    under the policy before the update, the base model reading the hint, and the base model
    without it. Returns [n, K + 1] log-probabilities (the last bin: all other tokens)."""
    target = with_tail(policy) + with_tail(hinted) - with_tail(unhinted)
    return target - torch.logsumexp(target, dim=-1, keepdim=True)


def topk_reverse_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Per-position KL(π_θ ‖ π_T) over the teacher's top K tokens and the rest.

    student: [n, K] log-probabilities of the teacher's top K token ids under the policy;
    teacher: [n, K + 1], the target's over the same ids and the rest (`with_tail`,
    `shifted_target`). Returns [n], ≥ 0, differentiable in `student`."""
    s = with_tail(student)
    return (s.exp() * (s - teacher)).sum(-1)
