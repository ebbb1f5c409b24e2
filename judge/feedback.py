"""Explicit feedback: a person's own verdict on one reply, in place of the judge's.

`POST /v1/feedback` names a reply by its response id, with a rating (+1 good, −1 bad) and
optionally a correction ("do it like this"). The rating is the turn's reward as the judge's
majority vote would be, with no votes taken; the correction plays the judge's hint: the OPD
teacher scores the reply under it, exactly as under a hint the judge wrote. So explicit
feedback works with no judge at all, with a judge that failed its calibration, and in every
mode — a rating alone still teaches in `opd` mode, where a reward alone otherwise would not,
because a person's rating is the least ambiguous signal there is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FeedbackStatus = Literal["applied", "already_trained", "not_found", "queued"]


@dataclass(frozen=True)
class FeedbackResult:
    status: FeedbackStatus
    sample_id: int | None = None
    session_id: str | None = None
    turn_index: int | None = None


def feedback_weights(mode: str, has_correction: bool, w_binary: float, w_opd: float) -> tuple[float, float]:
    """(binary, OPD) weights of a rated turn's advantages in each mode."""
    if mode == "binary":
        return 1.0, 0.0
    if mode == "opd":
        return (0.0, 1.0) if has_correction else (1.0, 0.0)
    return w_binary, w_opd
