"""The judge's start-up check, run beside serving without getting in its way.

A judge is checked on the bundled calibration cases (judge/calibration.py) before it scores
any turn. Asking them costs minutes on a slow judge, and after a restart that cost came beside
the first user request (152 s to its first token, the cases timing out): so the last verdict
stands when nothing it depends on changed — the same judge, cases, prompt and voting settings
(`calibration_key`) — and when the cases are asked, each waits for a gap between users'
requests. A check whose every vote failed (time-outs, errors) concludes but is not kept: it
said nothing about the judge, and the next start asks again.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nextstate.judge.calibration import (
    CALIBRATION_FILE, CALIBRATION_PROMPT, Calibration, calibration_key, case_values, conclude, judge_case, load_cases,
)
from nextstate.judge.service import Judge

log = logging.getLogger(__name__)
META_KEY = "judge_calibration"


class StartupCheck:
    def __init__(self, judge: Judge) -> None:
        self.judge = judge
        self.settings = judge.settings
        self.prompts = judge.prompts

    async def start(self) -> None:
        """Settle the judge's standing: skipped, the last verdict kept, or asked in the background."""
        judge = self.judge
        if not self.settings.judge_enabled or not self.settings.judge_calibration:
            why = "judging is off (NEXTSTATE_JUDGE_ENABLED=false)" if not self.settings.judge_enabled else (
                "not checked (NEXTSTATE_JUDGE_CALIBRATION=false)")
            judge.conclude(Calibration("skipped", why))
            await self._remember()
            return
        if (known := await self._known()) is not None:
            judge.conclude(known)
            log.info("judge: %s (the verdict of %s stands: same judge, cases and prompt)", known.detail,
                     time.strftime("%Y-%m-%d %H:%M", time.localtime(known.checked_at or 0)))
            return
        judge.checking = judge.desk.spawn(self.ask())

    def key(self) -> str | None:
        if not (self.prompts.directory / CALIBRATION_FILE).is_file():
            return None
        s = self.settings
        return calibration_key(
            self.judge.client.identity, self.prompts.directory, [self.prompts.source(CALIBRATION_PROMPT)],
            {"votes": s.prm_votes, "temperature": s.judge_temperature, "max_tokens": s.judge_max_tokens,
             "max_chars": s.judge_max_chars},
        )

    async def _known(self) -> Calibration | None:
        """The verdict a previous start reached on exactly this check, if there is one."""
        try:
            key = self.key()
            stored = await asyncio.to_thread(self.judge.store.get_meta, META_KEY)
        except Exception:  # noqa: BLE001 - then the check is simply asked again
            log.warning("could not read the judge's last calibration", exc_info=True)
            return None
        if key is None or not stored or stored.get("key") != key or stored.get("state") not in ("passed", "failed"):
            return None
        return Calibration.from_dict(stored)

    async def ask(self) -> Calibration:
        """Ask the judge the calibration cases; implicit judging waits for the verdict."""
        judge, started = self.judge, time.monotonic()
        calibration, stopped = Calibration("skipped", "not asked"), False
        try:
            if not (self.prompts.directory / CALIBRATION_FILE).is_file():
                calibration = Calibration("skipped", f"no {CALIBRATION_FILE} in {self.prompts.directory}")
                return calibration
            cases = load_cases(self.prompts.directory)
            key = self.key()
            log.info("judge: checking it on %d calibration cases before it scores any turn", len(cases))
            results = []
            for case in cases:  # one case at a time: the first one wrong settles it, at a quarter of the cost
                await judge.quiet()  # users first: the check runs in the gaps between their requests
                votes = await judge.votes(CALIBRATION_PROMPT, case_values(case, self.settings.judge_max_chars), (1, 0, -1))
                results.append(judge_case(case, [v.score for v in votes]))
                if not results[-1].passed:
                    break
            calibration = conclude(results, time.monotonic() - started, asked_of=len(cases))
            if any(v is not None for r in results for v in r.votes):
                calibration.key = key
            if calibration.state != "failed":
                log.info("judge: %s (%.1f s)", calibration.detail, calibration.seconds)
            judge.records.write("judge_calibration", calibration.to_dict())
            return calibration
        except asyncio.CancelledError:
            # the server stops: no verdict, none kept, and what waits for one stays pending
            log.info("judge: the start-up check stopped with the server; the next start asks it again")
            stopped = True
            raise
        except Exception as exc:  # noqa: BLE001 - a check that cannot run leaves the judge as configured
            log.warning("judge: the calibration could not run (%s: %s); judging goes on unchecked", type(exc).__name__, exc)
            calibration = Calibration("skipped", f"could not run: {type(exc).__name__}: {exc}")
            return calibration
        finally:
            if not stopped:
                judge.conclude(calibration)
                await self._remember()

    async def _remember(self) -> None:
        try:  # for `nextstate status`, which reads the data dir, and for the next start
            await asyncio.to_thread(self.judge.store.set_meta, META_KEY, self.judge.calibration.to_dict())
        except Exception:  # noqa: BLE001 - a fact for display, not worth failing anything
            log.warning("could not keep the judge's calibration in the sample store", exc_info=True)
