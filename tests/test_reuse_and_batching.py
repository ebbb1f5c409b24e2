"""Prefix reuse and batched decoding in the embedded engine: faster, and the same numbers.

Every comparison is against an engine that does neither (`kv_cache_mb=0, batching=False`):
tokens must be identical and logprobs equal within float32 tolerance, since the learner
trains on the logprobs recorded here.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from nextstate.engine import kv_cache
from nextstate.engine.base import SamplingParams
from nextstate.engine.local import LocalEngine
from nextstate.engine.scheduler import BACKGROUND_IDLE_CHUNK
from nextstate.engine.prefix_cache import PrefixCache, common_prefix

TOL = 1e-4


@pytest.fixture
async def fast(tiny_model_dir):
    engine = await LocalEngine.open(tiny_model_dir, device="cpu")
    yield engine
    await engine.close()


@pytest.fixture
async def plain(tiny_model_dir):
    engine = await LocalEngine.open(tiny_model_dir, device="cpu", kv_cache_mb=0, batching=False)
    yield engine
    await engine.close()


async def run(engine, prompt, params, adapter=None, background=False):
    toks = [t async for t in engine.generate(prompt, params, adapter, background=background)]
    return [t.token_id for t in toks], [t.logprob for t in toks]


def assert_same(got, want):
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=TOL)


async def test_a_conversation_reuses_its_last_turn_and_gets_the_same_logprobs(fast, plain):
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5)
    prompt = list(range(5, 60))
    for turn in range(3):
        before = fast.runner.stats.prompt_tokens_computed
        got = await run(fast, prompt, params)
        assert_same(got, await run(plain, prompt, params))
        computed = fast.runner.stats.prompt_tokens_computed - before
        if turn:
            # the previous prompt and reply (but its last token, never fed) come from the cache
            assert computed <= len(prompt) - shared + 1, (turn, computed)
        shared = len(prompt) + len(got[0]) - 1
        prompt = prompt + got[0] + list(range(70, 70 + 9 * (turn + 1)))
    assert fast.runner.stats.prompt_tokens_reused > 100


async def test_a_prompt_that_diverges_reuses_only_the_shared_prefix(fast, plain):
    params = SamplingParams(max_new_tokens=6, temperature=0)
    await run(fast, list(range(5, 80)), params)
    edited = list(range(5, 40)) + [3] * 20
    assert_same(await run(fast, edited, params), await run(plain, edited, params))
    scored = await fast.score(edited + [7, 8, 9], len(edited), background=True)
    assert scored == pytest.approx(await plain.score(edited + [7, 8, 9], len(edited)), abs=TOL)


async def test_concurrent_streams_decode_in_one_batch_with_the_same_results(fast, plain):
    """Different prompt lengths (left padding), samplers, lengths and a late joiner."""
    jobs = [
        (list(range(5, 25)), SamplingParams(max_new_tokens=30, temperature=1.0, seed=1)),
        (list(range(9, 60)), SamplingParams(max_new_tokens=8, temperature=0)),
        (list(range(30, 41)), SamplingParams(max_new_tokens=25, temperature=0.7, top_p=0.9, seed=2)),
        (list(range(11, 90)), SamplingParams(max_new_tokens=20, temperature=1.0, seed=3)),
    ]
    want = [await run(plain, p, s) for p, s in jobs]
    passes = fast.runner.stats.forward_passes
    started = asyncio.Event()

    async def first(prompt, params):
        toks = []
        async for t in fast.generate(prompt, params):
            toks.append(t)
            if len(toks) == 5:
                started.set()
        return [t.token_id for t in toks], [t.logprob for t in toks]

    async def late(prompt, params):
        await started.wait()
        return await run(fast, prompt, params)

    got = await asyncio.gather(first(*jobs[0]), *(run(fast, p, s) for p, s in jobs[1:3]), late(*jobs[3]))
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    passes = fast.runner.stats.forward_passes - passes
    # one at a time: 83 decoding passes and 4 prefills; together: about 30 + 4
    assert passes < 45, f"{passes} forward passes: not batched"


async def test_a_cancelled_row_leaves_the_batch_and_the_others_go_on(fast, plain):
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=9)
    stream = fast.generate(list(range(5, 70)), SamplingParams(max_new_tokens=100000))

    async def cancel_soon():
        n = 0
        async for _ in stream:
            n += 1
            if n == 5:
                break
        await stream.aclose()

    got, _ = await asyncio.gather(run(fast, list(range(5, 30)), params), cancel_soon())
    assert_same(got, await run(plain, list(range(5, 30)), params))


async def test_rows_of_different_adapters_share_a_pass_and_keep_their_own_results(fast, plain, tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # random LoRA weights, the same every run
    get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False),
    ).save_pretrained(tmp_path / "a")
    for engine in (fast, plain):
        await engine.load_adapter("a", str(tmp_path / "a"))
    prompt, params = list(range(5, 50)), SamplingParams(max_new_tokens=15, temperature=1.0, seed=4)
    adapters = (None, "a", None, "a")
    want = [await run(plain, prompt, params, adapter) for adapter in adapters]
    assert abs(want[0][1][0] - want[1][1][0]) > 1e-3, "the adapter changes the model"
    passes = fast.runner.stats.forward_passes
    got = await asyncio.gather(*(run(fast, prompt, params, adapter) for adapter in adapters))
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    assert fast.runner.stats.forward_passes - passes < 15 + 4 + 5, "the adapters decoded apart"
    # the adapter's cache is dropped with it: a reloaded name never meets stale keys and values
    await fast.unload_adapter("a")
    assert all(entry.adapter is None for entry in fast.runner.prefix._entries)


async def test_judge_votes_on_one_prompt_prefill_it_once(fast, plain):
    """m background votes on the same long prompt leapfrog one cache instead of m prefills."""
    prompt = [5 + i % 400 for i in range(4 * BACKGROUND_IDLE_CHUNK)]
    seeds = (1, 2, 3)
    want = [await run(plain, prompt, SamplingParams(max_new_tokens=10, temperature=1.0, seed=s)) for s in seeds]
    before = fast.runner.stats.prompt_tokens_computed
    got = await asyncio.gather(*(
        run(fast, prompt, SamplingParams(max_new_tokens=10, temperature=1.0, seed=s), background=True) for s in seeds
    ))
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    computed = fast.runner.stats.prompt_tokens_computed - before
    assert computed <= len(prompt) + 2 * BACKGROUND_IDLE_CHUNK, computed


async def test_the_cache_stays_within_its_budget(tiny_model_dir):
    engine = await LocalEngine.open(tiny_model_dir, device="cpu", kv_cache_mb=1)
    try:
        for start in range(10):
            prompt = [(start + i) % 97 + 3 for i in range(300)]
            await run(engine, prompt, SamplingParams(max_new_tokens=2))
        assert 0 < engine.runner.prefix.nbytes <= 2**20
        assert engine.runner.prefix.evictions > 0
    finally:
        await engine.close()


def test_prefix_cache_bookkeeping():
    def kv(n):
        return ((torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2)),)

    assert common_prefix(list(range(1000)), list(range(700)) + [0]) == 700
    assert common_prefix([1, 2], [3]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix(list(range(300)), list(range(300))) == 300
    assert common_prefix(list(range(256)), list(range(300))) == 256
    cache = PrefixCache(budget_bytes=kv_cache.nbytes(kv(10)))
    cache.put(None, None, [1, 2, 3], kv(3))
    cache.put(None, None, [1, 2, 3, 4, 5], kv(5))  # extends the first: replaces it
    assert len(cache) == 1
    cache.put(None, None, [1, 2], kv(2))  # covered already
    cache.put(None, None, [1, 2, 3, 4, 5], kv(5))  # the same tokens again: kept once
    assert len(cache) == 1
    assert cache.longest("other", None, [1, 2, 3], 10) is None
    hit = cache.longest(None, None, [1, 2, 3, 9], 10)
    assert hit.length == 3 and kv_cache.length(hit.kv) == 3
    assert cache.longest(None, None, [1, 2, 3, 9], 2).length == 2
    cache.put(None, None, [7, 8, 9, 10, 11, 12], kv(6))  # over budget: the least recently used goes
    assert len(cache) == 1 and cache.longest(None, None, [1, 2], 5) is None
    cache.put(None, None, list(range(50)), kv(50))  # larger than the whole budget: not kept
    assert cache.longest(None, None, list(range(50)), 50) is None
    cache.put(None, "alice", [1, 2, 3, 4], kv(4))
    assert cache.longest(None, "bob", [1, 2, 3, 4], 10) is None, "a salt never reuses another salt's prefix"
    assert cache.longest(None, None, [1, 2, 3, 4], 10) is None
    assert cache.longest(None, "alice", [1, 2, 3, 9], 10).length == 3


@pytest.mark.parametrize("fail_on_call", [1, 3])  # in the prefill, in a batched step
async def test_a_step_that_fails_half_way_leaves_no_cache_behind(fast, plain, fail_on_call):
    """Layers before the failing one have appended a position the rest lack: never reused."""
    from nextstate.engine.base import EngineError

    last = fast.runner.adapters.model.model.layers[-1]
    forward, calls = last.forward, {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == fail_on_call:
            raise RuntimeError("boom")
        return forward(*args, **kwargs)

    prompt, params = list(range(5, 40)), SamplingParams(max_new_tokens=10, temperature=1.0, seed=2)
    last.forward = flaky
    try:
        with pytest.raises(EngineError, match="boom"):
            await run(fast, prompt, params)
    finally:
        last.forward = forward
    assert fast.runner.prefix.longest(None, None, prompt, len(prompt)) is None
    assert_same(await run(fast, prompt, params), await run(plain, prompt, params))
