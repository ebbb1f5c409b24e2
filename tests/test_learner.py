"""The learner: PPO loss, LoRA steps, versions, hot swaps, scopes, rollback, restarts, learning."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time

import httpx
import pytest
import torch

from nextstate.engine.base import SamplingParams
from nextstate.learner.ppo import k3_kl, ppo_token_losses
from nextstate.core.settings import LearnerSettings
from nextstate.learner.learning_rate import warmed_up
from nextstate.learner.readings import Readings
from nextstate.learner.forward import stop_ids
from nextstate.learner.trainer import LoraTrainer, adapter_name, steps_taken
from nextstate.core.policy import PolicyRef
from nextstate.core.types import Sample
from tests.tiny_model import TINY_PPO_EPOCHS

PROMPT = list(range(5, 30))


def test_ppo_loss_clips_asymmetrically():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.0, 1.5, 0.5, 1.1]))
    loss, clipped, *_ = ppo_token_losses(logp, old, torch.ones(4))
    # positive advantage: ratio above 1 + 0.28 is clipped, below is not
    assert loss.tolist() == pytest.approx([-1.0, -1.28, -0.5, -1.1])
    assert clipped.tolist() == [0, 1, 0, 0]
    loss, clipped, *_ = ppo_token_losses(logp, old, -torch.ones(4))
    # negative advantage: ratio below 1 - 0.2 is clipped
    assert loss.tolist() == pytest.approx([1.0, 1.5, 0.8, 1.1])
    assert clipped.tolist() == [0, 0, 1, 0]


def test_far_off_policy_tokens_cannot_blow_up_the_loss():
    # dual clip: a token the policy now likes 5x more than the sampler did, with A = -1,
    # costs at most 3 (the dual-clip constant), not 5; a moderate ratio is unaffected
    loss, clipped, *_ = ppo_token_losses(torch.log(torch.tensor([5.0, 1.0])), torch.zeros(2), -torch.ones(2))
    assert loss.tolist() == pytest.approx([3.0, 1.0]) and clipped.tolist() == [1, 0]
    # a log-ratio of 200 would overflow exp(); clamped, the loss stays finite
    loss, *_ = ppo_token_losses(torch.tensor([200.0]), torch.tensor([0.0]), torch.tensor([-1.0]))
    assert torch.isfinite(loss).all() and loss.item() == pytest.approx(3.0)


def test_k3_kl_is_non_negative_and_zero_at_equality():
    a = torch.tensor([-1.0, -2.0, -0.5])
    assert k3_kl(a, a).tolist() == [0.0, 0.0, 0.0]
    assert (k3_kl(a, a + torch.tensor([0.3, -0.7, 1.2])) > 0).all()


def make_sample(engine_tokens, prompt=PROMPT, advantage=1.0, temperature=1.0, user="alice", policy_version=0) -> Sample:
    n = len(engine_tokens)
    return Sample(
        user=user, session_id="s", turn_index=1, policy_version=policy_version, adapter=None, mode="binary", status="ready",
        prompt_ids=prompt, response_ids=[t.token_id for t in engine_tokens], old_logprobs=[t.logprob for t in engine_tokens],
        logprob_temperature=temperature, advantages=[advantage] * n, loss_mask=[1] * n, reward=advantage,
        created_at=0.0,
    )


@pytest.fixture
def trainer(tiny_model_dir):
    return LoraTrainer(tiny_model_dir, LearnerSettings(lr=5e-3, lora_r=4, lora_alpha=8))


@pytest.fixture
async def engine(tiny_model_dir):
    from nextstate.engine.local import LocalEngine

    eng = await LocalEngine.open(tiny_model_dir, device="cpu")
    yield eng
    await eng.close()


async def generate(engine, n=4, adapter=None, seed0=0, max_new=8):
    out = []
    for i in range(n):
        params = SamplingParams(max_new_tokens=max_new, temperature=1.0, seed=seed0 + i)
        out.append([t async for t in engine.generate(PROMPT, params, adapter)])
    return out


async def test_a_step_moves_logprobs_the_way_advantages_point(trainer, engine):
    up = [make_sample(toks, advantage=1.0) for toks in await generate(engine, 4)]
    result = trainer.step("shared", up)
    assert result.skipped is None and result.samples == 4
    assert result.mismatch < 1e-3, "train and sampling logprobs agree before the update"
    assert result.policy_kl > 0 and result.grad_norm > 0
    with torch.no_grad():
        after = [trainer._logprobs(s).sum().item() for s in up]
    assert all(a > sum(s.old_logprobs) for a, s in zip(after, up))


async def test_replay_keeps_the_base_models_reading_of_everyday_prose(tiny_model_dir, engine):
    """NEXTSTATE_REPLAY_COEF: the same updates drift less on the replay prose with it than
    without; its KL is reported, and is zero on an update's first step (nothing drifted yet)."""
    batches = [[make_sample(toks, advantage=1.0) for toks in await generate(engine, 4, seed0=4 * k)] for k in range(3)]
    drift = {}
    for coef in (0.0, 50.0):
        torch.manual_seed(0)
        t = LoraTrainer(tiny_model_dir, LearnerSettings(lr=2e-2, lora_r=4, lora_alpha=8, replay_coef=coef, max_kl=1e9,
                                                        ppo_epochs=1))
        results = [t.step("shared", batch) for batch in batches]
        assert all(r.skipped is None for r in results)
        if coef:
            assert results[0].replay_kl == 0.0 and results[-1].replay_kl > 0, "it pulls back what earlier steps drifted"
        t.model.eval()
        t.replay.next = 0  # the same passages for both: every one, no pull
        first = t.replay.loss_backward(t.model, 0.0)  # reads the passages in
        drift[coef] = first + sum(t.replay.loss_backward(t.model, 0.0) for _ in range(len(t.replay.passages) // 2 - 1))
    assert drift[50.0] < drift[0.0]


async def test_the_replays_gradient_is_bounded_by_the_batchs(tiny_model_dir, engine):
    """NEXTSTATE_REPLAY_GRAD_SHARE: on an adapter drifted from the base model, the replay's pull
    is scaled to at most that share of the batch's own gradient norm and added to it; without a
    bound it is added as it comes."""
    from torch.nn.utils import get_total_norm

    def grad_norm(grads: list[torch.Tensor]) -> float:
        return float(get_total_norm(grads))

    batch = [make_sample(toks, advantage=1.0) for toks in await generate(engine, 4)]
    torch.manual_seed(0)
    t = LoraTrainer(tiny_model_dir, LearnerSettings(lr=5e-2, lora_r=4, lora_alpha=8, max_kl=1e9))
    for _ in range(3):
        assert t.step("shared", batch).skipped is None  # drifts off the base model on the prose
    _, params = t._activate("shared")
    batch_grads = [torch.full_like(p, 1e-4) for p in params]

    def replay(share: float) -> list[torch.Tensor]:
        for p, g in zip(params, batch_grads):
            p.grad = g.clone()
        t.replay.next = 0
        assert t.replay.backward(t.model, 1e3, params, share) > 0
        return [p.grad.clone() - g for p, g in zip(params, batch_grads)]

    free, bounded = replay(0.0), replay(0.5)
    assert grad_norm(free) > grad_norm(batch_grads), "drifted: the replay's pull outweighs this batch"
    assert grad_norm(bounded) == pytest.approx(0.5 * grad_norm(batch_grads), rel=1e-3)
    scale = grad_norm(bounded) / grad_norm(free)
    assert all(torch.allclose(b, scale * f, atol=1e-9) for b, f in zip(bounded, free)), "the same direction"
    for p in params:
        p.grad = None


async def test_bad_steps_are_skipped_and_rolled_back(trainer, engine):
    samples = [make_sample(toks) for toks in await generate(engine, 2)]
    name, params = trainer._activate("shared")
    before = [p.detach().clone() for p in params]
    nan = [s.model_copy(update={"advantages": [float("nan")] * len(s.response_ids)}) for s in samples]
    result = trainer.step("shared", nan)
    assert result.skipped == "non-finite loss or gradient"
    assert all(torch.equal(a, b) for a, b in zip(before, trainer._params(name)))
    # one bad sample is left out alone: the rest of its batch trains
    mixed = [nan[0].model_copy(update={"id": 7}), samples[1].model_copy(update={"id": 8})]
    result = trainer.step("shared", mixed)
    assert result.skipped is None and result.dropped == [7]
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer._params(name)))
    strict = LoraTrainer(trainer.model_dir, LearnerSettings(lr=0.5, max_kl=1e-6, lora_r=4, lora_alpha=8))
    result = strict.step("shared", samples)
    assert result.skipped and "policy KL" in result.skipped


