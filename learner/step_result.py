"""What one update did, as the learner records it (a `train_step` record, `nextstate status`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from nextstate.core.types import Sample
from nextstate.learner.memory_budget import Refusal


@dataclass
class StepResult:
    scope: str
    samples: int
    tokens: int
    loss: float
    pg_loss: float
    clip_fraction: float
    policy_kl: float  # k3 estimate of KL(π_old ‖ π_new) on the batch after the update
    mismatch: float  # mean |train logprob − sampling logprob| before the update
    mean_advantage: float
    grad_norm: float
    seconds: float
    skipped: str | None = None
    dropped: list[int] = field(default_factory=list)  # ids of samples left out: their loss was not finite
    refused: bool = False  # not started: it would not fit in memory (the samples stay ready)
    step_scale: float = 1.0  # the share of the trained step kept (KL backtracking; the gate may shorten it further)
    max_kl: float | None = None  # the limit the step's KL was held to
    kl_tries: list[dict] = field(default_factory=list)  # each length tried: {"scale", "kl"}, the kept one last
    epochs: int = 1  # passes made over the batch (ppo_epochs, fewer once epoch_kl_share's KL was reached)
    epoch_kls: list[float] = field(default_factory=list)  # the batch's policy KL after each pass but the last
    pass_tokens: int = 0  # padded tokens a forward pass could hold (the step's memory plan)
    peak_added_mb: float = 0.0  # the most a training pass added to memory, measured
    distill_kl: float = 0.0  # mean KL(π_θ ‖ π_teacher) over distilled tokens in training
    guarded: int = 0  # sample passes whose empty-reply chance was over NEXTSTATE_EMPTY_GUARD, and pushed down
    replay_kl: float = 0.0  # KL(base ‖ policy) per token on the replay prose before each optimizer step, mean (NEXTSTATE_REPLAY_COEF)
    # where its seconds went: the teacher's targets, the training passes, the KL checks between
    # passes, the KL line search (a profile per update, in the step's record)
    timings: dict[str, float] = field(default_factory=dict)

    @classmethod
    def not_started(cls, scope: str, samples: list[Sample], refusal: Refusal) -> StepResult:
        nan = float("nan")
        return cls(scope=scope, samples=len(samples), tokens=sum(sum(s.loss_mask) for s in samples), loss=nan,
                   pg_loss=nan, clip_fraction=nan, policy_kl=nan, mismatch=nan, mean_advantage=nan,
                   grad_norm=nan, seconds=0.0, skipped=refusal.reason(), refused=True)

    def to_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}
