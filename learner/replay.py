"""The replay prose: what keeps an update from leaking into how the model reads everything else.

Each optimizer step also pulls the policy's reading of a few passages of shipped everyday prose
(learner/probe/replay_text.txt, kept apart from the gate's probe) towards the base model's, as
InstructGPT's PPO-ptx mixed pretraining text into its RL updates (Ouyang et al. 2022). Its
gradient is bounded by a multiple of the batch's own, so the anchor never silences the person
once the adapter has drifted on the prose (NEXTSTATE_REPLAY_GRAD_SHARE).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.utils import get_total_norm

# Passages of the replay prose read per optimizer step: two of ~90 tokens each.
REPLAY_PASSAGES = 2


class Replay:
    """The replay passages, tokenised on first use (a learner with replay off never reads
    them), and which of them the next optimizer step reads."""

    def __init__(self, passages: Callable[[], list[list[int]]]) -> None:
        self._load = passages
        self.passages: list[list[int]] | None = None
        self.next = 0

    def loss_backward(self, model: torch.nn.Module, coef: float) -> float:
        """`coef` times KL(base ‖ policy) per token on the next REPLAY_PASSAGES passages, its
        gradients added to those there; returns that KL. The base model's side is the same
        peft model with the adapter off, no copy."""
        if self.passages is None:
            self.passages = self._load()
        device = next(model.parameters()).device
        total = 0.0
        for _ in range(REPLAY_PASSAGES):
            ids = torch.tensor([self.passages[self.next % len(self.passages)]], device=device)
            self.next += 1
            with torch.no_grad(), model.disable_adapter():
                base = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
            policy = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
            kl = (base.exp() * (base - policy)).sum(-1).mean()
            (coef * kl / REPLAY_PASSAGES).backward()
            total += float(kl.detach()) / REPLAY_PASSAGES
        return total

    def backward(self, model: torch.nn.Module, coef: float, params: list[torch.nn.Parameter], share: float = 0.0) -> float:
        """`loss_backward`, with the replay's own gradient scaled down (`share` > 0) to at most
        `share` times the norm of the gradient already there, the batch's."""
        batch_grads = None
        if share > 0:
            batch_grads = [None if p.grad is None else p.grad.clone() for p in params]
            for p in params:
                p.grad = None
        total = self.loss_backward(model, coef)
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
