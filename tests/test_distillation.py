"""Distillation over the teacher's distribution (NEXTSTATE_OPD_LOSS=topk, learner/distillation.py)."""

from __future__ import annotations

import pytest
import torch

from nextstate.core.settings import LearnerSettings
from nextstate.learner.distillation import shifted_target, teacher_topk, topk_reverse_kl, with_tail
from nextstate.learner.trainer import LoraTrainer
from tests.test_learner import PROMPT, engine, generate, make_sample, peaked_model_dir  # noqa: F401  (fixtures)

HINTED = PROMPT + [200, 201, 202, 203, 204, 205, 206, 207]  # the teacher reads a "hint" after the prompt


def test_the_topk_loss_is_a_divergence_over_k_tokens_and_a_tail():
    torch.manual_seed(0)
    teacher = torch.log_softmax(torch.randn(3, 10), -1)
    values, ids = teacher.topk(4, dim=-1)
    assert torch.allclose(with_tail(values).logsumexp(-1), torch.zeros(3), atol=1e-6), "K + 1 bins hold all the mass"
    assert torch.allclose(topk_reverse_kl(values, with_tail(values)), torch.zeros(3), atol=1e-6)
    student = torch.log_softmax(torch.randn(3, 10), -1).gather(-1, ids)
    assert (topk_reverse_kl(student, with_tail(values)) > 0).all()


def test_the_shifted_target_moves_the_policy_only_as_far_as_the_hint_moves_the_base():
    torch.manual_seed(2)
    policy, hinted, unhinted = (torch.log_softmax(torch.randn(3, 10), -1)[:, :4] for _ in range(3))
    target = shifted_target(policy, hinted, unhinted)
    assert torch.allclose(target.logsumexp(-1), torch.zeros(3), atol=1e-6), "a distribution over the K + 1 bins"
    assert torch.allclose(shifted_target(policy, hinted, hinted), with_tail(policy), atol=1e-6), \
        "a hint that changes nothing leaves the policy where it is"
    assert torch.allclose(shifted_target(unhinted, hinted, unhinted), with_tail(hinted), atol=1e-6), \
        "a policy still at the base model is pulled to the hinted base"
    # the log-odds between two kept tokens move by exactly the hint's move in the base model
    moved = (target[:, 0] - target[:, 1]) - (policy[:, 0] - policy[:, 1])
    assert torch.allclose(moved, (hinted[:, 0] - hinted[:, 1]) - (unhinted[:, 0] - unhinted[:, 1]), atol=1e-5)


def test_with_every_token_kept_it_is_the_reverse_kl_and_its_gradient():
    torch.manual_seed(1)
    logits = torch.randn(2, 8, requires_grad=True)
    values, ids = teacher_topk(torch.randn(2, 8), temperature=0.7, k=8)
    student = torch.log_softmax(logits, -1)
    ours = topk_reverse_kl(student.gather(-1, ids), with_tail(values))
    full_teacher = torch.empty(2, 8).scatter_(-1, ids, values)
    exact = (student.exp() * (student - full_teacher)).sum(-1)
    assert ours.tolist() == pytest.approx(exact.tolist(), abs=1e-5)
    grad_ours, = torch.autograd.grad(ours.sum(), logits, retain_graph=True)
    grad_exact, = torch.autograd.grad(exact.sum(), logits)
    assert torch.allclose(grad_ours, grad_exact, atol=1e-5)


def distilled(sample, teacher_prompt=HINTED, weight=1.0):
    return sample.model_copy(update={"advantages": [0.0] * len(sample.response_ids), "reward": 0.0,
                                     "teacher_prompt_ids": teacher_prompt, "distill_weight": weight})


async def test_the_teacher_is_the_base_model_reading_the_hint_at_each_response_position(tiny_model_dir, engine):
    """Every logprob the teacher hands the learner must be the base model's after the hinted
    prompt, at the response's own positions: with K = the vocabulary, the teacher's value at
    each sampled token equals the engine's score of it."""
    trainer = LoraTrainer(tiny_model_dir, LearnerSettings(lr=5e-3, lora_r=4, lora_alpha=8, opd_topk=10_000))
    trainer.ensure_scope("alice")
    trainer.logit_rows = 3  # several LM-head chunks per response
    *replies, plain = await generate(engine, 3, max_new=7)
    samples = [distilled(make_sample(toks, temperature=0.7)) for toks in replies]
    targets, _, _ = trainer._teacher_targets(samples + [make_sample(plain)])
    assert targets[2] is None, "a sample without a teacher's prompt is not distilled"
    for sample, (values, ids) in zip(samples, targets):
        expected = await engine.score(HINTED + sample.response_ids, len(HINTED), temperature=0.7)
        at_token = values.gather(-1, (ids == torch.tensor(sample.response_ids)[:, None]).float().argmax(-1, keepdim=True))
        assert at_token.squeeze(-1).tolist() == pytest.approx(expected, abs=1e-4)


