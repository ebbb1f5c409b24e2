"""Where should serving processes keep their shared rate-limit counters: PostgreSQL or Redis?

    python -m bench.shared_counters            # 2000 checks each, 1 and 16 at once

Every request of a rate-limited key costs one check (count a request, read the window). Measured
per backend, as the proxy would call it (async, from the event loop): the `limits` library's
moving window in memory (one process: today's default), the same on Redis (`limits`' own
storage, redis-py), `limits`' sliding-window counter on Redis, and on PostgreSQL the same kind
of counter hand-written: a count per key and minute in an UNLOGGED table, updated by one UPSERT
that also reads the minute before (weighted by the part of it still in the window), through
psycopg's async connection — there is no `limits` storage for PostgreSQL, so this is the least
a hand-written one would cost. The test PostgreSQL runs with fsync off; the table is UNLOGGED,
so it writes no WAL either way. Reported: checks per second and latency p50 and
p99 at 1 and at 16 concurrent checks.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from bench.report import percentile, pyplot, save
from tests.real_engines.postgres_server import PostgresServer
from tests.real_engines.redis_server import RedisServer

_PG_SCHEMA = """
CREATE UNLOGGED TABLE IF NOT EXISTS rate_counts (key TEXT NOT NULL, minute BIGINT NOT NULL, count BIGINT NOT NULL,
                                        PRIMARY KEY (key, minute))
"""
_PG_HIT = """
WITH hit AS (
    INSERT INTO rate_counts (key, minute, count) VALUES (%(key)s, %(minute)s, 1)
    ON CONFLICT (key, minute) DO UPDATE SET count = rate_counts.count + 1 RETURNING count
)
SELECT (SELECT count FROM hit), COALESCE((SELECT count FROM rate_counts WHERE key = %(key)s AND minute = %(minute)s - 1), 0)
"""


async def _limits_checker(storage_uri: str | None, counter: bool = False):
    from limits import RateLimitItemPerMinute
    from limits.aio.storage import MemoryStorage, RedisStorage
    from limits.aio.strategies import MovingWindowRateLimiter, SlidingWindowCounterRateLimiter

    storage = MemoryStorage() if storage_uri is None else RedisStorage(storage_uri.replace("redis://", "async+redis://"),
                                                                      implementation="redispy")
    limiter = (SlidingWindowCounterRateLimiter if counter else MovingWindowRateLimiter)(storage)
    item = RateLimitItemPerMinute(10**9)

    async def check(key: str) -> None:
        await limiter.hit(item, "requests", key)
        await limiter.get_window_stats(item, "requests", key)

    return check, None


async def _postgres_checker(url: str, concurrency: int):
    import psycopg

    setup = await psycopg.AsyncConnection.connect(url, autocommit=True)
    await setup.execute(_PG_SCHEMA)
    await setup.close()
    pool = asyncio.Queue()
    for _ in range(concurrency):  # one connection per concurrent check, as a pool would give
        pool.put_nowait(await psycopg.AsyncConnection.connect(url, autocommit=True))

    async def check(key: str) -> None:
        conn = await pool.get()
        try:
            now = time.time()
            current, previous = await (await conn.execute(_PG_HIT, {"key": key, "minute": int(now // 60)})).fetchone()
            _ = current + previous * (1 - (now % 60) / 60)
        finally:
            pool.put_nowait(conn)

    async def close() -> None:
        while not pool.empty():
            await (pool.get_nowait()).close()

    return check, close


async def _measure(check, checks: int, concurrency: int, keys: int = 64) -> dict:
    latencies: list[float] = []
    done = 0

    async def worker(w: int) -> None:
        nonlocal done
        while done < checks:
            done += 1
            started = time.perf_counter()
            await check(f"key{(done + w) % keys}")
            latencies.append(time.perf_counter() - started)

    for _ in range(50):  # warm connections and caches
        await check("warm")
    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    elapsed = time.perf_counter() - started
    return {
        "checks_per_s": round(len(latencies) / elapsed),
        "p50_ms": round(percentile(latencies, 0.5) * 1000, 3),
        "p99_ms": round(percentile(latencies, 0.99) * 1000, 3),
    }


async def run(checks: int, concurrencies: list[int]) -> list[dict]:
    postgres, redis = PostgresServer(), RedisServer()
    rows = []
    try:
        for concurrency in concurrencies:
            for backend in ("memory", "redis", "redis-counter", "postgres-counter"):
                if backend == "postgres-counter":
                    check, close = await _postgres_checker(postgres.url, concurrency)
                else:
                    check, close = await _limits_checker(None if backend == "memory" else redis.url,
                                                         counter=backend == "redis-counter")
                result = await _measure(check, checks, concurrency)
                if close is not None:
                    await close()
                rows.append({"backend": backend, "concurrency": concurrency, **result})
                print(rows[-1], flush=True)
    finally:
        redis.stop()
        postgres.stop()
    return rows


def headline(result: dict) -> str:
    parts = [f"{r['backend']}×{r['concurrency']}: {r['checks_per_s']}/s, p50 {r['p50_ms']:.2f} ms" for r in result["rows"]]
    return "rate-limit checks; " + "; ".join(parts)


def plot(result: dict):
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6, 3.5))
    rows = result["rows"]
    labels = [f"{r['backend']}\n×{r['concurrency']}" for r in rows]
    axis.bar(labels, [r["p50_ms"] for r in rows], label="p50")
    axis.scatter(labels, [r["p99_ms"] for r in rows], color="black", zorder=3, label="p99")
    axis.set(ylabel="ms per check", title="one rate-limit check, by backend and checks at once")
    axis.legend()
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    rows = asyncio.run(run(args.checks, args.concurrency))
    lines = ["| backend | at once | checks/s | p50 ms | p99 ms |", "|---|---|---|---|---|"]
    lines += [f"| {r['backend']} | {r['concurrency']} | {r['checks_per_s']} | {r['p50_ms']} | {r['p99_ms']} |" for r in rows]
    print("\n".join(lines))
    save({"benchmark": "shared_counters", "checks": args.checks, "rows": rows})


if __name__ == "__main__":
    main()
