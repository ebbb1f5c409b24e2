"""Each version shows what it gained for its user and what it forgot, and the gate decides on it
(learner/held_out.py): held-out turns are never trained, the figures are kept with the version,
a version made worse on purpose is refused, forget takes the figures, a user reads only theirs."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from nextstate.core.settings import LearnerSettings
from nextstate.learner.held_out import HintMove, figures, probe_passages, wish_terms
from nextstate.learner.readings import Readings
from nextstate.learner.trainer import LoraTrainer
from nextstate.progress import render_text
from tests.test_learner import (  # noqa: F401  (engine: a fixture)
    engine, feed, generate, learning_server, make_sample, served_samples, wait_for,
)


def test_the_probe_is_plain_text_of_a_few_hundred_sentences():
    passages = probe_passages()
    assert len(passages) >= 50 and all(p[0].isupper() or p[0] == '"' for p in passages)
    assert all(p.rstrip('"')[-1] in ".?!" for p in passages)
    assert sum(p.count(". ") + 1 for p in passages) >= 150, "passages of several sentences each"


def test_gain_weighs_each_token_by_what_the_person_wanted_from_where_its_writer_had_it():
    # written by a trained version, which found its own replies likelier than the base model does
    up = make_sample([], advantage=1.0).model_copy(update={"response_ids": [1, 2], "advantages": [1.0, 1.0],
                                                           "loss_mask": [1, 1], "old_logprobs": [-1.0, -1.0]})
    down = up.model_copy(update={"advantages": [-1.0, -1.0], "reward": -1.0})
    base = [torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0])]
    learnt = [torch.tensor([-0.5, -0.5]), torch.tensor([-1.5, -1.5])]  # accepted likelier, rejected less likely
    result = figures([up, down], learnt, base, 3.1, 3.0)
    assert result.gain == pytest.approx(0.5) and result.held_out == 2
    assert (result.accepted, result.rejected) == (pytest.approx(0.5), pytest.approx(0.5)), "the two halves of it"
    flattened = figures([up, down], [torch.tensor([-1.2, -1.2]), torch.tensor([-3.0, -3.0])], base, None, None)
    assert flattened.gain > 0 and flattened.accepted < 0 < flattened.rejected, \
        "gain from rejected replies made unlikely, while what the person accepted became less likely too"
    writer = [torch.tensor([-1.0, -1.0]), torch.tensor([-1.0, -1.0])]
    assert figures([up, down], writer, base, 3.0, 3.0).gain == 0.0, "the version that wrote them moved nothing"
    assert figures([up, down], [learnt[1], learnt[0]], base, None, None).gain == pytest.approx(-0.5)
    assert figures([up, down], base, base, None, None).gain == pytest.approx(0.0), \
        "the base model is not worse for a rejected reply a trained version wrote"
    assert result.forgetting == pytest.approx(math.exp(0.1) - 1) and result.kl > 0
    assert figures([], [], [], None, None).gain is None


def test_wish_is_the_share_of_the_hints_move_a_version_makes_untold():
    torch.manual_seed(3)
    unhinted_full, hinted_full = (torch.log_softmax(torch.randn(5, 12), -1) for _ in range(2))
    ids = hinted_full.topk(6, -1).indices  # the hinted base model's top K

    def at(alpha: float) -> torch.Tensor:  # a version that has gone `alpha` of the hint's way, in logits
        return torch.log_softmax(unhinted_full + alpha * (hinted_full - unhinted_full), -1).gather(-1, ids)

    def share(version: torch.Tensor) -> float:
        numerator, denominator = wish_terms(HintMove(at(1.0), at(0.0), version))
        return numerator / denominator

    assert share(at(0.0)) == pytest.approx(0.0, abs=1e-6), "the base model has made none of it"
    assert share(at(1.0)) == pytest.approx(1.0, abs=1e-5), "a version that does untold what the base does told"
    assert 0.3 < share(at(0.5)) < 0.7 and share(at(2.0)) > 1.5, "about as far as it went"
    assert share(at(-0.5)) < 0, "moved the other way"
    hinted, unhinted = at(1.0), at(0.0)
    sample = make_sample([], advantage=-1.0).model_copy(update={"response_ids": [1] * 5, "advantages": [-1.0] * 5,
                                                                "loss_mask": [1] * 5, "old_logprobs": [-1.0] * 5})
    lp = [torch.full((5,), -1.0)]
    assert figures([sample], lp, lp, None, None, [HintMove(hinted, unhinted, hinted)]).wish == pytest.approx(1.0, abs=1e-5)
    assert figures([sample], lp, lp, None, None, [None]).wish is None, "no hinted turn, no figure"


async def test_a_hinted_held_out_turn_gives_a_wish_of_zero_on_a_fresh_adapter_and_more_once_distilled(tiny_model_dir, engine):
    from tests.test_distillation import HINTED, distilled

    # replay off: on a random tiny model its pull back to the base model's reading of prose
    # is as strong as the distillation this measures
    trainer = LoraTrainer(tiny_model_dir, LearnerSettings(lr=2e-2, lora_r=4, lora_alpha=8, max_kl=100.0, replay_coef=0))
    readings = Readings(trainer)
    held = [distilled(make_sample(t)).model_copy(update={"id": i + 1}) for i, t in enumerate(await generate(engine, 4))]
    read, hinted_topk = [], trainer._hinted_topk
    trainer._hinted_topk = lambda samples, todo: read.extend(todo) or hinted_topk(samples, todo)
    assert readings.version_figures("alice", held, probe=False).wish == pytest.approx(0.0, abs=1e-5)
    for _ in range(3):
        trainer.step("alice", held)  # distilled on them (a held-out turn never is: here, to move it)
    assert readings.version_figures("alice", held, probe=False).wish > 0.1
    assert sorted(read) == [0, 1, 2, 3], "the hinted base model read each turn once, for the readings and the steps"


async def test_a_version_is_scored_against_the_base_model_and_forgets_nothing_at_first(tiny_model_dir, engine):
    trainer = LoraTrainer(tiny_model_dir, LearnerSettings(lr=5e-3, lora_r=4, lora_alpha=8))
    readings = Readings(trainer)
    held = [make_sample(t).model_copy(update={"id": i + 1}) for i, t in enumerate(await generate(engine, 3))]
    fresh = readings.version_figures("alice", held)  # a new adapter is the base model (LoRA's B starts at zero)
    assert fresh.gain == pytest.approx(0.0, abs=1e-6) and fresh.forgetting == pytest.approx(0.0, abs=1e-6)
    trainer.step("alice", held)  # trained on them (not what a held-out turn ever is: here, to move it)
    moved = readings.version_figures("alice", held)
    assert moved.gain > 0 and moved.kl > 0 and moved.forgetting != 0


def test_the_probe_stops_once_its_passages_put_the_forgetting_well_inside_the_limit():
    """The gate's forgetting check reads the probe PROBE_STEP passages at a time (a fixed shuffle
    of them, a fair sample at every length) and stops once the estimate plus PROBE_Z standard
    errors is under the limit; a version near or over it is read whole."""
    from nextstate.learner.readings import PROBE_STEP

    base = [(100.0 + 7 * (i % 5), 50 + i % 3) for i in range(60)]  # per passage: NLL summed, tokens
    steady = [(b + 0.01 * t, t) for b, t in base]  # every passage 0.01 nats/token worse: exp(0.01) - 1 = 1%
    assert Readings._inside(steady[:PROBE_STEP], base, 0.05)
    assert not Readings._inside(steady[:PROBE_STEP], base, 0.005), "over a limit of 0.5%"
    assert not Readings._inside(steady[:PROBE_STEP], base, None), "no limit: read whole"
    noisy = [(b + (6.0 if i % 2 else -5.5), t) for i, (b, t) in enumerate(base)]  # a small mean, a wide spread
    assert not Readings._inside(noisy[:PROBE_STEP], base, 0.05), "the spread leaves the limit in reach"


async def test_the_gate_reads_part_of_the_probe_for_a_version_far_inside_its_limit(tiny_model_dir, engine):
    from nextstate.learner.readings import PROBE_STEP

    trainer = LoraTrainer(tiny_model_dir, LearnerSettings(lr=5e-3, lora_r=4, lora_alpha=8))
    readings = Readings(trainer)
    held = [make_sample(t).model_copy(update={"id": i + 1}) for i, t in enumerate(await generate(engine, 3))]
    readings.version_figures("alice", held)  # the base model's side of the probe, kept
    trainer.step("alice", held)
    read, nlls = [], readings._probe_nlls
    readings._probe_nlls = lambda passages: read.append(len(passages)) or nlls(passages)
    whole = readings.version_figures("alice", held)
    assert read == [len(probe_passages())], "no limit given: the whole probe"
    read.clear()
    early = readings.version_figures("alice", held, max_forgetting=10.0)
    assert read == [PROBE_STEP], "far inside the limit after the first passages"
    assert early.forgetting == pytest.approx(whole.forgetting, abs=0.05) and early.gain == whole.gain
    order, base = readings._probe_order(), readings._base_probe
    worse = {i: (nll + 0.06 * n, n) for i, (nll, n) in zip(order, base)}  # every passage 6% more surprising
    read.clear()
    readings._probe_nlls = lambda passages: read.append(len(passages)) or [worse[i] for i in passages]
    over = readings.version_figures("alice", held, max_forgetting=0.05)
    assert sum(read) == len(probe_passages()), "a version over the limit is read whole"
    assert over.forgetting == pytest.approx(math.exp(0.06) - 1)


def test_the_probes_base_side_is_read_ahead_in_parts_until_told_to_stop(tiny_model_dir):
    """The base model's side of the probe never changes: the learner reads it while a batch
    fills (learner/gate.py `read_ahead`), a part at a time, stopping between two parts for an
    update; what is left is read by the first check that needs it, and the same figures come out
    as from one read of the whole."""
    from nextstate.learner.readings import PROBE_STEP

    trainer = LoraTrainer(tiny_model_dir, LearnerSettings(lora_r=4, lora_alpha=8))
    readings = Readings(trainer)
    parts, nlls = [], readings._probe_nlls
    readings._probe_nlls = lambda passages: parts.append(len(passages)) or nlls(passages)
    assert not readings.base_probe_ahead(stop=lambda: len(parts) == 1), "stopped after its first part"
    assert parts == [PROBE_STEP] and len(readings._base_probe) == PROBE_STEP
    parts.clear()
    figures = readings.version_figures("alice", [])  # a fresh scope is the base model: only the rest is read
    whole = len(probe_passages())
    assert sum(parts) == whole - PROBE_STEP and max(parts) <= PROBE_STEP and len(readings._base_probe) == whole
    assert figures.forgetting == pytest.approx(0.0, abs=1e-9)
    parts.clear()
    assert readings.base_probe_ahead() and parts == [], "nothing left to read"
    with torch.no_grad(), trainer._base_model():
        at_once = nlls(readings._probe_order())
    assert [n for _, n in readings._base_probe] == [n for _, n in at_once]
    assert [v for v, _ in readings._base_probe] == pytest.approx([v for v, _ in at_once], rel=1e-4), "in parts as whole"


async def test_a_scope_still_at_the_base_model_is_scored_from_the_base_models_kept_figures(tiny_model_dir, engine):
    """A new user's first update: the serving weights are the base model's, whose figures the
    gate computes for its base side anyway (kept). They are not computed a second time through
    the adapter: on an agent's 5-8k-token prompts each pass is minutes of a CPU."""
    trainer = LoraTrainer(tiny_model_dir, LearnerSettings(lr=5e-3, lora_r=4, lora_alpha=8))
    readings = Readings(trainer)
    held = [make_sample(t).model_copy(update={"id": i + 1}) for i, t in enumerate(await generate(engine, 3))]
    prompts = [s.prompt_ids for s in held]
    passes, generations = [], []
    each, generate_ = trainer._logprobs_each, readings.sampled
    trainer._logprobs_each = lambda samples: passes.append(len(samples)) or each(samples)
    readings.sampled = lambda *a: generations.append(len(a[0])) or generate_(*a)
    assert trainer._at_base("alice")
    serving = readings.version_figures("alice", held, probe=False)
    gate = readings.gate_figures("alice", [], prompts, 8)
    assert passes == [3] and generations == [3], "the base model's side only, once"
    assert serving.gain == pytest.approx(0.0, abs=1e-6) and serving.kl == pytest.approx(0.0, abs=1e-6)
    assert (gate.repetition, gate.empty) == readings.base_figures(prompts, 8) and generations == [3], "kept"
    trainer.step("alice", held)
    assert not trainer._at_base("alice")
    passes.clear(), generations.clear()
    readings.version_figures("alice", held, probe=False)
    readings.gate_figures("alice", [], prompts, 8)
    assert passes == [3] and generations == [3], "moved weights are scored through the adapter"


