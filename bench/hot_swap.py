"""Hot swaps under load: 20 consecutive adapter versions while clients keep chatting.

    python -m bench.hot_swap            # tiny model (fast)
    python -m bench.hot_swap --smol     # embedded SmolLM2

Four client threads send chat requests without pause while the learner publishes 20 versions
(real updates on real samples). Reports every request that failed (expected: none), the
version each request reports (X-Policy-Version; never goes backwards for a client), the swap
time (adapter load until new requests use it) and update-finished-to-serving time. Writes
bench/results/hot_swap-<model>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from bench.learning import _replies, _sample, _train_on
from bench.models import bench_model, bench_server
from bench.report import pyplot, save


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smol", action="store_true")
    parser.add_argument("--swaps", type=int, default=20)
    args = parser.parse_args()

    model_dir = bench_model(smol=args.smol, peaked=True)
    batch = 4
    # one shared adapter: the chatting clients are other users, and must be served each new version
    with bench_server(model_dir, judge_enabled=False, batch_size=batch, lr=1e-4 if args.smol else 1e-3,
                      adapter_scope="shared", shared_min_contributors=1) as server:
        stop = threading.Event()
        outcomes: list[tuple[int, float, int | None, str | None]] = []  # thread, latency, version, error
        lock = threading.Lock()

        def client_loop(worker: int) -> None:
            client = server.client(server.key(f"client{worker}"))
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    raw = client.chat.completions.with_raw_response.create(
                        model="m", messages=[{"role": "user", "content": f"hello {worker}"}], max_tokens=8,
                        extra_headers={"X-Turn-Type": "side"},
                    )
                    raw.parse()
                    item = (worker, time.perf_counter() - started, int(raw.headers["x-policy-version"]), None)
                except Exception as exc:  # noqa: BLE001 - a failure is what this bench counts
                    item = (worker, time.perf_counter() - started, None, repr(exc))
                with lock:
                    outcomes.append(item)

        threads = [threading.Thread(target=client_loop, args=(w,)) for w in range(4)]
        try:
            for t in threads:
                t.start()
            chat = server.app.state.services.turns
            prompt = chat.renderer.render([{"role": "user", "content": "Pick a word."}]).ids
            version, attempt = 0, 0
            while version < args.swaps:
                attempt += 1
                ref = server.app.state.services.policies.current("bench")
                runs = server.call(_replies(chat.engine, prompt, ref.adapter, batch, 100 * attempt, 4), timeout=600)
                _train_on(server, [_sample(prompt, toks, 1.0 if i % 2 else -1.0, ref.version) for i, toks in enumerate(runs)])
                learner = server.app.state.services.learner
                while len(learner.steps) < attempt:  # published, or skipped by the KL guard
                    time.sleep(0.02)
                version = server.app.state.services.policies.current("bench").version
                print(f"update {attempt}: serving version {version}", flush=True)
            time.sleep(0.5)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
            steps = list(server.app.state.services.learner.steps)

    failed = [o for o in outcomes if o[3] is not None]
    backwards = 0
    for worker in range(4):
        versions = [o[2] for o in outcomes if o[0] == worker and o[2] is not None]
        backwards += sum(1 for a, b in zip(versions, versions[1:]) if b < a)
    latencies = sorted(o[1] for o in outcomes if o[3] is None)
    swaps = [1000 * s["swap_s"] for s in steps if s.get("published")]
    served = [1000 * s["publish_to_serving_s"] for s in steps if s.get("published")]
    result = {
        "benchmark": "hot_swap",
        "model": model_dir.name,
        "swaps": len(swaps),
        "updates_skipped_by_guard": sum(1 for s in steps if not s.get("published")),
        "requests": len(outcomes),
        "requests_failed": len(failed),
        "failures": [o[3] for o in failed][:5],
        "version_went_backwards_for_a_client": backwards,
        "versions_seen": sorted({o[2] for o in outcomes if o[2] is not None}),
        "request_p50_ms": round(1000 * latencies[len(latencies) // 2], 1),
        "request_p99_ms": round(1000 * latencies[int(0.99 * (len(latencies) - 1))], 1),
        "swap_ms": {"median": round(statistics.median(swaps), 2), "max": round(max(swaps), 2), "all": [round(s, 2) for s in swaps]},
        "update_finished_to_serving_ms": {"median": round(statistics.median(served), 2), "max": round(max(served), 2),
                                          "all": [round(s, 2) for s in served]},
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("swap_ms", "update_finished_to_serving_ms")}, indent=2))
    save(result)


def headline(result: dict) -> str:
    return (f"{result['swaps']} swaps under load: {result['requests_failed']} of {result['requests']} requests failed, "
            f"swap median {result['swap_ms']['median']} ms, update → serving median "
            f"{result['update_finished_to_serving_ms']['median']} ms")


def plot(result: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    swaps = result["swap_ms"]["all"]
    ax.plot(range(1, len(swaps) + 1), swaps, "o-", label="swap (adapter load → new requests use it)")
    served = result["update_finished_to_serving_ms"].get("all")  # older results kept only median and max
    if served:
        ax.plot(range(1, len(served) + 1), served, "s--", label="update finished → serving")
    ax.set_xlabel("version")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{result['model']}: {result['requests_failed']} of {result['requests']} requests failed during "
                 f"{result['swaps']} swaps", fontsize=10)
    ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":
    main()