async def test_distilling_moves_the_policy_towards_the_teacher_and_nothing_else_changes(peaked_model_dir):
    from nextstate.engine.local import LocalEngine

    peaked = await LocalEngine.open(peaked_model_dir, device="cpu")  # a random model whose context matters
    try:
        replies = await generate(peaked, 6, max_new=8)
    finally:
        await peaked.close()
    # replay off: its pull towards the base model's reading of prose is another force on the
    # weights, and this measures the distillation's alone
    trainer = LoraTrainer(peaked_model_dir, LearnerSettings(lr=3e-2, lora_r=4, lora_alpha=8, opd_topk=16, replay_coef=0,
                                                            minibatch_size=0, max_kl=100.0, lr_warmup_steps=0))
    samples = [distilled(make_sample(toks)) for toks in replies[:4]]
    trainer.ensure_scope("alice")
    targets = trainer._teacher_targets(samples)[0]
    todo = list(range(len(samples)))

    def distance() -> float:
        """The policy's reverse KL to the targets set before the step, mean per position."""
        now = trainer._gathered(samples, todo, {i: ids for i, (_, ids) in enumerate(targets)})
        return float(torch.cat([topk_reverse_kl(now[i], target) for i, (target, _) in enumerate(targets)]).mean())

    before = distance()
    result = trainer.step("alice", samples)
    assert before > 0.05 and result.distill_kl > 0.05, "the hint changes what the teacher expects"
    assert distance() < 0.9 * before, "the step brings the policy nearer the target it was given"
    plain = trainer.step("bob", [make_sample(toks, advantage=0.0) for toks in replies[4:]])
    assert plain.distill_kl == 0.0 and plain.policy_kl == pytest.approx(0.0, abs=1e-6), "no teacher, no advantage: no move"


def test_the_shifted_target_of_a_fresh_adapter_is_the_hinted_base_and_an_idle_hint_moves_nothing(peaked_model_dir):
    """Before its first update the policy is the base model, so the shifted target is the
    hinted base model's; a "hint" that is the sample's own prompt changes nothing in the base
    model, and once the policy has moved its target is the policy itself (the hinted base model
    as the target would pull it back to the base where the hint says nothing)."""
    from nextstate.engine.base import GeneratedToken

    replies = [[GeneratedToken(t, -1.0) for t in reply] for reply in ([31, 40, 52, 33, 47, 60, 38, 41], [7, 8, 9, 10, 11, 12])]
    samples = [distilled(make_sample(toks)) for toks in replies]
    shift = LoraTrainer(peaked_model_dir, LearnerSettings(lora_r=4, lora_alpha=8, opd_topk=16))
    shift.ensure_scope("alice")
    sides = shift._base_sides(samples, [0, 1])
    for i, (target, ids) in enumerate(shift._teacher_targets(samples)[0]):
        assert torch.equal(ids, sides[i][0]) and torch.allclose(target, with_tail(sides[i][1]), atol=1e-5)
    # so at the base the policy's pass stands for the unhinted base model's: one pass fewer, same targets
    passes = []
    hook = shift._backbone_and_head()[0].register_forward_pre_hook(lambda *_: passes.append(1))
    for i, (target, ids) in enumerate(shift._teacher_targets(samples, at_base=True)[0]):
        assert torch.equal(ids, sides[i][0]) and torch.allclose(target, with_tail(sides[i][1]), atol=1e-5)
    shared = len(passes)
    passes.clear()
    shift._teacher_targets(samples)
    hook.remove()
    assert shared < len(passes)
    idle = [distilled(make_sample(toks), teacher_prompt=PROMPT) for toks in replies]
    # one pass: after it the policy has moved, and a further pass would distil back towards the target
    trainer = LoraTrainer(peaked_model_dir, LearnerSettings(lr=3e-2, lora_r=4, lora_alpha=8, opd_topk=16, ppo_epochs=1,
                                                            max_kl=100.0))
    trainer.step("alice", samples)  # a real hint first: the adapter moves off the base model
    assert trainer.step("alice", idle).distill_kl == pytest.approx(0.0, abs=1e-6)


