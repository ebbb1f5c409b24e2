"""SGLang's router (the `sglang-router` package, in the dev extras) as a process of its own."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.background_server import free_port
from tests.real_engines.server_process import ServerProcess


class SGLangRouter(ServerProcess):
    """The router in front of `workers`, with the `manual` policy: a request's routing key
    (header x-smg-routing-key) pins it to one worker; a new key goes to the worker with the fewest requests in flight."""

    name = "router"
    distribution = "sglang-router"
    start_timeout_s = 60.0

    def __init__(self, workers: list[str], log_dir: Path, health_checks: bool = False) -> None:
        """`health_checks`: watch the workers every second, and try a worker whose requests
        failed again after 2 s (a worker killed and restarted takes traffic again), for workers
        in processes of their own; off for stand-ins sharing the test's process (see below)."""
        self.workers = workers
        self.health_checks = health_checks
        super().__init__(Path("."), log_dir, python=sys.executable)

    def command(self) -> list[str]:
        return [self.python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
                "--worker-urls", *self.workers, "--policy", "manual", "--assignment-mode", "min_load",
                # its metrics listener has a fixed default port (29000): two routers would collide
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--log-level", "warn", *self._health()]

    def _health(self) -> list[str]:
        if not self.health_checks:
            # the stand-in workers share the test process, whose training holds the GIL for
            # seconds: a health check would then take a worker out and skew the routing
            return ["--disable-health-check"]
        return ["--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--health-success-threshold", "1",
                "--cb-timeout-duration-secs", "2"]

    def listed(self) -> list[str]:
        import httpx

        return sorted(w["url"] for w in httpx.get(f"{self.url}/workers", timeout=10).json()["workers"])

    def add_worker(self, url: str) -> None:
        import httpx

        httpx.post(f"{self.url}/workers", json={"url": url}, timeout=10).raise_for_status()
