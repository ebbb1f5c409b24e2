"""Judge building blocks: parsing, votes, hint selection, advantages, teacher alignment."""

from __future__ import annotations

import pytest

from nextstate.engine.base import SamplingParams
from nextstate.engine.local import LocalEngine
from nextstate.judge.advantages import opd_delta, standardize_outcome_batch, token_advantages
from nextstate.judge.parsing import majority_vote, parse_hint, parse_score, select_hint
from nextstate.judge.prompts import PromptLibrary
from nextstate.judge.teacher import HINT_HEADER, enhanced_messages, teacher_logprobs, teacher_prompt_ids
from nextstate.core.types import Sample, Turn
from nextstate.modelio.chat_template import ChatRenderer


@pytest.mark.parametrize(
    "text, expected",
    [
        ("good \\boxed{1}", 1),
        ("\\boxed{1} on reflection \\boxed{-1}", -1),  # the last one counts
        ("\\boxed{ 0 }", 0),
        ("\\boxed{+1}", 1),
        ("\\boxed{2}", None),  # not an allowed score
        ("no verdict", None),
        ("", None),
        ("\\boxed{yes}", None),
    ],
)
def test_parse_score(text, expected):
    assert parse_score(text) == expected


def test_parse_score_allowed_values():
    assert parse_score("\\boxed{0}", allowed=(1, -1)) is None


def test_parse_hint_takes_the_last():
    text = "[HINT_START]first[HINT_END] then [HINT_START]\n second one \n[HINT_END]"
    assert parse_hint(text) == "second one"
    assert parse_hint("[HINT_START]unclosed") is None


@pytest.mark.parametrize(
    "votes, expected",
    [([1, 1, -1], 1), ([-1, -1, 1], -1), ([1, -1, 0], 0), ([1, -1], 0), ([None, None, None], 0), ([0, 0, 1], 0),
     # a quorum: valid votes from a majority of the m votes, or no verdict
     ([None, -1, None], 0), ([1, None, 1], 1), ([1, None, None, None], 0), ([1, 1, None, None], 0), ([1, 1, 1, None], 1), ([1], 1)],
)
def test_majority_vote(votes, expected):
    assert majority_vote(votes) == expected


def test_select_hint_longest_valid():
    votes = [(1, "short hint"), (1, "a much longer useful hint"), (-1, "an even longer hint but a negative vote"), (1, None)]
    assert select_hint(votes, min_chars=10) == "a much longer useful hint"
    assert select_hint([(1, "tiny"), (1, "exactly10!")], min_chars=10) is None  # must be longer than 10
    assert select_hint([], 10) is None


def test_token_advantages_and_clip():
    assert token_advantages(3, -1, None, 1, 1) == [-1, -1, -1]
    delta = opd_delta([-0.1, -5.0, -1.0], [-1.0, -0.5, -1.0], clip=2.0)
    assert delta == pytest.approx([0.9, -2.0, 0.0])
    assert token_advantages(3, 1, delta, 0.5, 2.0) == pytest.approx([0.5 + 1.8, 0.5 - 4.0, 0.5])
    with pytest.raises(ValueError):
        opd_delta([0.0], [0.0, 0.0], 2.0)


def _sample(turn_index, reward, track="outcome", n=2):
    return Sample(
        user="u", session_id=f"s{reward}", turn_index=turn_index, policy_version=0, adapter=None, mode="binary",
        track=track, status="ready", prompt_ids=[1], response_ids=[2] * n, old_logprobs=[-1.0] * n,
        logprob_temperature=1.0, advantages=[9.0] * n, loss_mask=[1] * n, reward=reward, created_at=0.0,
    )


def test_outcome_rewards_are_standardised_per_step_index():
    batch = [_sample(1, 2.0), _sample(1, 0.0), _sample(2, 1.5), _sample(1, 7.0, track="personal")]
    out = standardize_outcome_batch(batch, w_binary=1.0, w_opd=1.0, clip=2.0)
    assert out[0].advantages == pytest.approx([1.0, 1.0], abs=1e-4)
    assert out[1].advantages == pytest.approx([-1.0, -1.0], abs=1e-4)
    assert out[2].advantages == [1.5, 1.5], "a step index alone in the batch keeps its reward"
    assert out[3].advantages == [9.0, 9.0], "personal samples pass through"


