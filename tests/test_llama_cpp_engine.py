"""The local engine on llama.cpp against the same engine on transformers, the learner's numbers.

tests/test_engine.py runs the engine's own contract on both runtimes; here, what only llama.cpp
needs checking: that its float16 GGUF copy serves the learner's policy (logprobs, greedy tokens,
adapters) within the bound the SGLang and vLLM contract holds, that rows of several adapters
decode together, that kept prefixes stay within their salt and adapter, that the house's
unsalted work keeps to a cache of its own, and that a cache too small for what it keeps makes
room instead of failing.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from nextstate.engine.base import SamplingParams
from tests.test_engine import collect, open_engine, settled
from tests.test_engine_contract import ENUM_TOOL, write_adapters
from tests.tiny_model import SERVED_TOLERANCE as TOLERANCE

PROMPT = list(range(5, 40))


@pytest.fixture
async def pair(tiny_model_dir):
    """(transformers, llama.cpp) on the same model."""
    torch_engine = await open_engine(tiny_model_dir, "transformers")
    llama = await open_engine(tiny_model_dir, "llama.cpp")
    yield torch_engine, llama
    await torch_engine.close()
    await llama.close()


@pytest.fixture
def adapters(tiny_model_dir, tmp_path):
    return write_adapters(tiny_model_dir, tmp_path)


@pytest.fixture
async def adapted(tiny_model_dir, adapters):
    """llama.cpp with adapter "a" loaded."""
    llama = await open_engine(tiny_model_dir, "llama.cpp")
    await llama.load_adapter("a", str(adapters["a"]))
    yield llama
    await llama.close()


async def test_served_logprobs_are_the_learners_within_the_bound(pair, adapters):
    torch_engine, llama = pair
    for engine in pair:
        await engine.load_adapter("a", str(adapters["a"]))
    for adapter in (None, "a"):
        for temperature in (0.0, 0.8):
            params = SamplingParams(max_new_tokens=16, temperature=temperature, seed=4)
            served = await collect(llama, params, adapter)
            ids = [t.token_id for t in served]
            learner = await torch_engine.score(PROMPT + ids, len(PROMPT), adapter, temperature=params.logprob_temperature)
            assert [t.logprob for t in served] == pytest.approx(learner, abs=TOLERANCE)
        greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
        assert [t.token_id for t in await collect(llama, greedy, adapter)] == [
            t.token_id for t in await collect(torch_engine, greedy, adapter)]
    adapted, base = await llama.score(PROMPT, 1, "a"), await llama.score(PROMPT, 1)
    assert max(abs(x - y) for x, y in zip(adapted, base)) > 10 * TOLERANCE, "the adapter changes what is served"


async def test_rows_of_several_adapters_decode_together_as_alone(pair, adapters):
    _, llama = pair
    await llama.load_adapter("a", str(adapters["a"]))
    await llama.load_adapter("b", str(adapters["b"]))
    plan = [(None, 1), ("a", 2), ("b", 3), ("a", 4)]

    async def run(adapter, seed):
        return [t.token_id for t in await collect(llama, SamplingParams(max_new_tokens=20, seed=seed), adapter)]

    alone = [await run(a, s) for a, s in plan]
    passes = llama.runner.stats.forward_passes
    together = await asyncio.gather(*(run(a, s) for a, s in plan))
    assert together == alone
    assert llama.runner.stats.forward_passes - passes < sum(len(r) for r in alone), "rows shared passes"


async def test_a_kept_prefix_serves_only_its_salt_and_adapter(adapted):
    llama = adapted
    first = SamplingParams(max_new_tokens=4, temperature=0.0, cache_salt="alice")
    turn = await collect(llama, first)
    follow = PROMPT + [t.token_id for t in turn] + [7, 8, 9]
    again = await collect(llama, first, prompt=follow)
    assert again[0].cached_prompt_tokens == len(PROMPT) + len(turn) - 1, "her next turn reads only what is new"
    other = await collect(llama, SamplingParams(max_new_tokens=4, temperature=0.0, cache_salt="bob"), prompt=follow)
    assert other[0].cached_prompt_tokens == 0, "another user's salt shares nothing"
    by_adapter = await collect(llama, first, "a", prompt=follow)
    assert by_adapter[0].cached_prompt_tokens == 0, "keys and values of another policy are not reused"
    assert [t.token_id for t in again] == [t.token_id for t in other]


async def test_a_full_cache_drops_old_prefixes_and_serves_on(tiny_model_dir):
    # 1 MB: 4,096 cells of this model, three 1,100-token conversations
    llama = await open_engine(tiny_model_dir, "llama.cpp", kv_cache_mb=1)
    try:
        assert llama.runner.info.max_context == 4096
        prompts = [[5 + (i + j) % 400 for j in range(1100)] for i in range(4)]
        params = SamplingParams(max_new_tokens=6, temperature=0.0)
        first = [[t.token_id for t in await collect(llama, params, prompt=p)] for p in prompts]
        again = [[t.token_id for t in await collect(llama, params, prompt=p)] for p in prompts]
        assert again == first
        too_long = [5] * 4100
        with pytest.raises(Exception, match="does not fit"):
            await collect(llama, params, prompt=too_long)
        assert [t.token_id for t in await collect(llama, params, prompt=prompts[0])] == first[0], "serving goes on"
    finally:
        await llama.close()


async def test_the_houses_work_takes_no_room_from_a_persons_conversation(tiny_model_dir):
    """Unsalted work (the judge's votes, the teacher's reads) runs in a context of its own: it
    cannot push a person's kept conversation out, and her decoding attends over none of its cells."""
    llama = await open_engine(tiny_model_dir, "llama.cpp", kv_cache_mb=1)  # 4,096 cells a side
    try:
        runner = llama.runner
        hers = SamplingParams(max_new_tokens=4, temperature=0.0, cache_salt="alice")
        conversation = [5 + j % 300 for j in range(2500)]
        turn = await collect(llama, hers, prompt=conversation)
        judged = [[7 + (i + j) % 350 for j in range(2500)] for i in range(3)]  # 7,500 tokens: no room beside hers
        for prompt in judged:
            await collect(llama, SamplingParams(max_new_tokens=4, temperature=0.0), prompt=prompt)
            await llama.score(prompt, 2000, background=True)
        await settled(llama)
        assert {k.salt for k in runner.people.kept} == {"alice"}
        assert runner.house.kept and {k.salt for k in runner.house.kept} == {None}
        follow = conversation + [t.token_id for t in turn] + [9, 10]
        again = await collect(llama, hers, prompt=follow)
        assert again[0].cached_prompt_tokens == len(conversation) + len(turn) - 1, "her conversation was kept"
    finally:
        await llama.close()


