"""Reading responses with the learner's copy of the model: the forward passes training, the
teacher's targets, the KL checks and the gate's readings all share.

One forward pass reads several samples' rows right-padded together (a micro-batch,
learner/micro_batches.py), a row that begins another is read off that one, only response
positions go through the LM head (in chunks of `logit_rows`), and the prompts' keys and values
are kept where they can be: the base model's for good (it never changes), an update's long
prompt prefixes once per weights (learner/prompt_prefix.py). The hinted teacher's targets are
read here too, since they are the base model reading a prompt with the hint.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.utils.checkpoint

from nextstate.core.settings import LearnerSettings
from nextstate.core.types import Sample
from nextstate.engine import kv_cache
from nextstate.engine.prefix_cache import PrefixCache
from nextstate.learner.distillation import shifted_target, teacher_topk
from nextstate.learner.host_memory import release_freed_memory
from nextstate.learner.micro_batches import micro_batches, prefix_hosts
from nextstate.learner.prompt_prefix import PromptPrefixes
from nextstate.modelio.chat_template import ChatRenderer
from nextstate.modelio.logprobs import tempered_log_softmax

# Response positions go through the LM head at once in training so that their fp32 logits take
# about this much (`_over_responses`): with its log-softmax and gradient a chunk costs
# three times it. 1,024 positions on SmolLM2's 49k vocabulary (192 MiB of logits) added 0.6 GB
# on the CPU for nothing: a smaller chunk is as fast, the matmul stays large.
LOGITS_CHUNK_BYTES = 64 << 20
# The base model's keys and values kept of the prompts it read (`_base_hidden`): an
# agent's conversation, about 4.5k tokens of SmolLM2 at 46 KB each in fp32, twice over.
BASE_KV_BYTES = 512 << 20
# Samples whose base model's side of the distillation target is kept (`_base_sides`): a few
# hundred KB each (a reply's positions × the teacher's top K, three ways). Enough for the
# batches being filled and the held-out turns with a hint of recent users (the `wish` figure,
# NEXTSTATE_HELD_OUT_MAX = 32 each), which every gate check reads again.
SIDES_KEPT = 512


# A sample's base model side of its distillation target (`_base_sides`): the hinted base model's
# top K ids, their log-probabilities with the hint and without it (None where the unhinted base
# model is the policy itself: a fresh adapter reading the sample's own prompt).
BaseSides = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def completed(policy: torch.Tensor, sides: BaseSides) -> torch.Tensor:
    """The distillation target from the policy's log-probabilities of the top K ids before the
    update (learner/distillation.py `shifted_target`)."""
    _, hinted, unhinted = sides
    return shifted_target(policy, hinted, policy if unhinted is None else unhinted)


def logit_rows(vocab_size: int) -> int:
    """Response positions per LM-head chunk: LOGITS_CHUNK_BYTES of fp32 logits, 64 to 1,024."""
    return max(64, min(1024, LOGITS_CHUNK_BYTES // (4 * vocab_size)))


def learner_dtype(setting: str, device: str) -> torch.dtype:
    if setting == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return getattr(torch, setting)


def pad_id(model: torch.nn.Module) -> int:
    pad = model.generation_config.pad_token_id or model.generation_config.eos_token_id
    return pad[0] if isinstance(pad, list) else pad


def stop_ids(model: torch.nn.Module) -> list[int]:
    eos = model.generation_config.eos_token_id
    return sorted(set(eos if isinstance(eos, list) else [eos])) if eos is not None else []


class ResponsePass(NamedTuple):
    """One sample's side of a forward pass (`ResponseReader._response_logprobs`)."""

    token: torch.Tensor  # [response tokens] the response tokens' logprobs
    gathered: torch.Tensor | None  # [response tokens, K] the given ids' logprobs, where ids were given
    first_stop: torch.Tensor | None  # log chance of a stop token first (an empty reply), where asked


