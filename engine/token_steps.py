"""What a runner does with one step's logits, whatever computed them (transformers, llama.cpp):
draw a generation's next token, or keep a scoring job's logprobs. One definition, so both
runners hand the proxy and the learner the same tokens, finish reasons and logprobs."""

from __future__ import annotations

import torch

from nextstate.engine.base import EngineRejected, GeneratedToken
from nextstate.engine.constraints import ConstraintError
from nextstate.engine.sampling import sample_token
from nextstate.engine.scheduler import Job
from nextstate.modelio.logprobs import token_logprobs


def take_token(job: Job, logits: torch.Tensor, max_context: int) -> bool:
    """Sample `job`'s next token from its next-token `logits` and deliver it; True once the
    generation is over (a stop token, its length, the context, or a refused constraint)."""
    try:
        allowed = job.constraint.apply(logits) if job.constraint is not None else None
        token, logprob, top = sample_token(logits, job.sampling, job.generator, allowed)
        if job.constraint is not None and token not in job.sampling.stop_token_ids:
            job.constraint.advance(token)
    except ConstraintError as exc:
        # the schema outgrew what the grammar engine serves: this request's failure (a 400),
        # never its decode batch's — the other rows go on
        job.deliver(EngineRejected(str(exc)))
        return True
    job.last_token = token
    job.output_ids.append(token)
    finish = None
    produced = len(job.output_ids)
    if token in job.sampling.stop_token_ids:
        finish = "stop"
    elif produced >= job.sampling.max_new_tokens or len(job.input_ids) + produced >= max_context:
        finish = "length"
    job.deliver(GeneratedToken(token, logprob, top, finish, job.cached if produced == 1 else None))
    return finish is not None


def take_scores(job: Job, logits: torch.Tensor, first: int) -> bool:
    """logits[i] is the prediction for input_ids[first + i + 1]; keep those from score_from on.
    True (the scores delivered) once the whole input has been read."""
    ids = job.input_ids
    lo, hi = max(first + 1, job.score_from), min(job.fed + 1, len(ids))
    if lo < hi:
        targets = torch.tensor(ids[lo:hi], device=logits.device)
        job.scores += token_logprobs(logits[lo - 1 - first : hi - 1 - first], targets, job.score_temperature).tolist()
    if job.fed >= len(ids):
        job.deliver(job.scores)
        return True
    return False
