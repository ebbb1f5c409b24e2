"""The embedded engine: KV-cache decoding, logprob alignment, concurrency, adapters — on both
runtimes it computes with, transformers and llama.cpp (`engine` is each in turn)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from nextstate.engine.base import EngineError, SamplingParams, UnknownAdapterError
from nextstate.engine.local import LocalEngine

PROMPT = list(range(5, 40))


RUNTIMES = ["transformers", "llama.cpp"]


async def open_engine(model_dir, runtime: str, **kwargs) -> LocalEngine:
    """The local engine on `runtime`: llama.cpp serves the folder's float16 GGUF copy."""
    if runtime == "transformers":
        return await LocalEngine.open(model_dir, device="cpu", **kwargs)
    from nextstate.modelio.gguf_model import gguf_copy

    return await LocalEngine.open(model_dir, gguf=gguf_copy(model_dir, model_dir.parent / "gguf"), **kwargs)


@pytest.fixture(params=RUNTIMES)
async def engine(request, tiny_model_dir):
    eng = await open_engine(tiny_model_dir, request.param)
    eng.runtime = request.param
    yield eng
    await eng.close()


async def collect(engine, sampling, adapter=None, prompt=PROMPT):
    return [tok async for tok in engine.generate(prompt, sampling, adapter)]


async def settled(engine) -> None:
    """Wait until the engine's worker has released every job already answered: a call queued
    now runs only after the round that delivered their last token, release included."""
    await engine._call(lambda: None)


async def test_sampling_logprobs_match_a_full_forward_pass(engine):
    """What we record as old logprobs must equal what the learner will recompute."""
    for temperature in (0.0, 0.7, 1.0):
        toks = await collect(engine, SamplingParams(max_new_tokens=24, temperature=temperature, seed=3))
        params = SamplingParams(max_new_tokens=1, temperature=temperature)
        scored = await engine.score(PROMPT + [t.token_id for t in toks], len(PROMPT), temperature=params.logprob_temperature)
        assert len(scored) == len(toks)
        assert scored == pytest.approx([t.logprob for t in toks], abs=1e-4)


async def test_greedy_equals_argmax_of_full_forward(engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    toks = await collect(engine, SamplingParams(max_new_tokens=10, temperature=0))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(10):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert [t.token_id for t in toks] == ids[len(PROMPT) :]


async def test_length_and_stop_finish_reasons(engine):
    toks = await collect(engine, SamplingParams(max_new_tokens=7, temperature=0))
    assert len(toks) == 7 and toks[-1].finish_reason == "length"
    assert all(t.finish_reason is None for t in toks[:-1])
    first = toks[2].token_id
    toks = await collect(engine, SamplingParams(max_new_tokens=7, temperature=0, stop_token_ids=(first,)))
    assert toks[-1].token_id == first and toks[-1].finish_reason == "stop"


async def test_concurrent_generations_equal_sequential_ones(engine):
    params = [SamplingParams(max_new_tokens=30, temperature=1.0, seed=s) for s in (1, 2, 3, 4)]
    alone = [[t.token_id for t in await collect(engine, p)] for p in params]
    together = await asyncio.gather(*(collect(engine, p) for p in params))
    assert [[t.token_id for t in run] for run in together] == alone


async def test_closing_the_stream_cancels_generation(engine):
    stream = engine.generate(PROMPT, SamplingParams(max_new_tokens=100000))
    async for _ in stream:
        break
    await stream.aclose()
    # the engine is free again: a new request completes promptly
    toks = await asyncio.wait_for(collect(engine, SamplingParams(max_new_tokens=3)), 10)
    assert len(toks) == 3


async def test_named_adapters_load_serve_and_unload(engine, tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base_scores = await engine.score(PROMPT, 1)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False),
    )
    model.save_pretrained(tmp_path / "v1")
    with pytest.raises(UnknownAdapterError):
        await engine.score(PROMPT, 1, adapter="v1")
    await engine.load_adapter("v1", str(tmp_path / "v1"))
    await engine.load_adapter("v1-copy", str(tmp_path / "v1"))
    adapted = await engine.score(PROMPT, 1, adapter="v1")
    assert max(abs(a - b) for a, b in zip(adapted, base_scores)) > 1e-3
    assert await engine.score(PROMPT, 1) == pytest.approx(base_scores, abs=1e-6), "adapter=None must be the base model"
    toks = await collect(engine, SamplingParams(max_new_tokens=5, temperature=0), adapter="v1")
    scored = await engine.score(PROMPT + [t.token_id for t in toks], len(PROMPT), adapter="v1")
    assert scored == pytest.approx([t.logprob for t in toks], abs=1e-4)
    await engine.unload_adapter("v1")
    assert await engine.score(PROMPT, 1, adapter="v1-copy") == pytest.approx(adapted, abs=1e-6)
    await engine.unload_adapter("v1-copy")
    assert engine.adapters == []
    assert await engine.score(PROMPT, 1) == pytest.approx(base_scores, abs=1e-6)


