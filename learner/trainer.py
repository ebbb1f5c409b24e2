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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nextstate.core.settings import LearnerSettings
from nextstate.core.types import Sample
from nextstate.learner.checkpointing import enable_checkpointing
from nextstate.learner.distillation import topk_reverse_kl
from nextstate.learner.forward import BaseSides, ResponseReader, completed
from nextstate.learner.learning_rate import resolve_learning_rate, warmed_up
from nextstate.learner.held_out import shipped_lines
from nextstate.learner.memory_budget import MemoryBudget, Refusal
from nextstate.learner.step_result import StepResult
from nextstate.learner.micro_batches import padded_tokens
from nextstate.learner.ppo import k3_kl, ppo_token_losses
from nextstate.learner.replay import Replay
from nextstate.learner.step_sizes import KlTry, StepSizes

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
EPS = 0.2
EPS_HIGH = 0.28


def steps_taken(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer steps this scope's optimizer has taken, from its own state (kept with the
    adapter, restored with an undone update)."""
    return max((int(state["step"]) for state in optimizer.state.values() if "step" in state), default=0)


def adapter_name(scope: str) -> str:
    """peft adapter names become module keys: keep them to letters and digits."""
    return "a" + hashlib.sha256(scope.encode()).hexdigest()[:16]


class LoraTrainer(ResponseReader):
    """Trains one LoRA adapter per scope on the base model that `ResponseReader` reads."""

    def __init__(self, model_dir: str | Path, settings: LearnerSettings, device: str = "cpu") -> None:
        super().__init__(model_dir, settings, device)
        self.lr = resolve_learning_rate(settings.lr, self._base.config)
        self.memory = MemoryBudget(self._base.config, self.dtype, device, self.logit_rows, settings.learner_memory_mb)
        how = "auto, fitted to the model's size" if settings.lr == "auto" else "NEXTSTATE_LR"
        log.info("learner: learning rate %.3g (%s)", self.lr, how)
        enable_checkpointing(self._base)  # agent samples run to thousands of tokens
        self._optimizers: dict[str, torch.optim.Optimizer] = {}
        self._before: dict[str, tuple[list[torch.Tensor], dict]] = {}  # per scope: state before its last step
        self.step_sizes = StepSizes(settings.max_kl, settings.kl_backtracks)  # per scope: where a step starts
        self.replay = Replay(lambda: self._encoded(shipped_lines("replay_text.txt")))  # learner/replay.py

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
        self._sides_kept.clear()
        self._prefixes.clear()
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
        if self.model.active_adapters != [name]:
            self._prefixes.clear()  # what was read, was read with another scope's weights
        self.model.set_adapter(name)
        return name, self._params(name)

    def _at_base(self, scope: str) -> bool:
        """Whether the scope's weights are still the base model's (every LoRA B zero, as peft
        makes them: a scope's first update, or one undone back to the start; a scope the trainer
        has not met yet, a new user's batch filling, without making it an adapter). Its figures
        are then the base model's, which are computed once and kept; on an agent's 5-8k-token
        prompts that spares a new user's first update minutes of a CPU."""
        name = adapter_name(scope)
        if self.model is None or name not in self.model.peft_config:
            return True
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
        self._prefixes.clear()
        optimizer_file = path / OPTIMIZER_STATE
        if optimizer_file.is_file():
            self._optimizers[scope].load_state_dict(torch.load(optimizer_file, weights_only=True))

    # ---------------------------------------------------------------- training

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

    def forget_reads(self) -> None:
        """Drop the prompts' keys and values kept at the weights now (learner/prompt_prefix.py):
        the gate has read what it needed of them, and they hold memory until the next update."""
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
        self._prefixes.clear()
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
        plan = self.memory_plan(samples)
        if isinstance(plan, Refusal):
            return StepResult.not_started(scope, samples, plan)
        self._pass_tokens = plan
        _, params = self._activate(scope)
        optimizer = self._optimizers[scope]
        self._before[scope] = ([p.detach().clone() for p in params], copy.deepcopy(optimizer.state_dict()))
        c = self.settings
        u = _Update(samples, progress, plan, started=started, passes=c.ppo_epochs * sum(
            len(self._micro_batches(samples[start: start + c.minibatch])) for start in range(0, len(samples), c.minibatch)))
        self.model.eval()
        with u.timed("teacher"):
            # one optimizer step a pass: its first forwards read the policy's side of the targets
            u.teacher, reference, u.pending = self._teacher_targets(
                samples, range(c.minibatch, len(samples)), at_base=self._at_base(scope), deferred=c.minibatch >= len(samples))
        for i, lp in reference.items():
            u.before[i] = lp
        try:
            try:
                u.skipped = self._passes(u, params, optimizer)
            finally:  # the passes read the prompts' prefixes as the update began (learner/prompt_prefix.py)
                self._prefixes.clear()
            self.model.eval()
            if not u.skipped:
                with u.timed("kl_fit"):
                    u.skipped = self._step_length(scope, u)
        finally:
            self.model.eval()
            optimizer.zero_grad(set_to_none=True)
        if u.skipped:
            self._restore(scope, *self._before.pop(scope))
        return u.result(scope, self.step_sizes.max_kl)

    def _passes(self, u: _Update, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> str | None:
        """Up to `ppo_epochs` passes over the batch, `minibatch` samples an optimizer step,
        stopped once the batch's policy KL reaches `epoch_kl_share` of the limit (PPO's early
        stop on KL, read as a target). Returns why the step must be undone, or None."""
        c = self.settings
        self.model.train()
        # With one optimizer step a pass, the next pass's forward reads the weights the KL check
        # would: the check is taken from it (a pass's forward without gradients saved a pass).
        merged = c.epoch_kl_share > 0 and c.minibatch >= len(u.samples)
        for epoch in range(c.ppo_epochs):
            for start in range(0, len(u.samples), c.minibatch):
                if skipped := self._optimizer_step(u, range(start, min(start + c.minibatch, len(u.samples))), epoch,
                                                   params, optimizer, measure=merged and epoch > 0):
                    return skipped
            if u.stopped:  # the pass's forward found the KL target reached: its step was not taken
                break
            u.epochs += 1
            if u.epochs < c.ppo_epochs and c.epoch_kl_share > 0 and not merged:
                self.model.eval()
                with u.timed("epoch_kl"):
                    u.epoch_kls.append(self._policy_kl(*self._kept(u.samples, u.dropped, u.before)))
                self.model.train()
                if u.epoch_kls[-1] >= c.epoch_kl_share * self.step_sizes.max_kl:
                    break
        if u.progress is not None and u.epochs < c.ppo_epochs:  # the passes left were not needed
            u.progress(u.passes, u.passes)
        return None

    def _optimizer_step(self, u: _Update, batch: range, epoch: int, params: list[torch.nn.Parameter],
                        optimizer: torch.optim.Optimizer, measure: bool = False) -> str | None:
        """One optimizer step on `batch`, a micro-batch of forward and backward passes at a
        time, with the replay's pull; None, or why the step must be undone. `measure`: the
        forward passes also read the batch's policy KL since the update began (the whole batch
        is in this step), and once it reaches the pass target the step is not taken
        (`u.stopped`)."""
        c = self.settings
        batch_tokens = max(1, sum(sum(u.samples[i].loss_mask) for i in batch))
        optimizer.zero_grad(set_to_none=True)
        live = [i for i in batch if i not in u.dropped]
        totals = dict(u.totals)
        u.kl_sum = u.kl_tokens = 0.0
        for group in self._micro_batches([u.samples[i] for i in live]):
            members = [live[j] for j in group]
            with self.memory.meter() as meter:
                if losses := self._losses(u, members, epoch, batch_tokens, measure):
                    torch.stack(losses).sum().backward()
            self.memory.record(padded_tokens([self._row(u.samples[i]) for i in members]), meter.added)
            u.peak_added = max(u.peak_added, meter.added)
            u.done += 1
            if u.progress is not None:
                u.progress(min(u.done, u.passes), u.passes)
        if measure:
            u.epoch_kls.append(u.kl_sum / max(1.0, u.kl_tokens))
            if u.epoch_kls[-1] >= c.epoch_kl_share * self.step_sizes.max_kl:
                u.stopped = True
                u.totals = totals  # the step not taken leaves no trace in the record
                optimizer.zero_grad(set_to_none=True)
                return None
        if c.replay_coef > 0:  # its gradients are checked with the batch's below
            u.totals["replay"] += self.replay.backward(self.model, c.replay_coef, params, c.replay_grad_share)
        if len(u.dropped) == len(u.samples) or not math.isfinite(u.totals["loss"]) or any(
            p.grad is not None and not torch.isfinite(p.grad).all() for p in params
        ):
            return "non-finite loss or gradient"
        u.totals["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP))
        for group in optimizer.param_groups:
            group["lr"] = warmed_up(self.lr, steps_taken(optimizer), c.lr_warmup_steps)
        optimizer.step()
        u.steps += 1
        return None

    def _losses(self, u: _Update, members: list[int], epoch: int, batch_tokens: int,
                measure: bool = False) -> list[torch.Tensor]:
        """Each sample's loss from one forward pass over `members`: PPO's clipped surrogate, the
        distillation towards its teacher's target, the empty-reply guard, as a share of the
        batch's tokens. A sample whose loss is not finite is left out (`u.dropped`). `measure`:
        its policy KL from before the update is added up too (`u.kl_sum`, as `_policy_kl` reads it)."""
        c = self.settings
        outputs = self._response_logprobs([u.samples[i] for i in members],
                                          [t[1] if (t := u.teacher[i]) else None for i in members],
                                          first_stop=c.empty_guard > 0)
        losses = []
        for i, answer in zip(members, outputs):
            s, logprobs = u.samples[i], answer.token
            if u.steps == 0 and u.before[i] is None:
                u.before[i] = logprobs.detach()
            old = torch.tensor(s.old_logprobs, device=self.device)
            # a single sample must never dominate an update, whatever its reward
            adv = torch.tensor(s.advantages, device=self.device).clamp(-c.max_advantage, c.max_advantage)
            mask = torch.tensor(s.loss_mask, device=self.device, dtype=torch.float32)
            pg, clipped = ppo_token_losses(logprobs, old, adv, EPS, EPS_HIGH)
            tok_loss = pg
            if answer.gathered is not None:
                if (target := u.teacher[i][0]) is None:  # the update's first forward: the weights before it
                    target = u.complete(i, answer.gathered.detach())
                distill = topk_reverse_kl(answer.gathered, target) * mask
                tok_loss = tok_loss + s.distill_weight * distill
                u.totals["distill"] += float(distill.detach().sum())
                u.totals["distilled"] += float(mask.sum())
            loss = (tok_loss * mask).sum() / batch_tokens
            if answer.first_stop is not None:  # an empty reply is no one's wish
                guard = torch.relu(answer.first_stop - math.log(c.empty_guard))
                loss = loss + EMPTY_GUARD_WEIGHT * guard / batch_tokens
                u.totals["guarded"] += float(guard.detach() > 0)
            if not torch.isfinite(loss):
                u.dropped.add(i)  # this sample alone is left out; the batch trains on
                continue
            losses.append(loss)
            if measure:  # over the samples the step keeps, as `_policy_kl` reads them
                u.kl_sum += float((k3_kl(u.before[i], logprobs.detach()) * mask).sum())
                u.kl_tokens += sum(s.loss_mask)
            if epoch == 0:
                u.totals["mismatch"] += float(((logprobs.detach() - old).abs() * mask).sum())
            u.totals["loss"] += float(loss.detach())
            u.totals["pg"] += float((pg.detach() * mask).sum()) / batch_tokens
            u.totals["clipped"] += float((clipped * mask).sum())
        return losses

    def _step_length(self, scope: str, u: _Update) -> str | None:
        """The trained step shortened until its policy KL fits (`_fit_kl`); why it must be
        undone, or None."""
        at_full = u.epoch_kls[-1] if len(u.epoch_kls) == u.epochs else None  # measured after the last pass
        u.policy_kl, u.kl_tries = self._fit_kl(scope, *self._kept(u.samples, u.dropped, u.before), at_full)
        if not math.isfinite(u.policy_kl):
            return "policy KL not finite"
        if u.policy_kl > self.step_sizes.max_kl:
            return (f"policy KL {u.policy_kl:.4g} exceeds the limit {self.step_sizes.max_kl:g} even at "
                    f"{u.kl_tries[-1].scale:g} of the step (tried {len(u.kl_tries)} lengths)")
        return None


@dataclass
class _Update:
    """What one update carries between its phases, and what its record is made of."""

    samples: list[Sample]
    progress: Callable[[int, int], None] | None
    plan: int  # padded tokens a forward pass may hold (the memory plan)
    passes: int  # training passes planned (forward and backward over one micro-batch)
    teacher: list[tuple[torch.Tensor | None, torch.Tensor] | None] = field(default_factory=list)
    pending: dict[int, BaseSides] = field(default_factory=dict)  # targets the first forwards complete
    # the policy before the step, for its KL (`_policy_kl`): the first optimizer step's own
    # forward passes give it for free; samples it does not see need a pass of their own
    before: list[torch.Tensor | None] = field(default_factory=list)
    dropped: set[int] = field(default_factory=set)
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("loss", "pg", "clipped", "mismatch", "grad_norm", "distill", "distilled", "guarded", "replay"), 0.0))
    steps: int = 0
    epochs: int = 0
    epoch_kls: list[float] = field(default_factory=list)  # the batch's policy KL after each pass but the last
    kl_sum: float = 0.0  # ... being read by a pass's forward (`measure`), and its tokens
    kl_tokens: float = 0.0
    stopped: bool = False  # a pass's forward found the KL target reached: no more passes
    done: int = 0
    peak_added: int = 0
    policy_kl: float = 0.0
    kl_tries: list[KlTry] = field(default_factory=list)
    skipped: str | None = None
    started: float = field(default_factory=time.monotonic)
    timings: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("teacher", "passes", "epoch_kl", "kl_fit"), 0.0))

    def __post_init__(self) -> None:
        self.before = [None] * len(self.samples)

    def complete(self, i: int, policy: torch.Tensor) -> torch.Tensor:
        """Sample i's distillation target from the policy's top-K log-probabilities before the
        update, read by the update's first forward pass over it."""
        target = completed(policy, self.pending.pop(i))
        self.teacher[i] = (target, self.teacher[i][1])
        return target

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        mark = time.monotonic()
        try:
            yield
        finally:
            self.timings[phase] += time.monotonic() - mark

    def result(self, scope: str, max_kl: float) -> StepResult:
        samples, totals = self.samples, self.totals
        tokens = sum(sum(s.loss_mask) for s in samples)
        denom = max(tokens * max(1, self.epochs), 1)
        steps = max(self.steps, 1)
        self.timings["passes"] = time.monotonic() - self.started - sum(self.timings.values())  # training, replay included
        return StepResult(
            scope=scope, samples=len(samples), tokens=tokens, loss=totals["loss"] / steps, pg_loss=totals["pg"] / steps,
            clip_fraction=totals["clipped"] / denom,
            policy_kl=self.policy_kl if not self.skipped or "KL" in self.skipped else float("nan"),
            step_scale=self.kl_tries[-1].scale if self.kl_tries else 1.0, max_kl=max_kl,
            kl_tries=[t.to_dict() for t in self.kl_tries], epochs=self.epochs,
            epoch_kls=[round(k, 6) for k in self.epoch_kls], mismatch=totals["mismatch"] / max(tokens, 1),
            mean_advantage=sum(a * m for s in samples for a, m in zip(s.advantages, s.loss_mask)) / max(tokens, 1),
            distill_kl=totals["distill"] / totals["distilled"] if totals["distilled"] else 0.0,
            guarded=int(totals["guarded"]), replay_kl=totals["replay"] / steps, grad_norm=totals["grad_norm"],
            seconds=time.monotonic() - self.started, timings={k: round(v, 2) for k, v in self.timings.items()},
            skipped=self.skipped, dropped=[samples[i].id for i in sorted(self.dropped) if samples[i].id is not None],
            pass_tokens=self.plan, peak_added_mb=round(self.peak_added / 2**20, 1),
        )