def test_enhanced_messages_append_to_the_last_user_message():
    msgs = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "second"},
            {"role": "assistant", "content": "b"}, {"role": "tool", "content": "result"}]
    out = enhanced_messages(msgs, "Be brief.")
    assert out[2]["content"] == "second" + HINT_HEADER + "Be brief."
    assert out[0]["content"] == "first" and out[4]["content"] == "result"
    assert msgs[2]["content"] == "second", "the turn's own messages are not modified"
    assert enhanced_messages(msgs, "") == msgs


def test_a_next_states_placebo_holds_its_words_without_their_order():
    """judge/hindsight.py: the placebo a hindsight hint is measured against has each message's
    words, shuffled the same way every time, under the same leads."""
    from nextstate.core.types import NextState
    from nextstate.judge.hindsight import LEADS, hindsight_hint, hindsight_placebo

    said = "No, that doesn't answer my question. Answer in one short sentence. Please try again."
    state = NextState(messages=[{"role": "tool", "content": "42 rows"}, {"role": "user", "content": said}])
    hint, placebo = hindsight_hint(state, 1000), hindsight_placebo(state, 1000)
    assert hint == f"{LEADS['tool']}42 rows\n{LEADS['user']}{said}"
    tool_line, user_line = placebo.split("\n")
    assert tool_line.startswith(LEADS["tool"]) and user_line.startswith(LEADS["user"])
    words = user_line.removeprefix(LEADS["user"]).split()
    assert sorted(words) == sorted(said.split()) and words != said.split(), "the same words, not their sentence"
    assert hindsight_placebo(state, 1000) == placebo, "one next state, one placebo (a sample judged twice)"
    assert hindsight_placebo(NextState(messages=[{"role": "user", "content": " "}]), 1000) is None


def test_bundled_prompts_render():
    lib = PromptLibrary()
    values = dict(task="t", history="h", request="r", response="resp", next_state_role="user", next_state="ns")
    for name in ("prm_personal", "opd_hint", "prm_terminal", "prm_swe", "prm_toolcall", "prm_gui"):
        system, user = lib.render(name, **values)
        assert system["role"] == "system" and "\\boxed{" in system["content"] + user["content"]
        assert "$" not in user["content"]
    with pytest.raises(FileNotFoundError):
        lib.require("nope")


async def test_teacher_alignment(tiny_model_dir):
    """One teacher logprob per response token; with an empty hint, exactly the scoring of
    the original prompt, which equals the sampling logprobs."""
    renderer = ChatRenderer.from_dir(tiny_model_dir)
    engine = await LocalEngine.open(tiny_model_dir, device="cpu")
    try:
        messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."}]
        prompt = renderer.render(messages).ids
        params = SamplingParams(max_new_tokens=16, temperature=0.8, seed=5)
        toks = [t async for t in engine.generate(prompt, params)]
        turn = Turn(
            session_id="s", user="u", turn_index=1, messages=messages, prompt_ids=prompt,
            response_ids=[t.token_id for t in toks], response_logprobs=[t.logprob for t in toks],
            logprob_temperature=params.logprob_temperature, sampling={}, policy_version=0, adapter=None,
            response_message={}, finish_reason="length", created_at=0.0,
        )
        assert await teacher_prompt_ids(renderer, turn, "") == prompt
        empty = await teacher_logprobs(engine, renderer, turn, "", None)
        original = await engine.score(prompt + turn.response_ids, len(prompt), temperature=0.8)
        assert len(empty) == len(turn.response_ids)
        assert empty == pytest.approx(original, abs=1e-6)
        assert empty == pytest.approx(turn.response_logprobs, abs=1e-4)

        hinted = await teacher_logprobs(engine, renderer, turn, "Answer with one word.", None)
        assert len(hinted) == len(turn.response_ids)
        assert max(abs(a - b) for a, b in zip(hinted, empty)) > 1e-4
        text = renderer.tokenizer.decode(await teacher_prompt_ids(renderer, turn, "Answer with one word."))
        assert "Name a colour.\n\n[user's hint / instruction]\nAnswer with one word.<|im_end|>" in text
    finally:
        await engine.close()


