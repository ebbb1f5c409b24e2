"""What do more nextstate processes buy? N serving processes in front of one stub engine.

    python -m bench.proxy_replicas                      # N = 1, 2, 3 at 16 clients
    python -m bench.proxy_replicas --replicas 1 2 4 --clients 32

One engine server answers every request with the same 32-token reply and no model
(tests/fake_sglang.py --scripted, as bench/proxy_overhead's stub), so only HTTP and nextstate
cost time. N `nextstate serve` processes (NEXTSTATE_LEARN=false, judging off) share one
PostgreSQL (NEXTSTATE_DATABASE_URL: keys, open sessions, rate windows, replies in flight) and
sit beside the engine; each client plays 10-turn conversations and sends each turn to the next
process in turn (as a round-robin load balancer would: every conversation crosses processes, so
each request reads the session another process wrote), or with `--pinned` always to one. Reported per N: replies per second over
the whole run and first-token / full-reply latency p50 and p99. Every process shares this
machine's cores with the engine, PostgreSQL and the client, so on a small machine the figure
shows where one box stops, not how far the design goes: BENCHMARKS.md says what it would take at
10x and 100x.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx

from bench.models import bench_model
from bench.proxy_overhead import STUB_REPLY, Conversation, _spawn, _stop, _stream_proxy, _wait_up
from bench.report import percentile, pyplot, save
from nextstate.core.stores.keys import KeyStore
from tests.background_server import free_port
from tests.real_engines.postgres_server import PostgresServer


class Replicas:
    """The stub engine, PostgreSQL and N nextstate processes, each in its own process."""

    def __init__(self, model_dir: Path, replicas: int, clients: int, local: bool = False) -> None:
        """`local`: one process on its data dir's SQLite files and its own memory, no PostgreSQL
        (the single-process default, for the cost of sharing)."""
        self.procs = []
        self.tmp = tempfile.TemporaryDirectory()
        self.postgres = None if local else PostgresServer()
        try:
            port = free_port()
            self.procs.append(_spawn(["-m", "tests.fake_sglang", str(port), str(model_dir), "--scripted", STUB_REPLY]))
            engine_url = f"http://127.0.0.1:{port}"
            _wait_up(f"{engine_url}/health", self.procs[-1])
            database = None if local else self.postgres.fresh_database("bench")
            store = KeyStore(Path(self.tmp.name) / ("p0/nextstate.sqlite3" if local else "unused.sqlite3"), database)
            self.keys = [store.create(f"user{i}")[1] for i in range(clients)]
            store.close()
            self.urls = []
            for n in range(replicas):
                port = free_port()
                env = {"NEXTSTATE_DATA_DIR": f"{self.tmp.name}/p{n}", "NEXTSTATE_MODEL": str(model_dir),
                       "NEXTSTATE_SERVED_MODEL_NAME": "m", "NEXTSTATE_LEARN": "0", "NEXTSTATE_JUDGE_ENABLED": "0",
                       "NEXTSTATE_LOG_LEVEL": "warning", "NEXTSTATE_MAX_CONCURRENT_GENERATIONS": "64",
                       "NEXTSTATE_ENGINE": "sglang", "NEXTSTATE_SGLANG_URL": engine_url,
                       "NEXTSTATE_ADAPTERS_DIR": f"{self.tmp.name}/adapters", "NEXTSTATE_PORT": str(port),
                       **({"NEXTSTATE_DATABASE_URL": database} if database else {})}
                self.procs.append(_spawn(["-m", "nextstate.cli", "serve"], env))
                self.urls.append(f"http://127.0.0.1:{port}")
                _wait_up(f"{self.urls[-1]}/healthz", self.procs[-1])
        except BaseException:
            self.close()
            raise

    def database_load(self) -> tuple[int, int] | None:
        """PostgreSQL's view of the serving processes: their open connections to the bench's
        database and the transactions it has committed so far (None without PostgreSQL)."""
        if self.postgres is None:
            return None
        import psycopg

        with psycopg.connect(self.postgres.url, autocommit=True) as conn:
            connections = conn.execute("SELECT COUNT(*) FROM pg_stat_activity WHERE datname = 'bench'").fetchone()[0]
            commits = conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = 'bench'").fetchone()[0]
        return int(connections), int(commits)

    def close(self) -> None:
        for proc in reversed(self.procs):
            _stop(proc)
        if self.postgres is not None:
            self.postgres.stop()
        self.tmp.cleanup()


async def drive(replicas: Replicas, clients: int, turns: int, pinned: bool = False) -> dict:
    """`clients` conversations at once, turn t of client c on process (c + t) mod N (or c mod N,
    `pinned`); latencies in ms."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:

        async def play(c: int) -> list[tuple[float, float]]:
            convo, out = Conversation(c), []
            for turn in range(turns):
                url = replicas.urls[(c + (0 if pinned else turn)) % len(replicas.urls)]
                if turn and turn % 10 == 0:
                    convo = Conversation(c)
                ttft, total, text = await _stream_proxy(http, url, replicas.keys[c], convo.next_request(turn), 64)
                convo.answered(text)
                out.append((1000 * ttft, 1000 * total))
            return out

        started = time.perf_counter()
        per_client = await asyncio.gather(*(play(c) for c in range(clients)))
        seconds = time.perf_counter() - started
    pairs = [p for client in per_client for p in client]
    ttft, total = [p[0] for p in pairs], [p[1] for p in pairs]
    return {"requests": len(pairs), "seconds": round(seconds, 2), "replies_per_s": round(len(pairs) / seconds, 1),
            **{f"{name}_{q}_ms": round(percentile(values, level), 1)
               for name, values in (("ttft", ttft), ("total", total)) for q, level in (("p50", 0.5), ("p99", 0.99))}}


