"""The judge's start-up check: a judge that cannot judge is found out and scores nothing,
and explicit feedback still trains."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.test_feedback import rate
from tests.test_judge import SCRIPT, converse
from tests.test_learner import wait_for


def calibrated_server(server_factory, judge, **overrides):
    values = {"judge_base_url": judge.base_url, "judge_model": "judge", "prm_votes": 3, "judge_calibration": True,
              "batch_size": 2, "lr": 5e-3, "lora_r": 4, "lora_alpha": 8, "max_user_share": 1.0}
    server = server_factory(**{**values, **overrides})
    wait_for(lambda: server.app.state.services.judge.calibration.state != "pending", timeout=60)
    return server


def admin_stats(server) -> dict:
    admin = server.key("root", admin=True)
    return httpx.get(f"{server.base_url}/admin/stats", headers={"Authorization": f"Bearer {admin}"}).json()


def test_a_judge_that_judges_passes_and_scores_next_states(server_factory, judge):
    server = calibrated_server(server_factory, judge)
    calibration = admin_stats(server)["judge"]["calibration"]
    assert calibration["state"] == "passed", calibration
    assert [c["verdict"] for c in calibration["cases"]] == [1, -1, -1, 0]
    assert admin_stats(server)["judge"]["implicit_feedback"] is True
    converse(server.client(server.key("alice")), SCRIPT[:2], max_tokens=3)
    server.end_conversations()
    server.drain_judge()
    assert [s.reward for s in server.app.state.services.samples.samples()] == [-1.0], "the correction was judged"


@pytest.mark.parametrize("mode", ["garbage", "error"])
def test_a_judge_that_cannot_judge_is_benched_and_feedback_still_trains(server_factory, judge, mode, caplog):
    judge.mode = mode
    server = calibrated_server(server_factory, judge, judge_timeout_s=2, judge_fallback="ratings")
    stats = admin_stats(server)["judge"]
    assert stats["calibration"]["state"] == "failed" and stats["implicit_feedback"] is False
    assert "POST /v1/feedback" in stats["calibration"]["detail"]
    assert len(stats["calibration"]["cases"]) == 1, "the first case judged wrong ends the check"
    assert any("calibration case 'clear thanks' wrong" in r.getMessage() for r in caplog.records)
    calls = len(judge.calls)

    alice = server.key("alice")
    messages = converse(server.client(alice), SCRIPT[:3], max_tokens=3)
    server.end_conversations()
    server.drain_judge()
    assert len(judge.calls) == calls, "no implicit-feedback work goes to a failed judge"
    assert server.app.state.services.samples.samples() == []
    assert server.app.state.services.samples.stats()["transitions_pending"] == 0, "the turns wait for explicit feedback"

    # every turn can still be rated, and the ratings train
    records = [r for r in server.records() if r["kind"] == "request"]
    for record in records[:2]:
        assert rate(server, alice, record["id"], -1, "Answer in French.").json()["status"] == "accepted"
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 1, timeout=60)
    assert messages


def test_the_embedded_default_judge_is_checked_too(server_factory):
    """No NEXTSTATE_JUDGE_BASE_URL: the served model judges itself, and the tiny one cannot;
    its next states teach as hints of their own (the default fallback)."""
    server = server_factory(judge_calibration=True, prm_votes=1, judge_max_tokens=16)
    wait_for(lambda: server.app.state.services.judge.calibration.state != "pending", timeout=120)
    judge = server.app.state.services.judge
    assert judge.calibration.state == "failed" and judge.hindsight and judge.implicit


def test_a_benched_judges_next_states_teach_as_hints_of_their_own(server_factory, judge):
    """Issue 38: on a laptop the judge is benched, and next states taught nothing. Now each next
    state is the OPD hint of the reply before it, scored by the served model; the judge is
    asked nothing, and the samples train a version with no rating at all."""
    judge.mode = "garbage"
    server = calibrated_server(server_factory, judge, judge_timeout_s=2, mode="combined", opd_loss="sampled")
    stats = admin_stats(server)["judge"]
    assert stats["calibration"]["state"] == "failed" and stats["fallback"] == "hindsight" and stats["implicit_feedback"]
    calls = len(judge.calls)
    alice = server.key("alice")
    converse(server.client(alice), SCRIPT[:3], max_tokens=3)
    server.end_conversations()
    server.drain_judge()
    assert len(judge.calls) == calls, "a benched judge is asked nothing"
    samples = sorted(server.app.state.services.samples.samples(), key=lambda s: s.turn_index)
    taught = [s for s in samples if s.reason.startswith("hindsight: the next state as the hint")]
    assert len(taught) >= 2, [(s.status, s.reason) for s in samples]
    for sample in taught:
        assert sample.reward == 0 and sample.votes == []
        assert sample.hint.startswith(("The user answered this reply with: ", "The tool call returned: "))
        assert len(sample.teacher_logprobs) == len(sample.response_ids) and any(sample.advantages)
    assert taught[0].hint == "The user answered this reply with: " + SCRIPT[1]["content"], "the person's own words"
    wait_for(lambda: server.app.state.services.policies.current("alice").version >= 1, timeout=90)
    admin = server.key("root", admin=True)
    report = httpx.get(f"{server.base_url}/admin/progress", headers={"Authorization": f"Bearer {admin}"}).json()
    assert not [w for w in report["waiting"] if w["reason"] == "judge_benched"], "next states train: nothing waits"
    assert report["judge"]["fallback"] == "hindsight"


def test_a_case_passes_only_when_most_votes_have_a_verdict():
    from nextstate.judge.calibration import judge_case

    case = {"name": "clear thanks", "accept": [1]}
    assert not judge_case(case, [1, None, None]).passed, "one valid vote of three is not a judge"
    assert judge_case(case, [1, 1, None]).passed and judge_case(case, [1]).passed
    assert not judge_case(case, [-1, -1, 1]).passed


def test_a_restart_keeps_the_verdict_on_the_same_judge_and_asks_a_new_one(server_factory, judge, tmp_path):
    """The check costs minutes on a slow judge and used to run again beside the first user of
    every restart: the same judge, cases and prompt keep their verdict; another judge is asked."""
    data = tmp_path / "kept"
    first = calibrated_server(server_factory, judge, data_dir=data)
    assert first.app.state.services.judge.calibration.state == "passed"
    asked = len(judge.calls)
    first.stop()

    again = calibrated_server(server_factory, judge, data_dir=data)
    calibration = again.app.state.services.judge.calibration
    assert calibration.state == "passed" and len(judge.calls) == asked, "nothing asked again"
    assert again.app.state.services.judge.implicit is True
    again.stop()

    other = calibrated_server(server_factory, judge, data_dir=data, judge_model="another-judge")
    assert other.app.state.services.judge.calibration.state == "passed"
    assert len(judge.calls) > asked, "a different judge is checked anew"


def test_a_stop_during_the_check_waits_for_no_verdict_and_loses_no_turn(server_factory, judge, tmp_path):
    """A stop during the start-up check waited for the check's in-flight votes (over 7 s with the
    embedded SmolLM2 judging itself). Now the check stops at once, concludes nothing and keeps
    nothing; turns waiting for its verdict stay pending, and the next start judges them."""
    data = tmp_path / "kept"
    judge.mode = "hang"
    values = {"judge_base_url": judge.base_url, "judge_model": "judge", "prm_votes": 3, "judge_calibration": True,
              "data_dir": data}
    first = server_factory(**values)
    wait_for(lambda: judge.calls, timeout=30)  # the check is asking its first case
    converse(first.client(first.key("alice")), SCRIPT[:2], max_tokens=3)
    first.end_conversations()
    assert first.app.state.services.samples.stats()["transitions_pending"] == 1
    started = time.monotonic()
    first.stop()
    assert time.monotonic() - started < 5, "the stop did not wait for the check"
    assert first.app.state.services.judge.calibration.state == "pending", "no verdict from a check cut short"

    judge.mode = "rules"
    again = calibrated_server(server_factory, judge, **{k: v for k, v in values.items() if k != "judge_calibration"})
    assert again.app.state.services.judge.calibration.state == "passed", "asked again, not a kept non-verdict"
    wait_for(lambda: [s.reward for s in again.app.state.services.samples.samples()] == [-1.0], timeout=60)


def test_a_check_whose_votes_all_failed_is_asked_again_at_the_next_start(server_factory, judge, tmp_path):
    data = tmp_path / "kept"
    judge.mode = "error"
    first = calibrated_server(server_factory, judge, data_dir=data, judge_timeout_s=2)
    assert first.app.state.services.judge.calibration.state == "failed"
    first.stop()
    judge.mode = "rules"
    again = calibrated_server(server_factory, judge, data_dir=data)
    assert again.app.state.services.judge.calibration.state == "passed", "an unreachable judge's verdict is not kept"


def test_a_next_states_hint_is_measured_against_its_placebo(server_factory, judge):
    """The learner measures a next state's hint against the same words shuffled
    (judge/hindsight.py), so what merely copying them adds cancels."""
    from nextstate.judge.hindsight import LEADS, scrambled

    judge.mode = "garbage"
    server = calibrated_server(server_factory, judge, judge_timeout_s=2, mode="opd")
    converse(server.client(server.key("alice")), SCRIPT[:2], max_tokens=3)
    server.end_conversations()
    server.drain_judge()
    taught, = [s for s in server.app.state.services.samples.samples() if s.reason.startswith("hindsight")]
    assert taught.distill_weight == 1.0 and taught.teacher_prompt_ids
    tokenizer = server.app.state.services.turns.renderer.tokenizer
    placebo = tokenizer.decode(taught.contrast_prompt_ids)
    assert LEADS["user"] + scrambled(SCRIPT[1]["content"]) in placebo
    assert tokenizer.decode(taught.teacher_prompt_ids) == placebo.replace(scrambled(SCRIPT[1]["content"]), SCRIPT[1]["content"])
