"""What the judge did lately, for /v1/admin/stats: latencies (bounded), vote and error counts."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass
class Vote:
    score: int | None
    hint: str | None
    text: str
    error: str | None
    seconds: float


class JudgeStats:
    """Recent judge latencies (bounded) for /v1/admin/stats."""

    def __init__(self, window: int = 1000) -> None:
        self.sample_seconds: deque[float] = deque(maxlen=window)
        self.call_seconds: deque[float] = deque(maxlen=window)  # one call asks a prompt's m votes
        self.votes = 0
        self.votes_failed = 0
        self.errors = 0
        self.feedback = 0  # explicit ratings applied

    def snapshot(self) -> dict[str, Any]:
        def summary(values: deque[float]) -> dict[str, float] | None:
            if not values:
                return None
            ordered = sorted(values)
            return {
                "mean_s": round(statistics.fmean(ordered), 4),
                "p50_s": round(ordered[len(ordered) // 2], 4),
                "p95_s": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))], 4),
            }

        return {
            "per_sample": summary(self.sample_seconds),
            "per_call": summary(self.call_seconds),
            "votes": self.votes,
            "votes_failed": self.votes_failed,
            "errors": self.errors,
            "feedback_applied": self.feedback,
        }


