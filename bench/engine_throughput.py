"""Total decoding throughput of the embedded engine at 1, 4 and 8 concurrent streams,
batched (one forward pass per step for all streams) against one stream at a time per step.

    python -m bench.engine_throughput                # the embedded SmolLM2-135M-Instruct
    python -m bench.engine_throughput --tiny         # the tiny test model (a smoke run)
    python -m bench.engine_throughput --model DIR    # any local HF model directory

Each stream is a short chat prompt (different per stream) decoding `--max-tokens` tokens at
temperature 1 with no stop token, so every stream decodes the same number of tokens. Tokens/s
is all streams' tokens over the wall time from the first request to the last token, prefill
included. Both modes run in the same process, one after the other, on the same prompts.
Writes bench/results/engine_throughput-<model>[-<gpu>].json and its plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from bench.models import bench_model
from bench.report import pyplot, save

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works to a child.",
    "List some tips for learning a new language.",
    "Describe the water cycle.",
    "What makes a good cup of coffee?",
    "Summarise the plot of a heist film in three sentences.",
    "Why is the sky blue?",
    "Give me a packing list for a weekend hike.",
]
LEVELS = (1, 4, 8)


async def throughput(model_dir: Path, device: str, batching: bool, max_tokens: int, rounds: int) -> dict:
    from nextstate.engine.base import SamplingParams
    from nextstate.engine.local import LocalEngine
    from nextstate.modelio.chat_template import ChatRenderer

    renderer = ChatRenderer.from_dir(model_dir)
    prompts = [renderer.render([{"role": "user", "content": p}]).ids for p in PROMPTS]
    # no prefix cache in either mode: this measures decoding, not reuse of the prompts
    engine = await LocalEngine.open(model_dir, device=device, kv_cache_mb=0, batching=batching, max_active=max(LEVELS))
    out = {}
    try:

        async def stream(i: int, seed: int) -> int:
            params = SamplingParams(max_new_tokens=max_tokens, temperature=1.0, seed=seed)
            return sum([1 async for _ in engine.generate(prompts[i % len(prompts)], params)])

        await stream(0, 0)  # warm-up
        for level in LEVELS:
            rates = []
            for r in range(rounds):
                started = time.perf_counter()
                counts = await asyncio.gather(*(stream(i, 100 * r + i) for i in range(level)))
                rates.append(sum(counts) / (time.perf_counter() - started))
            out[str(level)] = max(rates)
            print(f"{'batched' if batching else 'one at a time'}: {level} streams, {out[str(level)]:.1f} tokens/s")
    finally:
        await engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local HF model dir (default: the embedded SmolLM2)")
    parser.add_argument("--tiny", action="store_true", help="use the tiny test model")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="runs per level; the best is kept")
    args = parser.parse_args()

    model_dir = bench_model(model=args.model, smol=not args.tiny)
    batched = asyncio.run(throughput(model_dir, args.device, True, args.max_tokens, args.rounds))
    alone = asyncio.run(throughput(model_dir, args.device, False, args.max_tokens, args.rounds))
    result = {
        "benchmark": "engine_throughput",
        "model": model_dir.name,
        "max_tokens": args.max_tokens,
        "tokens_per_s": {"batched": batched, "one_at_a_time": alone},
        "speedup_8_vs_1": batched["8"] / batched["1"],
    }
    print(json.dumps(result, indent=2))
    save(result)


def headline(result: dict) -> str:
    b, a = result["tokens_per_s"]["batched"], result["tokens_per_s"]["one_at_a_time"]
    return (f"total tokens/s at 1/4/8 streams: batched {b['1']:.0f}/{b['4']:.0f}/{b['8']:.0f}, "
            f"one at a time {a['1']:.0f}/{a['4']:.0f}/{a['8']:.0f}; 8 streams = {result['speedup_8_vs_1']:.1f}x one")


def plot(result: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    levels = [int(k) for k in result["tokens_per_s"]["batched"]]
    for mode, color in (("batched", "tab:blue"), ("one_at_a_time", "tab:gray")):
        ax.plot(levels, list(result["tokens_per_s"][mode].values()), "o-", color=color, label=mode.replace("_", " "))
    ax.set_xticks(levels)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("total tokens/s")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.suptitle(f"{result['model']}: decoding throughput", fontsize=10)
    return fig


if __name__ == "__main__":
    main()
