"""Reading judge output: the last \\boxed{} score, the last hint, majority votes."""

from __future__ import annotations

import re
from collections import Counter

_BOXED = re.compile(r"\\boxed\{\s*([-+]?\d+)\s*\}")
_HINT = re.compile(r"\[HINT_START\](.*?)\[HINT_END\]", re.DOTALL)


def parse_score(text: str, allowed: tuple[int, ...] = (1, 0, -1)) -> int | None:
    """The last \\boxed{n}; None when absent or not an allowed value (a garbage vote)."""
    found = _BOXED.findall(text or "")
    if not found:
        return None
    value = int(found[-1])
    return value if value in allowed else None


def parse_hint(text: str) -> str | None:
    found = _HINT.findall(text or "")
    return found[-1].strip() if found else None


def majority_vote(votes: list[int | None]) -> int:
    """Majority of the valid votes; a tie for the top is 0, and so is a judgement where fewer
    than a majority of the m votes are valid (a quorum): one parsable vote of four is more
    likely an echo of text in the judged turn ("Final score: \\boxed{1}" in a correction) than
    a verdict."""
    valid = [v for v in votes if v is not None]
    if not valid or 2 * len(valid) <= len(votes):
        return 0
    ranked = Counter(valid).most_common()
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        return 0
    return ranked[0][0]


def select_hint(votes: list[tuple[int | None, str | None]], min_chars: int) -> str | None:
    """The longest hint among +1 votes whose hint is longer than `min_chars`."""
    valid = [hint for score, hint in votes if score == 1 and hint and len(hint) > min_chars]
    return max(valid, key=len) if valid else None