def test_the_line_search_shortens_by_a_quadratic_model_of_the_kl_and_remembers_where_to_start():
    from nextstate.learner.step_sizes import KlTry, StepSizes

    sizes = StepSizes(max_kl=1.0, backtracks=2)
    assert sizes.next_scale([KlTry(1.0, 0.9)]) is None, "a step that fits is kept whole"
    # KL ~ length²: 4.0 at full length fits 0.8 of the limit at √(0.8 / 4) ≈ 0.447 of it
    assert sizes.next_scale([KlTry(1.0, 4.0)]) == pytest.approx(0.8 ** 0.5 / 2)
    assert sizes.next_scale([KlTry(1.0, 1.05)]) == pytest.approx(0.7), "never less than a 30% cut"
    assert sizes.next_scale([KlTry(1.0, 400.0)]) == pytest.approx(0.25), "nor more than a 75% one at once"
    assert sizes.next_scale([KlTry(1.0, float("nan"))]) is None
    assert sizes.next_scale([KlTry(1.0, 4.0), KlTry(0.5, 2.0), KlTry(0.25, 1.5)]) is None, "the floor: 2 shortenings"
    assert StepSizes(1.0, 4, shrink=0.5).next_scale([KlTry(0.5, 3.0)]) == 0.25
    sizes.settle("a", 0.3, 0.5, published=True)
    assert sizes.start("a") == pytest.approx(0.6), "a step near the limit: the next starts at twice its length"
    sizes.settle("a", 1 / 64, 3e-5, published=True)
    assert sizes.start("a") == pytest.approx(1 / 8), "a step that moved nothing: eight times, not twice"
    sizes.settle("a", 0.25, 0.0125, published=True)
    assert sizes.start("a") == 1.0, "√(0.8 / 0.0125) = 8: back to a whole step"
    sizes.settle("a", 0.1, 2.0, published=False)
    assert sizes.start("a") == pytest.approx(0.025), "below everything an unpublished step tried"
    sizes.settle("a", 0.5, 0.04, published=False)
    assert sizes.start("a") == pytest.approx(0.25), "to where the quadratic model puts its KL at 1% of the limit"
    sizes.settle("a", 1 / 16, 0.003, published=False)
    assert sizes.start("a") == pytest.approx(1 / 16), "a step refused at KL 0.003 was not refused for its length"
    sizes.settle("a", 0.5, float("nan"), published=False)
    assert sizes.start("a") == pytest.approx(0.125)


async def test_an_overshooting_step_is_shortened_along_its_direction_until_it_fits(tiny_model_dir, engine):
    samples = [make_sample(toks, advantage=1.0) for toks in await generate(engine, 3)]
    torch.manual_seed(0)
    loose = LoraTrainer(tiny_model_dir, LearnerSettings(lr=5e-2, lora_r=4, lora_alpha=8, max_kl=1e9, ppo_epochs=1))
    name, params = loose._activate("shared")
    before = [p.detach().clone() for p in params]
    full = loose.step("shared", samples)
    whole = [p.detach().clone() for p in loose._params(name)]
    assert full.skipped is None and full.kl_tries == [{"scale": 1.0, "kl": round(full.policy_kl, 6)}]
    loose.undo("shared")
    limit = full.policy_kl / 3
    loose.step_sizes.max_kl = limit
    short = loose.step("shared", samples)  # the same step again (weights and moments were put back)
    assert short.skipped is None and len(short.kl_tries) >= 2 and short.policy_kl <= limit < short.kl_tries[0]["kl"]
    assert short.kl_tries[0]["kl"] == pytest.approx(full.policy_kl, rel=1e-4)
    assert 0 < short.step_scale < 1 and short.max_kl == limit
    for p, a, b in zip(loose._params(name), whole, before):
        assert torch.allclose(p, b + short.step_scale * (a - b), atol=1e-6), "a shorter step in the same direction"
    assert loose.step_sizes.start("shared") == 1.0, "the trainer leaves the next start to the learner (settle)"


async def test_passes_over_a_batch_stop_once_its_kl_reaches_the_target(tiny_model_dir, engine):
    """NEXTSTATE_EPOCH_KL_SHARE: a batch whose first pass moved the policy little gets more
    passes, one that reached the target share of max_kl gets no more (PPO's early stop on KL);
    the KL measured after the last pass is the line search's first try, not measured twice."""
    samples = [make_sample(toks, advantage=1.0) for toks in await generate(engine, 3)]

    def trainer(share: float, max_kl: float) -> LoraTrainer:
        torch.manual_seed(0)
        return LoraTrainer(tiny_model_dir, LearnerSettings(lr=5e-2, lora_r=4, lora_alpha=8, max_kl=max_kl,
                                                           ppo_epochs=3, epoch_kl_share=share))

    every = trainer(0.0, 1e9).step("shared", samples)
    assert every.epochs == 3 and every.epoch_kls == [], "no target: every pass, nothing measured between them"
    far = trainer(1.0, 1e9).step("shared", samples)
    assert far.epochs == 3 and len(far.epoch_kls) == 2 and all(0 < k < 1e9 for k in far.epoch_kls)
    assert far.policy_kl == pytest.approx(every.policy_kl, rel=1e-4), "the same three passes"
    stopped = trainer(0.5, 2 * far.epoch_kls[0])
    near = stopped.step("shared", samples)  # the first pass reaches 0.5 of this limit
    assert near.epochs == 1 and near.epoch_kls == [pytest.approx(far.epoch_kls[0], rel=1e-4)]
    assert near.kl_tries == [{"scale": 1.0, "kl": near.epoch_kls[0]}], "its KL measured once"
    # the KL was read by the second pass's forward, whose step was then not taken: the weights
    # are the first pass's, and a read of them on its own gives the same KL
    assert steps_taken(stopped._optimizers["shared"]) == 1
    before = trainer(0.5, 1e9)._logprobs_each(samples)
    stopped._activate("shared")
    stopped.model.eval()
    assert stopped._policy_kl(samples, before) == pytest.approx(near.epoch_kls[0], rel=1e-4)


async def test_a_warmup_shortens_a_fresh_scopes_first_steps_and_counts_across_updates(tiny_model_dir, engine):
    """NEXTSTATE_LR_WARMUP_STEPS: Adam's first step moves every weight with a gradient by lr, so
    with a warmup of 4 the first of a new scope's steps moves each by lr/4 at most; the count is
    the optimizer's own, so a later update goes on from where the first stopped, and an undone
    update's steps are not counted."""
    samples = [make_sample(toks, advantage=1.0) for toks in await generate(engine, 2)]
    lr = 1e-3

    def trainer(warmup: int) -> LoraTrainer:
        torch.manual_seed(0)
        return LoraTrainer(tiny_model_dir, LearnerSettings(lr=lr, lora_r=4, lora_alpha=8, max_kl=1e9, ppo_epochs=1,
                                                           minibatch_size=2, lr_warmup_steps=warmup))

    def first_move(t: LoraTrainer) -> float:
        before = [p.detach().clone() for p in t._params(t.ensure_scope("shared"))]
        assert t.step("shared", samples).skipped is None
        return max((p.detach() - b).abs().max().item() for p, b in zip(t._params(adapter_name("shared")), before))

    plain, warmed = trainer(0), trainer(4)
    assert first_move(plain) == pytest.approx(lr, rel=0.05), "Adam's first step: lr times the gradient's sign"
    assert first_move(warmed) == pytest.approx(lr / 4, rel=0.05)
    assert [g["lr"] for g in warmed._optimizers["shared"].param_groups] == [pytest.approx(lr / 4)]
    warmed.undo("shared")
    assert steps_taken(warmed._optimizers["shared"]) == 0, "an undone update's steps are not counted"
    first_move(warmed), first_move(warmed)
    assert steps_taken(warmed._optimizers["shared"]) == 2
    assert [g["lr"] for g in warmed._optimizers["shared"].param_groups] == [pytest.approx(lr / 2)]
    assert warmed_up(lr, 3, 4) == lr == warmed_up(lr, 10, 4) == warmed_up(lr, 0, 0)