def test_a_hint_measured_against_its_placebo_moves_only_what_the_placebo_does_not(peaked_model_dir):
    """A hindsight hint's shift is measured against its placebo (`contrast_prompt_ids`,
    judge/hindsight.py), not the sample's own prompt: a placebo that reads as the hint does
    leaves nothing to distil (the target is the policy), one that is the sample's own prompt is
    the plain shift, and any other changes the target."""
    from nextstate.engine.base import GeneratedToken

    replies = [[GeneratedToken(t, -1.0) for t in reply] for reply in ([31, 40, 52, 33, 47], [7, 8, 9, 10])]
    plain = [distilled(make_sample(toks)) for toks in replies]
    trainer = LoraTrainer(peaked_model_dir, LearnerSettings(lora_r=4, lora_alpha=8, opd_topk=16))
    trainer.ensure_scope("alice")

    def targets(contrast):
        return trainer._teacher_targets([s.model_copy(update={"contrast_prompt_ids": contrast}) for s in plain])[0]

    for i, ((idle, ids), (own, _), (other, _), (base, _)) in enumerate(
            zip(targets(HINTED), targets(PROMPT), targets(PROMPT[:-2] + [90, 91]), trainer._teacher_targets(plain)[0])):
        assert torch.allclose(idle, with_tail(trainer._gathered(plain, [i], {i: ids})[i]), atol=1e-5)
        assert torch.allclose(own, base, atol=1e-5)
        assert not torch.allclose(other, base, atol=1e-3)


def test_one_pass_before_the_step_gives_the_shift_targets_policy_side_and_the_kl_reference(peaked_model_dir):
    """The shift target's policy side and the step's KL reference (the policy before the update,
    for samples the first optimizer step does not see) come from one no-grad pass per sample."""
    from nextstate.engine.base import GeneratedToken

    replies = [[GeneratedToken(t, -1.0) for t in reply] for reply in ([31, 40, 52, 33], [7, 8, 9, 10, 11], [60, 38, 41])]
    samples = [distilled(make_sample(toks)) for toks in replies]
    trainer = LoraTrainer(peaked_model_dir, LearnerSettings(lr=3e-2, lora_r=4, lora_alpha=8, opd_topk=16,
                                                            minibatch_size=1, max_kl=100.0, micro_batch_tokens=1,
                                                            replay_coef=0))  # its passes over prose are not counted here
    trainer.step("alice", samples)  # the adapter moves off the base model: policy and base differ
    _, reference, _ = trainer._teacher_targets(samples, [1, 2])
    assert sorted(reference) == [1, 2]
    for got, want in zip((reference[1], reference[2]), trainer._logprobs_each(samples[1:])):
        assert torch.allclose(got, want, atol=1e-6)
    rows, at_first_step = [], []
    backbone, _ = trainer._backbone_and_head()
    backbone.register_forward_pre_hook(lambda m, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    trainer._optimizers["alice"].register_step_pre_hook(lambda *_: at_first_step.append(sum(rows)))
    trainer.step("alice", samples)
    assert at_first_step[0] == 3 + 3 + 3 + 1, "hinted base, unhinted base, the policy once each, then the first step's sample"


def test_a_hindsight_hint_with_no_reward_trains_through_its_teacher(server_factory):
    """A benched judge's sample (every advantage 0) used to be screened out as "no signal";
    with a teacher to distil it is exactly what should train."""
    from tests.test_learner import feed, learning_server, served_samples, wait_for

    server = learning_server(server_factory, batch_size=4, opd_loss="topk")
    hinted = [distilled(s, teacher_prompt=HINTED) for s in served_samples(server, 4, advantage=0.0)]
    feed(server, hinted)
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 1)
    assert len(server.app.state.services.samples.samples("consumed")) == 4
    step = next(r for r in server.records() if r["kind"] == "train_step")
    assert step["distill_kl"] > 0 and step["mean_advantage"] == 0


