"""The publish gate: a version that makes liked replies unlikely, or repeats itself, never serves."""

from __future__ import annotations

import pytest

from nextstate.learner.gate import GATE_NEW_TOKENS, verdict_from_figures
from nextstate.learner.readings import GateFigures, repetition
from nextstate.learner.held_out import VersionFigures
from tests.test_learner import feed, learning_server, served_samples, wait_for


def test_the_verdict_rules():
    assert repetition("Too short.") is None and repetition("The sea is calm tonight.") == 0
    assert repetition("The most, most, most. The most!") == pytest.approx(1 - 2 / 6), "case and punctuation aside"
    # a wish spread past its place repeats words, not trigrams: the opening word's hard seed
    spread = "The Sky\nThe Light\nThe Flower\nThe Starlight exceed Bounds\nThe sea of cephalopods"
    assert repetition(spread) == pytest.approx(4 / 14)
    # the gate reads a reply's first words only: a longer reply repeats "the" without degenerating
    assert repetition("one two three four the five six seven the", 8) == 0 < repetition("one two three four the five six seven the")
    # Chinese and Japanese have no spaces: each character is a word, so a loop there is seen too
    assert repetition("今天天气很好") == pytest.approx(1 / 6) and repetition("好的好的好的好的") == pytest.approx(6 / 8)
    assert repetition("これはペンです。これはペンです。") == pytest.approx(7 / 14), "kana, full-width stops aside"
    ok = verdict_from_figures(GateFigures(-2.0, 0.1), GateFigures(-2.05, 0.12), 0.1, max_likelihood_drop=0.1,
                       max_repetition_rise=0.05, held_out=4, prompts=4)
    assert ok.passed and ok.reasons == []
    bad = verdict_from_figures(GateFigures(-2.0, 0.1), GateFigures(-2.5, 0.4), 0.1, max_likelihood_drop=0.1,
                        max_repetition_rise=0.05, held_out=4, prompts=4)
    assert not bad.passed and len(bad.reasons) == 2
    assert "less likely" in bad.reasons[0] and "repeat themselves" in bad.reasons[1]
    # drift is measured from the base model, not from the serving version: it cannot pile up
    drift = verdict_from_figures(GateFigures(-2.0, 0.3), GateFigures(-2.0, 0.32), 0.1, max_likelihood_drop=0.1,
                          max_repetition_rise=0.05, held_out=4, prompts=4)
    assert not drift.passed and "serving version's 0.300" in drift.reasons[0]
    # but a version that repeats no more than the one serving is not held back for it
    no_worse = verdict_from_figures(GateFigures(-2.0, 0.3), GateFigures(-2.0, 0.28), 0.1, max_likelihood_drop=0.1,
                             max_repetition_rise=0.05, held_out=4, prompts=4)
    assert no_worse.passed
    unmeasured = verdict_from_figures(GateFigures(-2.0, None), GateFigures(-2.0, 0.28), 0.1, max_likelihood_drop=0.1,
                               max_repetition_rise=0.05, held_out=4, prompts=4)
    assert not unmeasured.passed


def test_a_version_that_would_serve_empty_replies_does_not_pass():
    """The chance of an empty reply is measured from the base model's, as repetition is; a
    version no emptier than the one serving is not held back for it."""
    def verdict(serving: float | None, candidate: float | None, base: float | None = 0.0):
        return verdict_from_figures(GateFigures(None, None, empty=serving), GateFigures(None, None, empty=candidate), None,
                                    max_likelihood_drop=0.1, max_repetition_rise=0.05, held_out=0, prompts=8,
                                    base_empty=base, max_empty_rise=0.02)

    assert verdict(0.0, 0.01).passed
    sliding = verdict(0.0, 0.06)
    assert not sliding.passed and sliding.reasons == [
        "replies end before they begin: 6.0% of replies to recent prompts would be empty against the base model's 0.0% (limit +2%)"]
    assert sliding.base_empty == 0.0
    assert verdict(0.08, 0.06).passed, "no emptier than the serving version"
    assert verdict(0.0, 0.5, base=None).passed and verdict(0.0, None).passed, "unmeasured: nothing to compare"


def test_worse_for_its_user_is_a_drop_past_the_limit_and_past_its_noise():
    """The held-out gain is compared turn by turn with the serving version's: a drop that one
    reply's swing explains does not refuse a version; the same mean drop on every turn does."""
    def versions(serving: list[float], candidate: list[float]):
        figures = [VersionFigures(sum(g) / len(g), 0.0, 0.0, len(g), turn_gains=g) for g in (serving, candidate)]
        return GateFigures(None, None, figures[0]), GateFigures(None, None, figures[1])

    def verdict(serving, candidate):
        return verdict_from_figures(serving, candidate, None, max_likelihood_drop=0.1, max_repetition_rise=0.05,
                                    held_out=4, prompts=0, max_gain_drop=0.05)

    one_swing = verdict(*versions([0.0, 0.0, 0.0, 0.0], [-0.4, 0.05, 0.05, 0.0]))  # mean drop 0.075
    assert one_swing.passed, one_swing.reasons
    everywhere = verdict(*versions([0.0, 0.0, 0.0, 0.0], [-0.07, -0.08, -0.07, -0.08]))
    assert not everywhere.passed and "per turn 0.075 ± 0.003" in everywhere.reasons[0]
    too_few = verdict(*versions([0.0, 0.0, 0.0], [-0.5, -0.5, -0.5]))
    assert too_few.passed, "three held-out turns are not enough to compare"
    assert "turn_gains" not in VersionFigures(0.1, 0.0, 0.0, 1, turn_gains=[0.1]).to_dict(), "manifests keep the totals"


