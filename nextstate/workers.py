"""`nextstate judge` and `nextstate learn`: the judge and the learner as processes of their own.

`nextstate serve` judges and learns beside serving, which suits one machine. A deployment with
several serving processes, or a model too big to train beside serving, runs them apart: serving
processes with NEXTSTATE_JUDGE_IN_PROCESS=false and NEXTSTATE_LEARN=false, any number of judge
processes (each claims a bounded batch of transitions at a time from the shared inbox; a judge
that dies has its claims taken by another after their lease), and one learner (the adapters
folder's lock refuses a second). They share NEXTSTATE_DATABASE_URL (or one data dir) and the
adapters folder (NEXTSTATE_ADAPTERS_DIR), and take every other setting from the same variables
as `serve`.

A judge process opens the engine the way `serve` does (its teacher passes and, without
NEXTSTATE_JUDGE_BASE_URL, its votes run there) and follows the published versions, so an OPD
teacher reads the hint with the adapter that serves. A learner process loads each version into
the engine servers if the engine is one (SGLang, its router, vLLM), before the serving processes
move to it; with the embedded engine each serving process loads it from the folder itself.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from nextstate.assembly import EngineFactory, build_follower, build_judge, build_learner, open_engine, policy_directory
from nextstate.core.settings import Settings
from nextstate.judge.inbox import JudgeInbox
from nextstate.judge.startup_check import StartupCheck
from nextstate.lifecycle import Process

log = logging.getLogger(__name__)

# How often a judge process looks for transitions when it has room for more.
POLL_S = 1.0


async def run_judge(settings: Settings, stop: asyncio.Event, engine_factory: EngineFactory = open_engine) -> None:
    """Judge what the serving processes write to the inbox until `stop` is set."""
    async with Process(settings, "judge", engine_factory=engine_factory, claims_inbox=True) as process:
        samples = process.stores.samples
        policies = policy_directory(settings)
        follower = build_follower(settings, process.engine, policies, process.stores.versions)
        await follower.start()
        process.started(follower.aclose)
        judge = build_judge(settings, process.engine, process.renderer, process.model_name, samples, process.records,
                            policies)
        inbox = JudgeInbox(judge, judge.desk, samples)
        process.started(inbox.aclose)  # after the judge's own close: what it did not judge goes back
        process.started(judge.aclose)
        await StartupCheck(judge).start()
        log.info("judging the inbox as %s (%d at a time)", samples.worker, settings.judge.judge_concurrency)
        most = 2 * settings.judge.judge_concurrency  # claimed here at once: the rest is for other judges
        while not stop.is_set():
            try:
                await inbox.poll(most)
            except Exception:  # noqa: BLE001 - the database may be back next round
                log.exception("could not poll the judge's inbox")
            try:
                await asyncio.wait_for(stop.wait(), POLL_S)
            except asyncio.TimeoutError:
                pass


async def run_learner(settings: Settings, stop: asyncio.Event, engine_factory: EngineFactory = open_engine) -> None:
    """Train on the ready samples in the shared store and publish versions until `stop` is set."""
    # the embedded engine would be a second copy of the model for nothing: serving processes
    # load each version themselves
    async with Process(settings, "learn", engine_factory=engine_factory, renderer=False,
                       engine=settings.engine.engine != "local") as process:
        learner = build_learner(settings, process.model_dir, process.engine, process.stores.samples,
                                policy_directory(settings), process.records, process.stores.versions)
        await learner.start()
        process.started(learner.aclose)
        log.info("learning from the ready samples into %s", settings.adapters_dir)
        await stop.wait()


def run_until_signalled(work, settings: Settings) -> None:
    """Run `work(settings, stop)` until SIGINT or SIGTERM."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await work(settings, stop)

    asyncio.run(main())