def headline(result: dict) -> str:
    rows = result["rows"]
    parts = [f"N={r['replicas']}: {r['replies_per_s']} replies/s, p50 {r['total_p50_ms']:.0f} ms" for r in rows]
    spread = ("one process, no PostgreSQL" if result.get("local") else
              "each on one process" if result.get("pinned") else "turns round-robin over the processes")
    return f"{result['clients']} clients ({spread}) on a stub engine; " + "; ".join(parts)


def plot(result: dict):
    plt = pyplot()
    rows = result["rows"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    n = [r["replicas"] for r in rows]
    left.plot(n, [r["replies_per_s"] for r in rows], marker="o")
    left.set(xlabel="nextstate processes", ylabel="replies / s", title="throughput", xticks=n)
    for key, label in (("total_p50_ms", "reply p50"), ("total_p99_ms", "reply p99"), ("ttft_p50_ms", "first token p50")):
        right.plot(n, [r[key] for r in rows], marker="o", label=label)
    right.set(xlabel="nextstate processes", ylabel="ms", title="latency", xticks=n)
    right.legend()
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--turns", type=int, default=20, help="requests per client")
    parser.add_argument("--pinned", action="store_true", help="each client always on one process")
    parser.add_argument("--local", action="store_true",
                        help="one process without PostgreSQL (SQLite and memory, the default deployment)")
    args = parser.parse_args()
    model_dir = bench_model()
    rows = []
    if args.local:
        args.replicas = [1]
    for n in args.replicas:
        replicas = Replicas(model_dir, n, args.clients, local=args.local)
        try:
            asyncio.run(drive(replicas, args.clients, 2))  # warm every connection and process
            before = replicas.database_load()
            rows.append({"replicas": n, **asyncio.run(drive(replicas, args.clients, args.turns, args.pinned))})
            if before is not None:  # an idle backend reports its committed transactions within 10 s (PostgreSQL 15+)
                time.sleep(11)
                after = replicas.database_load()
                rows[-1].update(pg_connections_per_process=round(after[0] / n, 1),
                                pg_commits_per_request=round((after[1] - before[1]) / rows[-1]["requests"], 2))
            print(json.dumps(rows[-1]), flush=True)
        finally:
            replicas.close()
    variant = f"{args.clients}-clients" + ("-pinned" if args.pinned else "") + ("-local" if args.local else "")
    save({"benchmark": "proxy_replicas", "variant": variant, "clients": args.clients, "pinned": args.pinned,
          "local": args.local, "rows": rows})


if __name__ == "__main__":
    main()