async def test_her_conversation_read_by_a_new_version_forgets_the_old_versions_read(adapted):
    llama = adapted
    hers = SamplingParams(max_new_tokens=4, temperature=0.0, cache_salt="alice")
    turn = await collect(llama, hers)
    conversation = PROMPT + [t.token_id for t in turn]
    await collect(llama, SamplingParams(max_new_tokens=1, cache_salt="bob"))
    await collect(llama, SamplingParams(max_new_tokens=1, cache_salt="alice"), "a", prompt=conversation)
    await settled(llama)
    kept = {(k.salt, k.adapter) for k in llama.runner.people.kept}
    assert kept == {("alice", "a"), ("bob", None)}, "her base read is gone, his is not"


async def test_her_next_turn_forgets_the_last_ones_read_though_its_reply_was_re_rendered(adapted):
    """Agents send a sampled reply back as text, which the chat template renders with other
    tokens: the next turn holds the last one's prompt, not its reply, and that is enough."""
    llama = adapted
    hers = SamplingParams(max_new_tokens=4, temperature=0.0, cache_salt="alice")
    reply = [t.token_id for t in await collect(llama, hers)]
    elsewhere = [*PROMPT[:10], 300, 301, 302]  # another conversation of hers, on the same system prompt
    await collect(llama, hers, prompt=elsewhere)
    re_rendered = [*reply[:-1], reply[-1] + 1]
    follow = await collect(llama, hers, prompt=PROMPT + re_rendered + [7, 8, 9])
    assert follow[0].cached_prompt_tokens == len(PROMPT) + len(reply) - 1, "what it shares is still read once"
    await settled(llama)
    kept = sorted(len(k.tokens) for k in llama.runner.people.kept)
    assert kept == [len(elsewhere) + 4 - 1, len(PROMPT) + len(reply) + 3 + 4 - 1], "one read per conversation"


async def test_a_forced_tool_call_is_the_schemas_json(pair):
    _, llama = pair
    schema = json.dumps(ENUM_TOOL["function"]["parameters"])
    eos = 2  # the tiny model's <|im_end|>
    tokens = await collect(llama, SamplingParams(max_new_tokens=40, temperature=1.0, seed=1, json_schema=schema,
                                                 stop_token_ids=(eos,)))
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(llama.model_dir).decode([t.token_id for t in tokens if t.token_id != eos])
    assert json.loads(text)["n"] in ("x", "y")


async def test_votes_on_one_prompt_read_it_once(pair):
    """The judge's m votes on one prompt run side by side in the background, a chunk at a time:
    each takes over what the others have read so far."""
    _, llama = pair
    prompt = [5 + j % 400 for j in range(320)]
    params = SamplingParams(max_new_tokens=3, temperature=1.0, seed=2)
    before = llama.runner.stats.prompt_tokens_computed

    async def vote():
        return [t async for t in llama.generate(prompt, params, background=True)]

    votes = await asyncio.gather(*(vote() for _ in range(3)))
    assert [[t.token_id for t in v] for v in votes] == [[t.token_id for t in votes[0]]] * 3
    assert llama.runner.stats.prompt_tokens_computed - before < 1.5 * len(prompt)


def test_the_runtime_follows_the_setting_and_falls_back_saying_why(tiny_model_dir, tmp_path, caplog):
    import shutil

    from nextstate.assembly import llama_cpp_model
    from nextstate.core.settings import Settings

    def settings(**overrides):
        return Settings(data_dir=tmp_path / "data", model=str(tiny_model_dir), **overrides)

    copy = llama_cpp_model(settings(), tiny_model_dir)
    assert copy is not None and copy.is_relative_to(tmp_path / "data") and copy.suffix == ".gguf"
    assert llama_cpp_model(settings(), tiny_model_dir) == copy, "written once"
    assert llama_cpp_model(settings(local_runtime="transformers"), tiny_model_dir) is None
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "phi3"}))
    assert llama_cpp_model(settings(), other) is None
    assert "serving on transformers" in caplog.text and "phi3" in caplog.text
    with pytest.raises(RuntimeError, match="phi3"):
        llama_cpp_model(settings(local_runtime="llama.cpp"), other)
