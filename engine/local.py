"""The embedded engine: a transformers (+ peft) model decoded in-process with a KV cache.

One worker thread owns the model. Every generation, score and adapter change is a job on its
queue, so nothing ever touches the model concurrently (no interleaving corruption) and the
asyncio loop never blocks on a forward pass. Active generations are decoded round-robin, one
token each per turn of the loop, so concurrent streams all make progress and a long
generation cannot starve a short one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import re
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.base import EngineError, EngineInfo, GeneratedToken, SamplingParams, UnknownAdapterError, check_request
from engine.sampling import make_generator, sample_token

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Background work (the in-process judge) runs only while no user request is decoding; while
# users keep it busy, one background step runs per this many seconds, so it never starves.
BACKGROUND_MAX_WAIT_S = 1.0
# Background prompts are fed this many tokens per step, so a long judge prompt never holds
# the model for more than a short step while a user request waits.
BACKGROUND_CHUNK = 32
# ... and starts only after no user request has decoded for this long.
BACKGROUND_IDLE_GAP_S = 0.1


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


MAX_FREE_SLOTS = 2
_LORA_KEY = re.compile(r"\.(lora_[AB])\.weight$")


@dataclass(frozen=True)
class _Slot:
    slot: str
    signature: tuple
    path: str


@dataclass(frozen=True)
class _AdapterFiles:
    signature: tuple  # what must match for a version's tensors to fit a slot
    tensors: dict

    @classmethod
    def read(cls, path: Path) -> _AdapterFiles:
        from safetensors.torch import load_file

        config = json.loads((path / "adapter_config.json").read_text())
        targets = config.get("target_modules")
        signature = (
            config.get("peft_type"), config.get("r"), config.get("lora_alpha"),
            tuple(sorted(targets)) if isinstance(targets, list) else targets,
            config.get("use_rslora", False), config.get("use_dora", False), config.get("bias", "none"),
            tuple(config.get("modules_to_save") or ()),
        )
        weights = path / "adapter_model.safetensors"
        return cls(signature, load_file(str(weights)) if weights.is_file() else {})


@dataclass(eq=False)
class _Generation:
    input_ids: list[int]
    sampling: SamplingParams
    adapter: str | None
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    background: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)
    generator: torch.Generator | None = None
    cache: Any = None
    last_token: int | None = None
    produced: int = 0
    fed: int = 0  # prompt tokens already through the model
    # A scoring job (the judge's teacher pass): logprobs of input_ids[score_from:], no sampling.
    score_from: int | None = None
    score_temperature: float = 1.0
    scores: list[float] = field(default_factory=list)
    last_step: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _Call:
    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    # Adapter unloads wait until no queued or running generation still uses the adapter.
    waits_for_adapter: str | None = None


def _resolve(call: _Call, result: Any = None, error: BaseException | None = None) -> None:
    def settle() -> None:
        if call.future.done():
            return
        if error is not None:
            call.future.set_exception(error)
        else:
            call.future.set_result(result)

    with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
        call.loop.call_soon_threadsafe(settle)


class LocalEngine:
    """In-process engine. Construct with `await LocalEngine.open(...)`; loading takes seconds."""

    def __init__(self, model_dir: str | Path, *, device: str = "auto", dtype: str = "float32", max_active: int = 8):
        from transformers import AutoModelForCausalLM

        self.model_dir = Path(model_dir)
        self.device = resolve_device(device)
        self._base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=_DTYPES[dtype]).to(self.device)
        self._base.eval()
        self._model = self._base
        self._peft = None  # a peft.PeftModel once the first adapter is loaded
        self._adapters: dict[str, _Slot] = {}  # served name -> peft slot holding its weights
        self._free_slots: list[_Slot] = []
        self._slot_counter = 0
        self._active_adapter: str | None = None
        self.info = EngineInfo(
            model_name=self.model_dir.name,
            max_context=int(getattr(self._base.config, "max_position_embeddings", 2048)),
            device=self.device,
            dtype=dtype,
            vocab_size=int(self._base.config.vocab_size),
        )
        self._max_active = max_active
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: deque[_Generation] = deque()
        self._active: list[_Generation] = []
        self._deferred: list[_Call] = []
        self._stopping = False
        self._last_background_step = time.monotonic()
        self._last_user_step = 0.0
        self._thread = threading.Thread(target=self._run, name="nextstate-engine", daemon=True)
        self._thread.start()

    @classmethod
    async def open(cls, model_dir: str | Path, **kwargs: Any) -> LocalEngine:
        return await asyncio.to_thread(cls, model_dir, **kwargs)

    # ---------------------------------------------------------------- public, async API

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, adapter: str | None = None, background: bool = False
    ) -> AsyncIterator[GeneratedToken]:
        check_request(self._adapters, adapter, input_ids)
        if sampling.max_new_tokens < 1:
            raise EngineError("max_new_tokens must be at least 1")
        job = _Generation(
            input_ids=list(input_ids),
            sampling=sampling,
            adapter=adapter,
            loop=asyncio.get_running_loop(),
            out=asyncio.Queue(),
            generator=make_generator(sampling.seed, self.device),
            background=background,
        )
        self._jobs.put(job)
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
        check_request(self._adapters, adapter, input_ids, start)
        ids = list(input_ids)
        if not background:
            return await self._call(lambda: self._score(ids, start, adapter, temperature))
        # In the background it is scheduled like a background generation: chunked, yielding
        # to user requests, and holding its adapter against unloads until it finishes.
        job = _Generation(
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
        files = await asyncio.to_thread(_AdapterFiles.read, Path(path))  # disk I/O off the model thread
        await self._call(lambda: self._load_adapter(name, str(path), files))

    async def unload_adapter(self, name: str) -> None:
        if name not in self._adapters:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded")
        await self._call(lambda: self._unload_adapter(name), waits_for_adapter=name)

    @property
    def adapters(self) -> list[str]:
        return list(self._adapters)

    async def close(self) -> None:
        self._stopping = True
        self._jobs.put(None)
        await asyncio.to_thread(self._thread.join, 30)

    async def _call(self, fn: Callable[[], Any], waits_for_adapter: str | None = None) -> Any:
        loop = asyncio.get_running_loop()
        call = _Call(fn=fn, loop=loop, future=loop.create_future(), waits_for_adapter=waits_for_adapter)
        self._jobs.put(call)
        return await call.future

    # ---------------------------------------------------------------- worker thread

    def _run(self) -> None:
        with torch.inference_mode():
            while not self._stopping:
                idle = not (self._active or self._waiting or self._deferred)
                self._take_jobs(block=idle)
                self._admit()
                runnable = self._runnable()
                for job in runnable:
                    self._step(job)
                self._run_deferred()
                if not runnable and self._active:
                    # Background work is holding off right after a user request: wait for the
                    # gap to pass, or for new work, without spinning.
                    self._take_jobs(block=True, timeout=BACKGROUND_IDLE_GAP_S)
        for job in [*self._active, *self._waiting]:
            self._deliver(job, EngineError("engine is shutting down"))
        for call in self._deferred:
            _resolve(call, error=EngineError("engine is shutting down"))

    def _runnable(self) -> list[_Generation]:
        """This round's jobs: the user requests, plus one background job if background work
        has waited BACKGROUND_MAX_WAIT_S; with no user request, one background job once users
        have been quiet for BACKGROUND_IDLE_GAP_S."""
        users = [job for job in self._active if not job.background]
        background = [job for job in self._active if job.background]
        now = time.monotonic()
        if not users:
            # A client usually sends its next request right after a reply (an agent's tool
            # call, say): background work starts only once users have been quiet for a moment,
            # then runs one step at a time, the longest-waiting first, so a user request that
            # arrives meanwhile waits for at most one short step.
            if not background or now - self._last_user_step < BACKGROUND_IDLE_GAP_S:
                return []
            return [min(background, key=lambda job: job.last_step)]
        self._last_user_step = now
        if background and now - self._last_background_step >= BACKGROUND_MAX_WAIT_S:
            self._last_background_step = now
            return users + [min(background, key=lambda job: job.last_step)]
        return users

    def _admit(self) -> None:
        """Fill free decoding slots. Background work never takes a user's slot: a user
        request is admitted while fewer than max_active user requests decode."""
        users = sum(1 for job in self._active if not job.background)
        for job in list(self._waiting):
            if job.background:
                admit = len(self._active) < self._max_active
            else:
                admit = users < self._max_active
                users += admit
            if admit:
                self._waiting.remove(job)
                self._active.append(job)

    def _take_jobs(self, block: bool, timeout: float | None = None) -> None:
        try:
            item = self._jobs.get(block=block, timeout=timeout if block else 0)
        except queue.Empty:
            return
        while True:
            if item is None:
                self._stopping = True
            elif isinstance(item, _Generation):
                self._waiting.append(item)
            elif item.waits_for_adapter is not None:
                self._deferred.append(item)
            else:
                self._execute(item)
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return

    def _run_deferred(self) -> None:
        if not self._deferred:
            return
        in_use = {job.adapter for job in (*self._active, *self._waiting) if not job.cancelled.is_set()}
        still: list[_Call] = []
        for call in self._deferred:
            if call.waits_for_adapter in in_use:
                still.append(call)
            else:
                self._execute(call)
        self._deferred = still

    def _execute(self, call: _Call) -> None:
        try:
            result = call.fn()
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            _resolve(call, error=exc if isinstance(exc, EngineError) else EngineError(str(exc)))
        else:
            _resolve(call, result=result)

    def _step(self, job: _Generation) -> None:
        if job.cancelled.is_set():
            self._active.remove(job)
            return
        try:
            prompt_len = len(job.input_ids)
            if job.fed < prompt_len:
                size = BACKGROUND_CHUNK if job.background else prompt_len
                ids = job.input_ids[job.fed : job.fed + size]
            else:
                ids = [job.last_token]
            with self._use_adapter(job.adapter):
                out = self._model(
                    input_ids=torch.tensor([ids], device=self.device), past_key_values=job.cache, use_cache=True
                )
            job.cache = out.past_key_values
            job.last_step = time.monotonic()
            first, prefilling = job.fed, job.fed < prompt_len
            if prefilling:
                job.fed += len(ids)
            if job.score_from is not None:
                self._collect_scores(job, out.logits[0], first)
                return
            if job.fed < prompt_len:
                return  # more of the prompt to feed before the first token
            self._sample(job, out.logits[0, -1])
        except Exception as exc:  # noqa: BLE001 - a failing request must not kill the worker
            log.exception("generation failed")
            self._deliver(job, EngineError(f"generation failed: {exc}"))
            self._active.remove(job)

    def _sample(self, job: _Generation, logits: torch.Tensor) -> None:
        token, logprob, top = sample_token(logits, job.sampling, job.generator)
        job.last_token = token
        job.produced += 1
        finish = None
        if token in job.sampling.stop_token_ids:
            finish = "stop"
        elif job.produced >= job.sampling.max_new_tokens or len(job.input_ids) + job.produced >= self.info.max_context:
            finish = "length"
        self._deliver(job, GeneratedToken(token, logprob, top, finish))
        if finish is not None:
            self._active.remove(job)
            job.cache = None

    def _collect_scores(self, job: _Generation, logits: torch.Tensor, first: int) -> None:
        """logits[i] is the prediction for input_ids[first + i + 1]; keep those from score_from on."""
        ids = job.input_ids
        lo, hi = max(first + 1, job.score_from), min(job.fed + 1, len(ids))
        if lo < hi:
            rows = torch.log_softmax(logits[lo - 1 - first : hi - 1 - first].float() / job.score_temperature, dim=-1)
            targets = torch.tensor(ids[lo:hi], device=rows.device).unsqueeze(-1)
            job.scores += rows.gather(-1, targets).squeeze(-1).tolist()
        if job.fed >= len(ids):
            self._deliver(job, job.scores)
            self._active.remove(job)
            job.cache = None

    @staticmethod
    def _deliver(job: _Generation, item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening any more
            job.loop.call_soon_threadsafe(job.out.put_nowait, item)

    def _use_adapter(self, name: str | None) -> contextlib.AbstractContextManager:
        if name is not None and name not in self._adapters:
            # Never fall back to the base model silently: that would serve the wrong policy.
            raise UnknownAdapterError(f"adapter {name!r} is not loaded")
        if self._peft is None:
            return contextlib.nullcontext()
        if name is None:
            return self._peft.disable_adapter()
        slot = self._adapters[name].slot
        if self._active_adapter != slot:
            self._peft.set_adapter(slot)
            self._active_adapter = slot
        return contextlib.nullcontext()

    def _score(self, ids: list[int], start: int, adapter: str | None, temperature: float) -> list[float]:
        tensor = torch.tensor([ids], device=self.device)
        with self._use_adapter(adapter):
            logits = self._model(input_ids=tensor, use_cache=False).logits[0].float()
        # logits[i] predicts ids[i + 1], so ids[start:] are scored by logits[start - 1 : -1].
        logprobs = torch.log_softmax(logits[start - 1 : -1] / temperature, dim=-1)
        targets = tensor[0, start:].unsqueeze(-1)
        return logprobs.gather(-1, targets).squeeze(-1).tolist()

    def _load_adapter(self, name: str, path: str, files: _AdapterFiles) -> None:
        """Serve `path` as `name`. A new version usually lands in the slot an unloaded version
        left behind: its tensors are copied in place (milliseconds) instead of peft building
        new modules (hundreds of milliseconds with the model held)."""
        from peft import PeftModel

        if name in self._adapters:
            raise EngineError(f"adapter {name!r} is already loaded")
        for i, slot in enumerate(self._free_slots):
            if slot.signature == files.signature and self._copy_into(slot.slot, files.tensors):
                del self._free_slots[i]
                self._adapters[name] = _Slot(slot.slot, files.signature, path)
                return
        slot_name = f"slot{self._slot_counter}"
        self._slot_counter += 1
        if self._peft is None:
            self._peft = PeftModel.from_pretrained(self._base, path, adapter_name=slot_name, is_trainable=False)
            self._peft.eval()
            self._model = self._peft
        else:
            self._peft.load_adapter(path, adapter_name=slot_name, is_trainable=False)
        self._active_adapter = None
        self._adapters[name] = _Slot(slot_name, files.signature, path)

    def _copy_into(self, slot: str, tensors: dict[str, torch.Tensor]) -> bool:
        params = dict(self._peft.named_parameters())
        targets = []
        for key, value in tensors.items():
            target = params.get(_LORA_KEY.sub(rf".\1.{slot}.weight", key))
            if target is None or target.shape != value.shape:
                return False
            targets.append((target, value))
        if len(targets) != sum(1 for n in params if f".{slot}." in n):
            return False
        with torch.no_grad():
            for target, value in targets:
                target.copy_(value.to(target.dtype))
        return True

    def _unload_adapter(self, name: str) -> None:
        if name not in self._adapters:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded")
        slot = self._adapters.pop(name)
        # Keep a few slots allocated for the next versions; delete the rest.
        self._free_slots.append(slot)
        while len(self._free_slots) > MAX_FREE_SLOTS:
            stale = self._free_slots.pop(0)
            self._peft.delete_adapter(stale.slot)
        self._active_adapter = None
