"""The bench harness: its results log, and the personalization experiment's rule-based roles
against the real judge prompts and a real server (the experiment itself runs by hand)."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal

import pytest

from bench.personalization import (
    ANSWER_HINT, HELD_OUT_TASKS, INSTRUCTIONS, NOT_AN_ANSWER, THANKS, ChatModel, ModelScorer, ModelUser, Preference, PreferenceJudge,
    RuleScorer, RuleUser, TASKS, final_evaluation, final_seeds, headline, held_out_nll, mean_repetition, missed,
    not_an_answer, react, report, run_mode, summarise,
)
from bench.models import bench_server
from bench.report import LOG_HEADING, upsert_row
from nextstate.judge.parsing import parse_hint, parse_score
from nextstate.judge.context import fence
from nextstate.judge.prompts import PromptLibrary
from tests.tiny_model import TINY_PPO_EPOCHS

ONE_PASS = [f"ppo_epochs={TINY_PPO_EPOCHS}"]  # as the suite's servers (tests/tiny_model.py)


@pytest.fixture(autouse=True)
def bench_cache_of_its_own(tmp_path, monkeypatch):
    """The base model's readings are cached under $XDG_CACHE_HOME (bench/base_cache.py): a
    test's go in its own, never in the home directory's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_results_log_rows_are_replaced_by_file_and_stay_in_their_table(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\nSome prose.\n")
    upsert_row(path, "a.json", "| 1 | a | [json](bench/results/a.json) |")
    upsert_row(path, "b.json", "| 2 | b | [json](bench/results/b.json) |")
    upsert_row(path, "a.json", "| 3 | a again | [json](bench/results/a.json) |")
    text = path.read_text()
    assert text.startswith("# Benchmarks\n\nSome prose.\n") and text.count(LOG_HEADING) == 1
    rows = [line for line in text.splitlines() if "bench/results/" in line]
    assert rows == ["| 3 | a again | [json](bench/results/a.json) |", "| 2 | b | [json](bench/results/b.json) |"]

    path.write_text(text + "\n## Later section\n\nText.\n")
    upsert_row(path, "c.json", "| 4 | c | [json](bench/results/c.json) |")
    lines = path.read_text().splitlines()
    assert lines.index("| 4 | c | [json](bench/results/c.json) |") == lines.index("| 2 | b | [json](bench/results/b.json) |") + 1
    assert lines[-3:] == ["## Later section", "", "Text."]


@pytest.mark.parametrize(
    ("rule", "fits", "misses"),
    [("capital", "  Sure thing", "sure thing"), ("digit", "about 3 cups", "a few cups"), ("marker:The", "The sea", "A sea"),
     ("list", "Try:\n- tea\n- a walk", "Try tea, then a walk."), ("nolist", "Try tea, then a walk.", "- tea\n- a walk")],
)
def test_rule_preferences(rule, fits, misses):
    preference = Preference("Always do it.", rule)
    assert preference.fits(fits) and not preference.fits(misses)
    assert RuleScorer(preference).score("task", fits) == 1.0
    assert RuleUser(preference).react("Name a colour.", fits) == (True, THANKS)
    fitted, reaction = RuleUser(preference).react("Name a colour.", misses)
    assert not fitted and reaction.startswith("No,") and "Always do it." in reaction and reaction.endswith("Name a colour.")


def test_length_matched_repetition_compares_equal_lengths():
    tasks = [{"first_reply": "a b c d a b"}, {"first_reply": "one two three four five six seven eight"},
             {"first_reply": "short one here ok"}]
    assert mean_repetition(tasks) == pytest.approx((2 / 6 + 0 + 0) / 3, abs=1e-3)
    # over the first 6 words, of the replies that have 6: the 4-word reply is left out
    assert mean_repetition(tasks, words=6) == pytest.approx((2 / 6 + 0) / 2, abs=1e-3)
    assert mean_repetition(tasks[2:], words=6) is None


def test_report_and_headline_carry_the_final_evaluation(tmp_path, capsys):
    """The report derives the standard errors from the stored replies, so files saved before a
    figure existed (here: no repetition_stderr) still report it."""
    samples = [{"first_reply": "The sea is calm and blue tonight.", "score": 1},
               {"first_reply": "a b a b", "score": 0}]
    task = {"first_reply": "The sea is calm and blue tonight."}
    result = {"variant": "old-file", "runs": [{"tasks": [task] * 4, "final": {
        "version": 7, "replies": 2, "score": 0.5, "score_stderr": 0.5, "repetition": 0.25, "samples": samples}}],
        "summary": [{"mode": "binary", "score_first_quarter": 0.0, "score_last_quarter": 1.0,
                     "updates_published": 7, "updates_skipped": 1}]}
    path = tmp_path / "result.json"
    path.write_text(json.dumps(result))
    report([str(path)])
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith("| old-file | binary |")
    # score s.e. = stdev(1, 0)/sqrt 2 = 0.5; repetition 0 and 0.5 -> 0.25 ± 0.25
    assert row.endswith("| v7, 0.500 ± 0.500, 0.250 ± 0.250 (2) |")
    assert headline(result).endswith("final evaluation of v7: 0.50, repeated words 0.25 (2 replies)")


def test_the_proxy_benchs_agent_conversation_is_openclaws_and_grows_by_a_turn():
    from bench.proxy_overhead import TURNS_PER_CONVERSATION, Conversation

    convo = Conversation(0, agent=True)
    sizes = []
    for turn in range(3):
        messages = convo.next_request(turn)
        sizes.append(len(messages))
        convo.answered("ok")
    assert sizes == [2, 4, 6], "[system, user], then our reply and a new user message each turn"
    assert messages[0]["role"] == "system" and len(messages[0]["content"]) == 8971  # OpenClaw's trimmed prompt
    assert len(convo.tools) == 5 and messages[-1]["content"].startswith("[Mon 2026-11-23 ")
    assert Conversation(0, agent=True).next_request(TURNS_PER_CONVERSATION) == Conversation(0, agent=True).next_request(0)


def test_model_user_and_scorer_speak_openai_and_parse_their_answers():
    """With --user-url/--scorer-url the roles are chat models: a real OpenAI-compatible HTTP
    server here (the scripted judge's, answering by the rules it would apply)."""
    server, answer = PreferenceJudge(), {"text": ""}
    server.verdict = lambda messages: answer["text"]
    try:
        model = ChatModel(server.base_url, "any", api_key=None)
        preference = Preference("Always begin your reply with a capital letter.")
        answer["text"] = "Thanks, great!"
        assert ModelUser(model, preference).react("Give me a tip.", "Drink water.") == (True, "Thanks, great!")
        answer["text"] = "No, start with a capital letter. Try again."
        fitted, text = ModelUser(model, preference).react("Give me a tip.", "drink water.")
        assert not fitted and text.startswith("No,")
        answer["text"] = "It follows it partly. \\boxed{0.5}"
        assert ModelScorer(model, preference).score("Give me a tip.", "drink water.") == 0.5
        sent = server.calls[-1][0]["content"]
        assert "Always begin your reply with a capital letter." in sent and "drink water." in sent
    finally:
        server.stop()
    with pytest.raises(ValueError, match="needs a model user and scorer"):
        preference.fits("anything")


def test_rule_judge_reads_the_user_from_the_real_judge_prompts():
    """The experiment's judge must parse what nextstate actually sends it: the bundled PRM and
    hint prompts, filled with the rule user's reactions."""
    preference = Preference(INSTRUCTIONS["capital"], "capital")
    _, correction = RuleUser(preference).react("Give me a tip.", "drink water")
    judge, prompts = PreferenceJudge(serve=False), PromptLibrary()

    def ask(prompt: str, next_state: str) -> str:  # fenced, as nextstate sends it
        messages = prompts.render(prompt, request=fence("Give me a tip.", "k1"), response=fence("drink water", "k1"),
                                  next_state=fence(next_state, "k1"), next_state_role="user")
        return judge.verdict(messages)

    assert parse_score(ask("prm_personal", correction)) == -1
    assert parse_score(ask("prm_personal", THANKS)) == 1
    hinted = ask("opd_hint", correction)
    assert parse_score(hinted) == 1 and parse_hint(hinted) == INSTRUCTIONS["capital"]
    assert parse_score(ask("opd_hint", THANKS)) == -1
    for instruction in INSTRUCTIONS.values():  # each kind's wish, missed or met with nonsense: its sentence alone
        wish = instruction.format("The")
        for reaction in (missed(wish, "Give me a tip."), not_an_answer(wish, "Give me a tip.")):
            assert parse_hint(ask("opd_hint", reaction)) == wish, reaction
    # --nonsense-hint answer: a reply turned down as nonsense is hinted to answer, then the wish
    judge = PreferenceJudge(serve=False, nonsense_hint="answer")
    wish = INSTRUCTIONS["short"]
    assert parse_hint(ask("opd_hint", not_an_answer(wish, "Give me a tip."))) == f"{ANSWER_HINT} {wish}"
    assert parse_hint(ask("opd_hint", missed(wish, "Give me a tip."))) == wish
    with pytest.raises(ValueError, match="nonsense_hint"):
        PreferenceJudge(serve=False, nonsense_hint="both")


def test_personalization_loop_runs_over_http_and_trains(tiny_model_dir):
    """A short binary run of the experiment on the tiny model: a stock client, the rule judge
    over HTTP, and the learner publishing versions that later first replies are served by."""
    preference = Preference(INSTRUCTIONS["capital"], "capital")
    judge = PreferenceJudge()
    args = argparse.Namespace(defaults=False, set=ONE_PASS, feedback=False, votes=1, batch=2, lr=5e-3, lora_r=4, max_attempts=2, max_tokens=4,
                              temperature=1.0, seed=0, think_s=0.3, sglang_url=None, final_samples=1, wait_for_learner=True,
                              held_out_samples=1)
    try:
        run = run_mode("binary", tiny_model_dir, [TASKS[0]] * 8, args,
                       {"judge_base_url": judge.base_url, "judge_model": "rules"}, RuleUser(preference), RuleScorer(preference))
    finally:
        judge.stop()
    assert [t.task_index for t in run.tasks] == list(range(8))
    assert all(t.score in (0.0, 1.0) and t.version >= 0 for t in run.tasks)
    published = [s for s in run.steps if s["published"]]
    assert published and all(s["samples"] == 2 for s in published)
    assert run.tasks[-1].version >= 1
    # --wait-for-learner: each full batch trained before the next task, so the updates follow the tasks
    assert len(run.steps) >= 3 and run.tasks[-1].version >= 2, [t.version for t in run.tasks]
    assert any(call[0]["content"].startswith("You are a process reward model (PRM)") for call in judge.calls)
    assert run.final["version"] >= run.tasks[-1].version and run.final["replies"] == len(TASKS)
    # every published version carries its held-out figures; the summary sets them beside its measured success
    assert all(s.get("figures") and s["figures"]["forgetting"] is not None for s in published)
    # every first reply carries how strange the base model reads it (None only for an empty one)
    assert all(t.surprise is not None or not t.first_reply.strip() for t in run.tasks)
    assert len(summarise(run)["score_sensible_by_window"]) == 1
    rows = summarise(run)["versions"]
    assert rows[0]["version"] == 0 and rows[0]["gain"] == 0.0 and all(0 <= r["success"] <= 1 for r in rows)
    # the questions never asked, read from the base model and from every version as it began serving
    held = summarise(run)["held_out_by_version"]
    assert held[0]["version"] == 0 and held[0]["ratings"] == 0 and held[0]["replies"] == len(HELD_OUT_TASKS)
    assert all(0 <= r["score_sensible"] <= r["score"] for r in held), "read for sense against the base model's own"
    assert [r["version"] for r in held] == sorted({0} | {t.version for t in run.tasks}), held
    ratings = [r["ratings"] for r in held]
    assert ratings == sorted(ratings) and ratings[-1] <= sum(max(t.attempts, 1) for t in run.tasks) + len(run.tasks)
    assert run.final["held_out"]["replies"] == len(HELD_OUT_TASKS) and 0 <= run.final["held_out"]["score"] <= 1


def test_final_evaluation_samples_the_serving_version_on_fixed_seeds_and_leaves_no_trace(tiny_model_dir):
    """The end-of-run evaluation: the same seeds give the same replies (runs compare on the
    same draws), and it goes around the chat API: no session, no turn record, nothing to judge."""
    preference = Preference(INSTRUCTIONS["capital"], "capital")
    args = argparse.Namespace(final_samples=3, max_tokens=6, temperature=1.0)
    with bench_server(tiny_model_dir, "policy", learn=False, judge_enabled=False) as server:
        base = held_out_nll(server, None)
        first = final_evaluation(server, "simulated-user", args, RuleScorer(preference), base)
        again = final_evaluation(server, "simulated-user", args, RuleScorer(preference), base)
        server.call(server.app.state.services.turns.records.flush())
        assert len(server.app.state.services.turns.sessions) == 0 and server.app.state.services.turns.records.written == 0
    assert first == again and first["version"] == 0 and first["replies"] == 3 * len(TASKS)
    held_out = first["held_out"]
    assert held_out["replies"] == 3 * len(HELD_OUT_TASKS) and held_out["surprise_replies"] > 0
    assert not set(final_seeds(0, 3, HELD_OUT_TASKS)) & {seed for i in range(len(TASKS)) for seed in final_seeds(i, 3)}, \
        "other questions, other draws"
    assert first["perplexity_ratio"] == 1.0, "the base model against its own reading of the prose"
    assert [r["task_index"] for r in first["samples"]] == [i for i in range(len(TASKS)) for _ in range(3)]
    assert len({r["first_reply"] for r in first["samples"]}) > len(TASKS), "each seed draws its own reply"
    assert first["score"] == pytest.approx(sum(r["score"] for r in first["samples"]) / len(first["samples"]), abs=5e-4)
    # the base model's replies against its own: the reference's seeds are the first two of three
    assert first["surprise_replies"] > 0 and abs(first["surprise"]) < 1.0


def test_the_topic_kind_asks_outings_where_food_comes_up_and_holds_out_others():
    """--kind topic: its user asks the OUTINGS (the everyday questions hardly mention food), the
    final evaluation reads them and their own held-out questions, and every list of questions
    draws its own seeds."""
    import bench.personalization as bench

    assert bench.KIND_QUESTIONS["topic"] == "outings"
    every = [q for set_ in bench.QUESTIONS.values() for q in (set_.asked, set_.held_out)]
    seeds = [seed for questions in every for i in range(len(questions)) for seed in final_seeds(i, 8, questions)]
    assert len(seeds) == len(set(seeds)), "no two questions share a draw"
    outings = bench.QUESTIONS["outings"]
    assert not set(outings.asked) & set(outings.held_out)
    assert set(bench.task_list(0, 50, outings.asked)) <= set(outings.asked)


def test_surprise_reads_replies_against_the_base_models_own_cut_to_their_length():
    """0 for replies like the base model's own; a short reply is compared with the start of the
    base model's replies (the least predictable part), so brevity alone is not strangeness."""
    from bench.reply_surprise import surprise

    own = {"q": [[-4.0, -2.0, -1.0, -1.0], [-5.0, -3.0, -1.0, -1.0]]}
    assert surprise([("q", [-4.5, -2.5, -1.0, -1.0])], own)["surprise"] == 0.0
    assert surprise([("q", [-4.5, -2.5])], own)["surprise"] == 0.0, "as short as the start, as likely as it"
    strange = surprise([("q", [-9.0, -8.0]), ("q", [-7.0, -6.0])], own)
    assert strange["surprise"] == pytest.approx(4.0) and strange["surprise_replies"] == 2
    assert strange["surprise_stderr"] == pytest.approx(1.0)
    assert surprise([("q", []), ("other", [-1.0])], own)["surprise"] is None, "empty replies and unknown tasks left out"
    # the wish met with nonsense does not count as sensible; an empty reply neither
    mixed = surprise([("q", [-4.5, -2.5]), ("q", [-9.0, -8.0]), ("q", [])], own, scores=[1.0, 1.0, 1.0])
    assert mixed["score_sensible"] == pytest.approx(1 / 3, abs=1e-3) and mixed["surprise_replies"] == 2


def test_the_sensible_user_turns_down_nonsense_whatever_the_wish():
    """--sensible-user: a reply that fits the wish but reads as nonsense to the base model (or is
    empty) is turned down, with the wish repeated so the hint still carries it; a sensible one
    is judged by the wish alone, as without the flag."""
    user = RuleUser(Preference(INSTRUCTIONS["short"], "short"))
    assert react(user, "Name a bakery.", "Ladle.", 3.1, wants_answers=False) == (True, THANKS)
    fitted, said = react(user, "Name a bakery.", "Ladle.", 3.1, wants_answers=True)
    assert not fitted and said.startswith(NOT_AN_ANSWER) and INSTRUCTIONS["short"] in said and said.endswith("Name a bakery.")
    assert not react(user, "Name a bakery.", "", None, wants_answers=True)[0]
    assert react(user, "Name a bakery.", "Sweet Crumbs.", 0.4, wants_answers=True) == (True, THANKS)
    assert not react(user, "Name a bakery.", " ".join(["word"] * 20), 0.4, wants_answers=True)[0], "the wish still counts"


def test_personalization_with_explicit_feedback_trains_past_a_judge_that_cannot_judge(tiny_model_dir):
    """--feedback: the user rates every reply; the default judge (the served tiny model) fails
    its calibration, so what trains is the ratings alone."""
    preference = Preference(INSTRUCTIONS["capital"], "capital")
    args = argparse.Namespace(defaults=False, set=ONE_PASS, feedback=True, votes=1, batch=2, lr=5e-3, lora_r=4,
                              max_attempts=2, max_tokens=4, temperature=1.0, seed=0, think_s=0.1, sglang_url=None,
                              final_samples=0, wait_for_learner=True)
    run = run_mode("combined", tiny_model_dir, ["Name a colour."] * 6, args, {}, RuleUser(preference),
                   RuleScorer(preference))
    assert run.calibration["state"] in ("pending", "failed"), "the tiny judge never passes (it may still be trying)"
    published = [s for s in run.steps if s["published"]]
    assert published and run.tasks[-1].version >= 1


def test_a_stopped_run_ends_at_a_task_boundary_and_still_keeps_its_final_evaluation(tiny_model_dir):
    """SIGTERM or --stop-after-min: the tasks end after the one under way, and the run is closed
    and evaluated as a finished one would be, with `stopped_after` saying where it stopped."""
    from bench.personalization import StopRequest

    preference = Preference(INSTRUCTIONS["capital"], "capital")
    args = argparse.Namespace(defaults=False, set=ONE_PASS, feedback=True, votes=1, batch=2, lr=5e-3, lora_r=4,
                              max_attempts=1, max_tokens=4, temperature=1.0, seed=0, think_s=0.0, sglang_url=None,
                              final_samples=1, wait_for_learner=False)
    stop = StopRequest()
    assert not stop.requested
    previous = signal.getsignal(signal.SIGTERM)
    try:
        stop.install()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, "a second SIGTERM stops at once"
    finally:
        signal.signal(signal.SIGTERM, previous)
    run = run_mode("combined", tiny_model_dir, ["Name a colour."] * 6, args, {}, RuleUser(preference),
                   RuleScorer(preference), stop)
    assert run.stopped_after == 1 and len(run.tasks) == 1
    assert run.final is not None and run.final["replies"] == len(TASKS)
    assert summarise(run)["tasks"] == 1
    assert StopRequest(minutes=1e-9).requested, "a deadline passed asks for the stop as the signal does"


def test_learner_memory_measures_an_update_on_a_model_built_from_a_config():
    from bench.learner_memory import headline, measure

    rows = measure("tiny", [64], 2, "cpu", micro_batch_tokens=128)
    assert rows[0]["error"] is None and rows[0]["seconds"] > 0 and rows[0]["peak_gib"] > 0
    assert "tiny 64 tok x2" in headline({"rows": rows})


def test_engine_throughput_runs_every_level_in_both_modes(tiny_model_dir):
    import asyncio

    from bench.engine_throughput import LEVELS, throughput

    for batching in (True, False):
        out = asyncio.run(throughput(tiny_model_dir, "cpu", batching, max_tokens=4, rounds=1))
        assert set(out) == {str(level) for level in LEVELS} and all(rate > 0 for rate in out.values())


def test_the_seeds_report_groups_runs_by_setting_across_seeds(tmp_path, capsys):
    """bench.personalization --seeds-report: one row per (preference, mode, setting), the seeds of
    a setting (variants differing by their -seedN suffix) summarised together."""
    from bench.personalization import seeds_report

    def result(variant: str, seed: int, scores: list[float], final: float, steps: list[dict] | None = None) -> str:
        tasks = [{"score": s, "version": i // 4, "first_reply": "a b c d", "surprise": 2.5 if i % 2 else 0.1}
                 for i, s in enumerate(scores)]
        summary = {"mode": "combined", "final": {"version": 3, "score": final, "repetition": 0.1, "perplexity_ratio": 1.0,
                                                 "held_out": {"score": final / 2, "score_sensible": final / 4}},
                   "held_out_by_version": [{"version": 0, "ratings": 0, "score": 0.0},
                                           {"version": 1, "ratings": 9 + seed, "score": 0.25 + 0.25 * seed},
                                           {"version": 2, "ratings": 18, "score": 0.75}],
                   "held_out_after_ratings": {"version": 1, "ratings": 16 + seed, "score": 0.5}}
        path = tmp_path / f"{variant}.json"
        path.write_text(json.dumps({"variant": variant, "preference": {"instruction": "Be brief."}, "settings": {"seed": seed},
                                    "runs": [{"tasks": tasks, "steps": steps or []}], "summary": [summary]}))
        return str(path)

    made = [{"version": 1, "published": True, "samples": 8}, {"version": 2, "published": False, "samples": 4}]
    paths = [result("on-seed0", 0, [0.0] * 16 + [1.0] * 16, 0.6, made), result("on-seed1", 1, [0.0] * 32, 0.4),
             result("off-seed0", 0, [0.0] * 32, 0.2)]
    seeds_report(paths)
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| Be brief.")]
    assert len(rows) == 2
    on = next(r for r in rows if "| on |" in r)
    assert "| 0.00 ± 0.00 · 0.50 ± 0.71 | 0.00 ± 0.00 · 0.25 ± 0.35 |" in on, "half the replies read as nonsense"
    # the held-out questions, and the updates that made the version read after ~15 ratings
    assert "| 0.00 ± 0.00 → 0.50 ± 0.00 (16 in 1 update: 8, 17) → 0.25 ± 0.07 | 0.12 ± 0.04 |" in on, on
    # the stricter rule: the last version read by 17 ratings, v1 on each seed (v2 came after 18)
    assert ("held-out questions, on: the last version read after at most 17 ratings 0.38 ± 0.18: "
            "0.25 (seed 0, v1@9), 0.50 (seed 1, v1@10)") in out, out
    assert "| 0, 1 |" in on and "0.00 ± 0.00 · 0.50 ± 0.71" in on and "0.50 ± 0.14" in on and "| 7, never |" in on, on  # the window of tasks 13-28 reaches 0.81: task 28 was served by v7


def test_the_forgetting_probe_bench_reads_every_text_as_a_version_drifts(tiny_model_dir):
    from bench.forgetting_probe import readings

    rows = readings(tiny_model_dir, {"a": ["The bus leaves at noon.", "Bread rises."], "b": ["Rain falls on the hill."]},
                    steps=2, every=1, lr=1e-2, seed=0)
    assert [r["step"] for r in rows] == [1, 2] and all(r["a"] > -1 and r["b"] > -1 for r in rows)
    assert rows[-1]["a"] != 0.0, "the LoRA moved the model, so its reading moved"


def test_the_experienced_teacher_reads_the_wish_then_what_the_person_took():
    from bench.teacher_ceiling import with_experience

    assert with_experience("Be brief.", []) == "Be brief."
    hint = with_experience("Be brief.", [("Why is the sky blue?", "Light scatters.")])
    assert hint.startswith("Be brief.\n\n") and hint.endswith("Q: Why is the sky blue?\nA: Light scatters.")


def test_the_hint_shift_reads_each_kind_s_tokens_where_its_choice_is_live():
    import torch

    from bench.hint_shift import shift_at, spill_of, summary, token_class

    vocab = ["The", " the", "Hello", "-", " item", "\n", ".", "<end>"]
    assert token_class("opening", vocab, [7]).good.tolist() == [True] + [False] * 7
    assert token_class("length", vocab, [7]).good.tolist() == [False] * 7 + [True]
    assert token_class("format", vocab, [7]).good.tolist() == [False, False, False, True, False, False, False, False]
    case = token_class("case", vocab, [7])
    assert case.good.tolist() == [False, True, False, False, True, False, False, True]
    assert case.bad.tolist() == [True, False, True, False, False, False, False, False]
    assert token_class("topic", vocab, [7]) is None

    asked = torch.log_softmax(torch.zeros(3, len(vocab)), -1)  # even odds everywhere
    hinted = asked.clone()
    hinted[:, 3] += 2.0  # the hint raises "-" at every position
    prefixes = ["", "Hello", "Hello\n"]
    shifts = shift_at(token_class("format", vocab, [7]), asked, hinted, prefixes)
    assert len(shifts) == 2 and all(s > 1.5 for s in shifts), "the first position and the one after a line break"
    assert shift_at(token_class("opening", vocab, [7]), asked, hinted, prefixes) == [0.0], "the hint moved no 'The'"
    # the opening word's spill: "The" at the start of a later line or sentence, not at the first token
    raised = asked.clone()
    raised[:, 0] += 1.0
    raised = torch.log_softmax(raised, -1)  # the odds of "The" times e: a log-odds shift of 1
    spill = spill_of(token_class("opening", vocab, [7]))
    assert shift_at(spill, asked, raised, ["", "Hello.", "Hello\n"]) == pytest.approx([1.0, 1.0], abs=1e-5)
    assert shift_at(spill, asked, raised, ["", "Hello", "Hello there"]) == [], "no line or sentence began"
    assert spill_of(token_class("format", vocab, [7])) is None, "a list's choice is live at every line already"
    lowered = asked.clone()
    lowered[:, [0, 2]] -= 1.0  # capitals lose mass
    assert all(s > 0 for s in shift_at(case, asked, lowered, prefixes)), "capitals hold 2/8 > 10%: every position is live"
    result = summary([1.0, -1.0, 3.0], [(0.01, 0.05)])
    assert result["positions"] == 3 and result["median"] == 1.0 and result["towards"] == 0.667


def test_the_echo_bench_samples_the_compounded_shift_and_a_placebo_that_reads_as_the_hint_cancels(tiny_model_dir):
    """bench/hindsight_echo.py: a contrast equal to the hinted prompt leaves the question's own
    distribution (the same reply on the same seed); the echo figure reads the reaction's words."""
    from bench.hindsight_echo import ECHO, Sampler, hint_prompts, prompts_for
    from nextstate.judge.hindsight import scrambled

    sampler = Sampler(tiny_model_dir)
    task = "Name a colour."
    asked, hinted, placebo = prompts_for(sampler, task, "No, that doesn't answer my question.", "placebo")
    assert len(placebo) == len(hinted) != len(asked) and placebo != hinted
    assert prompts_for(sampler, task, "Thanks.", "prompt")[2] == asked
    judged = hint_prompts(sampler, task, "Answer in one word.", scrambled("Answer in one word."), "placebo")
    assert judged[0] == asked and judged[2] not in (judged[1], asked), "--judge-hint: the wish shuffled, in the hint block"
    alone = sampler.sample([asked], [1.0], 8, seed=3)
    assert sampler.sample([asked, hinted, hinted], [1.0, 2.0, -2.0], 8, seed=3) == alone
    assert len(sampler.reading(task, alone or "blue")) >= 1
    assert ECHO.search("No, that response was not accepted.") and ECHO.search("That answer was wrong.")
    assert not ECHO.search("Blue, like the sky at noon. Nobody knows.")


def test_each_candidate_topic_s_rule_spots_it_and_leaves_the_rest():
    from bench.personalization import avoided
    from bench.topic_rates import TOPICS, headline

    said = {"food": "Bring a picnic with sandwiches.", "itself": "I'm happy to help!",
            "doctor": "You should see a doctor.", "dogs": "A puppy would love the garden."}
    for key, topic in TOPICS.items():
        assert avoided(topic.rule).search(said[key]), key
        assert not avoided(topic.rule).search("Take a walk in the park and read a book."), key
        assert len(topic.questions) >= 16 and len(set(topic.questions)) == len(topic.questions), key
    result = {"topics": [{"topic": "dogs", "mention_rate": 0.21}, {"topic": "food", "mention_rate": 0.1}]}
    assert headline(result) == "brought up unasked: dogs 0.21, food 0.10"


def test_the_first_update_bench_reads_the_wish_share_on_the_same_seeds_before_and_after(tiny_model_dir):
    from bench.first_update import wish_share
    from nextstate.core.settings import Settings
    from nextstate.learner.trainer import LoraTrainer

    trainer = LoraTrainer(tiny_model_dir, Settings().learner)
    trainer.ensure_scope("bench")
    anything = Preference("Say anything.", "nolist")  # the tiny model's replies: some fit, some do not
    base = wish_share(trainer, None, anything, 2)
    assert 0.0 <= base <= 1.0
    assert wish_share(trainer, None, anything, 2) == base, "the same sampling seeds, the same reading"
    assert wish_share(trainer, "bench", anything, 2) == base, "a fresh adapter is the base model: nothing to tell apart"
    assert math.isnan(wish_share(trainer, None, anything, 0)), "no samples: nothing read"


def test_the_base_models_readings_are_kept_and_read_back_as_they_were_read(tiny_model_dir, tmp_path, capsys):
    from bench import base_cache
    from bench.personalization import base_model_readings

    args = argparse.Namespace(max_tokens=4, temperature=1.0, sglang_url=None)
    longer = argparse.Namespace(**vars(args) | {"max_tokens": 5})
    # on transformers: llama.cpp's readings agree only to rounding once a kept prefix is reused
    with bench_server(tiny_model_dir, "policy", learn=False, judge_enabled=False, local_runtime="transformers") as server:
        first = base_model_readings(server, tiny_model_dir, args, 1, {})
        again = base_model_readings(server, tiny_model_dir, args, 1, {})
        fresh = base_model_readings(server, tiny_model_dir, argparse.Namespace(**vars(args), fresh_base=True), 1, {})
        other = base_model_readings(server, tiny_model_dir, longer, 1, {})
        kept = sorted(base_cache.cache_dir().glob("personalization-base-*.json"), key=lambda p: p.stat().st_mtime)
        kept[0].write_text("{not json")  # a file cut short by a crash is read again, not trusted
        mended = base_model_readings(server, tiny_model_dir, args, 1, {})
    said = capsys.readouterr().out
    assert said.count("read and kept") == 4 and said.count("from the cache") == 1, said
    assert len(kept) == 2 and kept[0].is_relative_to(tmp_path), "one file per set of inputs, in the test's own cache"
    assert set(first) == {"prose", "reference", "held_texts", "held_reference"}
    assert again == fresh == mended == json.loads(json.dumps(first)), "read back as read (JSON's lists for tuples)"
    assert len(first["held_texts"]) == len(HELD_OUT_TASKS) and set(first["reference"]) == set(TASKS)
    assert other["held_texts"] != first["held_texts"], "a longer reply is another reading"


def test_every_bench_that_saves_a_result_can_draw_it_again():
    """bench/report.py redraws a saved result with its bench module's own `plot` and
    `headline`: a bench split into a package must still offer them at its top."""
    import importlib
    import pathlib

    for path in sorted(pathlib.Path(__file__).parents[1].joinpath("bench").iterdir()):
        name = path.stem if path.suffix == ".py" else path.name if (path / "__init__.py").is_file() else None
        if not name or name.startswith("_"):
            continue
        source = path.read_text() if path.suffix == ".py" else (path / "cli.py").read_text() if (path / "cli.py").is_file() else ""
        if "save(" in source and "from bench.report import" in source:
            module = importlib.import_module(f"bench.{name}")
            assert callable(getattr(module, "plot", None)) and callable(getattr(module, "headline", None)), name


async def test_a_kept_turns_decode_is_measured_beside_each_kind_of_kept_read(tiny_model_dir):
    """bench.serving_speed's `kept` figures: her turn reads only what is new, and the three other
    reads are kept where the figure says, the house's in a context of its own."""
    from bench.serving_speed import decode_beside
    from tests.test_engine import open_engine, settled

    long_ids = [5 + j % 300 for j in range(600)]
    # her turns hold one read (each next turn holds the last one's whole prompt), and the others
    for others, people, house in ((None, 1, 0), ("house", 1, 3), ("people", 4, 0)):
        engine = await open_engine(tiny_model_dir, "llama.cpp")
        try:
            assert await decode_beside(engine, long_ids, others, repeats=2) > 0
            await settled(engine)
            assert (len(engine.runner.people.kept), len(engine.runner.house.kept)) == (people, house)
            assert engine.runner.stats.prompt_tokens_reused >= 2 * len(long_ids), "her turns read only what is new"
        finally:
            await engine.close()