async def test_unload_waits_for_generations_using_the_adapter(engine, tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "a")
    await engine.load_adapter("a", str(tmp_path / "a"))
    running = asyncio.create_task(collect(engine, SamplingParams(max_new_tokens=200), adapter="a"))
    await asyncio.sleep(0.01)
    await engine.unload_adapter("a")
    toks = await running
    assert len(toks) == 200, "the in-flight request finished on its adapter"


async def test_bad_requests_raise_engine_errors(engine):
    with pytest.raises(EngineError):
        await collect(engine, SamplingParams(max_new_tokens=3), prompt=[])
    with pytest.raises(EngineError):
        await engine.score(PROMPT, 0)


async def test_background_work_yields_to_user_requests(engine):
    produced = 0

    async def background():
        nonlocal produced
        async for _ in engine.generate(PROMPT, SamplingParams(max_new_tokens=2000), background=True):
            produced += 1

    task = asyncio.create_task(background())
    while produced < 5:
        await asyncio.sleep(0.001)
    before = produced
    toks = await collect(engine, SamplingParams(max_new_tokens=60))
    during = produced - before
    task.cancel()
    assert len(toks) == 60
    assert during <= 3, f"background made {during} steps while the user waited for 60"


async def test_background_scoring_waits_for_user_requests(engine):
    order = []
    generating = asyncio.Event()

    async def user():
        async for _ in engine.generate(PROMPT, SamplingParams(max_new_tokens=150)):
            generating.set()
        order.append("user")

    async def judge():
        await engine.score(PROMPT, 1, background=True)
        order.append("judge")

    task = asyncio.create_task(user())
    await generating.wait()  # the judge asks while the user's reply is being written (a sleep was not enough on a busy machine)
    await asyncio.gather(task, judge())
    assert order == ["user", "judge"]
    assert len(await engine.score(PROMPT, 1, background=True)) == len(PROMPT) - 1  # idle: runs at once


def test_background_prompts_go_in_short_steps_only_beside_a_user():
    """Alone, background work reads its prompt in large steps (32-token ones go at a fraction of
    the pace); beside a user's request, in short ones, so the request waits a short step at most."""
    from nextstate.engine.scheduler import (BACKGROUND_CHUNK, BACKGROUND_IDLE_CHUNK, BACKGROUND_IDLE_GAP_S,
                                            BACKGROUND_MAX_WAIT_S, Job, Scheduler)

    def job(background: bool) -> Job:
        return Job(list(range(2000)), SamplingParams(max_new_tokens=1), None, None, None, background=background)

    scheduler = Scheduler(max_active=4)
    judge = job(True)
    scheduler.add(judge)
    scheduler.admit()
    assert scheduler.runnable(now=1000.0) == [judge] and judge.prefill_chunk == BACKGROUND_IDLE_CHUNK
    user = job(False)
    scheduler.add(user)
    scheduler.admit()
    assert scheduler.runnable(now=1000.0 + BACKGROUND_MAX_WAIT_S) == [user, judge]
    assert judge.prefill_chunk == BACKGROUND_CHUNK < BACKGROUND_IDLE_CHUNK
    assert user.prefill_chunk == 2000  # a user's prompt in one step
    scheduler.finish(user)
    later = 1000.0 + BACKGROUND_MAX_WAIT_S + 2 * BACKGROUND_IDLE_GAP_S
    assert scheduler.runnable(now=later) == [judge] and judge.prefill_chunk == BACKGROUND_IDLE_CHUNK


