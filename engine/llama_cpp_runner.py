"""Forward passes of the embedded engine on llama.cpp: the runner `engine.local` uses on a CPU.

On the same two cores, llama.cpp decodes SmolLM2-135M 5-7× faster than transformers (its
kernels read float16 weights without Python between the layers; docs/benchmark-log.md, "Fast on the
person's own machine"). This runner keeps the transformers runner's contract, so the engine's
scheduler, streaming and adapters work as they do there:

* **The same policy.** It serves a float16 GGUF copy of the model folder the learner trains
  (`modelio.gguf_model`), and every logprob comes from the logits through `engine.token_steps`,
  the definition the learner uses; llama.cpp's own samplers are not used.
* **Sequences in one cache per side.** Every generation has a sequence of its own in a llama.cpp
  unified KV cache; a finished one stays as a prefix for the next request of the same adapter
  and salt (a conversation's next turn), which takes it over by sharing its cells
  (`llama_memory_seq_cp`), not copying them; a running one shares what it has read so far the
  same way. The least recently used are dropped when the cache or the sequence ids run out.
* **One read per conversation.** A turn that holds an earlier turn's whole prompt supersedes
  its read (agents send a reply back as text, re-rendered with other tokens, so the replies
  are not compared), and so does a new version's read of her conversation: llama.cpp attends
  up to the cache's highest used cell, and a version's read placed beyond her old one decoded
  her next turn at 28-30 tokens/s instead of 41-43 (docs/benchmark-log.md, "One read per
  conversation").
* **The house's work in a context of its own.** llama.cpp attends over every used cell of a
  unified cache, whichever sequence holds it: one 4k conversation decodes 36 tokens/s alone and
  24 beside three other kept 4k reads (docs/benchmark-log.md, "The house's reads in a cache of
  their own"). Work with no salt (the judge's votes, the teacher's hinted reads) shares no
  prefix with a person's anyway, so it runs in a second context on the same weights, and a
  person's turn attends over the people's cells only.
* **Adapters by group.** llama.cpp applies LoRA adapters to the whole context, so one decoding
  step makes one pass per adapter among its rows. A published version is written as a GGUF
  LoRA (`modelio.gguf_lora`, what `nextstate export --format gguf` writes) and loaded beside
  the model, never changing the weights other requests read.

Not thread-safe: only the engine's worker thread calls it.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from nextstate.engine.base import EngineError, EngineInfo, EngineRejected, UnknownAdapterError
from nextstate.engine.constraints import ConstraintCompiler, ConstraintError
from nextstate.engine.model_runner import RunnerStats
from nextstate.engine.scheduler import Job
from nextstate.engine.token_steps import take_scores, take_token
from nextstate.modelio.logprobs import token_logprobs

# Tokens per llama_decode call, and llama.cpp's physical batch: 512 prefilled fastest here.
BATCH_TOKENS = 512
# Sequence ids: running generations plus finished ones kept as prefixes.
MAX_SEQUENCES = 64
# The people's unified cache holds at most this many full context windows (SmolLM2: 4 × 8k
# tokens, 755 MB in float16): llama.cpp allocates all of it at start.
MAX_WINDOWS = 4
# The house's (unsalted work's) cache: one window at least, two where NEXTSTATE_KV_CACHE_MB
# leaves room beyond the people's (a teacher read and the judge's votes on another turn at once).
HOUSE_WINDOWS = 2


def available() -> bool:
    """Whether llama-cpp-python is installed (it builds from source: some machines lack it)."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


@dataclass
class _Kept:
    """A finished sequence kept for its prefix."""

    seq: int
    adapter: str | None
    salt: str | None
    tokens: np.ndarray
    prompt: int  # how many of `tokens` were the prompt (the rest: the reply sampled)
    used: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class SequenceBatch:
    """The generations decoding together (users', or background work's): `engine.local` steps
    every row of a job's batch at once."""

    background: bool
    context: _Context
    rows: list[Job] = field(default_factory=list)


class LlamaAdapters:
    """The loaded versions: name → llama.cpp adapter and the GGUF file it was read from."""

    def __init__(self) -> None:
        self.loaded: dict[str, tuple[ctypes.c_void_p, Path]] = {}

    @property
    def names(self) -> list[str]:
        return list(self.loaded)

    def __contains__(self, name: object) -> bool:
        return name in self.loaded


