"""LoRA training on the learner's own copy of the base model.

One peft model holds one adapter per scope ("shared", or one per user), each with its own
AdamW state, so per-user adapters train on per-user samples only. A step that produces a
non-finite loss or gradient is rolled back (weights and optimizer state) and reported as
skipped. A step that moves the policy further than `max_kl` (measured on the batch's tokens,
from the weights before the step) is not thrown away but shortened along its own direction
until it fits (a backtracking line search, as TRPO's; `step_sizes.py` says how the lengths are
chosen), and undone only when it still does not fit at the floor. Calls are blocking and meant for a worker thread.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import math
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.utils.checkpoint
from torch.nn.utils import get_total_norm
from transformers import LogitsProcessorList

from nextstate.core.settings import LearnerSettings
from nextstate.core.types import Sample
from nextstate.engine import kv_cache
from nextstate.engine.prefix_cache import PrefixCache
from nextstate.learner.distillation import shifted_target, teacher_topk, topk_reverse_kl, with_tail
from nextstate.learner.gate import GATE_SAMPLED_REPLIES, REPETITION_WORDS, GateFigures, Replies, mean, repetition, surprise
from nextstate.learner.learning_rate import resolve_learning_rate, warmed_up
from nextstate.learner.held_out import HintMove, VersionFigures, figures as held_out_figures, probe_passages, shipped_lines
from nextstate.learner.host_memory import release_freed_memory
from nextstate.learner.memory_budget import MemoryBudget, Refusal
from nextstate.learner.micro_batches import length_groups, micro_batches, padded_tokens, prefix_hosts
from nextstate.learner.ppo import k3_kl, ppo_token_losses
from nextstate.learner.prompt_prefix import PromptPrefixes, read_through
from nextstate.learner.seeded_sampling import SeededGumbel, row_seed
from nextstate.learner.step_sizes import KlTry, StepSizes
from nextstate.modelio.chat_template import ChatRenderer
from nextstate.modelio.logprobs import tempered_log_softmax, token_logprobs

log = logging.getLogger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
OPTIMIZER_STATE = "optimizer.pt"


# The optimiser and clipping of OpenClaw-RL's training recipe (paper appendix A), fixed rather
# than configurable: AdamW with weight decay 0.1 and betas (0.9, 0.98), gradient norm clipped
# to 1, PPO's ratio clipped to [1 - 0.2, 1 + 0.28] (the asymmetric "clip-higher" bounds).
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.98)
GRAD_CLIP = 1.0
# NEXTSTATE_EMPTY_GUARD's hinge counts as this many response tokens' loss: a sample's whole
# reply is ~10-50 tokens, each pushed by an advantage of at most a few units, and the drift
# towards empty replies is their side effect; one strongly weighted position holds it back.
EMPTY_GUARD_WEIGHT = 8.0
# Passages of the replay prose read per optimizer step (replay_coef): two of ~90 tokens each.
REPLAY_PASSAGES = 2
EPS = 0.2
EPS_HIGH = 0.28


@dataclass
class StepResult:
    scope: str
    samples: int
    tokens: int
    loss: float
    pg_loss: float
    clip_fraction: float
    kl_to_base: float
    policy_kl: float  # k3 estimate of KL(π_old ‖ π_new) on the batch after the update
    mismatch: float  # mean |train logprob − sampling logprob| before the update
    mean_advantage: float
    grad_norm: float
    seconds: float
    skipped: str | None = None
    dropped: list[int] = field(default_factory=list)  # ids of samples left out: their loss was not finite
    refused: bool = False  # not started: it would not fit in memory (the samples stay ready)
    step_scale: float = 1.0  # the share of the trained step kept (KL backtracking; the gate may shorten it further)
    max_kl: float | None = None  # the limit the step's KL was held to
    kl_tries: list[dict] = field(default_factory=list)  # each length tried: {"scale", "kl"}, the kept one last
    epochs: int = 1  # passes made over the batch (ppo_epochs, fewer once epoch_kl_share's KL was reached)
    epoch_kls: list[float] = field(default_factory=list)  # the batch's policy KL after each pass but the last
    pass_tokens: int = 0  # padded tokens a forward pass could hold (the step's memory plan)
    peak_added_mb: float = 0.0  # the most a training pass added to memory, measured
    distill_kl: float = 0.0  # mean KL(π_θ ‖ π_teacher) over distilled tokens in training (NEXTSTATE_OPD_LOSS=topk)
    guarded: int = 0  # sample passes whose empty-reply chance was over NEXTSTATE_EMPTY_GUARD, and pushed down
    replay_kl: float = 0.0  # KL(base ‖ policy) per token on the replay prose before each optimizer step, mean (NEXTSTATE_REPLAY_COEF)
    # where its seconds went: the teacher's targets, the training passes, the KL checks between
    # passes, the KL line search (a profile per update, in the step's record)
    timings: dict[str, float] = field(default_factory=dict)

    @classmethod
    def not_started(cls, scope: str, samples: list[Sample], refusal: Refusal) -> StepResult:
        nan = float("nan")
        return cls(scope=scope, samples=len(samples), tokens=sum(sum(s.loss_mask) for s in samples), loss=nan,
                   pg_loss=nan, clip_fraction=nan, kl_to_base=nan, policy_kl=nan, mismatch=nan, mean_advantage=nan,
                   grad_norm=nan, seconds=0.0, skipped=refusal.reason(), refused=True)

    def to_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


# Response positions go through the LM head at once in training so that their fp32 logits take
# about this much (LoraTrainer._logprobs_many): with its log-softmax and gradient a chunk costs
# three times it. 1,024 positions on SmolLM2's 49k vocabulary (192 MiB of logits) added 0.6 GB
# on the CPU for nothing: a smaller chunk is as fast, the matmul stays large.
LOGITS_CHUNK_BYTES = 64 << 20
# Base-model repetition figures the publish gate keeps (one per recent prompt).
BASE_REPLIES_KEPT = 256
# Base-model logprobs of held-out turns kept (NEXTSTATE_HELD_OUT_MAX per user, several users).
BASE_HELD_OUT_KEPT = 4096
# The base model's keys and values kept of the prompts it read (LoraTrainer._base_hidden): an
# agent's conversation, about 4.5k tokens of SmolLM2 at 46 KB each in fp32, twice over.
BASE_KV_BYTES = 512 << 20
# What one gate read keeps of the prompts it read, for the next of them that shares a start.
GATE_KV_BYTES = 1 << 30


def logit_rows(vocab_size: int) -> int:
    """Response positions per LM-head chunk: LOGITS_CHUNK_BYTES of fp32 logits, 64 to 1,024."""
    return max(64, min(1024, LOGITS_CHUNK_BYTES // (4 * vocab_size)))


def learner_dtype(setting: str, device: str) -> torch.dtype:
    if setting == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return getattr(torch, setting)


def steps_taken(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer steps this scope's optimizer has taken, from its own state (kept with the
    adapter, restored with an undone update, emptied by fresh_optimizer)."""
    return max((int(state["step"]) for state in optimizer.state.values() if "step" in state), default=0)