def test_background_work_holds_back_while_the_learner_computes():
    """Beside an update on the same cores (`held`), background work goes as beside a user's
    request: a short step per BACKGROUND_MAX_WAIT_S, never starved, never at full pace."""
    from nextstate.engine.scheduler import BACKGROUND_CHUNK, BACKGROUND_IDLE_CHUNK, BACKGROUND_MAX_WAIT_S, Job, Scheduler

    learning = [True]
    scheduler = Scheduler(max_active=4, held=lambda: learning[0])
    judge = Job(list(range(2000)), SamplingParams(max_new_tokens=1), None, None, None, background=True)
    scheduler.add(judge)
    scheduler.admit()
    start = scheduler._last_background_step
    assert scheduler.runnable(now=start + BACKGROUND_MAX_WAIT_S / 2) == []
    assert scheduler.runnable(now=start + BACKGROUND_MAX_WAIT_S) == [judge] and judge.prefill_chunk == BACKGROUND_CHUNK
    assert scheduler.runnable(now=start + 1.5 * BACKGROUND_MAX_WAIT_S) == [], "one short step, then it waits again"
    learning[0] = False
    assert scheduler.runnable(now=start + 1.5 * BACKGROUND_MAX_WAIT_S) == [judge]
    assert judge.prefill_chunk == BACKGROUND_IDLE_CHUNK, "the update over: full steps at once"


async def test_chunked_background_work_matches_foreground(engine):
    from nextstate.engine.scheduler import BACKGROUND_IDLE_CHUNK

    # read in three full steps and a short one (no user request: the idle chunk)
    long_prompt = [5 + i % 400 for i in range(3 * BACKGROUND_IDLE_CHUNK + 7)]
    foreground = await engine.score(long_prompt, 10)
    background = await engine.score(long_prompt, 10, background=True)
    assert len(background) == len(long_prompt) - 10
    # llama.cpp sums a chunk's attention in another order than one pass over the whole prompt
    assert background == pytest.approx(foreground, abs=1e-5 if engine.runtime == "transformers" else 1e-3)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=11)
    fg = [t.token_id for t in await collect(engine, params, prompt=long_prompt)]
    bg = [t.token_id async for t in engine.generate(long_prompt, params, background=True)]
    assert bg == fg


async def test_new_versions_reuse_freed_slots_in_place(engine, tiny_model_dir, tmp_path):
    if engine.runtime != "transformers":
        pytest.skip("peft slots are the transformers runtime's")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for i, name in enumerate(("v1", "v2")):
        torch.manual_seed(i)
        get_peft_model(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir),
            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
        ).save_pretrained(tmp_path / name)
    await engine.load_adapter("v1", str(tmp_path / "v1"))
    v1 = await engine.score(PROMPT, 1, adapter="v1")
    await engine.unload_adapter("v1")
    await engine.load_adapter("v2", str(tmp_path / "v2"))
    assert engine.runner.adapters.slot_of("v2") == "slot0", "v2 was copied into v1's slot"
    v2 = await engine.score(PROMPT, 1, adapter="v2")
    fresh = await LocalEngine.open(tiny_model_dir, device="cpu")
    try:
        await fresh.load_adapter("v2", str(tmp_path / "v2"))
        assert v2 == pytest.approx(await fresh.score(PROMPT, 1, adapter="v2"), abs=1e-6)
    finally:
        await fresh.close()
    assert max(abs(a - b) for a, b in zip(v1, v2)) > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
async def test_seeded_sampling_on_cuda(tiny_model_dir):
    """A seed's generator must live on the logits' device (it once was always a CPU one,
    which failed every seeded request on a GPU), and seeds must still reproduce there."""
    eng = await LocalEngine.open(tiny_model_dir, device="cuda")
    try:
        for top_p in (1.0, 0.9):
            params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=top_p, seed=5)
            first, second = await collect(eng, params), await collect(eng, params)
            assert [t.token_id for t in first] == [t.token_id for t in second]
            scored = await eng.score(PROMPT + [t.token_id for t in first], len(PROMPT), temperature=1.0)
            assert scored == pytest.approx([t.logprob for t in first], abs=1e-3)
    finally:
        await eng.close()