def test_a_version_that_unlearns_what_users_liked_does_not_serve(server_factory):
    # the second update must move as far as lr says: within a warmup its rate would be a fraction of it
    server = learning_server(server_factory, publish_gate=True, lr=2e-2, max_kl=1e9, gate_backtracks=0,
                             lr_warmup_steps=0)
    liked = served_samples(server, 4, advantage=1.0)
    feed(server, liked)
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 1)
    # the same replies, now punished hard: what users rewarded would become far less likely
    punished = [s.model_copy(update={"advantages": [-5.0] * len(s.response_ids), "reward": -1.0, "id": None})
                for s in liked]
    feed(server, punished)
    wait_for(lambda: any(st.get("gate") for st in server.app.state.services.learner.steps[1:]), timeout=120)
    step = server.app.state.services.learner.steps[-1]
    assert step["published"] is False and step["skipped"].startswith("gate: rewarded replies became less likely")
    assert step["gate"]["step_scale"] == 1 and step["gate"]["refused"] == [], "held back at once: no backtracking"
    assert step["gate"]["held_out"] == 4 and step["gate"]["candidate"]["liked_logprob"] < step["gate"]["serving"]["liked_logprob"]
    assert server.app.state.services.policies.current("alice").version == 1, "v1 keeps serving"
    records = [r for r in server.records() if r["kind"] == "train_step"]
    assert records[-1]["gate"]["passed"] is False
    # the learner's weights went back to v1's: its next figures are v1's again
    learner = server.app.state.services.learner
    liked = server.app.state.services.samples.samples("consumed")[:4]
    again = server.call(asyncio_to_thread(learner.gate.readings.gate_figures, "shared", liked, [], GATE_NEW_TOKENS))
    assert again.liked_logprob == pytest.approx(step["gate"]["serving"]["liked_logprob"], abs=1e-4)


def test_a_step_that_went_too_far_is_tried_at_half_its_length(server_factory, monkeypatch):
    """NEXTSTATE_GATE_BACKTRACKS at its default: the whole step is refused (forced here, so the
    test does not hang on how far a tiny model moves), half of it is scored again and serves."""
    server = learning_server(server_factory, publish_gate=True, gate_max_likelihood_drop=10.0)
    learner = server.app.state.services.learner
    real, verdicts = learner.gate._check, []

    def gate(*args):
        verdict = real(*args)
        if verdict.held_out and not any(v.held_out for v in verdicts):  # v2's whole step (v1 has no liked replies)
            verdict.passed, verdict.reasons = False, ["refused by the test"]
        verdicts.append(verdict)
        return verdict

    monkeypatch.setattr(learner.gate, "_check", gate)
    feed(server, served_samples(server, 4, advantage=1.0))
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 1)
    feed(server, served_samples(server, 4, advantage=1.0, seed0=40))
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 2)
    assert len(verdicts) == 3, "v1 was checked on its batch's prompts and shipped ones; v2 was scored twice"
    gate_record = learner.steps[-1]["gate"]
    assert gate_record["passed"] and gate_record["step_scale"] == 0.5
    assert gate_record["refused"] == [["refused by the test"]]
    first, second = (v.candidate.liked_logprob for v in verdicts[1:])
    serving = verdicts[1].serving.liked_logprob
    assert min(serving, first) - 1e-6 <= second <= max(serving, first) + 1e-6, "half the step scores between"


