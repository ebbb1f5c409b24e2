"""Can the configured judge judge? A handful of cases with known verdicts, asked at start-up.

With the defaults the judge is the served model itself; SmolLM2-135M never writes a valid
`\\boxed{}` verdict, so every reward would be 0 and nothing would train — silently. So before
the judge gets implicit feedback (next states) to score, it answers the bundled cases in
`prompts/calibration.json` (a clear thanks, a clear correction, a failed tool call, a neutral
follow-up) with the personal-agent PRM prompt and its usual number of votes, one case after
the other. A judge that gets one wrong by majority fails at once (no further case is asked:
on the embedded model each vote costs seconds of the same CPU that serves): the server says so in its log, in `/v1/admin/stats` and on the
dashboard, asks it nothing more, and trains from explicit feedback and, unless
`NEXTSTATE_JUDGE_FALLBACK=ratings`, from each next state read as a hint of its own
(judge/hindsight.py). Restarting with a better `NEXTSTATE_JUDGE_BASE_URL` brings rewards back.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from nextstate.core.types import NextState, Turn
from nextstate.judge.context import prompt_values
from nextstate.judge.parsing import majority_vote

CALIBRATION_PROMPT = "prm_personal"
CALIBRATION_FILE = "calibration.json"


@dataclass
class CaseResult:
    name: str
    accept: list[int]
    votes: list[int | None]
    verdict: int | None
    passed: bool


@dataclass
class Calibration:
    """The judge's standing: "pending" until its start-up check is done."""

    state: Literal["pending", "passed", "failed", "skipped"] = "pending"
    detail: str = ""
    cases: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0
    checked_at: float | None = None
    key: str | None = None  # what was checked (`calibration_key`): a verdict is reused only for the same

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "cases": [asdict(c) for c in self.cases]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        cases = [CaseResult(**c) for c in data.get("cases") or []]
        return cls(data.get("state", "pending"), data.get("detail", ""), cases, data.get("seconds", 0.0),
                   data.get("checked_at"), data.get("key"))


def calibration_key(judge_identity: str, directory: Path, prompt_texts: list[str], settings: dict[str, Any]) -> str:
    """What a verdict depends on: the judge, the cases, the prompts and the voting settings.
    The same key after a restart means the same check would be asked again of the same judge,
    so its last verdict stands instead of costing minutes beside the first users."""
    digest = hashlib.sha256()
    for part in (judge_identity, (directory / CALIBRATION_FILE).read_text(encoding="utf-8"), *prompt_texts,
                 json.dumps(settings, sort_keys=True)):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:32]


def load_cases(directory: Path) -> list[dict[str, Any]]:
    return json.loads((directory / CALIBRATION_FILE).read_text(encoding="utf-8"))["cases"]


def case_turn(case: dict[str, Any]) -> tuple[Turn, NextState]:
    """A case as the judge sees a real turn (no token ids: the judge reads text only)."""
    turn = Turn(
        session_id="calibration", user="calibration", turn_index=1, messages=case["messages"], prompt_ids=[],
        response_ids=[], response_logprobs=[], logprob_temperature=1.0, sampling={}, policy_version=0, adapter=None,
        response_message={"role": "assistant", "content": case["response"]}, finish_reason="stop", created_at=0.0,
    )
    return turn, NextState(messages=case["next_state"])


def case_values(case: dict[str, Any], max_chars: int) -> dict[str, str]:
    turn, next_state = case_turn(case)
    return prompt_values(turn, next_state, max_chars)


def judge_case(case: dict[str, Any], votes: list[int | None]) -> CaseResult:
    """Right when most votes are valid and their majority is an accepted verdict: a judge whose
    answers mostly have no verdict is not one to trust (SmolLM2 once passed a case on one valid
    vote of three)."""
    verdict = majority_vote(votes) if votes else None
    valid = [v for v in votes if v is not None]
    return CaseResult(case["name"], list(case["accept"]), votes, verdict, 2 * len(valid) > len(votes) and verdict in case["accept"])


def conclude(results: list[CaseResult], seconds: float, asked_of: int | None = None) -> Calibration:
    """The verdict on the cases asked; asking stops at the first case judged wrong."""
    total_cases = asked_of or len(results)
    failed = [r for r in results if not r.passed]
    if not failed:
        detail = f"the judge got all {len(results)} calibration cases right"
        state: Literal["passed", "failed"] = "passed"
    else:
        invalid = sum(1 for r in results for v in r.votes if v is None)
        total = sum(len(r.votes) for r in results)
        detail = (
            f"the judge got calibration case '{failed[0].name}' wrong ({len(results) - 1} of {total_cases} right "
            f"before it; {invalid} of {total} votes had no valid verdict): "
            "no vote of it is used; explicit feedback (POST /v1/feedback) trains, and with NEXTSTATE_JUDGE_FALLBACK="
            "hindsight (the default) each next state teaches as an OPD hint of its own. For rewards too, point "
            "NEXTSTATE_JUDGE_BASE_URL at a capable model (docs/guide.md, Judging)."
        )
        state = "failed"
    return Calibration(state, detail, results, round(seconds, 2), time.time())