def test_held_out_turns_are_never_trained_and_each_version_keeps_its_figures(server_factory):
    server = learning_server(server_factory, batch_size=3, held_out_every=4)
    feed(server, served_samples(server, 8))  # the 4th and the 8th are held out: two updates of three
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 2)
    store = server.app.state.services.samples
    held = store.held_out_samples("alice")
    assert len(held) == 2 and not {s.id for s in held} & {i for r in server.records() if r["kind"] == "train_step"
                                                           for i in r.get("sample_ids", [])}
    assert len(store.samples("consumed")) == 6
    report = httpx.get(f"{server.root}/v1/admin/progress", headers={"Authorization": f"Bearer {server.key('root', admin=True)}"}).json()
    versions = [v for v in report["versions"] if v["scope"] == "shared"]  # one adapter for all (the default here)
    assert [v["version"] for v in versions] == [1, 2] and versions[-1]["serving"]
    assert all(v["held_out"] == 2 and v["gain"] is not None and v["forgetting"] is not None for v in versions)
    assert report["samples"]["held_out"] == 2
    text = render_text(report, "here")  # `nextstate status`
    header = next(line for line in text.splitlines() if "forgetting" in line and "gain" in line)
    assert header.split()[:7] == ["scope", "version", "gain", "accepted", "rejected", "wish", "forgetting"] and "2 of them held out" in text