def adapter_name(scope: str) -> str:
    """peft adapter names become module keys: keep them to letters and digits."""
    return "a" + hashlib.sha256(scope.encode()).hexdigest()[:16]


class ResponsePass(NamedTuple):
    """One sample's side of a forward pass (LoraTrainer._response_logprobs)."""

    token: torch.Tensor  # [response tokens] the response tokens' logprobs
    gathered: torch.Tensor | None  # [response tokens, K] the given ids' logprobs, where ids were given
    first_stop: torch.Tensor | None  # log chance of a stop token first (an empty reply), where asked


class LoraTrainer:
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
        self.lr = resolve_learning_rate(settings.lr, self._base.config)
        self.logit_rows = logit_rows(self._base.config.vocab_size)
        self.memory = MemoryBudget(self._base.config, self.dtype, device, self.logit_rows, settings.learner_memory_mb)
        self._pass_tokens = settings.micro_batch_tokens  # the step's, from its memory plan
        how = "auto, fitted to the model's size" if settings.lr == "auto" else "NEXTSTATE_LR"
        log.info("learner: learning rate %.3g (%s)", self.lr, how)
        # Activations are recomputed in the backward pass instead of kept: memory grows with a
        # sample's length, and agent samples run to thousands of tokens.
        if hasattr(self._base, "activation_checkpointing_enable"):  # transformers >= 5.x names it so
            self._base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            self._base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = None  # peft.PeftModel once the first scope exists
        self._optimizers: dict[str, torch.optim.Optimizer] = {}
        self._before: dict[str, tuple[list[torch.Tensor], dict]] = {}  # per scope: state before its last step
        self.step_sizes = StepSizes(settings.max_kl, settings.kl_backtracks)  # per scope: where a step starts
        # the gate's base-model repetition per prompt, the most recently used BASE_REPLIES_KEPT
        # per prompt: each reply's repetition, and the chance of an empty reply
        self._base_replies: OrderedDict[tuple, tuple[list[float | None], float]] = OrderedDict()
        # the base model's side of the held-out figures (learner/held_out.py): per sample id, and the probe
        self._base_held_out: OrderedDict[int, torch.Tensor] = OrderedDict()
        # per held-out turn with a hint: (the hinted base model's top-K ids, their log-probabilities, the unhinted base's)
        self._base_hint_moves: OrderedDict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = OrderedDict()
        self._base_probe_nll: float | None = None
        self._probe: list[list[int]] | None = None
        self._everyday: list[list[int]] | None = None  # the gate's shipped prompts, rendered once
        self._replay: list[list[int]] | None = None  # the replay passages, tokenised once
        self._replay_next = 0  # which passage the next optimizer step reads
        self._renderer: ChatRenderer | None = None
        # the base model's keys and values of prompts it read (`_base_hidden`), and whether the
        # passes running now read the base model (`_base_model`)
        self._base_kv = PrefixCache(BASE_KV_BYTES)
        self._reading_base = False
        # an update's long prompts read once per weights, without gradients (learner/prompt_prefix.py)
        self._prefixes = PromptPrefixes()

    # ---------------------------------------------------------------- scopes

    def _lora_config(self):
        from peft import LoraConfig

        c = self.settings
        return LoraConfig(r=c.lora_r, lora_alpha=c.lora_alpha, lora_dropout=0.0, target_modules=list(c.target_modules), task_type="CAUSAL_LM")

    def ensure_scope(self, scope: str) -> str:
        from peft import get_peft_model

        name = adapter_name(scope)
        if self.model is None:
            with warnings.catch_warnings():
                # peft asks the model through transformers' deprecated alias; nothing for a user to do
                warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
                self.model = get_peft_model(self._base, self._lora_config(), adapter_name=name)
        elif name not in self.model.peft_config:
            self.model.add_adapter(name, self._lora_config())
        if scope not in self._optimizers:
            self._optimizers[scope] = torch.optim.AdamW(
                self._params(name), lr=self.lr, weight_decay=WEIGHT_DECAY, betas=BETAS
            )
        return name

    def drop_scope(self, scope: str) -> None:
        """Forget a scope's adapter and optimizer state (its user asked to be forgotten)."""
        name = adapter_name(scope)
        self._base_kv.drop(None)  # what the base model read of their prompts goes with them (entries name no user)
        self._optimizers.pop(scope, None)
        self._before.pop(scope, None)
        self.step_sizes.forget(scope)
        if self.model is not None and name in self.model.peft_config and len(self.model.peft_config) > 1:
            self.model.delete_adapter(name)
        elif self.model is not None and name in self.model.peft_config:
            # peft keeps at least one adapter: reset this one to zero instead of deleting it
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    if f".{name}." in n and "lora_B" in n:
                        p.zero_()

    def _params(self, name: str) -> list[torch.nn.Parameter]:
        params = [p for n, p in self.model.named_parameters() if "lora_" in n and f".{name}." in n]
        for p in params:
            if p.dtype != torch.float32:  # LoRA weights and AdamW state in fp32 over a bf16 base
                p.data = p.data.float()
            p.requires_grad_(True)
        return params

    def _activate(self, scope: str) -> tuple[str, list[torch.nn.Parameter]]:
        name = self.ensure_scope(scope)
        self.model.set_adapter(name)
        return name, self._params(name)

    def _at_base(self, scope: str) -> bool:
        """Whether the scope's weights are still the base model's (every LoRA B zero, as peft
        makes them: a scope's first update, or one undone back to the start). Its figures are
        then the base model's, which are computed once and kept; on an agent's 5-8k-token
        prompts that spares a new user's first update minutes of a CPU."""
        name = self.ensure_scope(scope)
        return all(not p.any() for n, p in self.model.named_parameters() if "lora_B" in n and f".{name}." in n)

    # ---------------------------------------------------------------- persistence

    def save(self, scope: str, path: Path) -> None:
        """Write the scope's adapter in peft's standard layout (loadable by peft and SGLang)."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        name = self.ensure_scope(scope)
        state = get_peft_model_state_dict(self.model, adapter_name=name)
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(path / ADAPTER_WEIGHTS))
        config = self.model.peft_config[name].to_dict()
        config["base_model_name_or_path"] = str(self.model_dir)
        config["target_modules"] = sorted(config["target_modules"])
        (path / "adapter_config.json").write_text(json.dumps(config, indent=1, default=str))
        torch.save(self._optimizers[scope].state_dict(), path / OPTIMIZER_STATE)

    def load(self, scope: str, path: Path) -> None:
        """Resume a scope from a published version: weights and optimizer state."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        name = self.ensure_scope(scope)
        set_peft_model_state_dict(self.model, load_file(str(path / ADAPTER_WEIGHTS)), adapter_name=name)
        optimizer_file = path / OPTIMIZER_STATE
        if optimizer_file.is_file():
            self._optimizers[scope].load_state_dict(torch.load(optimizer_file, weights_only=True))

    # ---------------------------------------------------------------- training

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
        stops = self._stop_ids(self.model if self.model is not None else self._base) if first_stop else []

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
        self, samples: list[Sample], reference: Sequence[int] = ()
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor] | None], dict[int, torch.Tensor]]:
        """Per sample to distil (`distill_weight`, NEXTSTATE_OPD_LOSS=topk): the target's
        log-probabilities over the base model's top `opd_topk` next tokens after the teacher's
        prompt and one bin for the rest ([n, K + 1]), with those token ids ([n, K]), at each
        response position; None for the others. The target is the hinted base model itself or,
        with NEXTSTATE_OPD_TARGET=shift, the policy before this update moved by what the hint
        changes in the base model (learner/distillation.py). Computed once per update, without
        gradients, before any of its steps.

        Also the policy's log-probabilities of the sampled tokens before the update for the
        samples in `reference` (the step's KL needs them for the samples its first optimizer
        step does not see), from the same forward pass as the shift target's policy side: one
        pass per sample where these were two (of 16 samples in four steps, 28 passes → 16)."""
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(samples)
        todo = [i for i, s in enumerate(samples) if s.distill_weight and s.teacher_prompt_ids]
        if not todo or self.settings.opd_target == "teacher":
            for i, (values, ids) in self._hinted_topk(samples, todo).items():
                out[i] = (with_tail(values), ids)
            return out, {i: token for i, (token, _) in self._policy_passes(samples, list(reference), {}).items()}
        sides = self._base_sides(samples, todo)
        policy = self._policy_passes(samples, sorted(set(todo) | set(reference)), {i: ids for i, (ids, _, _) in sides.items()})
        for i, (ids, hinted, unhinted) in sides.items():
            out[i] = (shifted_target(policy[i][1], hinted, unhinted, self.settings.opd_anchor,
                                     self.settings.opd_shift_scale), ids)
        return out, {i: policy[i][0] for i in reference}

    def _base_sides(self, samples: list[Sample], todo: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """For samples[i], i in `todo`: the hint's side of the base model — the hinted base
        model's top K ids at each response position, their log-probabilities after the hinted
        prompt, and after the prompt the hint is measured against: the sample's own, or its
        hint's placebo (`contrast_prompt_ids`, judge/hindsight.py). The shift target's and the
        `wish` figure's base model, which never changes. No gradients."""
        hinted = self._hinted_topk(samples, todo)
        ids = {i: top for i, (_, top) in hinted.items()}
        against = [s.model_copy(update={"prompt_ids": s.contrast_prompt_ids}) if s.contrast_prompt_ids else s
                   for s in samples]
        with self._base_model():
            unhinted = self._gathered(against, todo, ids)
        return {i: (ids[i], hinted[i][0], unhinted[i]) for i in todo}

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
        with self.model.disable_adapter():
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

    # ---------------------------------------------------------------- what a version gained and forgot

    def version_figures(self, scope: str, held_out: list[Sample], probe: bool = True) -> VersionFigures:
        """The scope's weights as they are now, scored on `held_out` and (`probe`) the
        general-text probe (learner/held_out.py). The base model's side of both is computed
        once and kept. The gate scores the serving version without the probe: its forgetting is
        compared with nothing, and the probe is most of the cost."""
        self._activate(scope)
        self.model.eval()
        at_base = self._at_base(scope)
        with torch.no_grad():
            now = self._logprobs_each(held_out) if held_out and not at_base else []
            base: list[torch.Tensor | None] = [self._base_held_out.get(s.id) if s.id is not None else None for s in held_out]
            missing = [i for i, b in enumerate(base) if b is None]
            if missing or (probe and self._base_probe_nll is None):
                with self._base_model():
                    for i, lp in zip(missing, self._logprobs_each([held_out[i] for i in missing]) if missing else []):
                        base[i] = lp
                        if held_out[i].id is not None:
                            self._base_held_out[held_out[i].id] = lp
                    if probe and self._base_probe_nll is None:
                        self._base_probe_nll = self._probe_nll()
            probe_nll = (self._base_probe_nll if at_base else self._probe_nll()) if probe else None
            moves = self._hint_moves(held_out, at_base)
        if at_base:
            now = [b for b in base if b is not None]  # every one filled above
        while len(self._base_held_out) > BASE_HELD_OUT_KEPT:
            self._base_held_out.popitem(last=False)
        return held_out_figures(held_out, now, base, probe_nll, self._base_probe_nll, moves)  # type: ignore[arg-type]

    def _hint_moves(self, held_out: list[Sample], at_base: bool = False) -> list[HintMove | None]:
        """Per held-out turn with a teacher's prompt (a hint or correction): the hinted base
        model's top K at each response position, the base model's log-probabilities of them
        without the hint (both computed once and kept), and the active weights' (the `wish`
        figure, learner/held_out.py; the base model's again while they are `at_base`); None for
        the others."""
        todo = [i for i, s in enumerate(held_out) if s.teacher_prompt_ids and s.id is not None]
        if not todo:
            return [None] * len(held_out)
        missing = [i for i in todo if held_out[i].id not in self._base_hint_moves]
        if missing:
            for i, sides in self._base_sides(held_out, missing).items():
                self._base_hint_moves[held_out[i].id] = sides
        for i in todo:
            self._base_hint_moves.move_to_end(held_out[i].id)
        while len(self._base_hint_moves) > BASE_HELD_OUT_KEPT:
            self._base_hint_moves.popitem(last=False)
        kept = {i: self._base_hint_moves[held_out[i].id] for i in todo}
        version = ({i: unhinted for i, (_, _, unhinted) in kept.items()} if at_base
                   else self._gathered(held_out, todo, {i: ids for i, (ids, _, _) in kept.items()}))
        return [HintMove(kept[i][1], kept[i][2], version[i]) if i in kept else None for i in range(len(held_out))]

    def _replay_passages(self) -> list[list[int]]:
        """The replay prose, tokenised on first use: a learner with replay off never reads it."""
        if self._replay is None:
            self._replay = self._encoded(shipped_lines("replay_text.txt"))
        return self._replay

    def _encoded(self, texts: list[str]) -> list[list[int]]:
        """Plain texts as token ids without special tokens (the probe's and the replay's prose),
        a text of one token left out: it has nothing to predict."""
        tokenizer = self._chat().tokenizer
        return [ids for text in texts if len(ids := tokenizer.encode(text, add_special_tokens=False)) > 1]

    def _replay_backward(self, coef: float, params: list[torch.nn.Parameter], share: float = 0.0) -> float:
        """Adds to the gradients `coef` times KL(base ‖ policy) per token on the next
        REPLAY_PASSAGES of the shipped replay prose (settings: replay_coef says why); returns
        that KL. The base model's side is the same weights with the adapter off, no copy.
        `share` > 0: the replay's own gradient is scaled down to at most `share` times the norm
        of the gradient already there, the batch's (settings: replay_grad_share)."""
        batch_grads = None
        if share > 0:
            batch_grads = [None if p.grad is None else p.grad.clone() for p in params]
            for p in params:
                p.grad = None
        total = self._replay_loss_backward(coef)
        if batch_grads is not None:
            batch_norm = float(get_total_norm([g for g in batch_grads if g is not None]))
            replay_norm = float(get_total_norm([p.grad for p in params if p.grad is not None]))
            scale = min(1.0, share * batch_norm / max(replay_norm, 1e-12))
            for p, g in zip(params, batch_grads):
                if p.grad is not None and scale < 1:
                    p.grad.mul_(scale)
                if g is not None:
                    p.grad = g if p.grad is None else p.grad.add_(g)
        return total

    def _replay_loss_backward(self, coef: float) -> float:
        """`_replay_backward`'s loss and its gradients, added to those there; returns its KL."""
        passages = self._replay_passages()
        total = 0.0
        for _ in range(REPLAY_PASSAGES):
            ids = torch.tensor([passages[self._replay_next % len(passages)]], device=self.device)
            self._replay_next += 1
            with torch.no_grad(), self.model.disable_adapter():
                base = torch.log_softmax(self.model(input_ids=ids).logits.float(), dim=-1)
            policy = torch.log_softmax(self.model(input_ids=ids).logits.float(), dim=-1)
            kl = (base.exp() * (base - policy)).sum(-1).mean()
            (coef * kl / REPLAY_PASSAGES).backward()
            total += float(kl.detach()) / REPLAY_PASSAGES
        return total

    def _probe_nll(self) -> float:
        """Mean NLL per token of the general-text probe under the active weights (no grad)."""
        if self._probe is None:
            self._probe = self._encoded(probe_passages())
        total, tokens = 0.0, 0
        for group in micro_batches([ids[:-1] for ids in self._probe], self._pass_tokens):
            rows = [self._probe[i] for i in group]

            def at(logits: torch.Tensor, i: int, part: slice) -> torch.Tensor:
                return token_logprobs(logits, torch.tensor(rows[i][1:], device=self.device)[part], 1.0)

            for pieces in self._over_responses([r[:-1] for r in rows], [len(r) - 1 for r in rows], at):
                scores = torch.cat(pieces)
                total -= float(scores.sum())
                tokens += scores.numel()
        return total / max(1, tokens)

    # ---------------------------------------------------------------- the publish gate

    def gate_figures(self, scope: str, liked: list[Sample], prompts: list[list[int]], max_new: int) -> GateFigures:
        """The scope's current weights scored as learner/gate.py says."""
        self._activate(scope)
        self.model.eval()
        with torch.no_grad():
            per_token = [float(lp.mean()) for lp in self._logprobs_each(liked)] if liked else []
        if self._at_base(scope):  # the base model's replies, answered once for the gate's base side too
            repeats, empty = self.base_figures(prompts, max_new)
            return GateFigures(mean(per_token), repeats, empty=empty,
                               surprise=0.0 if self.settings.gate_max_surprise and prompts else None)
        replies = self.gate_replies(prompts, max_new)
        figures = GateFigures(mean(per_token), mean([self._repetition(r) for r in replies.ids]), empty=mean(replies.empty))
        if self.settings.gate_max_surprise and prompts:
            own = self.base_own_readings(prompts, max_new)
            per_prompt = len(replies.ids) // len(prompts)
            read = self.base_readings([p for p in prompts for _ in range(per_prompt)], replies.ids)
            figures.surprise = mean([surprise(r, own[i // per_prompt]) for i, r in enumerate(read)])
        return figures

    def _repetition(self, reply: list[int]) -> float | None:
        """A gate reply's repetition, read in words as learner/gate.py says."""
        return repetition(self._chat().tokenizer.decode(reply, skip_special_tokens=True), REPETITION_WORDS)

    def gate_replies(self, prompts: list[list[int]], max_new: int) -> Replies:
        """The active weights' replies whose repetition the gate measures (`gate_replies`)."""
        if self.settings.gate_replies == "greedy":
            return self.greedy(prompts, max_new)
        return self.sampled(prompts, max_new, GATE_SAMPLED_REPLIES)

    def sampled(self, prompts: list[list[int]], max_new: int, n: int) -> Replies:
        """`n` replies to each prompt sampled at temperature 1 (`ids`: a prompt's n together, in
        the prompts' order), each from a random stream seeded by the prompt and the reply's index
        alone (learner/seeded_sampling.py): the same draws for every weights asked, whatever else
        runs or shares the batch (common random numbers), all in one batch."""
        return self._generate(prompts, max_new, n)

    def greedy(self, prompts: list[list[int]], max_new: int) -> Replies:
        """Greedy replies of the active weights (the adapter as it is now, or none), all prompts
        in one left-padded batch: on a CPU four SmolLM2 replies take ~1.5x one, not 4x."""
        return self._generate(prompts, max_new, None)

    def _generate(self, prompts: list[list[int]], max_new: int, sampled: int | None) -> Replies:
        """Greedy replies, or `sampled` replies per prompt at temperature 1 (greedy decoding of
        seeded Gumbel-perturbed logits), with each prompt's chance of an empty reply. Prompts go
        in left-padded batches of similar lengths: eight everyday questions padded to an agent
        prompt's 2k tokens cost as much as four more agent prompts (45 of 76 s of one read)."""
        per_prompt = sampled or 1
        ids: list[list[list[int]]] = [[] for _ in prompts]
        empty: list[float] = [0.0] * len(prompts)
        for group in length_groups([len(p) for p in prompts]):
            replies = self._generate_batch([prompts[i] for i in group], max_new, sampled)
            for k, i in enumerate(group):
                ids[i], empty[i] = replies.ids[k * per_prompt:(k + 1) * per_prompt], replies.empty[k]
        return Replies([reply for replies in ids for reply in replies], empty)

    def _generate_batch(self, prompts: list[list[int]], max_new: int, sampled: int | None) -> Replies:
        model = self.model if self.model is not None else self._base
        pad = self._pad_id(model)
        per_prompt = sampled or 1
        rows = [p[-self.settings.max_train_tokens:] for p in prompts for _ in range(per_prompt)]
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=self.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        noise = LogitsProcessorList([SeededGumbel([row_seed(p, j) for p in prompts for j in range(per_prompt)], width)]
                                    if sampled else [])
        read = {}
        if width > 1:
            read["past_key_values"] = self._read_once(model, rows[::per_prompt], width, per_prompt)
        with torch.no_grad(), warnings.catch_warnings():
            # transformers 5 renames generate's past_key_values to `cache`; 4.56-4.x, which
            # pyproject allows, know only the old name
            warnings.filterwarnings("ignore", message="`past_key_values` is deprecated", category=FutureWarning)
            generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                                       do_sample=False, use_cache=True, pad_token_id=pad, logits_processor=noise,
                                       return_dict_in_generate=True, output_logits=True, **read)
        empty = self._empty_chance(model, generated.logits[0][::per_prompt])  # a prompt's rows share their first step
        return Replies([self._until_stop(model, row) for row in generated.sequences[:, width:].tolist()], empty)

    def _read_once(self, model: torch.nn.Module, prompts: list[list[int]], width: int, replies: int) -> Any:
        """The KV cache of each prompt but its last token, left-padded to `width` - 1, read once
        and repeated for each of its `replies`: reading an agent's prompt once per reply doubled
        the sampled gate check's prefill on a CPU. Each prompt is read alone, from the longest
        prefix an earlier one of them shares with it (an agent's turns share its system prompt
        and conversation: four OpenClaw prompts are 4.5k tokens read, not 16k); its positions
        start at 0 as generate gives them from the mask, so the replies are a full read's."""
        if any(len(p) < 2 for p in prompts):
            return None  # a one-token prompt has nothing to read first: generate reads them all
        kept = PrefixCache(GATE_KV_BYTES)
        rows = [kv_cache.pad_left(read_through(kept, model, p[:-1], named_by=self._base), width - len(p)) for p in prompts]
        return kv_cache.to_cache(tuple((k.repeat_interleave(replies, 0), v.repeat_interleave(replies, 0))
                                       for k, v in kv_cache.stack(rows)))

    @staticmethod
    def _pad_id(model: torch.nn.Module) -> int:
        pad = model.generation_config.pad_token_id or model.generation_config.eos_token_id
        return pad[0] if isinstance(pad, list) else pad

    @staticmethod
    def _stop_ids(model: torch.nn.Module) -> list[int]:
        eos = model.generation_config.eos_token_id
        return sorted(set(eos if isinstance(eos, list) else [eos])) if eos is not None else []

    @classmethod
    def _until_stop(cls, model: torch.nn.Module, row: list[int]) -> list[int]:
        """A generated row cut after its stop token (rows that finished early are padded out)."""
        stops = set(cls._stop_ids(model))
        return row[:next((i + 1 for i, t in enumerate(row) if t in stops), len(row))]

    @classmethod
    def _empty_chance(cls, model: torch.nn.Module, first_logits: torch.Tensor) -> list[float]:
        """Per row, the stop tokens' share of the first token's distribution at temperature 1: the
        chance that a sampling client is served an empty reply. Read from the generation's own
        first step, so it costs nothing, and a probability, so it sees what eight greedy replies
        cannot (a version that ends one reply in twenty before it begins)."""
        stops = cls._stop_ids(model)
        if not stops:
            return [0.0] * first_logits.shape[0]
        return torch.softmax(first_logits.float(), dim=-1)[:, stops].sum(-1).tolist()

    def everyday_prompts(self, n: int) -> list[list[int]]:
        """The first `n` shipped everyday questions as chat prompts of this model, for the gate's
        repetition check where a scope has too few prompts of its own (learner/gate.py)."""
        if self._everyday is None:
            self._everyday = [self._chat().render([{"role": "user", "content": q}]).ids
                              for q in shipped_lines("everyday_questions.txt")]
        return self._everyday[:n]

    def _chat(self) -> ChatRenderer:
        """The model's tokenizer and chat template, loaded once for the probe and the gate's prompts."""
        if self._renderer is None:
            self._renderer = ChatRenderer.from_dir(self.model_dir)
        return self._renderer

    def base_readings(self, prompts: list[list[int]], replies: list[list[int]]) -> list[list[float]]:
        """The base model's log-probability of each token of each reply given its prompt (a
        trailing stop token left out: ending is what a length wish asks for), packed into
        forward passes as training is (the gate's `surprise`)."""
        stops = set(self._stop_ids(self.model))
        bodies = [r[:-1] if r and r[-1] in stops else r for r in replies]
        rows = [p[-self.settings.max_train_tokens:] + b for p, b in zip(prompts, bodies)]
        todo = [i for i, b in enumerate(bodies) if b]
        out: list[list[float]] = [[] for _ in replies]
        with torch.no_grad(), self._base_model():
            for group in micro_batches([rows[i][:-1] for i in todo], self._pass_tokens):
                members = [todo[j] for j in group]

                def at(logits: torch.Tensor, k: int, part: slice) -> torch.Tensor:
                    return token_logprobs(logits, torch.tensor(bodies[members[k]], device=self.device)[part], 1.0)

                for i, pieces in zip(members, self._over_responses([rows[i][:-1] for i in members],
                                                                   [len(bodies[i]) for i in members], at)):
                    out[i] = torch.cat(pieces).tolist()
        return out

    def base_own_readings(self, prompts: list[list[int]], max_new: int) -> list[list[list[float]]]:
        """Per prompt, the base model's readings of its own gate replies (`base_figures` answers
        and keeps them): what a version's replies are compared with."""
        self.base_figures(prompts, max_new)
        return [self._base_replies[key][2] for key in self._base_reply_keys(prompts, max_new)]

    def _base_reply_keys(self, prompts: list[list[int]], max_new: int) -> list[tuple]:
        how = self.settings.gate_replies
        return [(hash(tuple(p)), len(p), max_new, how) for p in prompts]  # a digest: prompts run to thousands of tokens

    def base_figures(self, prompts: list[list[int]], max_new: int) -> tuple[float | None, float | None]:
        """The base model's repetition and chance of an empty reply on these prompts, on the
        replies `gate_replies` names; the base never changes, so each prompt is answered once (on
        a CPU a reply of SmolLM2 costs seconds)."""
        how = self.settings.gate_replies
        keys = self._base_reply_keys(prompts, max_new)
        missing = [(k, p) for k, p in zip(keys, prompts) if k not in self._base_replies]
        if missing:
            n = 1 if how == "greedy" else GATE_SAMPLED_REPLIES  # a prompt's sampled replies count one each in the mean
            with self.model.disable_adapter():
                answer = (self.greedy([p for _, p in missing], max_new) if how == "greedy"
                          else self.sampled([p for _, p in missing], max_new, n))
            read = (self.base_readings([p for _, p in missing for _ in range(n)], answer.ids)
                    if self.settings.gate_max_surprise else [[] for _ in answer.ids])
            per_prompt = [([self._repetition(r) for r in answer.ids[j * n:(j + 1) * n]], empty, read[j * n:(j + 1) * n])
                          for j, empty in enumerate(answer.empty)]
            self._base_replies.update((key, figures) for (key, _), figures in zip(missing, per_prompt))
        repeats = mean([v for k in keys for v in self._base_replies[k][0]])
        empty = mean([self._base_replies[k][1] for k in keys])
        for key in keys:
            self._base_replies.move_to_end(key)
        while len(self._base_replies) > BASE_REPLIES_KEPT:
            self._base_replies.popitem(last=False)
        return repeats, empty

    def shorten_step(self, scope: str, factor: float) -> None:
        """Take the scope's weights back along their last step to `factor` of its length (the
        optimizer's moments keep the step's gradients: they were measured, only the move was
        too long). `undo` still goes back to before the whole step."""
        weights, _ = self._before[scope]
        _, params = self._activate(scope)
        with torch.no_grad():
            for p, before in zip(params, weights):
                p.lerp_(before, 1 - factor)
        self._prefixes.clear()

    def undo(self, scope: str) -> None:
        """Put the scope's weights and optimizer state back to before the last step (its
        version could not be published, so training goes on from the last one that was)."""
        if scope in self._before:
            self._restore(scope, *self._before.pop(scope))

    def _restore(self, scope: str, weights: list[torch.Tensor], optimizer_state: dict) -> None:
        _, params = self._activate(scope)
        with torch.no_grad():
            for p, before in zip(params, weights):
                p.copy_(before)
        self._optimizers[scope].load_state_dict(optimizer_state)

    def _policy_kl(self, samples: list[Sample], before: list[torch.Tensor]) -> float:
        """Mean per-token k3 divergence of the policy now from the policy before this step
        (`before`: its logprobs of the samples' tokens), over the samples' response tokens.

        Measured from the weights before the step, not from the sampler's logprobs: a sample
        served one or two versions ago already differs from the policy by the earlier updates,
        which no shortening of this step can take back — measured from the sampler, a batch with
        such samples could be over the limit at every length, and never be published."""
        total, tokens = 0.0, 0
        with torch.no_grad():
            for sample, old, new in zip(samples, before, self._logprobs_each(samples)):
                mask = torch.tensor(sample.loss_mask, device=self.device, dtype=torch.float32)
                total += float((k3_kl(old, new) * mask).sum())
                tokens += sum(sample.loss_mask)
        return total / max(1, tokens)

    @staticmethod
    def _kept(samples: list[Sample], dropped: set[int], before: list[torch.Tensor | None]
              ) -> tuple[list[Sample], list[torch.Tensor]]:
        """The samples a step trained (none `dropped`) and the policy's logprobs of each before it."""
        kept = [i for i in range(len(samples)) if i not in dropped]
        reference = [before[i] for i in kept]
        assert all(r is not None for r in reference), "every kept sample had a forward pass before the step"
        return [samples[i] for i in kept], reference  # type: ignore[return-value]

    def _fit_kl(self, scope: str, samples: list[Sample], before: list[torch.Tensor],
                at_full: float | None = None) -> tuple[float, list[KlTry]]:
        """Shorten the scope's trained step until its policy KL fits `max_kl`, or the floor is
        reached. Returns the KL of the length kept and every length tried, the kept one last.
        `at_full`: the KL of the whole step, when it was measured already.

        The step starts at the scope's own starting length (smaller after a scope's steps
        overshot, `StepSizes`); each shortening is one forward pass over the batch without
        gradients, a third of what training it cost."""
        scale = self.step_sizes.start(scope)
        if scale < 1:
            self.shorten_step(scope, scale)
        kl = at_full if scale == 1 and at_full is not None else self._policy_kl(samples, before)
        tries = [KlTry(scale, kl)]
        while (shorter := self.step_sizes.next_scale(tries)) is not None:
            self.shorten_step(scope, shorter / tries[-1].scale)
            tries.append(KlTry(shorter, self._policy_kl(samples, before)))
        return tries[-1].kl, tries

    def memory_plan(self, samples: list[Sample]) -> int | Refusal:
        """The padded tokens a forward pass of a step on `samples` may hold, or why the step
        would not fit in memory now (learner/memory_budget.py)."""
        return self.memory.plan([self._row_length(s) for s in samples], self.settings.micro_batch_tokens)

    def step(self, scope: str, samples: list[Sample], progress: Callable[[int, int], None] | None = None) -> StepResult:
        """One PPO update on `samples`. A sample whose loss is not finite is left out (its id in
        `dropped`) and the others train; a step whose gradients or policy KL go wrong is undone.
        `progress(done, total)` hears of each training pass (a forward and backward over one
        micro-batch): on two cores an update on agent-size samples takes minutes."""
        with self._prefixes.during_update():
            return self._step(scope, samples, progress)

    def _step(self, scope: str, samples: list[Sample], progress: Callable[[int, int], None] | None) -> StepResult:
        started = time.monotonic()
        c = self.settings
        plan = self.memory_plan(samples)
        if isinstance(plan, Refusal):
            return StepResult.not_started(scope, samples, plan)
        self._pass_tokens = plan
        peak_added = 0
        _, params = self._activate(scope)
        optimizer = self._optimizers[scope]
        weights_before = [p.detach().clone() for p in params]
        optimizer_before = copy.deepcopy(optimizer.state_dict())
        self._before[scope] = (weights_before, optimizer_before)
        if c.fresh_optimizer:  # undo and a skipped step restore the moments kept just above
            optimizer.state.clear()
        dropped: set[int] = set()
        totals = {"loss": 0.0, "pg": 0.0, "kl": 0.0, "clipped": 0.0, "mismatch": 0.0, "grad_norm": 0.0, "distill": 0.0,
                  "distilled": 0.0, "guarded": 0.0, "replay": 0.0}
        tokens = sum(sum(s.loss_mask) for s in samples)
        mean_adv = sum(a * m for s in samples for a, m in zip(s.advantages, s.loss_mask)) / max(tokens, 1)
        skipped = None
        steps = epochs = 0
        epoch_kls: list[float] = []  # the batch's policy KL after each pass but the last (epoch_kl_share)
        passes = c.ppo_epochs * sum(len(self._micro_batches(samples[start: start + c.minibatch]))
                                    for start in range(0, len(samples), c.minibatch))
        done = 0
        # the policy before the step, for its KL (`_policy_kl`): the first optimizer step's own
        # forward passes give it for free; samples it does not see need a pass of their own
        before: list[torch.Tensor | None] = [None] * len(samples)
        self.model.eval()
        timings = dict.fromkeys(("teacher", "passes", "epoch_kl", "kl_fit"), 0.0)
        mark = time.monotonic()
        teacher, reference = self._teacher_targets(samples, range(c.minibatch, len(samples)))
        timings["teacher"] = time.monotonic() - mark
        for i, lp in reference.items():
            before[i] = lp
        self.model.train()
        try:
            for epoch in range(c.ppo_epochs):
                for start in range(0, len(samples), c.minibatch):
                    batch = samples[start : start + c.minibatch]
                    batch_tokens = max(1, sum(sum(s.loss_mask) for s in batch))
                    optimizer.zero_grad(set_to_none=True)
                    live = [i for i in range(start, start + len(batch)) if i not in dropped]
                    for group in self._micro_batches([samples[i] for i in live]):
                        members = [live[j] for j in group]
                        with self.memory.meter() as meter:
                            outputs = self._response_logprobs(
                                [samples[i] for i in members], [t[1] if (t := teacher[i]) else None for i in members],
                                first_stop=c.empty_guard > 0)
                            logprobs_of = [answer.token for answer in outputs]
                            base_of: list[torch.Tensor | None] = [None] * len(members)
                            if c.kl_coef > 0:
                                with torch.no_grad(), self._base_model():
                                    base_of = self._logprobs_many([samples[i] for i in members])
                            losses = []
                            for i, logprobs, base, answer in zip(members, logprobs_of, base_of, outputs):
                                student_topk = answer.gathered
                                s = samples[i]
                                if steps == 0 and before[i] is None:
                                    before[i] = logprobs.detach()
                                old = torch.tensor(s.old_logprobs, device=self.device)
                                # a single sample must never dominate an update, whatever its reward
                                adv = torch.tensor(s.advantages, device=self.device).clamp(-c.max_advantage, c.max_advantage)
                                mask = torch.tensor(s.loss_mask, device=self.device, dtype=torch.float32)
                                tok_loss, clipped, kl, pg = ppo_token_losses(logprobs, old, adv, EPS, EPS_HIGH, base, c.kl_coef)
                                if student_topk is not None:
                                    distill = topk_reverse_kl(student_topk, teacher[i][0]) * mask
                                    tok_loss = tok_loss + s.distill_weight * distill
                                    totals["distill"] += float(distill.detach().sum())
                                    totals["distilled"] += float(mask.sum())
                                loss = (tok_loss * mask).sum() / batch_tokens
                                if answer.first_stop is not None:  # an empty reply is no one's wish
                                    guard = torch.relu(answer.first_stop - math.log(c.empty_guard))
                                    loss = loss + EMPTY_GUARD_WEIGHT * guard / batch_tokens
                                    totals["guarded"] += float(guard.detach() > 0)
                                if not torch.isfinite(loss):
                                    dropped.add(i)  # this sample alone is left out; the batch trains on
                                    continue
                                losses.append(loss)
                                if epoch == 0:
                                    totals["mismatch"] += float(((logprobs.detach() - old).abs() * mask).sum())
                                totals["loss"] += float(loss.detach())
                                totals["pg"] += float((pg.detach() * mask).sum()) / batch_tokens
                                totals["kl"] += float((kl.detach() * mask).sum())
                                totals["clipped"] += float((clipped * mask).sum())
                            if losses:
                                torch.stack(losses).sum().backward()
                        padded = padded_tokens([self._row(samples[i]) for i in members])
                        self.memory.record(padded, meter.added)
                        peak_added = max(peak_added, meter.added)
                        done += 1
                        if progress is not None:
                            progress(min(done, passes), passes)
                    if c.replay_coef > 0:  # its gradients are checked with the batch's below
                        totals["replay"] += self._replay_backward(c.replay_coef, params, c.replay_grad_share)
                    if len(dropped) == len(samples) or not math.isfinite(totals["loss"]) or any(
                        p.grad is not None and not torch.isfinite(p.grad).all() for p in params
                    ):
                        skipped = "non-finite loss or gradient"
                        break
                    totals["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP))
                    for group in optimizer.param_groups:
                        group["lr"] = warmed_up(self.lr, steps_taken(optimizer), c.lr_warmup_steps)
                    optimizer.step()
                    self._prefixes.clear()
                    steps += 1
                if skipped:
                    break
                epochs += 1
                if epochs < c.ppo_epochs and c.epoch_kl_share > 0:  # PPO's early stop on KL, as a target
                    self.model.eval()
                    mark = time.monotonic()
                    epoch_kls.append(self._policy_kl(*self._kept(samples, dropped, before)))
                    timings["epoch_kl"] += time.monotonic() - mark
                    self.model.train()
                    if epoch_kls[-1] >= c.epoch_kl_share * self.step_sizes.max_kl:
                        break
            if progress is not None and epochs < c.ppo_epochs:  # the passes left were not needed
                progress(passes, passes)
            self.model.eval()
            policy_kl = 0.0
            kl_tries: list[KlTry] = []
            if not skipped:
                at_full = epoch_kls[-1] if len(epoch_kls) == epochs else None  # measured after the last pass
                mark = time.monotonic()
                policy_kl, kl_tries = self._fit_kl(scope, *self._kept(samples, dropped, before), at_full)
                timings["kl_fit"] = time.monotonic() - mark
                if not math.isfinite(policy_kl):
                    skipped = "policy KL not finite"
                elif policy_kl > self.step_sizes.max_kl:
                    skipped = (f"policy KL {policy_kl:.4g} exceeds the limit {self.step_sizes.max_kl:g} even at "
                               f"{kl_tries[-1].scale:g} of the step (tried {len(kl_tries)} lengths)")
        finally:
            self.model.eval()
            optimizer.zero_grad(set_to_none=True)
        if skipped:
            self._restore(scope, *self._before.pop(scope))
        denom = max(tokens * max(1, epochs), 1)
        timings["passes"] = time.monotonic() - started - sum(timings.values())  # training, replay included
        return StepResult(
            scope=scope,
            samples=len(samples),
            tokens=tokens,
            loss=totals["loss"] / max(steps, 1),
            pg_loss=totals["pg"] / max(steps, 1),
            clip_fraction=totals["clipped"] / denom,
            kl_to_base=totals["kl"] / denom,
            policy_kl=policy_kl if not skipped or "KL" in (skipped or "") else float("nan"),
            step_scale=kl_tries[-1].scale if kl_tries else 1.0,
            max_kl=self.step_sizes.max_kl,
            kl_tries=[t.to_dict() for t in kl_tries],
            epochs=epochs,
            epoch_kls=[round(k, 6) for k in epoch_kls],
            mismatch=totals["mismatch"] / max(tokens, 1),
            mean_advantage=mean_adv,
            distill_kl=totals["distill"] / totals["distilled"] if totals["distilled"] else 0.0,
            guarded=int(totals["guarded"]),
            replay_kl=totals["replay"] / max(steps, 1),
            grad_norm=totals["grad_norm"],
            seconds=time.monotonic() - started,
            timings={k: round(v, 2) for k, v in timings.items()},
            skipped=skipped,
            dropped=[samples[i].id for i in sorted(dropped) if samples[i].id is not None],
            pass_tokens=plan,
            peak_added_mb=round(peak_added / 2**20, 1),
        )
