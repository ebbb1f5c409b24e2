"""The co-located learner: consumes ready samples, trains, publishes and hot-swaps adapters.

Training runs in a worker thread beside serving, or in a process of its own (`nextstate learn`,
nextstate/workers.py): then it loads each version into the engine servers the serving processes
share, if any, and otherwise only publishes it, for the serving processes to load from the
adapters folder (learner/follower.py). One learner at a time trains an adapters folder
(`AdapterVersions.hold_learner`). Every `batch_size` ready samples of a scope
give one update; the result is published as version N+1 on disk, loaded into the engine under
a new name, made current for new requests, and the previous version is unloaded once the
requests still using it finish (the engine defers the unload). Samples are marked consumed
only after their version is published, and each version's manifest names its samples, so a
crash at any point neither loses a sample nor trains one twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from nextstate.engine.base import AdapterServer, Engine
from nextstate.engine.devices import resolve_device
from nextstate.learner.batching import Waiting, choose_batch, ready_by_scope
from nextstate.learner.follower import load_version
from nextstate.learner.gate import PublishGate
from nextstate.learner.readings import Readings
from nextstate.learner.held_out import VersionFigures
from nextstate.learner.memory_budget import Refusal
from nextstate.learner.screening import NO_SIGNAL_IN_BATCH, NOT_FINITE, Screened, screen
from nextstate.core.activity import Activity
from nextstate.core.stores.versions import VersionRegistry
from nextstate.learner.step_result import StepResult
from nextstate.learner.trainer import LoraTrainer
from nextstate.learner.versions import AdapterVersions
from nextstate.core.policy import PolicyDirectory, PolicyRef
from nextstate.core.stores.samples import SampleStore
from nextstate.core.settings import LearnerSettings
from nextstate.core.types import Sample
from nextstate.core.records import RecordWriter

log = logging.getLogger(__name__)


# A step that did not fit in memory is tried again after this long (memory may have freed up:
# serving's KV cache shrinks, another process ends); its samples wait, ready, meanwhile.
MEMORY_RETRY_S = 300.0
# An update that was trained and not published (its KL did not fit at the line search's floor,
# or the publish gate refused every length) leaves its samples ready; the scope tries again
# after this long, doubled with each try of its oldest sample, at most UNPUBLISHED_RETRY_MAX_S.
# The next try starts shorter than anything the last one tried (learner/step_sizes.py), so it
# is not refused the same way again.
UNPUBLISHED_RETRY_S = 60.0
UNPUBLISHED_RETRY_MAX_S = 1800.0
# TRAINING.json is written again at most this often while training passes report progress.
PASSES_WRITE_S = 5.0

# Gives a training batch its final advantages (the judge's `prepare_batch`: outcome rewards
# are standardised per batch); the learner applies it without knowing the reward math.
BatchAdvantages = Callable[[list[Sample]], list[Sample]]


class Learner:
    def __init__(
        self,
        settings: LearnerSettings,
        model_dir: Path,
        adapters_dir: Path,
        engine: Engine | None,
        store: SampleStore,
        policies: PolicyDirectory,
        records: RecordWriter,
        prepare_batch: BatchAdvantages | None = None,
        registry: VersionRegistry | None = None,
        activity: Activity | None = None,
    ) -> None:
        self.settings = settings
        self.activity = activity  # this process's requests, which training makes way for
        self.prepare_batch = prepare_batch or (lambda samples: samples)
        self.registry = registry  # the shared database's pointer to each scope's serving version
        self.model_dir = model_dir
        self.engine = engine
        self.store = store
        self.policies = policies
        self.records = records
        self.versions = AdapterVersions(adapters_dir)
        self.trainer: LoraTrainer | None = None
        self.gate: PublishGate | None = None
        self.steps: list[dict[str, Any]] = []
        self.waiting: dict[str, Waiting] = {}  # per scope with ready samples and no batch: why
        self._step_index: dict[str, int] = {}  # updates tried per scope, published or skipped
        self._refused: dict[str, tuple[float, str, str]] = {}  # per scope: retry time, waiting reason, why
        self.training: dict[str, Any] | None = None  # the update running now: scope, samples, since, phase, passes
        self._passes_written = 0.0
        self._last_seconds: dict[str, float] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # one update or rollback at a time
        self._closing = False  # read by the read ahead's thread (`_read_ahead`)
        self._held: IO[str] | None = None  # the adapters folder's learner lock

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self._held = self.versions.hold_learner()  # raises LearnerRunning: one learner per folder
        self.trainer = await asyncio.to_thread(
            LoraTrainer, self.model_dir, self.settings, resolve_device(self.settings.learner_device)
        )
        if self.activity is not None and self.trainer.device == "cpu":  # a GPU learner takes no serving cores
            self.trainer.between_layers = self.activity.make_way
        self.gate = PublishGate(self.settings, self.store, Readings(self.trainer), self.policies.per_user)
        await self._resume()
        self._task = asyncio.create_task(self._run(), name="learner")

    async def aclose(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._held is not None:
            self._held.close()
            self._held = None

    def notify(self, sample: Sample) -> None:
        """Called for every stored sample; wakes the loop when one is ready to train."""
        if sample.status == "ready":
            self._wake.set()

    async def _resume(self) -> None:
        for scope in await asyncio.to_thread(self.versions.scopes):
            if unfinished := await asyncio.to_thread(self.versions.remove_unfinished, scope):
                log.warning("learner %s: removed %d version folder(s) a crash left half-written", scope, len(unfinished))
            if (adopted := await asyncio.to_thread(self.versions.adopt_latest, scope)) is not None:
                log.warning("learner %s: version %d was published just before a stop; it serves now", scope, adopted)
            version = self.versions.current(scope)
            if version is None:
                continue
            path = self.versions.path(scope, version)
            consumed = [i for v in self.versions.versions(scope) for i in self.versions.manifest(scope, v).get("sample_ids", [])]
            await asyncio.to_thread(self.store.mark_consumed, consumed)
            await asyncio.to_thread(self.trainer.load, scope, path)
            self._step_index[scope] = self.versions.manifest(scope, version).get("step_index", 0)
            await self._serve(scope, version, path)
            log.info("learner resumed scope %s at version %d", scope, version)
        # an engine that outlives nextstate (SGLang) may still hold versions it served before
        if isinstance(self.engine, AdapterServer):
            await self.engine.unload_leftovers(self.versions.root, set(self.engine.adapters))

    # ---------------------------------------------------------------- the loop

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=5.0)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                if self.registry is not None:
                    await self._forget_asked()
                while await self.train_ready():
                    pass
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the learner must outlive a failed update
                log.exception("learner update failed")

    async def train_ready(self) -> bool:
        """Run one update if some scope has a full batch; True if one ran. With none, read ahead
        for the batches that are filling."""
        scope, batch = await asyncio.to_thread(self._next_batch)
        if not batch:
            async with self._lock:  # the trainer is one update's, a rollback's or a forget's at a time
                with self._computing():
                    await asyncio.to_thread(self._read_ahead)
            return False
        with self._computing():
            await self.update(scope, batch)
        return True

    def _computing(self) -> contextlib.AbstractContextManager:
        """Beside serving on the same CPU, the engine's background work holds back while this
        runs (`Activity.learning`): the version a person waits for takes the cores first. A GPU
        learner takes none of them."""
        on_cpu = self.trainer is not None and self.trainer.device == "cpu"
        return self.activity.learning() if self.activity is not None and on_cpu else contextlib.nullcontext()

    def _read_ahead(self) -> None:
        """The base model's side of the ready samples' distillation targets, and of a new
        scope's gate check, read while their batch fills (`LoraTrainer.read_ahead`,
        `PublishGate.read_ahead`): the update after a person's last rating then starts from its
        policy passes. Each scope's next batch (its oldest ready samples), at most, a sample or a
        prompt at a time: a closing learner, or a new ready sample, stops it between two (its
        thread cannot be cancelled, and a last rating that came while the gate's replies were read
        ahead waited for all of them). What is left is read by the update, or by the next read-ahead."""
        if self.trainer is None:
            return

        def stop() -> bool:  # closing, or a new sample that may fill a batch: the update goes first
            return self._closing or self._wake.is_set()

        for scope, samples, _ in ready_by_scope(self.store, self.settings, self.policies.per_user):
            batch = samples[: self.settings.batch_size]
            for sample in batch:
                if stop():
                    return
                if self.trainer.read_ahead([sample]):
                    log.debug("learner %s: read ahead the base model's side of sample %s", scope, sample.id)
            if self.gate and (answered := self.gate.read_ahead(scope, batch, stop)):
                log.debug("learner %s: read ahead the gate's base replies to %d prompt(s)", scope, answered)

    def _next_batch(self) -> tuple[str, list[Sample]]:
        """The first scope with a batch to train (learner/batching.py), oldest samples first;
        what every other scope with ready samples waits for is kept in `waiting`."""
        self._screen(self.store.ready_samples(self.settings.batch_size * 50))  # what it drops leaves the store's ready set
        waiting: dict[str, Waiting] = {}
        found: tuple[str, list[Sample]] = ("", [])
        now = time.monotonic()
        for scope, samples, training in ready_by_scope(self.store, self.settings, self.policies.per_user):
            choice = choose_batch(scope, samples, self.settings, training)
            retry_at, reason, why = self._refused.get(scope, (0.0, "", ""))
            if choice and not isinstance(choice, Waiting) and now < retry_at:
                detail = f"{why}; tried again in {retry_at - now:.0f} s"
                choice = Waiting(scope, reason, detail, len(samples))
            if isinstance(choice, Waiting):
                waiting[scope] = choice
            elif choice and not found[1]:
                found = (scope, choice)
        self.waiting = waiting
        return found

    def _screen(self, samples: list[Sample], batch: bool = False) -> Screened:
        """Drop, with the reason, the samples that must not train (learner/screening.py): ready
        ones before they take a batch slot, and a `batch` again once it has its final advantages."""
        screened = screen(samples, self.settings,
                          lambda x: self.policies.current(x.user).version - x.policy_version, batch)
        for why, ids in screened.dropped.items():
            if ids:
                self.store.mark_dropped(ids, why)
                log.log(logging.WARNING if why == NOT_FINITE else logging.INFO,
                        "learner: %d sample(s) dropped %s (%s)", len(ids), "from a batch" if batch else "before training", why)
        return screened

    async def update(self, scope: str, samples: list[Sample]) -> StepResult | None:
        """One update of `scope` on `samples`: screen → step (its KL line search) → gate →
        publish, or, when no length of the step may serve, its samples back to ready."""
        async with self._lock:
            try:
                return await self._update(scope, samples)
            finally:
                self.training = None
                await asyncio.to_thread(self.versions.write_training, None)

    def _phase(self, scope: str, samples: int, phase: str) -> None:
        """What the update does now, for the progress report (live, and `nextstate status`)."""
        since = self.training["since"] if self.training else time.time()
        # the last update's seconds by phase: what the progress report estimates the rest from
        self.training = {"scope": scope, "samples": samples, "since": since, "phase": phase,
                         "phase_since": time.time(), "last_seconds": dict(self._last_seconds)}
        try:
            self.versions.write_training(self.training)  # a few hundred bytes, once per phase
        except OSError:
            log.warning("learner: could not write TRAINING.json (status will not show the update running)")

    def _passes(self, done: int, total: int) -> None:
        """The trainer's thread reports each training pass: the live report shows it at once,
        TRAINING.json (for `nextstate status` from the data dir) every few seconds."""
        training = self.training
        if training is None:
            return
        training["passes"] = [done, total]
        now = time.monotonic()
        if done == total or now - self._passes_written >= PASSES_WRITE_S:
            self._passes_written = now
            with contextlib.suppress(OSError):
                self.versions.write_training(training)

    async def _update(self, scope: str, samples: list[Sample]) -> StepResult | None:
        current = self.policies.current_scope(scope)
        step_index = self._step_index[scope] = self._step_index.get(scope, 0) + 1
        record: dict[str, Any] = {"step": step_index, "scope": scope, "sample_ids": [x.id for x in samples],
                                  "tries_before": max((x.tries for x in samples), default=0)}
        self._phase(scope, len(samples), "preparing")
        screened = await asyncio.to_thread(self._screen, self.prepare_batch(samples), True)
        record["dropped"] = screened.ids(NO_SIGNAL_IN_BATCH)
        batch = screened.kept
        if not batch:  # nothing in it could teach: its samples dropped, nothing published
            record.update(version=None, published=False, skipped=NO_SIGNAL_IN_BATCH)
            self._finish(record, current.version)
            return None
        plan = await asyncio.to_thread(self.trainer.memory_plan, batch)
        if isinstance(plan, Refusal):  # before the gate's passes: they cost memory too
            return self._not_started(record, StepResult.not_started(scope, batch, plan), current.version)
        if self.gate:  # minutes on a CPU when the prompts are an agent's: say so, not "preparing"
            self._phase(scope, len(batch), "scoring the serving version for the gate")
        mark = time.monotonic()
        held = await asyncio.to_thread(self.gate.hold_out, scope, batch) if self.gate else None
        phase_seconds = record["phase_seconds"] = {"gate_serving": round(time.monotonic() - mark, 2)}
        self._phase(scope, len(batch), "training")
        result = await asyncio.to_thread(self.trainer.step, scope, batch, self._passes)
        if result.refused:
            return self._not_started(record, result, current.version)
        self._refused.pop(scope, None)
        ids = [x.id for x in batch if x.id is not None and x.id not in result.dropped]
        if result.dropped:
            await asyncio.to_thread(self.store.mark_dropped, result.dropped, "loss not finite: dropped by the learner")
        record.update({**result.to_dict(), "sample_ids": ids, "dropped": record["dropped"] + result.dropped})
        phase_seconds["training"] = round(result.seconds, 2)
        scale = trained = result.step_scale  # the gate may shorten it further
        figures: VersionFigures | None = None
        if not result.skipped and held:
            self._phase(scope, len(batch), "gate")
            mark = time.monotonic()
            verdict = await asyncio.to_thread(self.gate.review, scope, held, step_index)
            phase_seconds["gate"] = round(time.monotonic() - mark, 2)
            record["gate"] = verdict.to_dict()
            scale *= verdict.step_scale
            figures = verdict.candidate.version if verdict.candidate else None
            if not verdict.passed:
                result.skipped = record["skipped"] = "gate: " + "; ".join(verdict.reasons)
        if not result.skipped and figures is None and self.gate is not None:  # the gate is off, or had nothing else to check
            figures = await asyncio.to_thread(self.gate.readings.version_figures, scope, self.gate.held_out_turns(scope))
        if figures is not None:
            record["figures"] = figures.to_dict()  # what this version gained for its user, and forgot
        result.step_scale = record["step_scale"] = round(scale, 6)  # what serves, if it does: in the manifest too
        # the KL at the length that serves (or was tried last): by the line search's quadratic
        # model, the trainer's measured KL times the square of the gate's own shortening
        kl = result.policy_kl * (scale / trained) ** 2
        self.trainer.step_sizes.settle(scope, scale, kl, published=not result.skipped)
        if result.skipped:
            await self._return(scope, ids, record, result.skipped)
        else:
            self._phase(scope, len(batch), "publishing")
            await self._publish(scope, step_index, ids, result, record)
        self._last_seconds = dict(phase_seconds)
        self._finish(record, record["version"] or current.version)
        return result

    async def _return(self, scope: str, ids: list[int], record: dict[str, Any], why: str) -> None:
        """An update that may not serve at any length: undone (the trainer or the gate did), its
        samples ready again with the reason and one try more, the scope waiting a while."""
        tries = record["tries_before"] + 1
        await asyncio.to_thread(self.store.mark_returned, ids, f"not published (try {tries}): {why}")
        delay = min(UNPUBLISHED_RETRY_MAX_S, UNPUBLISHED_RETRY_S * 2 ** (tries - 1))
        start = self.trainer.step_sizes.start(scope)
        self._refused[scope] = (time.monotonic() + delay, "unpublished",
                                f"update {record['step']} was not published ({why}); its {len(ids)} samples wait, "
                                f"ready, and the next try starts at {start:.3g} of a step")
        record.update(version=None, published=False, returned=len(ids))
        log.warning("learner step %d (%s) not published, its %d samples ready again (try %d): %s",
                    record["step"], scope, len(ids), tries, why)

    def _not_started(self, record: dict[str, Any], result: StepResult, version: int) -> StepResult:
        """A step that would not fit in memory: recorded, nothing trained, its samples left
        ready; the scope waits MEMORY_RETRY_S before it is tried again."""
        record.update(result.to_dict(), version=None, published=False)
        self._refused[result.scope] = (time.monotonic() + MEMORY_RETRY_S, "memory", result.skipped or "")
        log.warning("learner step %d (%s) not started: %s", record["step"], result.scope, result.skipped)
        self._finish(record, version)
        return result

    async def _publish(self, scope: str, step_index: int, ids: list[int], result: StepResult, record: dict[str, Any]) -> None:
        """Write the trained step as the scope's next version, mark its samples consumed, serve it."""
        version = await asyncio.to_thread(self.versions.next_version, scope)
        finished = time.monotonic()
        try:
            path = await asyncio.to_thread(
                self.versions.publish, scope, version, lambda p: self.trainer.save(scope, p),
                {"sample_ids": ids, "step_index": step_index, "step": result.to_dict(), "figures": record.get("figures")},
            )
        except Exception:
            # the samples stay ready, and the weights go back to the published version
            self.trainer.undo(scope)
            self._step_index[scope] -= 1
            raise
        await asyncio.to_thread(self.store.mark_consumed, ids)
        swap_s = await self._serve(scope, version, path)
        record.update(version=version, published=True, publish_to_serving_s=round(time.monotonic() - finished, 4), swap_s=swap_s)
        log.info(
            "learner step %d (%s) -> v%d: %d samples, loss %.4f, clip %.3f, kl %.4g, mismatch %.4f, "
            "mean adv %.3f, %.1fs, swap %.0f ms",
            step_index, scope, version, result.samples, result.loss, result.clip_fraction, result.policy_kl,
            result.mismatch, result.mean_advantage, result.seconds, swap_s * 1000,
        )

    def _finish(self, record: dict[str, Any], version: int) -> None:
        self.steps.append(record)
        self.records.write("train_step", record, version=version)

    async def _serve(self, scope: str, version: int, path: Path) -> float:
        """Load `path` as the scope's new adapter and move new requests to it."""
        started = time.monotonic()
        name = await asyncio.to_thread(self.versions.serving_name, scope, version)
        old = self.policies.current_scope(scope)
        if self.engine is not None and name not in self.engine.adapters:
            await load_version(self.engine, name, str(path))  # a follower elsewhere may be loading it too
        self.policies.publish(scope, PolicyRef(version=version, adapter=name))
        if self.registry is not None:  # loaded on every engine worker: the followers may serve it
            await asyncio.to_thread(self.registry.publish, scope, version, name, str(path))
        swap_s = time.monotonic() - started
        if old.adapter and old.adapter != name and self.engine is not None:
            # Requests still decoding on the old version finish on it; the engine unloads it after.
            asyncio.create_task(self._unload(old.adapter))
        return round(swap_s, 4)

    async def _unload(self, name: str) -> None:
        try:
            await self.engine.unload_adapter(name)
        except Exception:  # noqa: BLE001
            log.exception("could not unload adapter %s", name)

    # ---------------------------------------------------------------- admin

    async def adapters(self) -> list[dict[str, Any]]:
        """Each scope's published versions and the one serving."""
        data = []
        for scope in await asyncio.to_thread(self.versions.scopes):
            current = self.policies.current_scope(scope)
            data.append({"scope": scope, "versions": self.versions.versions(scope), "serving": current.version,
                         "adapter": current.adapter})
        return data

    async def forget(self, user: str) -> bool:
        """Delete `user`'s own adapter (per-user scope): served the base model again, every
        version deleted. In the shared scope nothing is theirs alone; returns False."""
        if not self.policies.per_user:
            return False
        async with self._lock:
            old = self.policies.forget(user)
            if old is not None and old.adapter:
                await self._unload(old.adapter)
            await asyncio.to_thread(self.trainer.drop_scope, user)
            await asyncio.to_thread(shutil.rmtree, self.versions.scope_root(user), True)
            self._step_index.pop(user, None)
            if self.registry is not None:  # a version published while it was asked goes too
                await asyncio.to_thread(self.registry.forget, user)
                await asyncio.to_thread(self.registry.forgot, user)
            return True

    async def _forget_asked(self) -> None:
        """Forget the users another process was asked to forget (VersionRegistry.forget)."""
        for scope in await asyncio.to_thread(self.registry.forgotten):
            await self.forget(scope)
            await asyncio.to_thread(self.registry.forgot, scope)  # (the shared scope: nothing was theirs)
            log.info("learner: forgot the adapter of %s, as asked", scope)

    async def rollback(self, scope: str, version: int) -> int:
        """Serve (and train on from) an earlier version, published as a new version."""
        async with self._lock:
            if version not in self.versions.versions(scope):
                raise KeyError(version)
            source = self.versions.path(scope, version)
            new_version = self.versions.next_version(scope)

            def copy(dest: Path) -> None:
                for item in source.iterdir():
                    if item.name != "manifest.json":
                        shutil.copy2(item, dest / item.name)

            path = await asyncio.to_thread(self.versions.publish, scope, new_version, copy, {"rollback_of": version, "sample_ids": []})
            await asyncio.to_thread(self.trainer.load, scope, path)
            await self._serve(scope, new_version, path)
            self.records.write("rollback", {"scope": scope, "to": version, "version": new_version}, version=new_version)
            log.info("learner %s rolled back to v%d as v%d", scope, version, new_version)
            return new_version
