"""Which adapter serves whom. The only thing that flows back from the learner to the proxy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyRef:
    version: int
    adapter: str | None  # None = the base model


BASE_POLICY = PolicyRef(version=0, adapter=None)
SHARED_SCOPE = "shared"


def scope_of(user: str, per_user: bool) -> str:
    """The scope whose adapter serves `user`: their own, or the one everyone shares."""
    return user if per_user else SHARED_SCOPE


class PolicyDirectory:
    """Maps a scope ("shared", or a user's name) to the policy that serves it now.

    Reads happen on every request, writes only when the learner publishes a version, so a
    plain dict replaced by assignment is enough: the event loop never sees a half-written map.
    """

    def __init__(self, per_user: bool = False) -> None:
        self.per_user = per_user
        self._current: dict[str, PolicyRef] = {}
        self._listeners: list[Callable[[str, PolicyRef], None]] = []

    def on_publish(self, listener: Callable[[str, PolicyRef], None]) -> None:
        """`listener(scope, ref)` hears of each version published, after it serves."""
        self._listeners.append(listener)

    def scope_of(self, user: str) -> str:
        return scope_of(user, self.per_user)

    def current(self, user: str) -> PolicyRef:
        return self._current.get(self.scope_of(user), BASE_POLICY)

    def current_scope(self, scope: str) -> PolicyRef:
        return self._current.get(scope, BASE_POLICY)

    def scopes(self) -> set[str]:
        """The scopes served an adapter."""
        return set(self._current)

    def publish(self, scope: str, ref: PolicyRef) -> None:
        self._current = {**self._current, scope: ref}
        for listener in self._listeners:
            listener(scope, ref)

    def forget(self, scope: str) -> PolicyRef | None:
        """The scope is served the base model again; returns what served it."""
        old = self._current.get(scope)
        self._current = {k: v for k, v in self._current.items() if k != scope}
        return old
