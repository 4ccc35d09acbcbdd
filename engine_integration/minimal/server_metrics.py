"""The API server's own Prometheus metrics, on the engine's registry, and the ASGI
middleware that records them."""

from __future__ import annotations

import time
from collections.abc import Collection

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.requests = Counter(
            "api_requests", "HTTP requests answered", ["endpoint", "status"], registry=r
        )
        self.request_seconds = Histogram(
            "api_request_duration_seconds",
            "Time from receiving an HTTP request to the end of its response",
            ["endpoint"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.in_flight = Gauge(
            "api_generations_in_flight",
            "Generation requests handed to the engine and not finished",
            registry=r,
        )
        self.rejected = Counter(
            "api_generations_rejected", "Generation requests refused with 503 (queue full)",
            registry=r,
        )
        self.step_errors = Counter(
            "api_engine_step_errors", "Engine steps that raised (their requests failed)",
            registry=r,
        )


class MetricsMiddleware:
    """Counts every HTTP response by endpoint and status, and times it to its last byte.
    Paths outside ``endpoints`` are counted as "other" (bounded label values)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, endpoints: Collection[str]):
        self.app = app
        self.metrics = metrics
        self.endpoints = frozenset(endpoints)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in self.endpoints else "other"
        status = 500  # if the app raises before answering
        start = time.perf_counter()

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - start)
