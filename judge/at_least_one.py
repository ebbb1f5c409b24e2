"""The paper's at-least-one guarantee: a session whose turns were all neutral still trains one.

It needs to know, per open session, how many of its turns were accepted so far. That count is
forgotten when the session closes — but only once the session's turns still being judged are
done, since they count too.
"""

from __future__ import annotations

SessionKey = tuple[str, str]  # (user, session id)


class AtLeastOne:
    def __init__(self) -> None:
        self._accepted: dict[SessionKey, int] = {}
        self._judging: dict[SessionKey, int] = {}
        self._closed: set[SessionKey] = set()

    def judging(self, key: SessionKey) -> None:
        """A turn of the session is being judged."""
        self._judging[key] = self._judging.get(key, 0) + 1

    def judged(self, key: SessionKey) -> None:
        """A turn's judgement ended (whatever it was)."""
        self._judging[key] -= 1
        if not self._judging[key]:
            del self._judging[key]
            if key in self._closed:
                self._closed.discard(key)
                self._accepted.pop(key, None)

    def session_over(self, key: SessionKey) -> None:
        if self._judging.get(key):
            self._closed.add(key)  # forgotten when its last judgement ends
        else:
            self._accepted.pop(key, None)

    def accepted(self, key: SessionKey) -> None:
        self._accepted[key] = self._accepted.get(key, 0) + 1

    def claim_neutral(self, key: SessionKey) -> bool:
        """True (once per session) for a neutral turn of a session none of whose turns was
        accepted yet: it trains under the guarantee."""
        if self._accepted.get(key, 0):
            return False
        self._accepted[key] = 1
        return True
