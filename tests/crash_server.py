"""`nextstate serve`, made to die at one chosen point, for the fault-injection test.

    python -m tests.crash_server POINT N

Patches the function behind POINT so that its N-th call ends the process on the spot
(`os._exit`, as a power cut or SIGKILL would: no cleanup, no flush), then runs the real
`nextstate serve` with settings from the environment. Exit status 75 says the point was hit.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys

CRASHED = 75


def _target(point: str) -> tuple[object, str]:
    from nextstate.core.stores.samples import SampleStore
    from nextstate.engine.local import LocalEngine
    from nextstate.judge.service import Judge
    from nextstate.learner.trainer import LoraTrainer
    from nextstate.learner.versions import AdapterVersions

    return {
        "inbox": (SampleStore, "add_transition"),  # before a transition reaches the judge's inbox
        "judging": (Judge, "evaluate"),  # in the middle of judging it
        "storing": (SampleStore, "add_sample"),  # before its sample is stored
        "training": (LoraTrainer, "step"),  # in the middle of a training step
        "saving": (LoraTrainer, "save"),  # while a version is being written (before its rename)
        "current": (AdapterVersions, "set_current"),  # after the rename, before CURRENT moves
        "consumed": (SampleStore, "mark_consumed"),  # after publishing, before samples are marked
        "serving": (LocalEngine, "load_adapter"),  # after all that, before the version serves
    }[point]


def arm(point: str, nth: int) -> None:
    owner, name = _target(point)
    original = getattr(owner, name)
    calls = 0

    def hit() -> None:
        nonlocal calls
        calls += 1
        if calls >= nth:
            os._exit(CRASHED)

    if asyncio.iscoroutinefunction(original):

        @functools.wraps(original)
        async def crashing(*args, **kwargs):
            hit()
            return await original(*args, **kwargs)
    else:

        @functools.wraps(original)
        def crashing(*args, **kwargs):
            hit()
            return original(*args, **kwargs)

    setattr(owner, name, crashing)


def main(argv: list[str]) -> int:
    """POINT N: arm, then `nextstate serve`."""
    arm(argv[0], int(argv[1]))
    from nextstate.cli import main as nextstate

    return nextstate(["serve"])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
