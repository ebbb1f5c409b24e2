"""Forward passes of the embedded engine: one step of one job at a time, with its KV cache.

A step feeds a job's next prompt chunk (prefill) or its last sampled token (decode) through
the model under the job's adapter, then samples the next token, or, for a scoring job, keeps
the logprobs of the tokens it was asked to score. Sampling and scoring take their logprobs
from `modelio.logprobs`, the definition the learner trains with.

Not thread-safe: only the engine's worker thread calls it.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from nextstate.engine.adapter_slots import AdapterFiles, AdapterSlots
from nextstate.engine.base import EngineInfo, EngineRejected, GeneratedToken
from nextstate.engine.constraints import ConstraintCompiler, ConstraintError
from nextstate.engine.devices import DTYPES, resolve_device
from nextstate.engine.sampling import sample_token
from nextstate.engine.scheduler import Job
from nextstate.modelio.logprobs import token_logprobs


class ModelRunner:
    def __init__(self, model_dir: Path, device: str = "auto", dtype: str = "float32") -> None:
        from transformers import AutoModelForCausalLM

        self.device = resolve_device(device)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).to(self.device)
        base.eval()
        self.adapters = AdapterSlots(base)
        self.constraints = ConstraintCompiler(model_dir)
        self.info = EngineInfo(
            model_name=model_dir.name,
            max_context=int(getattr(base.config, "max_position_embeddings", 2048)),
            device=self.device,
            dtype=dtype,
            vocab_size=int(base.config.vocab_size),
        )

    def step(self, job: Job) -> bool:
        """Advance `job` by one forward pass; True once it is finished (result delivered)."""
        if job.sampling.json_schema is not None and job.constraint is None and job.score_from is None:
            try:
                job.constraint = self.constraints.compile(job.sampling.json_schema)
            except (ConstraintError, ValueError) as exc:
                raise EngineRejected(str(exc)) from exc
        prompt_len = len(job.input_ids)
        if job.fed < prompt_len:
            ids = job.input_ids[job.fed : job.fed + job.prefill_chunk]
        else:
            ids = [job.last_token]
        # A generation needs the next-token logits only; a scoring job those of its chunk.
        keep = len(ids) if job.score_from is not None else 1
        with self.adapters.use(job.adapter):
            out = self.adapters.model(
                input_ids=torch.tensor([ids], device=self.device), past_key_values=job.cache, use_cache=True,
                logits_to_keep=keep,
            )
        job.cache = out.past_key_values
        job.last_step = time.monotonic()
        first = job.fed
        if job.fed < prompt_len:
            job.fed += len(ids)
        if job.score_from is not None:
            return self._collect_scores(job, out.logits[0], first)
        if job.fed < prompt_len:
            return False  # more of the prompt to feed before the first token
        return self._sample(job, out.logits[0, -1])

    def _sample(self, job: Job, logits: torch.Tensor) -> bool:
        allowed = job.constraint.apply(logits) if job.constraint is not None else None
        token, logprob, top = sample_token(logits, job.sampling, job.generator, allowed)
        if job.constraint is not None and token not in job.sampling.stop_token_ids:
            job.constraint.advance(token)
        job.last_token = token
        job.produced += 1
        finish = None
        if token in job.sampling.stop_token_ids:
            finish = "stop"
        elif job.produced >= job.sampling.max_new_tokens or len(job.input_ids) + job.produced >= self.info.max_context:
            finish = "length"
        job.deliver(GeneratedToken(token, logprob, top, finish))
        return finish is not None

    def _collect_scores(self, job: Job, logits: torch.Tensor, first: int) -> bool:
        """logits[i] is the prediction for input_ids[first + i + 1]; keep those from score_from on."""
        ids = job.input_ids
        lo, hi = max(first + 1, job.score_from), min(job.fed + 1, len(ids))
        if lo < hi:
            targets = torch.tensor(ids[lo:hi], device=logits.device)
            job.scores += token_logprobs(logits[lo - 1 - first : hi - 1 - first], targets, job.score_temperature).tolist()
        if job.fed >= len(ids):
            job.deliver(job.scores)
            return True
        return False

    def score(self, ids: list[int], start: int, adapter: str | None, temperature: float) -> list[float]:
        """Logprobs of ids[start:] in one full forward pass (no cache kept)."""
        tensor = torch.tensor([ids], device=self.device)
        with self.adapters.use(adapter):
            # logits for positions start - 1 … n - 1 only; position i predicts ids[i + 1]
            logits = self.adapters.model(input_ids=tensor, use_cache=False, logits_to_keep=len(ids) - start + 1).logits[0]
        return token_logprobs(logits[:-1], tensor[0, start:], temperature).tolist()

    def load_adapter(self, name: str, path: str, files: AdapterFiles) -> None:
        self.adapters.load(name, path, files)

    def unload_adapter(self, name: str) -> None:
        self.adapters.unload(name)
