"""Prometheus view of one server: a private registry read from the live counters.

Nothing is counted twice: the connections count into ``Traffic`` and the store keeps its
own numbers; this collector turns both into metric families at scrape time, so the hot
path never touches prometheus_client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .persistence import Persister
from .protocol import Traffic
from .store import Store

PREFIX = "lmkv_server"


class ServerCollector(Collector):
    def __init__(
        self, store: Store, traffic: Callable[[], Traffic], persister: Persister | None
    ) -> None:
        self.store = store
        self.traffic = traffic
        self.persister = persister

    def collect(self) -> Iterator[Metric]:
        s = self.store.stats()
        t = self.traffic()
        yield _gauge("memory_used_bytes", "Bytes of value pages in use", s.used_bytes)
        yield _gauge(
            "memory_capacity_bytes", "The max_memory bound, in whole pages", s.capacity_bytes
        )
        yield _gauge("stored_bytes", "Sum of stored value lengths", s.stored_bytes)
        yield _gauge("entries", "Stored keys", s.entries)
        yield _counter("evictions", "Entries evicted to make room", s.evictions)
        yield _counter("evicted_bytes", "Value bytes evicted", s.evicted_bytes)
        yield _gauge("open_connections", "Open client connections", t.connections)
        yield _counter("accepted_connections", "Accepted client connections", t.connections_total)
        yield _counter(
            "idle_timeouts", "Connections closed after --idle-timeout without a request",
            t.idle_timeouts,
        )
        yield _labelled("requests", "Frames received, by command", "command", t.requests)
        yield _counter("get_hits", "GETs answered with a value", t.hits)
        yield _counter("get_misses", "GETs of absent keys", t.misses)
        yield _counter("received_bytes", "PUT payload bytes stored", t.bytes_in)
        yield _counter("sent_bytes", "GET payload bytes sent", t.bytes_out)
        yield _labelled("dropped_puts", "PUTs not stored, by reason", "reason", t.dropped)
        yield _labelled(
            "protocol_errors", "Malformed or timed-out frames, by kind", "kind", t.protocol_errors
        )
        yield _labelled("refused_connections", "Connections refused at accept, by reason",
                        "reason", t.refused)
        if self.persister is not None:
            p = self.persister
            yield _gauge("persist_pending", "Keys waiting to be written or deleted", p.pending)
            yield _counter("persist_files_written", "Value files written", p.files_written)
            yield _counter("persist_files_deleted", "Value files deleted", p.files_deleted)
            yield _counter("persist_errors", "Failed persistence writes", p.errors)


def build_registry(
    store: Store, traffic: Callable[[], Traffic], persister: Persister | None
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(store, traffic, persister))
    return registry


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _labelled(name: str, doc: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=[label])
    for key, value in values.items():
        family.add_metric([key.lower()], value)
    return family
