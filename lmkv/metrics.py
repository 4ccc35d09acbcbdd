"""lmkv's Prometheus metrics, on a registry the caller owns (the engine's, usually)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                    10, 30)  # (a slow link's batch reads take seconds; FETCH_TIMEOUT is 10 s)


class LMKVMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.lookups = Counter("lmkv_lookups", "Prefix lookups (one per request admission)",
                               registry=r)
        self.lookup_tokens = Counter("lmkv_lookup_tokens", "Prompt tokens looked up", registry=r)
        self.hit_tokens = Counter("lmkv_hit_tokens", "Prompt tokens lmkv found beyond the engine's "
                                  "own prefix cache (to be loaded)", registry=r)
        self.engine_cached_tokens = Counter(
            "lmkv_engine_cached_tokens", "Prompt tokens the engine's own prefix cache held at "
            "lmkv's lookups (lmkv loads none of them)", registry=r)
        self.loaded_tokens = Counter("lmkv_loaded_tokens",
                                     "Tokens whose KV lmkv wrote into the engine", registry=r)
        self.stored_chunks = Counter("lmkv_stored_chunks",
                                     "Chunks stored: kept hot or queued for a lower tier",
                                     registry=r)
        self.hit_rate = Gauge("lmkv_hit_rate", "hit_tokens / lookup_tokens since start",
                              registry=r)
        self.tier_bytes = Counter("lmkv_tier_bytes", "Bytes moved per tier and direction",
                                  ["tier", "op"], registry=r)
        self.tier_seconds = Histogram("lmkv_tier_seconds",
                                      "Latency of one tier call (raw-frame reads: their checks too)",
                                      ["tier", "op"], buckets=_LATENCY_BUCKETS, registry=r)
        self.load_wait_seconds = Histogram(
            "lmkv_load_wait_seconds", "Time a lookup waited for chunks from the tiers below the "
            "hot cache (the engine's scheduling waits with it)", buckets=_LATENCY_BUCKETS,
            registry=r)
        self.tier_skipped = Counter(
            "lmkv_tier_skipped", "Lookups and reads not sent to a tier while its breaker held it "
            "off after a failure (each a miss there)", ["tier", "op"], registry=r)
        self.tier_hits = Counter("lmkv_tier_hits", "Chunks found per tier (reads for loads and prefetches)",
                                 ["tier"], registry=r)
        self.evictions = Counter("lmkv_evictions", "Chunks evicted per tier", ["tier"],
                                 registry=r)
        self.errors = Counter("lmkv_errors", "Failures, each costing a recompute or a lost save",
                              ["tier", "kind"], registry=r)
        self.dropped = Counter("lmkv_dropped", "Background work dropped (queue full, no memory)",
                               ["what"], registry=r)
        self.prefetched_chunks = Counter("lmkv_prefetched_chunks",
                                         "Chunks pulled up to the hot cache ahead of scheduling",
                                         registry=r)
        self.blend_requests = Counter("lmkv_blend_requests", "Prompts looked up for blending",
                                      registry=r)
        self.blend_hit_tokens = Counter("lmkv_blend_hit_tokens",
                                        "Prompt tokens whose KV came from stored RAG chunks", registry=r)
        self.blend_recomputed_tokens = Counter(
            "lmkv_blend_recomputed_tokens", "Cached tokens recomputed by blending (selected)",
            registry=r)
        self.codec_checks = Counter("lmkv_codec_checks",
                                    "Requests served lossy KV that the quality gate re-ran",
                                    registry=r)
        self.codec_checked_tokens = Counter("lmkv_codec_checked_tokens",
                                            "Generated tokens compared by the quality gate",
                                            registry=r)
        self.codec_agreed_tokens = Counter("lmkv_codec_agreed_tokens",
                                           "Compared tokens equal with and without lossy KV",
                                           registry=r)
        self.codec_agreement = Gauge("lmkv_codec_agreement",
                                     "agreed / checked tokens of the quality gate since start "
                                     "(1 until a token is checked)", registry=r)
        self.codec_agreement.set(1.0)  # (0 read as total disagreement, where nothing is lossy)
        self.lossless_chunks = Counter("lmkv_codec_lossless_chunks",
                                       "Chunks a lossy tier stored lossless: beyond its table's range",
                                       ["tier"], registry=r)
        self.codec_fallbacks = Counter("lmkv_codec_fallbacks",
                                       "Times the quality gate turned lossy tiers lossless",
                                       registry=r)
        self.hot_chunks = Gauge("lmkv_hot_cache_chunks", "Chunks in the hot cache", registry=r)
        self.held_chunks = Gauge("lmkv_held_chunks", "Hot chunks held for requests waiting for "
                                 "them to arrive (bring_up), until their lookup", registry=r)

    def record_blend(self, tokens: int, hits: int) -> None:
        self.blend_requests.inc()
        self.blend_hit_tokens.inc(hits)

    def record_lookup(self, tokens: int, hits: int, engine_tokens: int = 0) -> None:
        self.lookups.inc()
        self.lookup_tokens.inc(tokens)
        self.hit_tokens.inc(hits)
        self.engine_cached_tokens.inc(engine_tokens)
        total = self.lookup_tokens._value.get()
        self.hit_rate.set(self.hit_tokens._value.get() / total if total else 0.0)


METRICS_CONNECTIONS = 16  # scrapes served at once on metrics_port; more are closed at accept
METRICS_TIMEOUT = 10.0  # seconds a scrape's connection may wait for the client's bytes


def serve_metrics(registry: CollectorRegistry, host: str, port: int):
    """``registry`` over HTTP on ``host:port`` from a daemon thread, for engines whose own
    /metrics lmkv cannot join; the server (``shutdown()`` and ``server_close()`` stop it).
    Unlike prometheus_client's start_http_server (a thread per connection, each waiting for
    its client for ever), at most METRICS_CONNECTIONS connections are served at once and a
    connection is cut METRICS_TIMEOUT after it opened. OSError if the port cannot
    be bound."""
    import contextlib
    import socket
    import sys
    import threading
    import time
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    slots = threading.BoundedSemaphore(METRICS_CONNECTIONS)

    class Server(ThreadingWSGIServer):
        address_family = family

        def process_request(self, request, client_address):
            if not slots.acquire(blocking=False):  # as many scrapes as it serves: refused
                self.shutdown_request(request)
                return
            try:
                super().process_request(request, client_address)
            except BaseException:
                slots.release()
                raise

        def process_request_thread(self, request, client_address):
            try:
                super().process_request_thread(request, client_address)
            finally:
                slots.release()

        def server_close(self):
            closed.set()
            super().server_close()

        def handle_error(self, request, client_address):
            if not isinstance(sys.exc_info()[1], OSError):  # (a client gone or idle: said
                super().handle_error(request, client_address)  # nothing; a defect: printed)

    class Handler(WSGIRequestHandler):
        timeout = METRICS_TIMEOUT  # (the connection's socket timeout)

        def setup(self):
            with lock:
                open_since[self.request] = time.monotonic()
            super().setup()

        def finish(self):
            with lock:
                open_since.pop(self.request, None)
            super().finish()

        def log_message(self, format, *args):  # noqa: A002 (not each scrape in the log)
            pass

    # a deadline for each whole connection, not per recv: a client sending a byte every few
    # seconds held a slot for good (METRICS_CONNECTIONS of them, and no scrape was served)
    lock, open_since, closed = threading.Lock(), {}, threading.Event()

    def cut_overdue() -> None:
        while not closed.wait(METRICS_TIMEOUT / 4):
            with lock:
                overdue = [c for c, t in open_since.items() if time.monotonic() - t > METRICS_TIMEOUT]
            for conn in overdue:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    server = make_server(host, port, make_wsgi_app(registry), Server, handler_class=Handler)
    threading.Thread(target=server.serve_forever, name="lmkv-metrics", daemon=True).start()
    threading.Thread(target=cut_overdue, name="lmkv-metrics-deadline", daemon=True).start()
    return server
