"""Prometheus metrics, on a registry owned by the app (no process-global collectors)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("nextstate_requests", "Chat completion requests by outcome.", ["status", "stream"], registry=r)
        self.refused = Counter(
            "nextstate_requests_refused", "Requests answered with an error, by status and error code.", ["status", "code"], registry=r
        )
        self.failed = Counter(
            "nextstate_turns_failed", "Replies that failed after the engine took the request, by error code.", ["code"], registry=r
        )
        self.aborted = Counter(
            "nextstate_requests_aborted", "Replies whose client went away before the end (never trained).", ["turn_type"], registry=r
        )
        self.turns = Counter("nextstate_turns", "Served turns by type and how their session was found.", ["turn_type", "match"], registry=r)
        self.transitions = Counter("nextstate_transitions", "Turns handed to the judge, by reason.", ["reason"], registry=r)
        self.judged = Counter("nextstate_judged_samples", "Judged turns by mode and outcome.", ["mode", "status"], registry=r)
        self.prompt_tokens = Counter("nextstate_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.prompt_tokens_cached = Counter(
            "nextstate_prompt_tokens_cached", "Prompt tokens whose keys and values the engine had cached.", registry=r
        )
        self.completion_tokens = Counter("nextstate_completion_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("nextstate_time_to_first_token_seconds", "Time to first token.", buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("nextstate_request_seconds", "Whole request latency.", buckets=_LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("nextstate_requests_in_flight", "Requests being generated.", registry=r)
        self.sessions_open = Gauge("nextstate_sessions_open", "Open sessions.", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