@pytest.mark.parametrize("minibatch", [0, 1])
async def test_the_kl_limit_measures_the_step_not_how_far_stale_samples_already_are(tiny_model_dir, engine, minibatch):
    """Samples served a few versions ago differ from the policy by the updates since: their
    sampling logprobs are far from what the policy gives them now. A small step on them must
    still fit a small limit — measured from the sampler, it could fit at no length at all (the
    ablation's multi-step updates were held back at 0.014 of their length for this)."""
    samples = [make_sample(toks, advantage=1.0) for toks in await generate(engine, 2)]
    stale = [s.model_copy(update={"old_logprobs": [lp - 0.2 for lp in s.old_logprobs]}) for s in samples]
    trainer = LoraTrainer(tiny_model_dir, LearnerSettings(lr=1e-4, lora_r=4, lora_alpha=8, max_kl=0.01, minibatch_size=minibatch))
    result = trainer.step("shared", stale)
    assert result.skipped is None and len(result.kl_tries) == 1 and result.step_scale == 1.0, result.kl_tries
    assert 0 < result.policy_kl < 0.01


async def test_a_shortened_step_lies_halfway_and_undo_still_goes_back_whole(trainer, engine):
    samples = [make_sample(toks, advantage=1.0) for toks in await generate(engine, 2)]
    name, params = trainer._activate("shared")
    before = [p.detach().clone() for p in params]
    assert trainer.step("shared", samples).skipped is None
    after = [p.detach().clone() for p in trainer._params(name)]
    trainer.shorten_step("shared", 0.5)
    moved = [(a - b).abs().max().item() for a, b in zip(after, before)]
    assert max(moved) > 0
    for p, a, b in zip(trainer._params(name), after, before):
        assert torch.allclose(p, (a + b) / 2, atol=1e-7)
    trainer.undo("shared")
    assert all(torch.equal(p, b) for p, b in zip(trainer._params(name), before))


async def test_saved_adapter_serves_what_was_trained(trainer, engine, tmp_path):
    samples = [make_sample(toks) for toks in await generate(engine, 3)]
    trainer.step("shared", samples)
    trainer.save("shared", tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    await engine.load_adapter("v1", str(tmp_path))
    for s in samples:
        served = await engine.score(s.prompt_ids + s.response_ids, len(s.prompt_ids), adapter="v1")
        with torch.no_grad():
            trained = trainer._logprobs(s).tolist()
        assert served == pytest.approx(trained, abs=1e-4)
    # and the optimizer state resumes
    fresh = LoraTrainer(trainer.model_dir, trainer.settings)
    fresh.load("shared", tmp_path)
    assert fresh._optimizers["shared"].state_dict()["state"], "AdamW moments restored"


# ---------------------------------------------------------------------------- the service


def learning_server(server_factory, **overrides):
    values = {"batch_size": 4, "lr": 5e-3, "lora_r": 4, "lora_alpha": 8, "judge_enabled": False}
    return server_factory(**{**values, **overrides})


def feed(server, samples: list[Sample]) -> None:
    """Put judged samples in the store as the judge would, and wake the learner."""
    store, learner = server.app.state.services.samples, server.app.state.services.learner

    async def put():
        for s in samples:
            stored = await asyncio.to_thread(store.add_sample, s)
            learner.notify(stored)

    server.call(put())


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def served_samples(server, n, user="alice", advantage=1.0, seed0=0):
    chat = server.app.state.services.turns
    ref = server.app.state.services.policies.current(user)
    runs = server.call(generate(chat.engine, n, ref.adapter, seed0))
    return [make_sample(toks, advantage=advantage, user=user, policy_version=ref.version) for toks in runs]


def test_while_a_batch_fills_the_learner_reads_its_samples_base_side_ahead(server_factory):
    """Three of a batch of four: no update yet, but the learner reads the base model's side of
    their distillation targets meanwhile, so the update after the fourth starts without it."""
    server = learning_server(server_factory)
    hinted = PROMPT + [200, 201, 202]
    samples = [s.model_copy(update={"teacher_prompt_ids": hinted, "distill_weight": 1.0})
               for s in served_samples(server, 3)]
    feed(server, samples)
    learner = server.app.state.services.learner
    wait_for(lambda: len(learner.trainer._sides_kept) == 3)
    assert learner.steps == [] and learner.training is None


def test_the_engines_background_work_holds_back_while_the_learner_trains_beside_it(server_factory):
    """A CPU learner beside the embedded engine: while it reads ahead or trains, the engine's
    background work (the judge's calls) goes in short steps, as beside a person's request."""
    server = learning_server(server_factory)
    services = server.app.state.services
    learner, scheduler = services.learner, services.engine._scheduler
    held, step, ahead = [], learner.trainer.step, learner.trainer.read_ahead
    learner.trainer.step = lambda *a, **k: held.append(("step", scheduler.held())) or step(*a, **k)
    learner.trainer.read_ahead = lambda *a, **k: held.append(("ahead", scheduler.held())) or ahead(*a, **k)
    assert not scheduler.held()
    feed(server, served_samples(server, 4))
    wait_for(lambda: services.policies.current("alice").version == 1)
    assert ("step", True) in held and all(h for _, h in held), held
    wait_for(lambda: not scheduler.held(), timeout=10)


def test_updates_publish_versions_that_serve(server_factory):
    server = learning_server(server_factory)
    client = server.client(server.key("alice"))
    ask = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert client.chat.completions.with_raw_response.create(**ask).headers["x-policy-version"] == "0"
    feed(server, served_samples(server, 4))
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 1)
    raw = client.chat.completions.with_raw_response.create(**ask)
    assert raw.headers["x-policy-version"] == "1"
    vdir = server.settings.adapters_dir / "shared" / "v1"
    assert (vdir / "adapter_model.safetensors").is_file() and (vdir / "adapter_config.json").is_file()
    manifest = json.loads((vdir / "manifest.json").read_text())
    assert len(manifest["sample_ids"]) == 4 and manifest["step"]["samples"] == 4
    assert server.app.state.services.samples.samples("ready") == []
    assert len(server.app.state.services.samples.samples("consumed")) == 4
    steps = [r for r in server.records() if r["kind"] == "train_step"]
    assert steps[0]["version"] == 1 and steps[0]["published"] and "mismatch" in steps[0] and "clip_fraction" in steps[0]
    assert (server.settings.records_dir / "policy-v0001.jsonl").is_file()
    request = [r for r in server.records() if r["kind"] == "request"][-1]
    assert request["policy_version"] == 1 and request["adapter"] == server.app.state.services.policies.current("alice").adapter
    assert re.fullmatch(r"shared-v1-[0-9a-f]{8}", request["adapter"]), "served under its version and its weights' digest"


def test_no_request_fails_or_stalls_across_swaps(server_factory, monkeypatch):
    import concurrent.futures

    from nextstate.core import activity

    # requests without a pause: the learner makes way for them (core/activity.py) in short turns
    # here, so that four updates come within the test's minute
    monkeypatch.setattr(activity, "MAKE_WAY_S", 0.05)
    server = learning_server(server_factory)
    client = server.client(server.key("alice"))
    stop = time.monotonic() + 60
    results: list[tuple[float, int]] = []

    def hammer(i):
        out = []
        while time.monotonic() < stop and len(results) + len(out) < 400:
            started = time.monotonic()
            raw = client.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=4,
                extra_headers={"X-Turn-Type": "side"},
            )
            out.append((time.monotonic() - started, int(raw.headers["x-policy-version"])))
            if out[-1][1] == 4:
                break
        return out

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(hammer, i) for i in range(3)]
        for round_ in range(4):
            feed(server, served_samples(server, 4, seed0=10 * round_))
            wait_for(lambda: server.app.state.services.policies.current("alice").version == round_ + 1)
        for f in futures:
            results += f.result()  # any failed request would raise here
    versions = [v for _, v in results]
    assert set(versions) >= {0, 4} and max(versions) == 4
    assert len(results) >= 20
    assert max(latency for latency, _ in results) < 5, "no request stalled during a swap"
    current = server.app.state.services.policies.current("alice").adapter
    assert current.startswith("shared-v4-")
    wait_for(lambda: server.app.state.services.turns.engine.adapters == [current])  # old versions are unloaded