def test_a_new_scopes_gate_reads_the_base_replies_it_can_while_the_batch_fills(server_factory):
    """Three ready samples of a batch of four: the base model's replies to the gate's prompts
    known so far are read ahead (a new scope is served by the base model), and the base model's
    side of the forgetting probe; after the fourth rating the check answers only that rating's
    new prompt, and reads only the candidate's side of the probe."""
    from nextstate.learner.held_out import probe_passages

    server = learning_server(server_factory, publish_gate=True)
    learner = server.app.state.services.learner
    readings = learner.gate.readings
    feed(server, served_samples(server, 3))
    # their one prompt and 7 everyday ones, and every passage of the probe
    wait_for(lambda: len(readings._base_replies) == 8 and len(readings._base_probe) == len(probe_passages()), timeout=120)
    assert learner.steps == [] and learner.training is None
    assert learner.trainer._optimizers == {}, "no adapter is made for a batch still filling"
    probe_reads = []
    real_nlls = readings._probe_nlls
    readings._probe_nlls = lambda passages: probe_reads.append(readings.trainer._reading_base) or real_nlls(passages)
    answered = []
    real = readings.sampled

    def sampled(prompts, max_new, n):
        if readings.trainer._reading_base:  # the base model's side, not the candidate's
            answered.extend(prompts)
        return real(prompts, max_new, n)

    readings.sampled = sampled
    new_prompt = list(range(40, 60))
    fourth = served_samples(server, 1, seed0=9)[0].model_copy(update={"prompt_ids": new_prompt})
    feed(server, [fourth])
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 1, timeout=120)
    assert answered == [new_prompt], "the base model answered the new prompt once, and nothing it had read ahead"
    assert probe_reads and not any(probe_reads), "the probe's base side is not read again"
    first = learner.steps[0]["gate"]
    assert first["prompts"] == 8 and first["base_repetition"] is not None


def asyncio_to_thread(fn, *args):
    import asyncio

    return asyncio.to_thread(fn, *args)


def test_a_version_that_keeps_what_users_liked_serves_with_its_figures_recorded(server_factory):
    server = learning_server(server_factory, publish_gate=True)
    feed(server, served_samples(server, 4, advantage=1.0))
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 1)
    feed(server, served_samples(server, 4, advantage=1.0, seed0=40))
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 2)
    gate = server.app.state.services.learner.steps[-1]["gate"]
    assert gate["passed"] and gate["held_out"] == 4 and gate["prompts"] == 8, "4 recent prompts and 4 of its batch"
    assert gate["candidate"]["liked_logprob"] >= gate["serving"]["liked_logprob"] - 0.1
    assert gate["base_repetition"] is not None and gate["serving"]["repetition"] is not None
    assert 0 <= gate["base_empty"] <= 1 and 0 <= gate["candidate"]["empty"] <= 1 and 0 <= gate["serving"]["empty"] <= 1
    first = server.app.state.services.learner.steps[0]["gate"]
    assert first["prompts"] == 8 and first["held_out"] == 0, \
        "the first version is checked too: its batch's 4 prompts, topped up with 4 shipped everyday questions"
    assert first["candidate"]["repetition"] is not None and first["base_repetition"] is not None


def test_the_gate_answers_distinct_prompts_and_at_most_eight():
    from nextstate.learner.gate import GATE_PROMPTS, gate_prompts

    chosen = gate_prompts([[1, 2], [], [1, 2], [3]] + [[10 + i] for i in range(20)])
    assert chosen[:2] == [[1, 2], [3]], "empty and repeated prompts are skipped, the order kept"
    assert len(chosen) == GATE_PROMPTS == 8


def test_the_gate_reads_an_agents_turns_whole_and_unrelated_long_prompts_at_their_end():
    """One agent's turns share its setup, which the trainer reads once: they are answered whole.
    Six unrelated OpenClaw-size prompts took 647 s to answer whole on a CPU and 129 s cut to their
    last 2048 tokens, with the same greedy replies: past eight prompts' worth of reading beyond
    what they share, each is cut to its end, and two prompts that end alike are one."""
    from nextstate.learner.gate import GATE_PROMPT_TOKENS, gate_prompts

    system = list(range(5000))
    turns = [system + [1, 2], system + [1, 2, 3, 4], system + [1, 2, 3, 4, 5, 6]]
    assert gate_prompts(turns) == turns, "5,006 tokens read in all"
    chosen = gate_prompts([[k] + system + [1, 2] for k in range(3)] + [system + [3]])
    assert [len(p) for p in chosen] == [GATE_PROMPT_TOKENS] * 2
    assert chosen[0][-2:] == [1, 2] and chosen[1][-1] == 3


def test_a_sample_that_arrives_stops_the_read_ahead_between_two_reads(monkeypatch):
    """The read-ahead holds the trainer; a rating that may fill a batch must not wait for all of
    it: it stops at the next sample or prompt (learner/service.py `_read_ahead`)."""
    import asyncio
    from types import SimpleNamespace

    from nextstate.learner import service

    read, wake = [], asyncio.Event()

    def trainer_read(samples):
        read.append(samples[0].id)
        if len(read) == 2:
            wake.set()  # the learner is notified of a new ready sample meanwhile
        return 1

    samples = [SimpleNamespace(id=i) for i in range(4)]
    monkeypatch.setattr(service, "ready_by_scope", lambda *args: [("alice", samples, False)])
    gate_calls = []
    learner = SimpleNamespace(trainer=SimpleNamespace(read_ahead=trainer_read), _closing=False, _wake=wake,
                              settings=SimpleNamespace(batch_size=4), policies=SimpleNamespace(per_user=True),
                              store=None, gate=SimpleNamespace(read_ahead=lambda *a: gate_calls.append(a) or 0))
    service.Learner._read_ahead(learner)
    assert read == [0, 1] and gate_calls == [], "stopped after the read that was running"