def test_a_version_made_worse_on_purpose_is_refused_for_its_user_with_the_reason_shown(server_factory):
    """Replies the person accepted are held out; an update then trains the same replies with the
    reward reversed: the version makes what they accepted less likely, and may not serve."""
    server = learning_server(server_factory, batch_size=4, held_out_every=1, held_out_max=4, lr=3e-2,
                             publish_gate=True, gate_max_gain_drop=0.01, gate_backtracks=0, max_kl=100.0)
    accepted = served_samples(server, 4, advantage=1.0)
    feed(server, accepted)  # every one held out (held_out_every=1), up to four
    store = server.app.state.services.samples
    wait_for(lambda: len(store.held_out_samples("alice")) == 4)
    reversed_ = [s.model_copy(update={"advantages": [-1.0] * len(s.advantages), "reward": -1.0, "response_id": None})
                 for s in accepted]
    feed(server, reversed_)  # the cap is reached: these are ready, and train
    learner = server.app.state.services.learner
    wait_for(lambda: any(s.get("skipped") for s in learner.steps))
    step = next(s for s in learner.steps if s.get("skipped"))
    assert "worse for its user" in step["skipped"] and server.app.state.services.policies.current("alice").version == 0
    assert all(s.status == "ready" for s in store.samples() if s.reward < 0), "its samples wait, ready"
    text = httpx.get(f"{server.root}/v1/admin/progress", headers={"Authorization": f"Bearer {server.key('root', admin=True)}"}).json()
    assert any("worse for its user" in (s.get("summary") or "") for s in text["steps"])