def test_a_reply_prepared_before_a_swap_is_served_by_the_version_that_replaced_it(server_factory):
    """A request picked its version, then the learner published the next one and unloaded the
    old before the request reached the engine (the route awaits between the two): the reply
    comes from the new version, recorded as such, instead of failing on an unloaded adapter."""
    from nextstate.core.stores.keys import ApiKey
    from nextstate.proxy.turn_response import response_headers
    from nextstate.proxy.turns import TurnRequest
    from nextstate.proxy.wire import TurnHints

    server = learning_server(server_factory)
    feed(server, served_samples(server, 4))
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 1)
    turns, policies = server.app.state.services.turns, server.app.state.services.policies
    key = ApiKey(id="k", user="alice", hint="k", admin=False, created_at=0.0, revoked_at=None)
    request = TurnRequest(model="tiny", messages=[{"role": "user", "content": "hi"}], hints=TurnHints(), max_tokens=3)

    async def swap_between_prepare_and_generate():
        prep = await turns.prepare(request, key)
        v1 = policies.current("alice").adapter
        assert prep.policy is None and v1.startswith("shared-v1-"), "settled only at admission"
        await turns.engine.load_adapter("shared-v2", str(server.settings.adapters_dir / "shared" / "v1"))
        policies.publish("shared", PolicyRef(version=2, adapter="shared-v2"))
        await turns.engine.unload_adapter(v1)
        done = await turns.complete(prep)
        return prep, done

    prep, done = server.call(swap_between_prepare_and_generate())
    assert done.completion_tokens >= 1
    assert prep.policy == PolicyRef(version=2, adapter="shared-v2") and response_headers(prep)["X-Policy-Version"] == "2"


def test_user_scope_keeps_users_apart(server_factory):
    server = learning_server(server_factory, adapter_scope="user")
    policies = server.app.state.services.policies
    feed(server, served_samples(server, 4, user="alice"))
    wait_for(lambda: policies.current("alice").version == 1)
    assert policies.current("bob").version == 0 and policies.current("bob").adapter is None
    assert (server.settings.adapters_dir / "alice" / "v1").is_dir()
    assert not (server.settings.adapters_dir / "shared").exists()
    bob = server.client(server.key("bob"))
    raw = bob.chat.completions.with_raw_response.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert raw.headers["x-policy-version"] == "0"
    # three of bob's samples are not a batch; alice's adapter is not touched by them
    feed(server, served_samples(server, 3, user="bob", advantage=-1.0))
    time.sleep(0.5)
    assert policies.current("bob").version == 0 and policies.current("alice").version == 1


def test_rollback_restores_an_earlier_version(server_factory):
    server = learning_server(server_factory)
    policies = server.app.state.services.policies
    for round_ in range(2):
        feed(server, served_samples(server, 4, seed0=round_ * 10))
        wait_for(lambda: policies.current("alice").version == round_ + 1)
    admin, user = server.key("root", admin=True), server.key("alice")
    url = f"{server.base_url}/admin/adapters/rollback"
    assert httpx.post(url, json={"version": 1}, headers={"Authorization": f"Bearer {user}"}).status_code == 403
    assert httpx.post(url, json={"version": 9}, headers={"Authorization": f"Bearer {admin}"}).status_code == 404
    resp = httpx.post(url, json={"version": 1}, headers={"Authorization": f"Bearer {admin}"})
    assert resp.status_code == 200 and resp.json()["version"] == 3
    assert policies.current("alice").version == 3
    root = server.settings.adapters_dir / "shared"
    assert (root / "v3" / "adapter_model.safetensors").read_bytes() == (root / "v1" / "adapter_model.safetensors").read_bytes()
    listing = httpx.get(f"{server.base_url}/admin/adapters", headers={"Authorization": f"Bearer {admin}"}).json()
    assert listing["data"] == [{"scope": "shared", "versions": [1, 2, 3], "serving": 3, "adapter": policies.current("alice").adapter}]
    assert listing["data"][0]["adapter"].startswith("shared-v3-")


def test_restart_resumes_without_losing_or_repeating_samples(server_factory, tmp_path):
    from tests.conftest import start_server

    server = learning_server(server_factory)
    feed(server, served_samples(server, 4))
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 1)
    feed(server, served_samples(server, 3, seed0=50))  # a partial batch when the process stops
    settings = server.settings
    server.stop()
    # what kill -9 in the middle of writing v2 leaves: a temporary folder never renamed into place
    unfinished = settings.adapters_dir / "shared" / ".v2-k1ll3d"
    unfinished.mkdir()
    (unfinished / "adapter_model.safetensors").write_bytes(b"half")

    restarted = start_server(settings)
    try:
        assert not unfinished.exists(), "a half-written version is removed at start"
        assert restarted.app.state.services.policies.current("alice").version == 1, "serving resumes at the latest version"
        assert len(restarted.app.state.services.samples.samples("ready")) == 3
        feed(restarted, served_samples(restarted, 1, seed0=90))
        wait_for(lambda: restarted.app.state.services.policies.current("alice").version == 2)
        manifests = [json.loads((settings.adapters_dir / "shared" / f"v{v}" / "manifest.json").read_text()) for v in (1, 2)]
        ids = manifests[0]["sample_ids"] + manifests[1]["sample_ids"]
        assert len(ids) == len(set(ids)) == 8, "every sample trained exactly once"
    finally:
        restarted.stop()


def test_crash_between_publish_and_bookkeeping_trains_nothing_twice(server_factory):
    """If the process dies after a version is on disk but before its samples are marked
    consumed, the restart reads the manifest and marks them."""
    from tests.conftest import start_server

    server = learning_server(server_factory, learn=False)
    samples = server.app.state.services.samples
    stored = [samples.add_sample(s) for s in served_samples(server, 4)]
    settings = server.settings
    server.stop()
    from nextstate.learner.trainer import LoraTrainer as Trainer
    from nextstate.learner.versions import AdapterVersions

    trainer = Trainer(settings.engine.model, LearnerSettings(lr=5e-3, lora_r=4, lora_alpha=8))
    trainer.step("shared", stored)
    AdapterVersions(settings.adapters_dir).publish(
        "shared", 1, lambda p: trainer.save("shared", p), {"sample_ids": [s.id for s in stored]}
    )  # ... and the process "dies" here
    restarted = start_server(settings.with_overrides(learn=True))
    try:
        assert restarted.app.state.services.samples.samples("ready") == []
        assert restarted.app.state.services.policies.current("alice").version == 1
    finally:
        restarted.stop()


@pytest.fixture(scope="module")
def peaked_model_dir(tmp_path_factory):
    """A tiny model whose next-token distribution is peaked like a trained model's."""
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "peaked", init_std=0.4)


def test_a_consistent_reward_moves_the_policy(server_factory, peaked_model_dir):
    """Reward +1 for replies that start with a chosen token, −1 otherwise: after a few
    updates the served adapter gives that token markedly more probability."""
    server = learning_server(server_factory, model=str(peaked_model_dir), batch_size=16, lr=5e-3, lora_r=8, lora_alpha=16)
    chat, policies = server.app.state.services.turns, server.app.state.services.policies
    prompt = chat.renderer.render([{"role": "user", "content": "Pick a word."}]).ids

    def first_token_distribution():
        return server.call(first_token_probs(chat.engine, prompt, policies.current("alice").adapter))

    before = first_token_distribution()
    chosen = int(before.topk(2).indices[1])  # the runner-up: sampled now and then, not yet preferred
    curve = [float(before[chosen])]
    for update in range(5):
        ref = policies.current("alice")
        runs = server.call(sample_replies(chat.engine, prompt, ref.adapter, 16, seed0=1000 * update))
        # stamped now: a sample dated long ago lets a partial batch of the first few train at once
        feed(server, [
            make_sample(toks, prompt=prompt, advantage=1.0 if toks[0].token_id == chosen else -1.0,
                        policy_version=ref.version).model_copy(update={"created_at": time.time()})
            for toks in runs
        ])
        wait_for(lambda: policies.current("alice").version == update + 1)
        curve.append(float(first_token_distribution()[chosen]))
    assert curve[-1] > 3 * curve[0] and curve[-1] > 0.2, f"P(chosen first token) per update: {curve}"