class ResponseReader:
    """The learner's model (the frozen base, and the peft model over it once a scope exists) and
    every read of responses with it. `LoraTrainer` trains on top of it. Blocking calls."""

    def __init__(self, model_dir: str | Path, settings: LearnerSettings, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        release_freed_memory()  # before the first step's tensors: learner/host_memory.py says why
        self.settings = settings
        self.device = device
        self.model_dir = Path(model_dir)
        self.dtype = learner_dtype(settings.learner_dtype, device)
        self._base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype).to(device)
        self._base.requires_grad_(False)
        self._base.config.use_cache = False
        self.logit_rows = logit_rows(self._base.config.vocab_size)
        self._pass_tokens = settings.micro_batch_tokens  # a step's, from its memory plan
        self.model = None  # peft.PeftModel once the first scope exists
        self._renderer: ChatRenderer | None = None
        # the base model's keys and values of prompts it read (`_base_hidden`), and whether the
        # passes running now read the base model (`_base_model`)
        self._base_kv = PrefixCache(BASE_KV_BYTES)
        self._reading_base = False
        # per sample id: the base model's side of its distillation target (`_base_sides`), read
        # ahead while its batch fills (`read_ahead`)
        self._sides_kept: OrderedDict[int, BaseSides] = OrderedDict()
        # an update's long prompts read once per weights, without gradients (learner/prompt_prefix.py)
        self._prefixes = PromptPrefixes()
        # called before each decoder layer of every pass (forward, and its recompute in the
        # backward): where the learner makes way for a person's request (core/activity.py)
        self.between_layers: Callable[[], None] | None = None
        for layer in getattr(getattr(self._base, "model", None), "layers", None) or []:
            layer.register_forward_pre_hook(self._between_layers)

    def _between_layers(self, module: torch.nn.Module, args: Any) -> None:
        if self.between_layers is not None:
            self.between_layers()

    def _train_ids(self, sample: Sample) -> list[int]:
        """The tokens a sample trains on: a prompt that does not fit `max_train_tokens` with
        its response is cut from the left (the response is what the loss is about)."""
        room = max(1, self.settings.max_train_tokens - len(sample.response_ids))
        return sample.prompt_ids[-room:] + sample.response_ids

    def _row(self, sample: Sample) -> list[int]:
        """What a sample feeds a forward pass: its training ids but the last (nothing is
        predicted after it)."""
        return self._train_ids(sample)[:-1]

    def _row_length(self, sample: Sample) -> int:
        return len(self._train_ids(sample)) - 1

    def _micro_batches(self, samples: list[Sample]) -> list[list[int]]:
        return micro_batches([self._row(s) for s in samples], self._pass_tokens)

    def _logprobs_each(self, samples: list[Sample]) -> list[torch.Tensor]:
        """`_logprobs_many` over all `samples`, a micro-batch at a time, in their order (no grad)."""
        out: list[torch.Tensor | None] = [None] * len(samples)
        for group in self._micro_batches(samples):
            for i, lp in zip(group, self._logprobs_many([samples[i] for i in group])):
                out[i] = lp
        return out

    def _logprobs(self, sample: Sample) -> torch.Tensor:
        return self._logprobs_many([sample])[0]

    def _logprobs_many(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Logprobs of each sample's response tokens, in fp32, from one forward pass over the
        samples right-padded to a common length (a micro-batch, learner/micro_batches.py)."""
        return [answer.token for answer in self._response_logprobs(samples)]

    def _response_logprobs(
        self, samples: list[Sample], gather: list[torch.Tensor | None] | None = None, first_stop: bool = False
    ) -> list[ResponsePass]:
        """Per sample: the logprobs of its response tokens; where `gather` gives token ids
        ([response tokens, K], the teacher's top K), the logprobs of those ids too; with
        `first_stop`, the log of the chance (at temperature 1) that the reply ends at its first
        token, the chance the gate calls an empty reply."""
        rows = [self._row(s) for s in samples]
        targets = [torch.tensor(s.response_ids, device=self.device) for s in samples]
        stops = stop_ids(self.model if self.model is not None else self._base) if first_stop else []

        def at(logits: torch.Tensor, i: int, part: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            logprobs = tempered_log_softmax(logits, samples[i].logprob_temperature)
            token = logprobs.gather(-1, targets[i][part].unsqueeze(-1)).squeeze(-1)
            ids = gather[i] if gather is not None else None
            first = (torch.log_softmax(logits[:1].float(), -1)[:, stops].logsumexp(-1)
                     if stops and part.start == 0 else token[:0])
            return token, (logprobs.gather(-1, ids[part]) if ids is not None else token[:0]), first

        out = []
        for i, pieces in enumerate(self._over_responses(rows, [len(s.response_ids) for s in samples], at)):
            token, first = torch.cat([p[0] for p in pieces]), torch.cat([p[2] for p in pieces])
            out.append(ResponsePass(token, torch.cat([p[1] for p in pieces]) if gather is not None and gather[i] is not None else None,
                                    first[0] if first.numel() else None))
        return out

    def _over_responses(self, rows: list[list[int]], response_lengths: list[int],
                        at: Callable[[torch.Tensor, int, slice], Any]) -> list[list[Any]]:
        """`at(logits, i, part)` on the logits of row i's last `response_lengths[i]` positions,
        a chunk at a time (`part`: the chunk's positions within the response), from one forward
        pass over the rows right-padded to a common length.

        Only response positions go through the LM head, `logit_rows` of them at a time, each
        chunk recomputed in the backward pass: a [tokens × vocab] logits tensor is 4.9 GB in
        fp32 for an 8k-token response on a 152k vocabulary, a chunk 64 MiB."""
        # a row that begins another is read off that one (learner/micro_batches.py)
        hosts = prefix_hosts(rows)
        computed = sorted(set(hosts))
        slot = [computed.index(h) for h in hosts]
        width = max(len(rows[h]) for h in computed)
        ids = torch.tensor([rows[h] + [0] * (width - len(rows[h])) for h in computed], device=self.device)
        # right padding: causal attention keeps real tokens from seeing it, positions stay 0..len-1
        mask = None if all(len(rows[h]) == width for h in computed) else torch.tensor(
            [[1] * len(rows[h]) + [0] * (width - len(rows[h])) for h in computed], device=self.device)
        spans = [(len(r) - n, len(r)) for r, n in zip(rows, response_lengths)]
        model = self.model if self.model is not None else self._base
        parts = self._backbone_and_head()
        if parts is None:  # a model whose head does more than a linear map (soft-capping, scaling)
            first = min(a for a, _ in spans)
            logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=width - first).logits
            return [[at(logits[slot[i], a - first : b - first], i, slice(0, b - a))] for i, (a, b) in enumerate(spans)]
        backbone, head = parts
        if self._reading_base and not torch.is_grad_enabled() and self._base_kv.budget > 0:
            # row by row, each from the longest prefix the base model already read
            starts = [min(a for (a, _), host in zip(spans, hosts) if host == h) for h in computed]
            rows_hidden = [self._base_hidden(backbone, rows[h], start) for h, start in zip(computed, starts)]
            offset = [starts[k] for k in slot]
        elif not self._reading_base and (split := self._prefixes.split([a for a, _ in spans])):
            rows_hidden, offset = list(self._prefixes.hidden(backbone, ids, mask, split)), [split] * len(rows)
        else:
            hidden = backbone(input_ids=ids, attention_mask=mask).last_hidden_state
            rows_hidden, offset = list(hidden), [0] * len(rows)
        out = []
        for i, (a, b) in enumerate(spans):
            pieces = []
            for start in range(a, b, self.logit_rows):
                part = slice(start - a, min(b, start + self.logit_rows) - a)
                h = rows_hidden[slot[i]][start - offset[i] : min(b, start + self.logit_rows) - offset[i]]
                if torch.is_grad_enabled():
                    pieces.append(torch.utils.checkpoint.checkpoint(
                        lambda h, i=i, part=part: at(head(h), i, part), h, use_reentrant=False))
                else:
                    pieces.append(at(head(h), i, part))
            out.append(pieces)
        return out

    def _teacher_ids(self, sample: Sample) -> list[int]:
        """The tokens the distillation teacher reads: its prompt (the hint in it), cut from the
        left as `_train_ids` cuts the sample's own, and the response."""
        room = max(1, self.settings.max_train_tokens - len(sample.response_ids))
        return (sample.teacher_prompt_ids or [])[-room:] + sample.response_ids

    def _teacher_targets(
        self, samples: list[Sample], reference: Sequence[int] = (), at_base: bool = False, deferred: bool = False
    ) -> tuple[list[tuple[torch.Tensor | None, torch.Tensor] | None], dict[int, torch.Tensor], dict[int, BaseSides]]:
        """Per sample to distil (`distill_weight`): the target's log-probabilities over the
        base model's top `opd_topk` next tokens after the teacher's prompt and one bin for the
        rest ([n, K + 1]), with those token ids ([n, K]), at each response position; None for
        the others. The target is the policy before this update moved by what the hint changes
        in the base model (learner/distillation.py). Computed once per update, without
        gradients, before any of its steps.

        Also the policy's log-probabilities of the sampled tokens before the update for the
        samples in `reference` (the step's KL needs them for the samples its first optimizer
        step does not see), from the same forward pass as the target's policy side: one pass
        per sample where these were two.

        `at_base`: the weights are still the base model's (a scope's first update), so the
        policy's pass is also the unhinted base model's wherever the hint is measured against
        the sample's own prompt, and that pass is not made twice.

        `deferred` (no `reference`: the update's first optimizer step sees every sample): the
        policy's pass is not made here at all. That step's forward passes read the same weights
        and gather the same top-K ids, so each target is completed from them (`completed`):
        the targets come back None, with their base model's sides (the third value)."""
        out: list[tuple[torch.Tensor | None, torch.Tensor] | None] = [None] * len(samples)
        todo = [i for i, s in enumerate(samples) if s.distill_weight and s.teacher_prompt_ids]
        shared = [i for i in todo if at_base and not samples[i].contrast_prompt_ids]
        sides = self._base_sides(samples, todo, skip=shared) if todo else {}
        if deferred and not reference:
            return [(None, sides[i][0]) if i in sides else None for i in range(len(samples))], {}, sides
        policy = self._policy_passes(samples, sorted(set(todo) | set(reference)), {i: ids for i, (ids, _, _) in sides.items()})
        for i, side in sides.items():
            out[i] = (completed(policy[i][1], side), side[0])
        return out, {i: policy[i][0] for i in reference}, {}

    def _base_sides(self, samples: list[Sample], todo: list[int], skip: Sequence[int] = ()) -> dict[int, BaseSides]:
        """For samples[i], i in `todo`: the hint's side of the base model — the hinted base
        model's top K ids at each response position, their log-probabilities after the hinted
        prompt, and after the prompt the hint is measured against: the sample's own, or its
        hint's placebo (`contrast_prompt_ids`, judge/hindsight.py). The shift target's and the
        `wish` figure's base model, which never changes. No gradients. The unhinted side of
        the samples in `skip` is left out (None): the caller reads it elsewhere.

        A sample's side depends on the base model and the sample alone: it is kept by the
        sample's id, and read ahead while its batch fills (`read_ahead`)."""
        out: dict[int, BaseSides] = {}
        for i in todo:
            kept = self._sides_kept.get(samples[i].id) if samples[i].id is not None else None
            if kept is not None and (i in skip or kept[2] is not None):
                self._sides_kept.move_to_end(samples[i].id)
                out[i] = (kept[0], kept[1], None if i in skip else kept[2])
        missing = [i for i in todo if i not in out]
        if not missing:
            return out
        hinted = self._hinted_topk(samples, missing)
        ids = {i: top for i, (_, top) in hinted.items()}
        against = [s.model_copy(update={"prompt_ids": s.contrast_prompt_ids}) if s.contrast_prompt_ids else s
                   for s in samples]
        with self._base_model():
            unhinted = self._gathered(against, [i for i in missing if i not in skip], ids)
        for i in missing:
            out[i] = (ids[i], hinted[i][0], unhinted.get(i))
            if samples[i].id is not None:
                self._sides_kept[samples[i].id] = out[i]
        while len(self._sides_kept) > SIDES_KEPT:
            self._sides_kept.popitem(last=False)
        return out

    def read_ahead(self, samples: list[Sample]) -> int:
        """The base model's side of each sample's distillation target, read now and kept for
        its update (`_base_sides`): while a batch fills, the learner is idle, and on an agent's
        samples these reads were a tenth of an update after the last rating. Returns how many
        samples were read."""
        todo = [i for i, s in enumerate(samples) if s.distill_weight and s.teacher_prompt_ids and s.id is not None
                and (s.id not in self._sides_kept or self._sides_kept[s.id][2] is None)]
        if todo:
            self._base_sides(samples, todo)
        return len(todo)

    def _hinted_topk(self, samples: list[Sample], todo: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """For samples[i], i in `todo` (each with a teacher's prompt): the base model's top
        `opd_topk` next tokens after the hinted prompt at each response position, as
        (log-probabilities, ids), each [response tokens, K]. No gradients."""
        k = self.settings.opd_topk
        hinted: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        teacher_rows = [self._teacher_ids(samples[i])[:-1] for i in todo]
        with torch.no_grad(), self._base_model():
            for group in micro_batches(teacher_rows, self._pass_tokens):
                group_samples = [samples[todo[j]] for j in group]
                temperatures = [s.logprob_temperature for s in group_samples]
                rows = [self._teacher_ids(s)[:-1] for s in group_samples]
                results = self._over_responses(
                    rows, [len(s.response_ids) for s in group_samples],
                    lambda logits, i, part, temperatures=temperatures: teacher_topk(logits, temperatures[i], k))
                for j, pieces in zip(group, results):
                    hinted[todo[j]] = (torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces]))
        return hinted

    def _gathered(self, samples: list[Sample], todo: list[int], ids: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The active weights' log-probabilities of `ids[i]` ([response tokens, K]) at each
        response position of samples[i], after its own prompt. No gradients."""
        return {i: at_ids for i, (_, at_ids) in self._policy_passes(samples, todo, ids).items()}

    def _policy_passes(
        self, samples: list[Sample], todo: list[int], ids: dict[int, torch.Tensor]
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
        """For samples[i], i in `todo`: the active weights' log-probabilities of its response
        tokens and, where `ids` has an entry, of `ids[i]` at each response position; a
        micro-batch at a time, no gradients."""
        out: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        with torch.no_grad():
            for group in micro_batches([self._row(samples[i]) for i in todo], self._pass_tokens):
                members = [todo[j] for j in group]
                for i, answer in zip(members, self._response_logprobs([samples[i] for i in members],
                                                                      [ids.get(i) for i in members])):
                    out[i] = (answer.token, answer.gathered)
        return out

    @contextlib.contextmanager
    def _base_model(self) -> Iterator[None]:
        """The base model (adapter off) for the passes inside, whose prompts' keys and values
        may then come from `_base_kv`: the base never changes, so what it computed for an
        agent's system prompt and conversation serves every later read of them."""
        # before any scope's adapter exists (a batch read ahead), the model is the base model
        with self.model.disable_adapter() if self.model is not None else contextlib.nullcontext():
            self._reading_base = True
            try:
                yield
            finally:
                self._reading_base = False

    def _base_hidden(self, backbone: torch.nn.Module, row: list[int], start: int) -> torch.Tensor:
        """The base model's last hidden states of `row` from position `start` on, no gradients:
        the longest cached prefix of row[:start] is not computed again, and row[:start] is kept
        for the next read (learner/micro_batches.py names the other half of this: rows that
        begin other rows)."""
        hit = self._base_kv.longest(None, None, row, start)
        done = hit.length if hit is not None else 0
        cache = kv_cache.to_cache(hit.kv) if hit is not None else kv_cache.new_cache()
        ids = torch.tensor([row[done:]], device=self.device)
        hidden = backbone(input_ids=ids, use_cache=True, **{kv_cache.cache_argument(backbone): cache}).last_hidden_state
        if start > done and kv_cache.reusable(cache):
            self._base_kv.put(None, None, row[:start], kv_cache.tokens(kv_cache.tensors(cache), 0, start, copy=True))
        return hidden[0, start - done:]

    def _backbone_and_head(self) -> tuple[torch.nn.Module, torch.nn.Module] | None:
        model = self.model.get_base_model() if self.model is not None else self._base
        config = model.config
        plain = not getattr(config, "final_logit_softcapping", None) and getattr(config, "logit_scale", None) in (None, 1, 1.0)
        backbone, head = getattr(model, "model", None), getattr(model, "lm_head", None)
        if not plain or backbone is None or not isinstance(head, torch.nn.Linear):
            return None
        return backbone, head

    def _encoded(self, texts: list[str]) -> list[list[int]]:
        """Plain texts as token ids without special tokens (the probe's and the replay's prose),
        a text of one token left out: it has nothing to predict."""
        tokenizer = self._chat().tokenizer
        return [ids for text in texts if len(ids := tokenizer.encode(text, add_special_tokens=False)) > 1]

    def _chat(self) -> ChatRenderer:
        """The model's tokenizer and chat template, loaded once for the probe and the gate's prompts."""
        if self._renderer is None:
            self._renderer = ChatRenderer.from_dir(self.model_dir)
        return self._renderer
