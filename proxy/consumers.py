"""Where (turn, next state) transitions go once the proxy has paired them.

The judge plugs in here. Consumers are called on the event loop and must not block: anything
slow (judging, scoring) belongs in a task the consumer schedules itself.
"""

from __future__ import annotations

from typing import Protocol

from nextstate.types import Transition
from proxy.records import RecordWriter


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


class RecordingConsumer:
    """Keeps transitions as JSONL records; the consumer in place until a judge is configured."""

    def __init__(self, records: RecordWriter) -> None:
        self.records = records
        self.received: int = 0

    def submit(self, transition: Transition) -> None:
        self.received += 1
        self.records.write("transition", transition_record(transition), version=transition.turn.policy_version)
