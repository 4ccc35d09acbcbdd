"""The engine's Prometheus metrics, on a registry owned by the engine (no globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("engine_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("engine_generation_tokens", "Tokens generated", registry=r)
        self.prefix_cache_hit_tokens = Counter(
            "engine_prefix_cache_hit_tokens", "Prompt tokens served by the prefix cache", registry=r
        )
        self.computed_tokens = Counter(
            "engine_computed_tokens", "Tokens run through the model", registry=r
        )
        self.preemptions = Counter("engine_preemptions", "Requests preempted", registry=r)
        self.requests_finished = Counter(
            "engine_requests_finished", "Finished requests", ["reason"], registry=r
        )
        self.running = Gauge("engine_requests_running", "Requests running", registry=r)
        self.waiting = Gauge("engine_requests_waiting", "Requests waiting", registry=r)
        self.kv_usage = Gauge("engine_kv_cache_usage", "Fraction of KV blocks in use", registry=r)
        self.ttft = Histogram(
            "engine_time_to_first_token_seconds",
            "Time from arrival to the first generated token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.step_seconds = Histogram(
            "engine_step_seconds", "Duration of one engine step",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=r,
        )
