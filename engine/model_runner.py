"""Forward passes of the embedded engine, with each sequence's KV cache.

A job's prompt goes through the model on its own (prefill: all at once for users, in short
chunks in the background), starting from the longest prefix the `PrefixCache` already holds.
Once its first token is sampled, a generation joins the `DecodeBatch` (users', or background
work's) and decodes in one forward pass with the others, whatever their adapters (`step_batch`). When a job ends its cache goes back
to the prefix cache, so the conversation's next request, or the judge's pass over the same
turn, prefills only what is new. Sampling and scoring take their logprobs from
`modelio.logprobs`, the definition the learner trains with.

Not thread-safe: only the engine's worker thread calls it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from nextstate.engine import kv_cache
from nextstate.engine.adapter_slots import AdapterFiles, AdapterSlots
from nextstate.engine.base import EngineInfo, EngineRejected
from nextstate.engine.constraints import ConstraintCompiler, ConstraintError
from nextstate.engine.decode_batch import DecodeBatch
from nextstate.engine.devices import DTYPES, resolve_device
from nextstate.engine.prefix_cache import PrefixCache
from nextstate.engine.scheduler import Job
from nextstate.engine.token_steps import take_scores, take_token
from nextstate.modelio.logprobs import token_logprobs


@dataclass
class RunnerStats:
    """What the model computed: for benchmarks, tests and metrics."""

    forward_passes: int = 0
    prompt_tokens_computed: int = 0  # prefilled, not taken from the prefix cache
    prompt_tokens_reused: int = 0  # taken from the prefix cache


class ModelRunner:
    def __init__(
        self, model_dir: Path, device: str = "auto", dtype: str = "float32", kv_cache_mb: int = 2048,
        batching: bool = True,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.device = resolve_device(device)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).to(self.device)
        base.eval()
        self.adapters = AdapterSlots(base)
        self.cache_argument = kv_cache.cache_argument(base)
        self.constraints = ConstraintCompiler(model_dir)
        self.prefix = PrefixCache(kv_cache_mb * 2**20)
        self.batching = batching
        self._batches: dict[bool, DecodeBatch] = {}  # users', and background work's
        self.stats = RunnerStats()
        self.info = EngineInfo(
            model_name=model_dir.name,
            max_context=int(getattr(base.config, "max_position_embeddings", 2048)),
            device=self.device,
            dtype=dtype,
            vocab_size=int(base.config.vocab_size),
        )

    # ------------------------------------------------------------- one job: prefill, scoring

    def step(self, job: Job) -> bool:
        """Advance `job` by one forward pass; True once it is finished (result delivered)."""
        if job.sampling.json_schema is not None and job.constraint is None and job.score_from is None:
            try:
                job.constraint = self.constraints.compile(job.sampling.json_schema)
            except (ConstraintError, ValueError) as exc:
                raise EngineRejected(str(exc)) from exc
        prompt_len = len(job.input_ids)
        if job.fed < prompt_len:
            self._reuse_prefix(job)
            ids = job.input_ids[job.fed : job.fed + job.prefill_chunk]
        else:
            ids = [job.last_token]
        # A generation needs the next-token logits only; a scoring job those of its chunk.
        keep = len(ids) if job.score_from is not None else 1
        if job.cache is None:
            job.cache = kv_cache.new_cache()
        with self.adapters.use(job.adapter):
            out = self.adapters.model(
                input_ids=torch.tensor([ids], device=self.device), use_cache=True,
                **{self.cache_argument: job.cache}, logits_to_keep=keep,
            )
        job.last_step = time.monotonic()
        self.stats.forward_passes += 1
        first = job.fed
        if job.fed < prompt_len:
            job.fed += len(ids)
            self.stats.prompt_tokens_computed += len(ids)
            if job.fed < prompt_len and kv_cache.reusable(job.cache):
                # Progress is shared at once: a vote on the same prompt continues from here.
                self.prefix.put(job.adapter, job.sampling.cache_salt, job.input_ids[: job.fed], kv_cache.tensors(job.cache))
        if job.score_from is not None:
            return take_scores(job, out.logits[0], first)
        if job.fed < prompt_len:
            return False  # more of the prompt to feed before the first token
        finished = take_token(job, out.logits[0, -1], self.info.max_context)
        if not finished and self.batching and kv_cache.reusable(job.cache):
            batch = self._batches.get(job.background)
            if batch is None:
                batch = self._batches[job.background] = DecodeBatch(job.background)
            batch.join(job, kv_cache.tensors(job.cache))
            job.cache = None
        return finished

    def _reuse_prefix(self, job: Job) -> None:
        """Skip the part of the prompt whose keys and values are cached. A scoring job must
        still compute the logits it scores, from position score_from - 1 on."""
        limit = len(job.input_ids) - 1 if job.score_from is None else job.score_from - 1
        if job.fed >= limit:
            return
        hit = self.prefix.longest(job.adapter, job.sampling.cache_salt, job.input_ids, limit)
        if hit is None or hit.length <= job.fed:
            return
        self.stats.prompt_tokens_reused += hit.length - job.fed
        job.cached += hit.length - job.fed
        job.cache = kv_cache.to_cache(hit.kv)
        job.fed = hit.length

    # ------------------------------------------------------------- decoding in batches

    def step_batch(self, batch: DecodeBatch) -> list[Job]:
        """One decoding step for every row of `batch`; returns the jobs that finished."""
        adapters = [job.adapter for job in batch.rows]
        row_names = self.adapters.row_names(adapters)
        if row_names is None:  # one adapter for every row: routed as for a single job
            with self.adapters.use(adapters[0]):
                out = self.adapters.model(**batch.inputs(self.device, self.cache_argument), use_cache=True, logits_to_keep=1)
        else:  # several: peft applies each row's LoRA to its own row
            out = self.adapters.model(**batch.inputs(self.device, self.cache_argument), use_cache=True, logits_to_keep=1, adapter_names=row_names)
        batch.advanced()
        self.stats.forward_passes += 1
        now = time.monotonic()
        finished = []
        for i, job in enumerate(batch.rows):
            job.last_step = now
            if take_token(job, out.logits[i, -1], self.info.max_context):
                finished.append(job)
        return finished

    # ------------------------------------------------------------- shared

    def release(self, job: Job, keep: bool = True) -> None:
        """The job is over (finished, failed or cancelled): its cache goes to the prefix cache,
        unless `keep` is False (a forward pass failed half-way: some layers may hold a
        position the others lack, and such a cache must never be reused)."""
        if job.batch is not None:
            batch = job.batch
            kv = batch.leave(job)
            if not batch.rows:
                self._batches.pop(batch.background, None)
        elif job.cache is not None and kv_cache.reusable(job.cache):
            kv = kv_cache.tensors(job.cache)
        else:
            kv = None
        job.cache = None
        if not keep or kv is None or not (job.adapter is None or job.adapter in self.adapters):
            return
        n, ids = kv_cache.length(kv), job.input_ids + job.output_ids
        if n <= len(ids) and all(keys.shape[2] == values.shape[2] == n for keys, values in kv):
            self.prefix.put(job.adapter, job.sampling.cache_salt, ids[:n], kv)

    def score(self, ids: list[int], start: int, adapter: str | None, temperature: float) -> list[float]:
        """Logprobs of ids[start:] in one full forward pass (no cache kept)."""
        tensor = torch.tensor([ids], device=self.device)
        with self.adapters.use(adapter):
            # logits for positions start - 1 … n - 1 only; position i predicts ids[i + 1]
            logits = self.adapters.model(input_ids=tensor, use_cache=False, logits_to_keep=len(ids) - start + 1).logits[0]
        return token_logprobs(logits[:-1], tensor[0, start:], temperature).tolist()

    @staticmethod
    def read_adapter(path: Path) -> AdapterFiles:
        """A published adapter's tensors (off the model thread)."""
        return AdapterFiles.read(path)

    def load_adapter(self, name: str, path: str, files: AdapterFiles) -> None:
        self.prefix.drop(name)
        self.adapters.load(name, path, files)

    def unload_adapter(self, name: str) -> None:
        self.adapters.unload(name)
        self.prefix.drop(name)

    def close(self) -> None:
        """Nothing to free by hand: the model is garbage once the engine lets go of it."""