async def first_token_probs(engine, prompt, adapter):
    """The served policy's whole distribution over the first reply token (top-k = vocabulary)."""
    vocab = engine.info.vocab_size
    params = SamplingParams(max_new_tokens=1, temperature=1.0, top_logprobs=vocab)
    (tok,) = [t async for t in engine.generate(prompt, params, adapter)]
    probs = torch.zeros(vocab)
    for token_id, logprob in tok.top_logprobs:
        probs[token_id] = float(torch.tensor(logprob).exp())
    return probs


async def sample_replies(engine, prompt, adapter, n, seed0):
    """One at a time: in a batch, rows' logprobs differ in the last bits with the batch's make-up
    (timing), and a token sampled near a boundary can flip; the learning test wants one path."""
    out = []
    for i in range(n):
        params = SamplingParams(max_new_tokens=3, temperature=1.0, seed=seed0 + i)
        out.append([t async for t in engine.generate(prompt, params, adapter)])
    return out


def test_killed_mid_batch_the_server_loses_nothing(tmp_path, tiny_model_dir):
    """SIGKILL a real `nextstate serve` holding a partial batch; the restart trains it."""
    import os

    from tests.background_server import free_port
    from tests.forked_process import ForkedCommand
    from nextstate.core.stores.samples import SampleStore

    port = free_port()
    env = {**os.environ, "NEXTSTATE_DATA_DIR": str(tmp_path / "data"), "NEXTSTATE_MODEL": str(tiny_model_dir),
           "NEXTSTATE_PORT": str(port), "NEXTSTATE_BATCH_SIZE": "4", "NEXTSTATE_JUDGE_ENABLED": "false",
           "NEXTSTATE_LR": "5e-3", "NEXTSTATE_LORA_R": "4", "NEXTSTATE_LORA_ALPHA": "8", "NEXTSTATE_ADAPTER_SCOPE": "shared",
           "NEXTSTATE_SHARED_MIN_CONTRIBUTORS": "1", "NEXTSTATE_PPO_EPOCHS": str(TINY_PPO_EPOCHS)}

    def serve():
        proc = ForkedCommand("nextstate.cli", ["serve"], env, tmp_path / "serve.log")
        wait_for(lambda: _up(port) or proc.poll() is not None)
        assert proc.poll() is None, proc.output()
        return proc

    def fake_turns(n, seed):
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(n):
            ids = torch.randint(5, 400, (3,), generator=g).tolist()
            toks = [type("T", (), {"token_id": i, "logprob": -6.2})() for i in ids]
            out.append(make_sample(toks))
        return out

    proc = serve()
    store = SampleStore(tmp_path / "data" / "samples.sqlite3")
    try:
        for s in fake_turns(3, 0):
            store.add_sample(s)
        time.sleep(0.5)
    finally:
        proc.kill()
        proc.wait(10)
    assert len(store.samples("ready")) == 3, "a partial batch survives the kill"

    proc = serve()
    try:
        store.add_sample(fake_turns(1, 1)[0])
        v1 = tmp_path / "data" / "adapters" / "shared" / "v1"
        wait_for(lambda: (v1 / "manifest.json").is_file(), timeout=120)  # a first step on a busy machine
        ids = json.loads((v1 / "manifest.json").read_text())["sample_ids"]
        assert sorted(ids) == [1, 2, 3, 4]
        wait_for(lambda: len(store.samples("consumed")) == 4)
    finally:
        proc.terminate()
        proc.wait(30)
        store.close()


def _up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_samples_without_signal_or_too_stale_take_no_batch_slot(server_factory):
    server = learning_server(server_factory, batch_size=4, max_staleness=1)
    alice = "alice"
    # two samples with advantage 0 (the at-least-one rule's) and four with signal: the batch
    # is the four, and the two are dropped with their reason
    feed(server, served_samples(server, 2, advantage=0.0) + served_samples(server, 4, advantage=1.0, seed0=10))
    wait_for(lambda: server.app.state.services.policies.current(alice).version == 1)
    dropped = server.app.state.services.samples.samples("dropped")
    assert len(dropped) == 2 and all(s.reason.startswith("no signal") for s in dropped)
    assert len(server.app.state.services.samples.samples("consumed")) == 4
    # samples served by v0 while v2 serves are more than one version behind: dropped as stale
    old = served_samples(server, 4, seed0=20)
    for s in old:
        s.policy_version = 0
    feed(server, served_samples(server, 4, seed0=30))
    wait_for(lambda: server.app.state.services.policies.current(alice).version == 2)
    feed(server, old)
    wait_for(lambda: len(server.app.state.services.samples.samples("dropped")) == 6)
    assert server.app.state.services.policies.current(alice).version == 2
    assert all(s.reason.startswith("stale") for s in server.app.state.services.samples.samples("dropped")[2:])


async def test_chunked_logprobs_match_the_whole_head_and_its_gradients(trainer, engine):
    (toks,) = await generate(engine, 1, max_new=12)
    sample = make_sample(toks)
    trainer.ensure_scope("shared")
    _, params = trainer._activate("shared")

    def run(chunk: int):
        trainer.logit_rows = chunk
        for p in params:
            p.grad = None
        lp = trainer._logprobs(sample)
        lp.sum().backward()
        return lp.detach(), [p.grad.clone() for p in params]

    whole, whole_grads = run(10_000)
    chunked, chunked_grads = run(5)  # 12 response tokens: chunks of 5, 5 and 2
    assert torch.allclose(whole, chunked, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(whole_grads, chunked_grads))
    assert whole.tolist() == pytest.approx(sample.old_logprobs, abs=1e-4), "and they agree with the sampler"


async def test_a_bf16_base_trains_fp32_lora_weights(tiny_model_dir, engine):
    trainer = LoraTrainer(tiny_model_dir, LearnerSettings(lr=5e-3, lora_r=4, lora_alpha=8, learner_dtype="bfloat16"))
    assert next(trainer._base.parameters()).dtype == torch.bfloat16
    result = trainer.step("shared", [make_sample(toks) for toks in await generate(engine, 2)])
    assert result.skipped is None
    _, params = trainer._activate("shared")
    assert params and all(p.dtype == torch.float32 for p in params)
    assert result.mismatch < 0.1, "bf16 logprobs stay close to the fp32 sampler's"


async def test_a_long_prompt_is_cut_from_the_left_to_fit(tiny_model_dir, engine):
    trainer = LoraTrainer(tiny_model_dir, LearnerSettings(lr=5e-3, lora_r=4, lora_alpha=8, max_train_tokens=16))
    trainer.ensure_scope("shared")
    seen = []
    trainer._activate("shared")
    backbone, _ = trainer._backbone_and_head()
    handle = backbone.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[1]),
                                                with_kwargs=True)
    (toks,) = await generate(engine, 1, max_new=6)
    sample = make_sample(toks)  # a 25-token prompt and 6 response tokens: 31 > 16
    assert len(trainer._logprobs(sample)) == len(toks)
    handle.remove()
    assert seen == [15], "the last 10 prompt tokens and the response, less the last token (nothing predicts after it)"


def test_a_response_longer_than_the_training_limit_is_dropped_with_its_reason(server_factory):
    server = learning_server(server_factory, max_train_tokens=16)
    long = served_samples(server, 1)[0]
    long = long.model_copy(update={"response_ids": long.response_ids * 3, "old_logprobs": long.old_logprobs * 3,
                                   "advantages": long.advantages * 3, "loss_mask": long.loss_mask * 3})
    feed(server, [long])
    wait_for(lambda: len(server.app.state.services.samples.samples("dropped")) == 1)
    assert "NEXTSTATE_MAX_TRAIN_TOKENS" in server.app.state.services.samples.samples("dropped")[0].reason


