"""Does it learn, how fast do new versions serve, and what does training cost serving?

    pip install -e '.[bench]'
    python -m bench.learning                  # peaked tiny model: learning curve + swap latency
    python -m bench.learning --smol           # embedded SmolLM2: adds chat latency while training

Learning curve: a rule rewards replies whose first token is a chosen token (+1) and punishes
every other reply (−1); batches of real samples from the served adapter go through the real
learner (the judge is bypassed: this measures the learner, not the judge), and after every
update the chosen token's probability under the served adapter is measured. Hot swap: time
from an update finishing to its version serving. With --smol, chat latency (p50/p99) is
measured while idle and while a training step runs. Writes bench/results/learning-<model>.json
and a PNG plot beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time

from nextstate.engine.base import SamplingParams
from bench.models import bench_model, bench_server
from bench.report import percentile, pyplot, save
from nextstate.core.types import Sample

# Seconds between a reply and the next request in the latency measurements.
THINK_S = 2.0


async def _first_token_probs(engine, prompt, adapter) -> list[float]:
    import math

    params = SamplingParams(max_new_tokens=1, temperature=1.0, top_logprobs=engine.info.vocab_size)
    (tok,) = [t async for t in engine.generate(prompt, params, adapter)]
    probs = [0.0] * engine.info.vocab_size
    for token_id, logprob in tok.top_logprobs:
        probs[token_id] = math.exp(logprob)
    return probs


async def _replies(engine, prompt, adapter, n, seed0, max_new):
    async def one(i):
        params = SamplingParams(max_new_tokens=max_new, temperature=1.0, seed=seed0 + i)
        return [t async for t in engine.generate(prompt, params, adapter)]

    return await asyncio.gather(*(one(i) for i in range(n)))


def _sample(prompt, toks, reward, version) -> Sample:
    n = len(toks)
    return Sample(
        user="bench", session_id="bench", turn_index=1, policy_version=version, adapter=None, mode="binary",
        status="ready", prompt_ids=prompt, response_ids=[t.token_id for t in toks], old_logprobs=[t.logprob for t in toks],
        logprob_temperature=1.0, advantages=[reward] * n, loss_mask=[1] * n, reward=reward, created_at=time.time(),
    )


def _train_on(server, samples: list[Sample]) -> None:
    store, learner = server.app.state.services.samples, server.app.state.services.learner

    async def put():
        for s in samples:
            learner.notify(await asyncio.to_thread(store.add_sample, s))

    server.call(put())


def _wait_version(server, version: int, timeout: float = 1800) -> None:
    deadline = time.monotonic() + timeout
    while server.app.state.services.policies.current("bench").version < version:
        if time.monotonic() > deadline:
            raise TimeoutError(f"version {version} did not appear")
        time.sleep(0.05)


def learning_curve(server, updates: int, batch: int, max_new: int) -> dict:
    chat, policies = server.app.state.services.turns, server.app.state.services.policies
    prompt = chat.renderer.render([{"role": "user", "content": "Pick a word."}]).ids
    before = server.call(_first_token_probs(chat.engine, prompt, None))
    chosen = sorted(range(len(before)), key=lambda i: -before[i])[1]  # the runner-up token
    probs, rewards = [before[chosen]], []
    for update in range(updates):
        ref = policies.current("bench")
        runs = server.call(_replies(chat.engine, prompt, ref.adapter, batch, 1000 * update, max_new), timeout=1800)
        batch_rewards = [1.0 if toks[0].token_id == chosen else -1.0 for toks in runs]
        rewards.append(statistics.fmean(batch_rewards))
        _train_on(server, [_sample(prompt, toks, r, ref.version) for toks, r in zip(runs, batch_rewards)])
        _wait_version(server, update + 1)
        probs.append(server.call(_first_token_probs(chat.engine, prompt, policies.current("bench").adapter)))
        probs[-1] = probs[-1][chosen]
        print(f"update {update + 1}: mean reward {rewards[-1]:+.3f}, P(chosen) {probs[-1]:.3f}", flush=True)
    steps = server.app.state.services.learner.steps
    return {
        "chosen_token": chosen,
        "p_chosen_per_update": [round(p, 4) for p in probs],
        "mean_reward_per_update": [round(r, 4) for r in rewards],
        "train_seconds_per_update": [round(s["seconds"], 3) for s in steps],
        "swap_ms": [round(1000 * s["swap_s"], 2) for s in steps if s.get("published")],
        "update_finished_to_serving_ms": [round(1000 * s["publish_to_serving_s"], 2) for s in steps if s.get("published")],
    }


def latency_while_training(server, batch: int, max_new: int, requests: int, think_s: float = THINK_S) -> dict:
    """Chat latency while idle, then while one training step of `batch` samples runs, each
    request `think_s` after the last reply: a person reads and types between turns, and the
    learner makes way while a request is in flight (core/activity.py), so back-to-back requests
    would hold the update off for as long as they came and measure nothing a person meets. The
    training side ends when the update's version serves."""
    chat, policies = server.app.state.services.turns, server.app.state.services.policies
    client = server.client(server.key("bench-user"))
    ask = dict(model="m", messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=8, temperature=0,
               extra_headers={"X-Turn-Type": "side"})

    def measure(n: int, stop: threading.Event | None = None) -> list[float]:
        out = []
        while len(out) < n and not (stop is not None and stop.is_set()):
            started = time.perf_counter()
            client.chat.completions.create(**ask)
            out.append(time.perf_counter() - started)
            if stop is not None:
                stop.wait(think_s)
            else:
                time.sleep(think_s)
        return out

    idle = measure(requests)
    prompt = chat.renderer.render([{"role": "user", "content": "Tell me something."}]).ids
    ref = policies.current("bench")
    runs = server.call(_replies(chat.engine, prompt, ref.adapter, batch, 7, max_new), timeout=1800)
    done = threading.Event()
    during: list[float] = []
    target = ref.version + 1

    def watch():
        _wait_version(server, target)
        done.set()

    watcher = threading.Thread(target=watch)
    watcher.start()
    _train_on(server, [_sample(prompt, toks, 1.0, ref.version) for toks in runs])
    while not done.is_set():
        during += measure(1, done)
    watcher.join()

    def pct(values, q):
        return round(1000 * percentile(values, q), 1)

    return {
        "idle": {"requests": len(idle), "p50_ms": pct(idle, 0.5), "p99_ms": pct(idle, 0.99)},
        "while_training": {"requests": len(during), "p50_ms": pct(during, 0.5), "p99_ms": pct(during, 0.99)},
        "train_step_s": round(server.app.state.services.learner.steps[-1]["seconds"], 2),
        "think_s": think_s,
        "ratio_p50": round(percentile(during, 0.5) / percentile(idle, 0.5), 2),
    }


