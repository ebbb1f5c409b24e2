"""Prompts encoded piece by piece from a cache give exactly the ids of encoding the whole text."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken

from nextstate.modelio.chat_template import ChatRenderer
from nextstate.modelio.prompt_encoder import PromptEncoder
from tests.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def whole(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# Text that stresses the piece boundaries: the special tokens themselves (a user may paste them),
# the added text tokens, whitespace and newlines next to them, multi-byte characters.
_FRAGMENTS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<|im_start", "|>",
              "\n", "\n\n", " ", "  ", "\t", "é", "日本語", "🙂", "\u2028", "hello", "The quick", "{\"a\": 1}", "x"]
_content = st.lists(st.sampled_from(_FRAGMENTS) | st.text(max_size=8), max_size=12).map("".join)
_message = st.builds(lambda role, content: {"role": role, "content": content},
                     st.sampled_from(["system", "user", "assistant"]), _content)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversation=st.lists(_message, min_size=1, max_size=8))
def test_every_prefix_of_a_growing_conversation_encodes_as_the_whole_text(tokenizer, conversation):
    encoder = PromptEncoder(tokenizer)
    assert encoder.piecewise
    for n in range(1, len(conversation) + 1):  # a conversation growing turn by turn: the cache at work
        text = tokenizer.apply_chat_template(conversation[:n], add_generation_prompt=True, tokenize=False)
        assert encoder.encode(text) == whole(tokenizer, text)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_content)
def test_raw_text_with_special_tokens_anywhere(tokenizer, text):
    encoder = PromptEncoder(tokenizer)
    assert encoder.encode(text) == whole(tokenizer, text)
    assert encoder.encode(text) == whole(tokenizer, text)  # from the cache


def test_the_renderer_caches_the_conversation_so_far(tokenizer):
    renderer = ChatRenderer(tokenizer)
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    for turn in range(6):
        messages += [{"role": "user", "content": f"Question {turn}: what is the weather in Paris?"},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"id": f"c{turn}", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                     {"role": "tool", "tool_call_id": f"c{turn}", "content": "18 C"}]
        for choice in ("auto", "required"):
            got = renderer.render(messages, tools, choice)
            fresh = ChatRenderer(tokenizer)
            fresh.encoder = PromptEncoder(tokenizer, max_cached_tokens=0)  # encodes whole texts
            want = fresh.render(messages, tools, choice)
            assert got == want
    assert renderer.encoder.cached_pieces > 0


def test_a_small_cache_evicts_and_stays_exact(tokenizer):
    encoder = PromptEncoder(tokenizer, max_cached_tokens=40)
    texts = [f"<|im_start|>user\nmessage number {i} with some words<|im_end|>\n" * 3 for i in range(20)]
    for text in texts + texts[::-1]:
        assert encoder.encode(text) == whole(tokenizer, text)
    assert encoder.cached_tokens <= 40


def test_added_tokens_that_strip_whitespace_turn_the_cache_off():
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken("<sep>", lstrip=True, special=True)]})
    encoder = PromptEncoder(tokenizer)
    assert not encoder.piecewise  # "a <sep>" would lose its space only when encoded whole
    text = "<|im_start|>user\na <sep> b<|im_end|>\n"
    assert encoder.encode(text) == whole(tokenizer, text)


def test_real_agent_prompts_from_the_openclaw_capture(tokenizer):
    """OpenClaw's requests in order (a 3.8k-token system prompt and tools, growing by a few
    messages a turn): the same ids as encoding whole, with the conversation so far cached."""
    from tests.test_openclaw_replay import rows

    renderer, reference = ChatRenderer(tokenizer), ChatRenderer(tokenizer)
    reference.encoder = PromptEncoder(tokenizer, max_cached_tokens=0)
    bodies = [r["req_body"] for r in rows() if isinstance(r["req_body"], dict) and "messages" in r["req_body"]]
    assert len(bodies) >= 10
    for body in bodies:
        messages = [{**m, "content": "".join(p.get("text", "") for p in m["content"]) if isinstance(m.get("content"), list)
                     else m.get("content") or ""} for m in body["messages"]]
        got = renderer.render(messages, body.get("tools"), body.get("tool_choice"))
        assert got == reference.render(messages, body.get("tools"), body.get("tool_choice"))


def test_the_sized_lru_keeps_the_recently_used_within_its_budget():
    from nextstate.core.lru import SizedLRU

    lru: SizedLRU[str, str] = SizedLRU(10, lambda key, value: len(value))
    lru.put("a", "xxxx")
    lru.put("b", "xxxx")
    assert lru.get("a") == "xxxx"  # "b" is now the least recently used
    lru.put("c", "xxxx")
    assert (lru.get("b"), lru.get("a"), lru.get("c"), lru.total) == (None, "xxxx", "xxxx", 8)
    lru.put("big", "x" * 11)
    assert lru.get("big", "missing") == "missing" and len(lru) == 2, "an entry over the whole budget is not kept"
    lru.discard("a")
    lru.discard("gone")
    assert (lru.keys(), lru.total) == (["c"], 4)


def test_a_reply_sampled_off_the_tokenizers_encoding_comes_back_as_sampled(tokenizer):
    """The next turn's prompt holds the reply's ids as the model sampled them, so it begins with
    the turn's prompt and reply: the engine's kept prefix and the learner's shared rows reach past it."""
    renderer = ChatRenderer(tokenizer)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello to the world."}]
    prompt = renderer.render(messages).ids
    text = "hello   world, hello"
    sampled = [i for ch in text for i in whole(tokenizer, ch)]  # a character at a time: not the tokenizer's own
    assert sampled != whole(tokenizer, text)
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert renderer.remember_reply("alice", prompt, sampled + [stop])
    following = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "Again."}]
    assert renderer.render(following, owner="alice").ids[: len(prompt) + len(sampled)] == prompt + sampled
    # someone else's prompt with the same words is encoded as the tokenizer does: what the model
    # wrote for one person shapes no one else's prompt
    canonical = whole(tokenizer, tokenizer.apply_chat_template(following, add_generation_prompt=True, tokenize=False))
    assert renderer.render(following, owner="bob").ids == renderer.render(following).ids == canonical
    # so is another text, and a reply cut inside a character is not remembered
    other = messages + [{"role": "assistant", "content": text + "!"}, {"role": "user", "content": "Again."}]
    assert renderer.render(other, owner="alice").ids[len(prompt):][: len(sampled)] != sampled
    # the same words sampled again as the tokenizer spells them: the latest ids stand
    assert renderer.remember_reply("alice", prompt, whole(tokenizer, text) + [stop])
    assert renderer.render(following, owner="alice").ids == canonical
    cut = whole(tokenizer, "日")[:1]
    assert tokenizer.decode(cut).endswith("\ufffd")
    assert not renderer.remember_reply("alice", prompt, cut)