class LlamaCppRunner:
    def __init__(self, model_dir: Path, gguf: Path, kv_cache_mb: int = 2048, batching: bool = True,
                 threads: int | None = None) -> None:
        import llama_cpp as ll

        self.ll = ll
        self.model_dir = model_dir
        self.device = "cpu"
        self.batching = batching
        ll.llama_backend_init()
        ll.llama_log_set(_quiet_callback(), ctypes.c_void_p(0))
        params = ll.llama_model_default_params()
        self.model = ll.llama_model_load_from_file(str(gguf).encode(), params)
        if not self.model:
            raise EngineError(f"llama.cpp could not load {gguf}")
        window = int(ll.llama_model_n_ctx_train(self.model))
        layers, kv_heads = ll.llama_model_n_layer(self.model), ll.llama_model_n_head_kv(self.model)
        head_dim = ll.llama_model_n_embd(self.model) // ll.llama_model_n_head(self.model)
        cell_bytes = layers * 2 * kv_heads * head_dim * 2  # keys and values, float16
        # kv_cache_mb = 0: nothing kept between requests, room for one window
        self.keep_prefixes = kv_cache_mb > 0
        cells = min(max(kv_cache_mb * 2**20 // cell_bytes, window if not self.keep_prefixes else BATCH_TOKENS),
                    MAX_WINDOWS * window)
        threads = threads or len(os.sched_getaffinity(0))
        house = min(max(kv_cache_mb * 2**20 // cell_bytes - cells, window), HOUSE_WINDOWS * window)
        self.people = _Context(ll, self.model, cells, threads, "people")
        try:
            self.house = _Context(ll, self.model, house, threads, "the house")
        except EngineError:
            self.people.close()
            raise
        self.vocab = int(ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model)))
        self.batch = ll.llama_batch_init(BATCH_TOKENS, 0, 1)
        self.adapters = LlamaAdapters()
        # the GGUF LoRA files of loaded versions: removed at close or, for a runner never
        # closed (a test, a failed start), when it is collected or the process exits
        self._adapter_dir = tempfile.TemporaryDirectory(prefix="nextstate-lora-", ignore_cleanup_errors=True)
        self._contexts = (self.people, self.house)
        self._batches: dict[tuple[bool, _Context], SequenceBatch] = {}  # by (background, context)
        self.constraints = ConstraintCompiler(model_dir)
        self.stats = RunnerStats()
        self.info = EngineInfo(
            model_name=model_dir.name, max_context=min(window, cells), device="cpu", dtype="float16",
            vocab_size=self.vocab,
        )

    def _context(self, job: Job) -> _Context:
        """A person's work (salted) in the people's cache; the rest in the house's."""
        return self.house if job.sampling.cache_salt is None else self.people

    # ------------------------------------------------------------- one job: prefill, scoring

    def step(self, job: Job) -> bool:
        """Advance `job` by its prompt (a chunk of it in the background) or one token; True
        once it is finished (result delivered)."""
        if job.sampling.json_schema is not None and job.constraint is None and job.score_from is None:
            try:
                job.constraint = self.constraints.compile(job.sampling.json_schema)
            except (ConstraintError, ValueError) as exc:
                raise EngineRejected(str(exc)) from exc
        context = self._context(job)
        starting = job.cache is None
        if starting:
            job.cache = context.take_sequence()
            context.live[job.cache] = job
        prompt_len = len(job.input_ids)
        if job.fed < prompt_len:
            self._reuse_prefix(context, job)
            if starting:
                self._forget_superseded(context, job, job.input_ids)
            ids = job.input_ids[job.fed : job.fed + job.prefill_chunk]
            first = job.fed
            scored_from = job.score_from - 1 if job.score_from is not None else first + len(ids) - 1
            logits = self._feed(context, job.cache, job.adapter, ids, first, max(first, scored_from))
            job.fed += len(ids)
            self.stats.prompt_tokens_computed += len(ids)
        else:
            first = prompt_len + len(job.output_ids) - 1
            logits = self._feed(context, job.cache, job.adapter, [job.last_token], first, first)
        job.last_step = time.monotonic()
        if job.score_from is not None:
            offset = max(first, job.score_from - 1) - first
            return take_scores(job, _pad_rows(logits, offset), first)
        if job.fed < prompt_len:
            return False  # more of the prompt to feed before the first token
        finished = take_token(job, logits[-1], self.info.max_context)
        if not finished and self.batching:
            key = (job.background, context)
            batch = self._batches.get(key)
            if batch is None:
                batch = self._batches[key] = SequenceBatch(job.background, context)
            batch.rows.append(job)
            job.batch = batch
        return finished

    def _reuse_prefix(self, context: _Context, job: Job) -> None:
        """Take over the longest prefix of the prompt that another sequence of the same adapter
        and salt holds beyond what `job` has read: a kept one, or one still running (votes on
        one judge prompt share their progress chunk by chunk, so it is read once, not m
        times). A scoring job must still compute the logits it scores, from score_from - 1 on."""
        limit = len(job.input_ids) - 1 if job.score_from is None else job.score_from - 1
        if limit <= job.fed:
            return
        ids = np.asarray(job.input_ids[:limit], dtype=np.int64)
        best, length = None, job.fed
        salt = job.sampling.cache_salt
        sources = [(k.seq, k.tokens, k) for k in context.kept if k.adapter == job.adapter and k.salt == salt]
        for other in context.live.values():
            if other is not job and other.adapter == job.adapter and other.sampling.cache_salt == salt:
                held = context.held(other.cache)
                sources.append((other.cache, np.asarray((other.input_ids + other.output_ids)[:held], dtype=np.int64), None))
        for seq, tokens, kept in sources:
            n = min(len(tokens), len(ids))
            if n <= length:
                continue
            differ = np.flatnonzero(tokens[:n] != ids[:n])
            common = int(differ[0]) if differ.size else n
            if common > length:
                best, length = (seq, kept), common
        if best is None:
            return
        seq, kept = best
        if kept is not None:
            kept.used = time.monotonic()
        self.ll.llama_memory_seq_rm(context.memory, job.cache, -1, -1)
        self.ll.llama_memory_seq_cp(context.memory, seq, job.cache, 0, length)
        self.stats.prompt_tokens_reused += length - job.fed
        job.cached += length - job.fed
        job.fed = length

    # ------------------------------------------------------------- decoding in batches

    def step_batch(self, batch: SequenceBatch) -> list[Job]:
        """One decoding step for every row of `batch`, one pass per adapter among them;
        returns the jobs that finished."""
        groups: dict[str | None, list[Job]] = {}
        for job in batch.rows:
            groups.setdefault(job.adapter, []).append(job)
        finished = []
        for adapter, jobs in groups.items():
            entries = [(job.last_token, len(job.input_ids) + len(job.output_ids) - 1, job.cache, True) for job in jobs]
            rows = self._decode(batch.context, adapter, entries)
            now = time.monotonic()
            for job, logits in zip(jobs, rows):
                job.last_step = now
                if take_token(job, logits, self.info.max_context):
                    finished.append(job)
        return finished

    # ------------------------------------------------------------- shared

    def release(self, job: Job, keep: bool = True) -> None:
        """The job is over: its sequence is kept for its prefix, unless `keep` is False (a pass
        failed half-way) or its adapter is gone."""
        if job.batch is not None:
            job.batch.rows.remove(job)
            if not job.batch.rows:
                self._batches.pop((job.batch.background, job.batch.context), None)
            job.batch = None
        seq, job.cache = job.cache, None
        if seq is None:
            return
        context = self._context(job)
        context.live.pop(seq, None)
        length = context.held(seq)
        ids = job.input_ids + job.output_ids
        if (not keep or not self.keep_prefixes or length <= 0 or length > len(ids)
                or not (job.adapter is None or job.adapter in self.adapters)):
            context.drop_sequence(seq)
            return
        tokens = np.asarray(ids[:length], dtype=np.int64)
        self._forget_superseded(context, job, tokens)
        context.kept.append(_Kept(seq, job.adapter, job.sampling.cache_salt, tokens, min(len(job.input_ids), length)))

    def _forget_superseded(self, context: _Context, job: Job, tokens) -> None:
        """Forget the kept reads `job` supersedes: those of its salt whose whole prompt `tokens`
        begins with (an earlier turn of the same conversation; its reply is re-rendered by the
        client with other tokens, so only the prompt is compared) and, of a person's, also those
        read under another policy (her conversation goes on under this one: a new version's
        warm-up or first turn). Kept, they would only lengthen every step she decodes: llama.cpp
        attends over the cache up to its highest used cell. Done as the job starts, after it
        took over what it shares, so its new cells can fill the ones freed (llama.cpp places
        new tokens from the cache's start when enough before its head are free); and again as
        it ends, for reads that finished meanwhile."""
        salt = job.sampling.cache_salt
        ids = np.asarray(tokens, dtype=np.int64)
        for kept in [k for k in context.kept if k.salt == salt and (k.adapter == job.adapter or salt is not None)]:
            if kept.prompt <= len(ids) and np.array_equal(kept.tokens[: kept.prompt], ids[: kept.prompt]):
                context.forget(kept)

    def score(self, ids: list[int], start: int, adapter: str | None, temperature: float) -> list[float]:
        """Logprobs of ids[start:] in one pass of their own (nothing kept), in the house's cache."""
        seq = self.house.take_sequence()
        try:
            logits = self._feed(self.house, seq, adapter, ids[: len(ids) - 1], 0, start - 1)
            return token_logprobs(logits, torch.tensor(ids[start:]), temperature).tolist()
        finally:
            self.house.drop_sequence(seq)

    def read_adapter(self, path: Path) -> Path:
        """A published PEFT adapter as a GGUF LoRA file (off the model thread)."""
        from nextstate.modelio.gguf_lora import gguf_adapter

        config = json.loads((path / "adapter_config.json").read_text())
        if config.get("use_rslora") or config.get("use_dora"):
            raise EngineError("llama.cpp serves plain LoRA adapters (not rsLoRA or DoRA)")
        base = json.loads((self.model_dir / "config.json").read_text())
        folder = Path(self._adapter_dir.name)
        folder.mkdir(parents=True, exist_ok=True)  # a /tmp cleaner may have taken it while empty
        out = Path(tempfile.mkstemp(suffix=".gguf", dir=folder)[1])
        out.write_bytes(gguf_adapter(path, base, float(config["lora_alpha"])))
        return out

    def load_adapter(self, name: str, path: str, files: Path) -> None:
        adapter = self.ll.llama_adapter_lora_init(self.model, str(files).encode())
        if not adapter:
            raise EngineError(f"llama.cpp could not load the adapter {name!r} from {path}")
        if name in self.adapters:
            self.unload_adapter(name)
        self.adapters.loaded[name] = (adapter, files)

    def unload_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded")
        self.drop(name)
        adapter, files = self.adapters.loaded.pop(name)
        for context in self._contexts:
            if context.adapter == name:
                self._set_adapter(context, None)
        self.ll.llama_adapter_lora_free(adapter)
        files.unlink(missing_ok=True)

    def drop(self, adapter: str | None) -> None:
        """Forget the kept prefixes computed under `adapter`."""
        for context in self._contexts:
            for kept in [k for k in context.kept if k.adapter == adapter]:
                context.forget(kept)

    def close(self) -> None:
        ll = self.ll
        ll.llama_batch_free(self.batch)
        for context in self._contexts:
            context.close()
        for adapter, _ in self.adapters.loaded.values():
            ll.llama_adapter_lora_free(adapter)
        self.adapters.loaded.clear()
        ll.llama_model_free(self.model)
        self._adapter_dir.cleanup()

    # ------------------------------------------------------------- llama.cpp

    def _feed(self, context: _Context, seq: int, adapter: str | None, ids: list[int], first: int,
              logits_from: int) -> torch.Tensor:
        """Put `ids` (at positions first…) through the model in sequence `seq`; the logits of
        the positions from `logits_from` on, one row each."""
        rows = []
        for start in range(0, len(ids), BATCH_TOKENS):
            part = ids[start : start + BATCH_TOKENS]
            entries = [(t, first + start + i, seq, first + start + i >= logits_from) for i, t in enumerate(part)]
            rows.extend(self._decode(context, adapter, entries))
        return torch.stack(rows) if rows else torch.empty(0, self.vocab)

    def _decode(self, context: _Context, adapter: str | None,
                entries: list[tuple[int, int, int, bool]]) -> list[torch.Tensor]:
        """One llama_decode of (token, position, sequence, wants logits) entries; the logits
        rows asked for, copied (llama.cpp reuses its buffer). When the cache is full, the
        least recently used kept prefixes make room."""
        ll, batch = self.ll, self.batch
        self._set_adapter(context, adapter)
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        while True:
            status = ll.llama_decode(context.ctx, batch)
            if status == 0:
                break
            if status == 1 and context.kept:  # no room: the memory is as it was; make some
                context.forget(min(context.kept, key=lambda k: k.used))
                continue
            if status == 1:
                raise EngineRejected("the prompt does not fit the engine's KV cache (NEXTSTATE_KV_CACHE_MB)")
            raise EngineError(f"llama.cpp failed to decode (status {status})")
        self.stats.forward_passes += 1
        out = []
        for i, (_, _, _, logits) in enumerate(entries):
            if logits:
                row = np.ctypeslib.as_array(ll.llama_get_logits_ith(context.ctx, i), shape=(self.vocab,))
                out.append(torch.from_numpy(row.copy()))
        return out

    def _set_adapter(self, context: _Context, name: str | None) -> None:
        if context.adapter is not False and context.adapter == name:
            return
        ll = self.ll
        if name is None:
            status = ll.llama_set_adapters_lora(context.ctx, None, 0, None)
        else:
            if name not in self.adapters:
                raise UnknownAdapterError(f"adapter {name!r} is not loaded")
            handles = (ll.llama_adapter_lora_p_ctypes * 1)(self.adapters.loaded[name][0])
            status = ll.llama_set_adapters_lora(context.ctx, handles, 1, (ctypes.c_float * 1)(1.0))
        if status != 0:
            raise EngineError(f"llama.cpp could not apply adapter {name!r}")
        context.adapter = name


class _Context:
    """One llama.cpp context on the shared weights: its unified KV cache, the sequences running
    in it and those kept for their prefixes."""

    def __init__(self, ll, model, cells: int, threads: int, name: str) -> None:
        self.ll = ll
        params = ll.llama_context_default_params()
        params.n_ctx = cells
        params.n_batch = params.n_ubatch = BATCH_TOKENS
        params.n_seq_max = MAX_SEQUENCES
        params.kv_unified = True  # one pool of cells: a long prompt may use what others do not
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED  # fastest here (bench.serving_speed)
        self.ctx = ll.llama_init_from_model(model, params)
        if not self.ctx:
            raise EngineError(f"llama.cpp could not make a context of {cells} tokens for {name}")
        self.memory = ll.llama_get_memory(self.ctx)
        self.adapter: str | None | bool = False  # the adapter set on the context (False: unknown)
        self.free = list(range(MAX_SEQUENCES - 1, -1, -1))
        self.kept: list[_Kept] = []
        self.live: dict[int, Job] = {}  # sequence → the job running in it

    def held(self, seq: int) -> int:
        """How many positions sequence `seq` holds."""
        return int(self.ll.llama_memory_seq_pos_max(self.memory, seq)) + 1

    def take_sequence(self) -> int:
        if not self.free:
            if not self.kept:
                raise EngineError("no free llama.cpp sequence (too many generations at once)")
            self.forget(min(self.kept, key=lambda k: k.used))
        seq = self.free.pop()
        self.ll.llama_memory_seq_rm(self.memory, seq, -1, -1)
        return seq

    def drop_sequence(self, seq: int) -> None:
        self.ll.llama_memory_seq_rm(self.memory, seq, -1, -1)
        self.free.append(seq)

    def forget(self, kept: _Kept) -> None:
        self.kept.remove(kept)
        self.drop_sequence(kept.seq)

    def close(self) -> None:
        self.ll.llama_free(self.ctx)


def _pad_rows(logits: torch.Tensor, offset: int) -> torch.Tensor:
    """Logits rows for a chunk whose first `offset` positions were not asked for: those rows
    are placeholders (take_scores reads only the rows it scores)."""
    if offset <= 0:
        return logits
    return torch.cat([logits.new_zeros(offset, logits.shape[-1]), logits])


def _silence(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp logs every load and context to stderr; nextstate logs what matters itself."""


@functools.cache
def _quiet_callback():
    """One callback for the process: llama.cpp keeps calling it, so it must never be freed."""
    import llama_cpp as ll

    return ll.llama_log_callback(_silence)
