"""The co-located learner: consumes ready samples, trains, publishes and hot-swaps adapters.

Training runs in a worker thread beside serving. Every `batch_size` ready samples of a scope
give one update; the result is published as version N+1 on disk, loaded into the engine under
a new name, made current for new requests, and the previous version is unloaded once the
requests still using it finish (the engine defers the unload). Samples are marked consumed
only after their version is published, and each version's manifest names its samples, so a
crash at any point neither loses a sample nor trains one twice.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from engine.base import Engine
from judge.advantages import standardize_outcome_batch
from learner.trainer import LoraTrainer, StepResult, TrainConfig
from learner.versions import AdapterVersions, scope_dir_name
from nextstate.policy import PolicyDirectory, PolicyRef
from nextstate.sample_store import SampleStore
from nextstate.settings import Settings
from nextstate.types import Sample
from proxy.records import RecordWriter

log = logging.getLogger(__name__)


def train_config(s: Settings) -> TrainConfig:
    return TrainConfig(
        lr=s.lr, kl_coef=s.kl_coef, max_kl=s.max_kl, ppo_epochs=s.ppo_epochs,
        minibatch_size=s.minibatch_size or s.batch_size, lora_r=s.lora_r, lora_alpha=s.lora_alpha,
        target_modules=tuple(m.strip() for m in s.lora_target_modules.split(",") if m.strip()),
    )


class Learner:
    def __init__(
        self,
        settings: Settings,
        model_dir: Path,
        engine: Engine,
        store: SampleStore,
        policies: PolicyDirectory,
        records: RecordWriter,
    ) -> None:
        self.settings = settings
        self.model_dir = model_dir
        self.engine = engine
        self.store = store
        self.policies = policies
        self.records = records
        self.versions = AdapterVersions(settings.adapters_dir)
        self.batch_size = settings.batch_size
        self.trainer: LoraTrainer | None = None
        self.steps: list[dict[str, Any]] = []
        self._step_index: dict[str, int] = {}  # updates tried per scope, published or skipped
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # one update or rollback at a time

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self.trainer = await asyncio.to_thread(
            LoraTrainer, self.model_dir, train_config(self.settings), self.settings.learner_device_resolved
        )
        await self._resume()
        self._task = asyncio.create_task(self._run(), name="learner")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def notify(self, sample: Sample) -> None:
        """Called for every stored sample; wakes the loop when one is ready to train."""
        if sample.status == "ready":
            self._wake.set()

    async def _resume(self) -> None:
        for scope in await asyncio.to_thread(self.versions.scopes):
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

    # ---------------------------------------------------------------- the loop

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=5.0)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                while await self.train_ready():
                    pass
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the learner must outlive a failed update
                log.exception("learner update failed")

    async def train_ready(self) -> bool:
        """Run one update if some scope has a full batch; True if one ran."""
        user = None
        if self.policies.per_user:
            counts = await asyncio.to_thread(self.store.ready_counts_by_user)
            user = next((u for u, n in counts.items() if n >= self.batch_size), None)
            if user is None:
                return False
        batch = await asyncio.to_thread(self.store.ready_samples, self.batch_size, user)
        if len(batch) < self.batch_size:
            return False
        await self.update(user if user is not None else "shared", batch)
        return True

    async def update(self, scope: str, samples: list[Sample]) -> StepResult:
        async with self._lock:
            s = self.settings
            batch = standardize_outcome_batch(samples, s.w_binary, s.w_opd, s.opd_clip)
            result = await asyncio.to_thread(self.trainer.step, scope, batch)
            ids = [x.id for x in samples if x.id is not None]
            current = self.policies.current_scope(scope)
            step_index = self._step_index[scope] = self._step_index.get(scope, 0) + 1
            record = {"step": step_index, "scope": scope, "sample_ids": ids, **result.to_dict()}
            if result.skipped:
                await asyncio.to_thread(self.store.mark_consumed, ids)
                record.update(version=None, published=False)
                log.warning("learner step %d (%s) skipped, not published: %s", step_index, scope, result.skipped)
            else:
                version = max(current.version, self.versions.current(scope) or 0) + 1
                finished = time.monotonic()
                path = await asyncio.to_thread(
                    self.versions.publish, scope, version, lambda p: self.trainer.save(scope, p),
                    {"sample_ids": ids, "step_index": step_index, "step": result.to_dict()},
                )
                await asyncio.to_thread(self.store.mark_consumed, ids)
                swap_s = await self._serve(scope, version, path)
                record.update(version=version, published=True, publish_to_serving_s=round(time.monotonic() - finished, 4), swap_s=swap_s)
                log.info(
                    "learner step %d (%s) -> v%d: %d samples, loss %.4f, clip %.3f, kl %.4g, mismatch %.4f, "
                    "mean adv %.3f, %.1fs, swap %.0f ms",
                    step_index, scope, version, result.samples, result.loss, result.clip_fraction, result.policy_kl,
                    result.mismatch, result.mean_advantage, result.seconds, swap_s * 1000,
                )
            self.steps.append(record)
            self.records.write("train_step", record, version=record["version"] or current.version)
            return result

    async def _serve(self, scope: str, version: int, path: Path) -> float:
        """Load `path` as the scope's new adapter and move new requests to it."""
        started = time.monotonic()
        name = f"{scope_dir_name(scope)}-v{version}"
        old = self.policies.current_scope(scope)
        if name not in getattr(self.engine, "adapters", []):
            await self.engine.load_adapter(name, str(path))
        self.policies.publish(scope, PolicyRef(version=version, adapter=name))
        swap_s = time.monotonic() - started
        if old.adapter and old.adapter != name:
            # Requests still decoding on the old version finish on it; the engine unloads it after.
            asyncio.create_task(self._unload(old.adapter))
        return round(swap_s, 4)

    async def _unload(self, name: str) -> None:
        try:
            await self.engine.unload_adapter(name)
        except Exception:  # noqa: BLE001
            log.exception("could not unload adapter %s", name)

    # ---------------------------------------------------------------- admin

    async def rollback(self, scope: str, version: int) -> int:
        """Serve (and train on from) an earlier version, published as a new version."""
        async with self._lock:
            if version not in self.versions.versions(scope):
                raise KeyError(version)
            source = self.versions.path(scope, version)
            new_version = max(self.policies.current_scope(scope).version, self.versions.current(scope) or 0) + 1

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
