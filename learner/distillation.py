"""On-policy distillation over the teacher's distribution (NEXTSTATE_OPD_LOSS=topk).

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

With NEXTSTATE_OPD_TARGET=shift the target is not the hinted base model itself but the
policy as it stands, moved by what the hint changes in the base model: log π_θ₀ +
(log π_base(·|hint) − log π_base(·|no hint)), renormalised over the same K + 1 bins. The
hinted base pulls every position back to the base model's habits, also where the hint says
nothing (a length the policy had learnt, the reply's wording); the shift pulls only where the
hint moves something, and by as much as it moves it (the idea of contrastive decoding and of
"proxy tuning", Liu et al. 2024: the difference of two prompts' logits as the steering signal).

The shift alone keeps *whatever* the policy has drifted to where the hint says nothing, nonsense
included: on the length wish the policy's short replies turned into "Ladle." and "SmolMLO." (1.7-
2.4 nats a token stranger than the base model's own) and nothing in the target pulled back.
NEXTSTATE_OPD_ANCHOR takes the shift's starting point a share of the way back to the base model at
every position — a geometric mixture of the two, between the pure shift (0) and the hinted base
model (1). Measured at 0.5 on the length wish (one seed, BENCHMARKS.md "A user who turns down
nonsense"): the replies read less strange (1.40 nats a token against 1.68) and the prose's
perplexity came back within 5% (1.026 against 1.094), but the wish fell (0.71 against 0.88) and
the share of sensible replies that fit it did not rise. Off (0) by default.
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


def shifted_target(policy: torch.Tensor, hinted: torch.Tensor, unhinted: torch.Tensor,
                   anchor: float = 0.0, scale: float = 1.0) -> torch.Tensor:
    """The policy moved by the hint's effect on the base model, over the K + 1 bins.

    policy, hinted, unhinted: [n, K] log-probabilities of the hinted base model's top K tokens
    under the policy before the update, the base model reading the hint, and the base model
    without it. `anchor` (NEXTSTATE_OPD_ANCHOR) first takes the policy that share of the way
    back to the base model, in log-probabilities: 0 is the pure shift, 1 the hinted base model
    itself (NEXTSTATE_OPD_TARGET=teacher). `scale` (NEXTSTATE_OPD_SHIFT_SCALE) multiplies the
    hint's log-ratio, as classifier-free guidance scales a condition's: above 1 the target goes
    past what one reading of the hint does, for a wish the hinted model itself barely follows.
    Returns [n, K + 1] log-probabilities (the last bin: all other tokens)."""
    start = with_tail(policy)
    if anchor:
        start = start + anchor * (with_tail(unhinted) - start)
    target = start + scale * (with_tail(hinted) - with_tail(unhinted))
    return target - torch.logsumexp(target, dim=-1, keepdim=True)


def topk_reverse_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Per-position KL(π_θ ‖ π_T) over the teacher's top K tokens and the rest.

    student: [n, K] log-probabilities of the teacher's top K token ids under the policy;
    teacher: [n, K + 1], the target's over the same ids and the rest (`with_tail`,
    `shifted_target`). Returns [n], ≥ 0, differentiable in `student`."""
    s = with_tail(student)
    return (s.exp() * (s - teacher)).sum(-1)
