"""Where (turn, next state) transitions go once the proxy has paired them.

The judge (judge.service.Judge) is the consumer. Consumers are called on the event loop and must not block: anything
slow (judging, scoring) belongs in a task the consumer schedules itself.
"""

from __future__ import annotations

from typing import Protocol

from nextstate.types import Transition


class TransitionConsumer(Protocol):
    def submit(self, transition: Transition) -> None: ...


def transition_record(transition: Transition) -> dict:
    turn = transition.turn
    return {
        "user": turn.user,
        "session_id": turn.session_id,
        "turn_index": turn.turn_index,
        "policy_version": turn.policy_version,
        "reason": transition.reason,
        "next_state": transition.next_state.messages if transition.next_state else None,
        "response_tokens": len(turn.response_ids),
    }