def plot(result: dict):
    plt = pyplot()
    curve = result["learning_curve"]
    fig, ax1 = plt.subplots(figsize=(7, 4))
    updates = list(range(len(curve["p_chosen_per_update"])))
    ax1.plot(updates, curve["p_chosen_per_update"], "o-", color="tab:blue", label="P(chosen first token), served adapter")
    ax1.set_xlabel("update (policy version)")
    ax1.set_ylabel("probability", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(range(1, len(curve["mean_reward_per_update"]) + 1), curve["mean_reward_per_update"], "s--", color="tab:red",
             label="mean reward of the batch it trained on")
    ax2.set_ylabel("mean reward", color="tab:red")
    ax1.set_title(f"nextstate learner on {result['model']}: reward +1 for the chosen first token")
    fig.legend(loc="upper left", bbox_to_anchor=(0.1, 0.88), fontsize=8)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smol", action="store_true", help="the embedded SmolLM2 (adds latency while training)")
    parser.add_argument("--model", help="any local HF model dir")
    parser.add_argument("--updates", type=int, default=None)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--think-s", type=float, default=THINK_S, help="pause between a reply and the next request")
    args = parser.parse_args()

    model_dir = bench_model(model=args.model, smol=args.smol, peaked=True)
    small = not (args.smol or args.model)
    updates = args.updates or (8 if small else 4)
    lr = args.lr or (5e-3 if small else 1e-4)
    max_new = 3 if small else 8
    with bench_server(model_dir, judge_enabled=False, batch_size=args.batch, lr=lr, lora_r=8 if small else 16,
                      lora_alpha=16 if small else 32) as server:
        result = {
            "benchmark": "learning",
            "model": model_dir.name,
            "batch_size": args.batch,
            "lr": lr,
            "learning_curve": learning_curve(server, updates, args.batch, max_new),
        }
        if not small:
            result["latency_while_training"] = latency_while_training(server, args.batch, max_new, 30, args.think_s)
    print(json.dumps(result, indent=2))
    save(result)


def headline(result: dict) -> str:
    p = result["learning_curve"]["p_chosen_per_update"]
    text = f"P(chosen first token) {p[0]:.3f} → {p[-1]:.3f} in {len(p) - 1} updates"
    text += f"; update → serving median {statistics.median(result['learning_curve']['update_finished_to_serving_ms']):.0f} ms"
    if "latency_while_training" in result:
        t = result["latency_while_training"]
        text += (f"; chat p50/p99 idle {t['idle']['p50_ms']}/{t['idle']['p99_ms']} ms, "
                 f"training {t['while_training']['p50_ms']}/{t['while_training']['p99_ms']} ms")
        if "ratio_p50" in t:
            text += f" ({t['ratio_p50']}x idle p50, {t['think_s']:g} s between requests)"
    return text


if __name__ == "__main__":
    main()