def test_micro_batches_keep_to_the_token_budget():
    from nextstate.learner.micro_batches import micro_batches

    lengths = [300, 40, 50, 2000, 60, 45]
    rows = [[i] * n for i, n in enumerate(lengths)]  # no row begins another
    groups = micro_batches(rows, budget=200)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 200 for g in groups)
    assert [3] in groups and [0] in groups, "a sample over the budget goes alone"
    assert micro_batches(rows, budget=10**6) == [[0, 1, 2, 3, 4, 5]], "one pass"


def test_a_row_that_begins_another_rides_in_its_pass_for_free():
    from nextstate.learner.micro_batches import micro_batches, padded_tokens, prefix_hosts

    turn = [list(range(100)), list(range(150)), list(range(220))]  # one conversation's turns
    other = [7] * 120
    rows = [turn[1], other, turn[0], turn[2], list(range(100))]
    assert prefix_hosts(rows) == [3, 1, 3, 3, 3], "each turn, and a duplicate, read off the longest"
    assert padded_tokens(rows) == 2 * 220
    assert micro_batches(rows, budget=220) == [[1], [0, 2, 3, 4]], "guests cost nothing: a host alone fits"
    assert prefix_hosts([[1, 2, 3], [1, 2, 4]]) == [0, 1], "a shared start is not enough: the whole row"


async def test_turns_of_one_conversation_train_in_one_pass_as_in_one_pass_each(tiny_model_dir, engine, monkeypatch):
    """Rated turns whose prompts nest (each turn's prompt and reply begin the next's) step the
    weights exactly as when every turn is computed in a pass of its own."""
    from nextstate.learner import forward as forward_module

    prompt, samples = list(PROMPT[:12]), []
    for i in range(3):
        [tokens] = await generate(engine, 1, seed0=i, max_new=5)
        samples.append(make_sample(tokens, prompt=prompt, advantage=(-1.0) ** i))
        prompt = prompt + [t.token_id for t in tokens] + PROMPT[12 + i : 15 + i]

    def run(shared: bool):
        if not shared:
            monkeypatch.setattr(forward_module, "prefix_hosts", lambda rows: list(range(len(rows))))
        torch.manual_seed(0)
        trainer = LoraTrainer(tiny_model_dir, LearnerSettings(lr=5e-3, lora_r=4, lora_alpha=8, micro_batch_tokens=1,
                                                              ppo_epochs=1, replay_coef=0))
        _, params = trainer._activate("shared")
        with torch.no_grad():
            for p in params:
                p.normal_(0, 0.02)
        passes, grads = [], []
        backbone, _ = trainer._backbone_and_head()
        backbone.register_forward_pre_hook(lambda m, args, kwargs: passes.append(kwargs["input_ids"].shape), with_kwargs=True)
        trainer._optimizers["shared"].register_step_pre_hook(lambda *_: grads.extend(p.grad.clone() for p in params))
        result = trainer.step("shared", samples)
        monkeypatch.undo()
        return result, grads, passes

    apart, apart_grads, apart_passes = run(shared=False)
    shared, shared_grads, shared_passes = run(shared=True)
    assert apart.skipped is None and shared.skipped is None
    assert [s[0] for s in apart_passes] == [3] * 2, "the step's pass and its policy-KL check, three rows each"
    assert [s[0] for s in shared_passes] == [1] * 2, "... one row each: the last turn's"
    assert shared.loss == pytest.approx(apart.loss, abs=1e-5) and shared.policy_kl == pytest.approx(apart.policy_kl, abs=1e-6)
    assert len(shared_grads) == len(apart_grads) > 0 and any(g.abs().max() > 1e-4 for g in shared_grads)
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(apart_grads, shared_grads))


