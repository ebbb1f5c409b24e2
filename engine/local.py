"""The embedded engine: a transformers (+ peft) model decoded in-process with a KV cache.

One worker thread owns the model. Every generation, score and adapter change is a job on its
queue, so nothing ever touches the model concurrently (no interleaving corruption) and the
asyncio loop never blocks on a forward pass. Each round of the worker loop takes new jobs,
lets the `Scheduler` pick who runs (users first, background work in short steps), and has the
`ModelRunner` advance them: every decoding generation by one token in one batched forward
pass (whatever its adapter), each prompt still being prefilled by one pass of its own. Concurrent
streams thus all make progress, and a long generation cannot starve a short one.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import torch

from nextstate.engine.base import EngineError, GeneratedToken, SamplingParams, UnknownAdapterError, check_request
from nextstate.engine.model_runner import ModelRunner
from nextstate.engine.sampling import make_generator
from nextstate.engine.scheduler import BACKGROUND_CHUNK, BACKGROUND_IDLE_GAP_S, Call, Job, Scheduler

__all__ = ["BACKGROUND_CHUNK", "LocalEngine"]

log = logging.getLogger(__name__)


class LocalEngine:
    """In-process engine. Construct with `await LocalEngine.open(...)`; loading takes seconds."""

    def __init__(
        self, model_dir: str | Path, *, device: str = "auto", dtype: str = "float32", max_active: int = 8,
        kv_cache_mb: int = 2048, batching: bool = True, gguf: str | Path | None = None,
    ):
        """`gguf`: serve on llama.cpp from this file (the float16 copy of `model_dir`,
        `modelio.gguf_model`); None: on transformers, at `dtype` on `device`."""
        self.model_dir = Path(model_dir)
        if gguf is not None:
            from nextstate.engine.llama_cpp_runner import LlamaCppRunner

            self.runner = LlamaCppRunner(self.model_dir, Path(gguf), kv_cache_mb=kv_cache_mb, batching=batching)
        else:
            self.runner = ModelRunner(self.model_dir, device=device, dtype=dtype, kv_cache_mb=kv_cache_mb, batching=batching)
        self.info = self.runner.info
        self.device = self.runner.device
        self._scheduler = Scheduler(max_active)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="nextstate-engine", daemon=True)
        self._thread.start()
        # Forced tool calls need the tokenizer indexed for grammars (~0.35 s); do it now, aside.
        threading.Thread(target=self._warm_constraints, name="nextstate-grammar-warmup", daemon=True).start()

    def _warm_constraints(self) -> None:
        try:
            self.runner.constraints.warm()
        except Exception:  # noqa: BLE001 - the first forced call will try again and report it
            log.warning("could not prepare constrained decoding", exc_info=True)

    @classmethod
    async def open(cls, model_dir: str | Path, **kwargs: Any) -> LocalEngine:
        return await asyncio.to_thread(cls, model_dir, **kwargs)

    # ---------------------------------------------------------------- public, async API

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        adapter: str | None = None,
        background: bool = False,
        on_admit: Callable[[], None] | None = None,
    ) -> AsyncIterator[GeneratedToken]:
        check_request(self.runner.adapters.names, adapter, input_ids)
        if sampling.max_new_tokens < 1:
            raise EngineError("max_new_tokens must be at least 1")
        job = Job(
            input_ids=list(input_ids),
            sampling=sampling,
            adapter=adapter,
            loop=asyncio.get_running_loop(),
            out=asyncio.Queue(),
            generator=make_generator(sampling.seed, self.device),
            background=background,
        )
        self._jobs.put(job)
        if on_admit is not None:
            on_admit()
        try:
            while True:
                item = await job.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            job.cancelled.set()

    async def score(
        self,
        input_ids: list[int],
        start: int,
        adapter: str | None = None,
        temperature: float = 1.0,
        background: bool = False,
    ) -> list[float]:
        check_request(self.runner.adapters.names, adapter, input_ids, start)
        ids = list(input_ids)
        if not background:
            return await self._call(lambda: self.runner.score(ids, start, adapter, temperature))
        # In the background it is scheduled like a background generation: chunked, yielding
        # to user requests, and holding its adapter against unloads until it finishes.
        job = Job(
            input_ids=ids, sampling=SamplingParams(max_new_tokens=1), adapter=adapter, loop=asyncio.get_running_loop(),
            out=asyncio.Queue(), background=True, score_from=start, score_temperature=temperature,
        )
        self._jobs.put(job)
        try:
            item = await job.out.get()
        finally:
            job.cancelled.set()
        if isinstance(item, BaseException):
            raise item
        return item

    async def load_adapter(self, name: str, path: str) -> None:
        files = await asyncio.to_thread(self.runner.read_adapter, Path(path))  # disk I/O off the model thread
        await self._call(lambda: self.runner.load_adapter(name, str(path), files))

    async def unload_adapter(self, name: str) -> None:
        if name not in self.runner.adapters:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded")
        await self._call(lambda: self.runner.unload_adapter(name), waits_for_adapter=name)

    @property
    def adapters(self) -> list[str]:
        return self.runner.adapters.names

    def hold_background(self, held: Callable[[], bool]) -> None:
        self._scheduler.held = held

    async def close(self) -> None:
        self._stopping = True
        self._jobs.put(None)
        await asyncio.to_thread(self._thread.join, 30)
        if not self._thread.is_alive():
            self.runner.close()

    async def _call(self, fn: Callable[[], Any], waits_for_adapter: str | None = None) -> Any:
        loop = asyncio.get_running_loop()
        call = Call(fn=fn, loop=loop, future=loop.create_future(), waits_for_adapter=waits_for_adapter)
        self._jobs.put(call)
        return await call.future

    # ---------------------------------------------------------------- worker thread

    def _run(self) -> None:
        scheduler = self._scheduler
        with torch.inference_mode():
            while not self._stopping:
                self._take_jobs(block=scheduler.idle)
                scheduler.admit()
                runnable = scheduler.runnable()
                self._advance(runnable)
                for call in scheduler.due_calls():
                    self._execute(call)
                if not runnable and scheduler.active:
                    # Background work is holding off right after a user request: wait for the
                    # gap to pass, or for new work, without spinning.
                    self._take_jobs(block=True, timeout=BACKGROUND_IDLE_GAP_S)
        jobs, calls = scheduler.drain()
        for job in jobs:
            job.deliver(EngineError("engine is shutting down"))
        for call in calls:
            call.resolve(error=EngineError("engine is shutting down"))

    def _take_jobs(self, block: bool, timeout: float | None = None) -> None:
        try:
            item = self._jobs.get(block=block, timeout=timeout if block else 0)
        except queue.Empty:
            return
        while True:
            if item is None:
                self._stopping = True
            elif isinstance(item, Job):
                self._scheduler.add(item)
            elif item.waits_for_adapter is not None:
                self._scheduler.defer(item)
            else:
                self._execute(item)
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return

    @staticmethod
    def _execute(call: Call) -> None:
        try:
            result = call.fn()
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            call.resolve(error=exc if isinstance(exc, EngineError) else EngineError(str(exc)))
        else:
            call.resolve(result=result)

    def _advance(self, runnable: list[Job]) -> None:
        """One forward pass per decode batch with a picked job in it (all its rows advance),
        then one per picked job still prefilling; a job whose first token comes out here
        joins its batch for the next round."""
        batches, alone = [], []
        for job in runnable:
            if job.cancelled.is_set():
                self._finish(job)
            elif job.batch is None:
                alone.append(job)
            elif job.batch not in batches:
                batches.append(job.batch)
        for batch in batches:
            for job in [job for job in batch.rows if job.cancelled.is_set()]:
                self._finish(job)
            if not batch.rows:
                continue
            rows = list(batch.rows)
            try:
                finished = self.runner.step_batch(batch)
            except Exception as exc:  # noqa: BLE001 - a failing step must not kill the worker
                log.exception("generation failed")
                for job in rows:
                    job.deliver(EngineError(f"generation failed: {exc}"))
                    self._finish(job, keep=False)
                continue
            for job in finished:
                self._finish(job)
        for job in alone:
            self._step(job)

    def _step(self, job: Job) -> None:
        keep = True
        try:
            done = self.runner.step(job)
        except EngineError as exc:  # refused (a schema that cannot be compiled): the caller's fault
            job.deliver(exc)
            done = True
        except Exception as exc:  # noqa: BLE001 - a failing request must not kill the worker
            log.exception("generation failed")
            job.deliver(EngineError(f"generation failed: {exc}"))
            done, keep = True, False
        if done:
            self._finish(job, keep)

    def _finish(self, job: Job, keep: bool = True) -> None:
        try:
            self.runner.release(job, keep)
        except Exception:  # noqa: BLE001 - keeping a cache is an optimisation; serving goes on
            log.exception("could not keep a finished sequence's cache")
            job.batch = None
        self._scheduler.finish(job)