def test_an_update_whose_first_step_sees_every_sample_reads_the_targets_policy_side_from_that_steps_forwards(
        peaked_model_dir, monkeypatch):
    """With one optimizer step a pass (minibatch_size 0: the whole batch), the step's first
    forward passes read the weights the targets' policy side is read at: no pass of its own is
    made for it, and the update is the one the separate pass gave."""
    from nextstate.engine.base import GeneratedToken

    replies = [[GeneratedToken(t, -1.0) for t in reply] for reply in ([31, 40, 52, 33], [7, 8, 9, 10, 11], [60, 38, 41])]
    samples = [distilled(make_sample(toks)) for toks in replies]
    settings = LearnerSettings(lr=3e-2, lora_r=4, lora_alpha=8, opd_topk=16, minibatch_size=0, max_kl=100.0,
                               replay_coef=0, ppo_epochs=2, epoch_kl_share=0)
    results, passes = {}, {}
    for deferred in (True, False):
        trainer = LoraTrainer(peaked_model_dir, settings)
        torch.manual_seed(0)  # the same adapter's start
        trainer.step("alice", samples)  # off the base model: the policy's side is not the base model's
        targets = trainer._teacher_targets
        monkeypatch.setattr(trainer, "_teacher_targets", lambda *a, d=deferred, t=targets, **k: t(*a, **{**k, "deferred": d}))
        rows: list[int] = []
        trainer._backbone_and_head()[0].register_forward_pre_hook(
            lambda m, args, kwargs, rows=rows: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
        results[deferred], passes[deferred] = trainer.step("alice", samples), sum(rows)
    assert passes[True] == passes[False] - len(samples), "one pass over each sample fewer"
    for name in ("loss", "distill_kl", "policy_kl", "grad_norm"):
        assert getattr(results[True], name) == pytest.approx(getattr(results[False], name), rel=1e-4, abs=1e-6), name


def test_the_base_models_gate_reads_leave_the_teacher_only_the_hints_and_replies_to_read(peaked_model_dir):
    """The gate reads a new scope's serving side (the base model) before its first update: those
    prompts' keys and values stay with the base model's kept ones, so the teacher's hinted pass
    reads only what follows each prompt's shared start, and its targets are the same."""
    from nextstate.engine.base import GeneratedToken
    from nextstate.learner.readings import Readings

    replies = [[GeneratedToken(t, -1.0) for t in reply] for reply in ([31, 40, 52, 33], [7, 8, 9, 10, 11])]
    samples = [distilled(make_sample(toks)) for toks in replies]
    read, targets = {}, {}
    for gate_first in (False, True):
        trainer = LoraTrainer(peaked_model_dir, LearnerSettings(lora_r=4, lora_alpha=8, opd_topk=16))
        trainer.ensure_scope("alice")
        if gate_first:
            Readings(trainer).base_figures([s.prompt_ids for s in samples], 4)
        tokens: list[int] = []
        hook = trainer._backbone_and_head()[0].register_forward_pre_hook(
            lambda m, args, kwargs, tokens=tokens: tokens.append(kwargs["input_ids"].numel()), with_kwargs=True)
        targets[gate_first] = trainer._teacher_targets(samples, at_base=True)[0]
        hook.remove()
        read[gate_first] = sum(tokens)
    assert read[True] <= read[False] - (len(PROMPT) - 1), "the prompt the gate read is not read again"
    for (before, ids), (after, same) in zip(targets[False], targets[True]):
        assert torch.equal(ids, same) and torch.allclose(before, after, atol=1e-5)


def test_the_base_models_side_of_the_targets_is_read_ahead_and_kept_by_sample(peaked_model_dir):
    """While a batch fills, the learner reads the base model's side of each ready sample's
    target (`read_ahead`); the update then reads none of it again, and its targets are the
    ones read at the update. A sample without an id (never stored) is not kept."""
    from nextstate.engine.base import GeneratedToken

    replies = [[GeneratedToken(t, -1.0) for t in reply] for reply in ([31, 40, 52, 33], [7, 8, 9, 10, 11])]
    samples = [distilled(make_sample(toks)).model_copy(update={"id": 10 + k}) for k, toks in enumerate(replies)]
    passes, targets = {}, {}
    for ahead in (False, True):
        trainer = LoraTrainer(peaked_model_dir, LearnerSettings(lora_r=4, lora_alpha=8, opd_topk=16))
        trainer.ensure_scope("alice")
        if ahead:
            assert trainer.read_ahead(samples) == 2 and trainer.read_ahead(samples) == 0, "once each"
        rows: list[int] = []
        hook = trainer._backbone_and_head()[0].register_forward_pre_hook(
            lambda m, args, kwargs, rows=rows: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
        targets[ahead] = trainer._teacher_targets(samples, at_base=True)[0]
        hook.remove()
        passes[ahead] = len(rows)
    assert passes[True] < passes[False], "the hinted base model is not read again"
    for (before, ids), (after, same) in zip(targets[False], targets[True]):
        assert torch.equal(ids, same) and torch.allclose(before, after, atol=1e-5)
    unstored = [s.model_copy(update={"id": None}) for s in samples]
    assert trainer.read_ahead(unstored) == 0