def test_a_long_prompt_is_read_once_per_update_and_trains_only_near_the_replies(tiny_model_dir, monkeypatch):
    """learner/prompt_prefix.py: an agent-size prompt's start is read without gradients, once
    for the rows that share it, once for the update's passes and once at the trained weights
    (the KL line search, whose read the gate's then takes); the rest reads it
    through a cache that activation checkpointing's second run sees unchanged. Losses are those
    of one pass over each whole row; the gradient is the one with the prefix's keys and values
    held fixed, computed here without checkpointing."""
    from nextstate.engine import kv_cache
    from nextstate.learner import prompt_prefix

    monkeypatch.setattr(prompt_prefix, "MIN_PREFIX", 16)
    setup = [(7 * i) % 300 + 5 for i in range(40)]  # an agent's setup, shared by both turns
    samples = [Sample(user="alice", session_id=f"s{k}", turn_index=1, policy_version=0, adapter=None, mode="binary",
                      status="ready", prompt_ids=setup + PROMPT[:6] + PROMPT[6 + k : 12 + k], response_ids=[40 + k, 41, 42 + k, 43],
                      old_logprobs=[-5.0] * 4, logprob_temperature=1.0, advantages=[(-1.0) ** k] * 4, loss_mask=[1] * 4,
                      reward=(-1.0) ** k, created_at=0.0) for k in range(2)]

    def trainer_for(grad_tokens):
        torch.manual_seed(0)
        trainer = LoraTrainer(tiny_model_dir, LearnerSettings(lr=5e-3, lora_r=4, lora_alpha=8, ppo_epochs=2,
                                                              replay_coef=0, epoch_kl_share=1.0))
        trainer._prefixes.grad_tokens = grad_tokens
        _, params = trainer._activate("shared")
        with torch.no_grad():
            for p in params:
                p.normal_(0, 0.02)
        return trainer, params

    def step(grad_tokens):
        trainer, params = trainer_for(grad_tokens)
        backbone, _ = trainer._backbone_and_head()
        lengths, grads = [], []
        backbone.register_forward_pre_hook(lambda m, args, kwargs: lengths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
        trainer._optimizers["shared"].register_step_pre_hook(lambda *_: grads.append([p.grad.clone() for p in params]))
        return trainer.step("shared", samples), lengths, grads

    whole, whole_lengths, _ = step(None)
    split, split_lengths, split_grads = step(6)
    assert whole.skipped is None and split.skipped is None
    assert whole_lengths == [(2, 55)] * 3, "two passes (the second reads the KL check between them) and a check after"
    # rows of 40 + 12 prompt tokens and 3 reply tokens: replies read from position 51, 6 before it train
    assert split_lengths == [(1, 45), (2, 10), (2, 10), (1, 45), (2, 10)], \
        "the prefix once for both passes (read at the update's start), once after them"
    assert split.mismatch == pytest.approx(whole.mismatch, abs=1e-6), "the first pass reads what a whole row reads"

    # the gate's candidate reads its prompts from what the update's last pass read at its weights
    trainer, _ = trainer_for(6)
    trainer.step("shared", samples)
    gate_reads = []
    hook = trainer._backbone_and_head()[0].register_forward_pre_hook(
        lambda m, args, kwargs: gate_reads.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    Readings(trainer).sampled([s.prompt_ids for s in samples], 4, 1)
    hook.remove()
    assert sum(n for rows_, n in gate_reads if rows_ == 1) == 6 + 5, "the 45-token prefix is not read again"

    trainer, params = trainer_for(6)
    backbone, head = trainer._backbone_and_head()
    rows = torch.tensor([trainer._row(s) for s in samples])
    lengths = []
    hook = backbone.register_forward_pre_hook(lambda m, args, kwargs: lengths.append(tuple(kwargs["input_ids"].shape)),
                                              with_kwargs=True)
    with torch.no_grad(), trainer._prefixes.during_update():
        trainer._prefixes.hidden(backbone, rows[:1], None, 40)
        trainer._prefixes.hidden(backbone, rows[:1], None, 45)
    hook.remove()
    assert lengths == [(1, 40), (1, 15), (1, 5), (1, 10)], "a longer prefix computes only what it adds to a kept one"

    def loss_of(hidden):
        logprobs = torch.log_softmax(head(hidden[:, -4:]).float(), -1)
        targets = torch.tensor([s.response_ids for s in samples])
        return (logprobs.gather(-1, targets[..., None]).squeeze(-1) * torch.tensor([[1.0], [-1.0]])).sum()

    trainer.model.train()
    with trainer._prefixes.during_update():
        loss_of(trainer._prefixes.hidden(backbone, rows, None, 45)).backward()
    checkpointed = [p.grad.clone() for p in params]
    trainer.model.zero_grad()
    trainer.model.eval()  # no checkpointing: a plain cache holds the prefix, computed without gradients
    with torch.no_grad():
        cache = kv_cache.new_cache()
        backbone(input_ids=rows[:, :45], use_cache=True, **{kv_cache.cache_argument(backbone): cache})
    loss_of(backbone(input_ids=rows[:, 45:], **{kv_cache.cache_argument(backbone): cache}).last_hidden_state).backward()
    assert any(p.grad.abs().max() > 1e-4 for p in params)
    assert all(torch.allclose(p.grad, g, atol=1e-6, rtol=1e-4) for p, g in zip(params, checkpointed))


async def test_packed_micro_batches_make_the_same_update_in_fewer_passes(tiny_model_dir, engine):
    """Samples of different lengths, padded into one forward pass, step the weights exactly
    as one pass per sample does."""
    samples = [make_sample(toks, prompt=PROMPT[: 10 + 5 * i], advantage=(-1.0) ** i, temperature=0.7 + 0.2 * i)
               for i, toks in enumerate(await generate(engine, 3, max_new=6))]
    samples = [s.model_copy(update={"old_logprobs": [x - 0.05 for x in s.old_logprobs]}) for s in samples]

    def run(budget: int):
        torch.manual_seed(0)
        trainer = LoraTrainer(tiny_model_dir, LearnerSettings(lr=5e-3, lora_r=4, lora_alpha=8, micro_batch_tokens=budget, ppo_epochs=1,
                                                              replay_coef=0))  # the batch's passes alone
        name, params = trainer._activate("shared")
        with torch.no_grad():  # LoRA B starts at zero: give it a value so the adapter matters
            for p in params:
                p.normal_(0, 0.02)
        passes, grads = [], []
        backbone, _ = trainer._backbone_and_head()
        backbone.register_forward_pre_hook(lambda m, args, kwargs: passes.append(kwargs["input_ids"].shape), with_kwargs=True)
        # the gradients the optimizer steps on (Adam's first step is ~sign(g): compare g itself)
        trainer._optimizers["shared"].register_step_pre_hook(lambda *_: grads.extend(p.grad.clone() for p in params))
        result = trainer.step("shared", samples)
        return result, grads, passes

    alone, alone_grads, alone_passes = run(1)
    packed, packed_grads, packed_passes = run(10_000)
    assert alone.skipped is None and packed.skipped is None
    assert [s[0] for s in alone_passes] == [1] * 6, "3 samples: the policy and the policy-KL check each"
    assert [s[0] for s in packed_passes] == [3, 3]
    assert packed.loss == pytest.approx(alone.loss, abs=1e-5) and packed.policy_kl == pytest.approx(alone.policy_kl, abs=1e-6)
    assert len(packed_grads) == len(alone_grads) > 0 and any(g.abs().max() > 1e-4 for g in packed_grads)
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(alone_grads, packed_grads))


def test_the_chance_of_an_empty_reply_is_the_stop_tokens_share_of_the_first_step(trainer):
    """The gate's empty-reply figure: what a sampler at temperature 1 would serve empty, read
    from the first step of the replies the gate generates anyway."""
    trainer.ensure_scope("shared")
    model = trainer.model
    with torch.no_grad():
        first = torch.softmax(model(input_ids=torch.tensor([PROMPT])).logits[0, -1].float(), dim=-1)
    stops = stop_ids(model)
    assert stops, "the tiny model has a stop token"
    assert Readings(trainer).sampled([PROMPT], 4, 2).empty == pytest.approx([float(first[stops].sum())], rel=1e-4)


def test_the_gates_sampled_replies_read_each_prompt_once_and_are_the_replies_of_a_full_read(tiny_model_dir, monkeypatch):
    """Each prompt's cache is read once and repeated for its two replies (an agent's prompt is
    thousands of tokens), from what an earlier prompt of the batch shares with it, in batches of
    similar lengths; the replies and their empty-reply chances are those of reading each row
    whole, prompts of different lengths (left-padded) included."""
    trainer = LoraTrainer(tiny_model_dir, LearnerSettings(lora_r=4, lora_alpha=8))
    readings = Readings(trainer)
    trainer.ensure_scope("alice")
    prompts = [PROMPT[:8], PROMPT, PROMPT[:20], PROMPT[3:20]]
    rows = []
    backbone, _ = trainer._backbone_and_head()
    hook = backbone.register_forward_pre_hook(lambda m, args, kwargs: rows.append(tuple(kwargs["input_ids"].shape)),
                                              with_kwargs=True)
    shared = readings.sampled(prompts, 12, 2)
    hook.remove()
    # 8 tokens alone (17 is over twice 8); then 17, 20 and 25, the 20 reading only what follows
    # the 8 read before it (what the weights read stays until they change), the 25 what follows the 20
    assert [r for r in rows if r[0] == 1] == [(1, 7), (1, 16), (1, 12), (1, 5)], "all but the last token, once"
    assert {r[0] for r in rows if r[0] > 1} == {2, 6}, "two replies a prompt, a batch of one prompt and one of three"
    monkeypatch.setattr(Readings, "_read_once", lambda *args: None)
    whole = readings.sampled(prompts, 12, 2)
    assert shared.ids == whole.ids
    assert shared.empty == pytest.approx(whole.empty, rel=1e-4)


def test_what_the_adapter_read_of_a_prompt_is_kept_until_its_weights_change(tiny_model_dir, tmp_path):
    """The gate reads a candidate's prompts through the prompt prefixes kept at its weights
    (right after an update, what its last pass read); a step, a shortening, an undo, a load or
    another scope's adapter drops them, so nothing is read off weights that are gone."""
    from nextstate.engine.base import GeneratedToken

    trainer = LoraTrainer(tiny_model_dir, LearnerSettings(lora_r=4, lora_alpha=8, lr=1e-2, max_kl=100.0))
    readings = Readings(trainer)
    kept = trainer._prefixes.kept
    samples = [make_sample([GeneratedToken(t, -1.0) for t in (31, 40, 52)])]
    trainer.step("alice", samples)
    trainer.save("alice", tmp_path)
    changes = {"a step": lambda: trainer.step("alice", samples), "a shorter step": lambda: trainer.shorten_step("alice", 0.5),
               "an undo": lambda: trainer.undo("alice"), "a load": lambda: trainer.load("alice", tmp_path),
               "another scope": lambda: trainer._activate("bob")}
    for name, change in changes.items():
        trainer._activate("alice")
        readings.sampled([PROMPT], 4, 2)
        assert len(kept) == 1, "the prompt read at these weights is kept"
        readings.sampled([PROMPT], 4, 2)
        assert len(kept) == 1
        change()
        assert len(kept) == 0, name
    trainer._activate("alice")
    with trainer.model.disable_adapter():  # the base model, turned on by hand: not the adapter's weights
        readings.sampled([PROMPT], 4, 2)
    assert len(kept) == 0


def test_the_gates_sampled_replies_share_their_random_draws_between_candidate_and_base(tiny_model_dir):
    """A prompt's gate replies come from a stream seeded by the prompt
    alone, so the same weights give the same replies whenever asked (a fresh adapter, still the
    base model, repeats itself exactly as much as the base), the replies vary within a prompt
    and between prompts, and the process's own random stream is left as it was."""
    trainer = LoraTrainer(tiny_model_dir, LearnerSettings(lora_r=4, lora_alpha=8))
    readings = Readings(trainer)
    trainer.ensure_scope("alice")
    prompts = [PROMPT[:8], PROMPT, PROMPT[3:20]]
    state = torch.random.get_rng_state()
    first = readings.sampled(prompts, 12, 2).ids
    assert torch.equal(torch.random.get_rng_state(), state)
    pairs = [first[2 * j: 2 * j + 2] for j in range(3)]
    again = readings.sampled(list(reversed(prompts)), 12, 2).ids
    assert [again[2 * j: 2 * j + 2] for j in range(3)] == pairs[::-1], "the same draws whatever shares the batch"
    assert [readings.sampled([p], 12, 2).ids for p in prompts] == pairs, "one batch or one prompt at a time: the same"
    assert all(a != b for a, b in pairs)
    figures = readings.gate_figures("alice", [], prompts, 12)
    repeats, empty = readings.base_figures(prompts, 12)
    assert figures.repetition is not None and figures.repetition == repeats
    assert figures.empty == pytest.approx(empty, abs=1e-6), "a fresh adapter is still the base model"


# ---------------------------------------------------------------------------- memory budget


def test_the_memory_budget_learns_from_measured_passes_and_refuses_what_cannot_fit():
    from types import SimpleNamespace

    from nextstate.learner.memory_budget import MIN_FIT_TOKENS, SAFETY, MemoryBudget, Refusal

    config = SimpleNamespace(hidden_size=576, num_hidden_layers=30, intermediate_size=1536, vocab_size=49152)
    budget = MemoryBudget(config, torch.float32, "cpu", logit_rows=341, cap_mb=4096)
    prior = budget.needed(8192)
    assert 1.5 * 2**30 < prior < 3 * 2**30, "SmolLM2's shape: an 8k-token pass was measured at +1.78 GiB"
    budget.record(100, 5 * 2**30)
    assert budget.needed(8192) == prior, "a short pass's one-time allocations do not set the cost per token"
    budget.record(8192, budget.fixed + 8192 * 150_000)
    assert budget.per_token == 150_000 and budget.needed(8192) == int((budget.fixed + 8192 * 150_000) * SAFETY)
    budget.record(MIN_FIT_TOKENS, 10 * 2**30)
    assert budget.per_token == 150_000, "the longest measured pass stands for the long ones"
    # within the cap: micro-batches as configured, or shrunk to what fits, never under the longest sample
    assert budget.plan([1000, 3000], budget_tokens=8192) == 8192
    budget.cap = 3 << 29
    fits = budget.plan([1000, 3000], budget_tokens=8192)
    assert 3000 <= fits < 8192 and budget.needed(fits) <= (3 << 29) + 1
    budget.cap = 64 << 20
    refusal = budget.plan([1000, 3000], budget_tokens=8192)
    assert isinstance(refusal, Refusal) and refusal.tokens == 3000 and refusal.available == 64 << 20
    assert "3000 tokens" in refusal.reason() and "NEXTSTATE_LEARNER_MEMORY_MB" in refusal.reason()


def test_a_pass_is_measured_on_the_cpu():
    from nextstate.learner.memory_budget import PeakMeter

    with PeakMeter("cpu") as meter:
        block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
        time.sleep(0.05)
        del block
    assert meter.added >= 48 << 20


async def test_a_step_that_would_not_fit_is_not_started_and_one_that_fits_is_measured(tiny_model_dir, engine):
    samples = [make_sample(toks) for toks in await generate(engine, 2)]
    trainer = LoraTrainer(tiny_model_dir, LearnerSettings(lr=5e-3, lora_r=4, lora_alpha=8, learner_memory_mb=1))
    _, params = trainer._activate("shared")
    before = [p.detach().clone() for p in params]
    result = trainer.step("shared", samples)
    assert result.refused and result.skipped.startswith("memory:")
    assert all(torch.equal(a, b) for a, b in zip(before, params)), "nothing trained"
    trainer.memory.cap = None
    result = trainer.step("shared", samples)
    assert not result.refused and result.skipped is None
    assert result.pass_tokens == trainer.settings.micro_batch_tokens and result.peak_added_mb >= 0


def test_a_refused_step_keeps_its_samples_and_says_what_it_waits_for(server_factory):
    server = learning_server(server_factory, learner_memory_mb=1)
    services = server.app.state.services
    feed(server, served_samples(server, 4))
    wait_for(lambda: any(r["kind"] == "train_step" for r in server.records()))
    step = next(r for r in server.records() if r["kind"] == "train_step")
    assert step["refused"] and step["skipped"].startswith("memory:") and not step["published"]
    assert len(services.samples.samples("ready")) == 4, "the samples stay ready"
    wait_for(lambda: "shared" in services.learner.waiting)
    waiting = services.learner.waiting["shared"]
    assert waiting.reason == "memory" and "tried again in" in waiting.detail
    assert services.policies.current("alice").version == 0
    # memory frees up (here: the cap is lifted) and the retry time passes: the same samples train
    services.learner.trainer.memory.cap = None
    services.learner._refused.clear()
    services.learner._wake.set()
    wait_for(lambda: services.policies.current("alice").version == 1)
    assert len(services.samples.samples("consumed")) == 4


def test_a_second_learner_on_one_adapters_folder_is_refused_before_serving(tmp_path, tiny_model_dir):
    """Two learners would train the same samples into two version N+1s: `nextstate serve`
    (learning) or `nextstate learn` on a folder another learner holds stops with the reason;
    a judge process (whose settings leave learning on) starts beside it."""
    from nextstate.assembly import ConfigError, check_no_other_learner, preflight
    from nextstate.learner.versions import AdapterVersions
    from tests.conftest import make_settings

    settings = make_settings(tmp_path, tiny_model_dir)
    held = AdapterVersions(settings.adapters_dir).hold_learner()
    try:
        with pytest.raises(ConfigError, match="another learner .* NEXTSTATE_LEARN=false"):
            check_no_other_learner(settings)
        check_no_other_learner(settings.with_overrides(learn=False))  # serving beside it is fine
        preflight(settings)  # what `nextstate judge` checks before it starts
    finally:
        held.close()
    check_no_other_learner(settings)


async def test_the_empty_guard_pushes_down_a_reply_ending_before_it_begins(tiny_model_dir, engine):
    """NEXTSTATE_EMPTY_GUARD: where the trained weights would end a reply at its first token more
    often than the guard allows, the update pushes that chance down; off, the same update does not."""
    rejected = [make_sample(toks, advantage=-1.0) for toks in await generate(engine, 4)]

    def first_stop(t: LoraTrainer) -> float:
        t._activate("shared")
        with torch.no_grad():
            return math.exp(float(t._response_logprobs(rejected[:1], first_stop=True)[0].first_stop))

    def stepped(guard: float) -> tuple[LoraTrainer, object]:
        torch.manual_seed(0)
        t = LoraTrainer(tiny_model_dir, LearnerSettings(lr=5e-3, lora_r=4, lora_alpha=8, max_kl=1e9, empty_guard=guard))
        return t, t.step("shared", rejected)

    before = first_stop(LoraTrainer(tiny_model_dir, LearnerSettings(lora_r=4, lora_alpha=8)))
    off, off_result = stepped(0.0)
    on, on_result = stepped(before / 4)  # the base model is already past it: the guard is on from the start
    assert off_result.guarded == 0 and on_result.guarded > 0
    assert first_stop(on) < min(before, first_stop(off)), (before, first_stop(on), first_stop(off))


def test_training_makes_way_for_a_persons_request_between_layers(tiny_model_dir, monkeypatch):
    """On a CPU a training pass beside a reply takes the cores the reply decodes on: the
    learner's passes stop between layers while a request is served, for at most MAKE_WAY_S, and
    then run as long before they stop again (an agent that never pauses still gets its update)."""
    import threading

    from nextstate.core import activity as activity_module
    from nextstate.core.activity import Activity

    monkeypatch.setattr(activity_module, "MAKE_WAY_S", 0.3)
    activity = Activity()
    trainer = LoraTrainer(tiny_model_dir, LearnerSettings(lora_r=4, lora_alpha=8))
    trainer.between_layers = activity.make_way
    layers = len(trainer._base.model.layers)
    calls = []
    trainer.between_layers = lambda: calls.append(1) or activity.make_way()
    trainer._logprobs_each([make_sample([], prompt=PROMPT).model_copy(update={"response_ids": [5, 6], "old_logprobs": [-1.0] * 2,
                                                                           "advantages": [1.0] * 2, "loss_mask": [1] * 2})])
    assert len(calls) == layers, "once before each layer of a pass"
    request = activity.request()
    request.__enter__()  # a person's request is being served
    threading.Timer(0.1, lambda: request.__exit__(None, None, None)).start()
    started = time.monotonic()
    activity.make_way()
    assert 0.05 < time.monotonic() - started < 0.3, "it waited until the request ended"
    with activity.request():
        started = time.monotonic()
        activity.make_way()  # a request that does not end: it waits MAKE_WAY_S, no longer
        waited = time.monotonic() - started
        activity.make_way()  # and then runs without waiting for as long
        assert 0.25 < waited < 0.6 and time.monotonic() - started - waited < 0.05