def test_a_user_key_reads_only_its_own_figures_and_forget_takes_them(server_factory):
    server = learning_server(server_factory, batch_size=3, held_out_every=4, adapter_scope="user")
    feed(server, served_samples(server, 4))
    feed(server, served_samples(server, 4, user="bob", seed0=10))
    wait_for(lambda: all(server.app.state.services.policies.current(u).version == 1 for u in ("alice", "bob")))
    mine = httpx.get(f"{server.root}/v1/me/progress", headers={"Authorization": f"Bearer {server.key('alice')}"}).json()
    assert mine["user"] == "alice" and mine["scope"] == "alice" and mine["serving"] == 1 and mine["held_out"] == 1
    assert [v["version"] for v in mine["versions"]] == [1] and mine["versions"][0]["held_out"] == 1
    assert "bob" not in str(mine)
    assert httpx.get(f"{server.root}/v1/me/progress").status_code == 401
    schema = server.app.openapi()
    assert "/v1/me/progress" in schema["paths"]
    admin = server.key("root", admin=True)
    assert httpx.delete(f"{server.root}/v1/admin/users/alice", headers={"Authorization": f"Bearer {admin}"}).status_code == 200
    assert server.app.state.services.samples.held_out_samples("alice") == []
    gone = httpx.get(f"{server.root}/v1/admin/progress", headers={"Authorization": f"Bearer {admin}"}).json()
    assert not [v for v in gone["versions"] if v["scope"] == "alice"] and [v for v in gone["versions"] if v["scope"] == "bob"]


def test_the_figures_and_the_held_out_turns_survive_a_restart(server_factory):
    from tests.conftest import start_server

    server = learning_server(server_factory, batch_size=3, held_out_every=4, adapter_scope="user")
    feed(server, served_samples(server, 4))
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 1)
    key = server.key("alice")
    before = httpx.get(f"{server.root}/v1/me/progress", headers={"Authorization": f"Bearer {key}"}).json()
    settings = server.settings
    server.stop()
    restarted = start_server(settings)
    try:
        after = httpx.get(f"{restarted.root}/v1/me/progress", headers={"Authorization": f"Bearer {key}"}).json()
        assert after == before and after["held_out"] == 1 and after["versions"][0]["forgetting"] is not None
    finally:
        restarted.stop()
