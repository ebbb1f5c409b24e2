"""First-token latency and decode speed of the embedded engine, directly and over HTTP.

    python -m bench.serve_latency                 # the embedded default (SmolLM2-135M-Instruct)
    python -m bench.serve_latency --model DIR     # any local HF model directory
    python -m bench.serve_latency --tiny          # the tiny test model (a smoke run)

Writes bench/results/serve_latency-<model>.json. "Engine" numbers call the engine in-process
(prompt → first token, then steady decoding); "HTTP" numbers go through the whole proxy with
the openai SDK and stream=True (auth, templating, sessions, records, SSE).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from bench.models import bench_model, bench_server
from bench.report import pyplot, save

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works to a child.",
    "List some tips for learning a new language.",
    "Describe the water cycle.",
]


async def engine_numbers(model_dir: Path, max_tokens: int, runs: int) -> dict:
    from nextstate.engine.base import SamplingParams
    from nextstate.engine.local import LocalEngine
    from nextstate.modelio.chat_template import ChatRenderer

    renderer = ChatRenderer.from_dir(model_dir)
    engine = await LocalEngine.open(model_dir, device="cpu")
    ttfts, rates = [], []
    try:
        for i in range(runs + 1):  # first run warms up
            prompt = renderer.render([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]).ids
            params = SamplingParams(max_new_tokens=max_tokens, temperature=0)
            started = time.perf_counter()
            first = None
            n = 0
            async for _ in engine.generate(prompt, params):
                n += 1
                if first is None:
                    first = time.perf_counter()
            end = time.perf_counter()
            if i:
                ttfts.append(first - started)
                rates.append((n - 1) / (end - first))
        # aggregate throughput with 4 concurrent generations
        params = SamplingParams(max_new_tokens=max_tokens, temperature=0)
        prompts = [renderer.render([{"role": "user", "content": p}]).ids for p in PROMPTS]
        started = time.perf_counter()

        async def count(prompt: list[int]) -> int:
            return sum([1 async for _ in engine.generate(prompt, params)])

        counts = await asyncio.gather(*(count(p) for p in prompts))
        concurrent_rate = sum(counts) / (time.perf_counter() - started)
    finally:
        await engine.close()
    return {
        "ttft_s_median": statistics.median(ttfts),
        "decode_tokens_per_s_median": statistics.median(rates),
        "concurrent4_total_tokens_per_s": concurrent_rate,
    }


def http_numbers(model_dir: Path, max_tokens: int, runs: int) -> dict:
    with bench_server(model_dir) as server:
        client = server.client(server.key("bench"))
        ttfts, rates = [], []
        for i in range(runs + 1):
            started = time.perf_counter()
            first = None
            tokens = 0
            stream = client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter()
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            end = time.perf_counter()
            if i:
                ttfts.append(first - started)
                rates.append((tokens - 1) / (end - first))
    return {"ttft_s_median": statistics.median(ttfts), "decode_tokens_per_s_median": statistics.median(rates)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local HF model dir (default: the embedded SmolLM2)")
    parser.add_argument("--tiny", action="store_true", help="use the tiny test model")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    model_dir = bench_model(model=args.model, smol=not args.tiny)

    result = {
        "benchmark": "serve_latency",
        "model": model_dir.name,
        "dtype": "float32",
        "max_tokens": args.max_tokens,
        "runs": args.runs,
        "engine": asyncio.run(engine_numbers(model_dir, args.max_tokens, args.runs)),
        "http_stream": http_numbers(model_dir, args.max_tokens, args.runs),
    }
    print(json.dumps(result, indent=2))
    save(result)


def headline(result: dict) -> str:
    e, h = result["engine"], result["http_stream"]
    return (f"first token {1000 * e['ttft_s_median']:.0f} ms in-process / {1000 * h['ttft_s_median']:.0f} ms over HTTP; "
            f"{e['decode_tokens_per_s_median']:.1f} / {h['decode_tokens_per_s_median']:.1f} tokens/s")


def plot(result: dict):
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(8, 3.5))
    paths = ["engine, in-process", "nextstate, HTTP stream"]
    numbers = [result["engine"], result["http_stream"]]
    ax.bar(paths, [1000 * n["ttft_s_median"] for n in numbers], color=["tab:gray", "tab:blue"])
    ax.set_ylabel("first token, median (ms)")
    bx.bar(paths, [n["decode_tokens_per_s_median"] for n in numbers], color=["tab:gray", "tab:blue"])
    bx.set_ylabel("decoding, median (tokens/s)")
    fig.suptitle(f"{result['model']}, {result['max_tokens']} new tokens, greedy", fontsize=10)
    return fig


if __name__ == "__main__":
    main()
