"""metrics_port: lmkv's registry served over HTTP by the engine itself (for engines such as
vLLM whose /metrics lives in another process)."""

from __future__ import annotations

import logging
import socket
import urllib.request

import torch

from lmkv.cache import LMKVCache
from lmkv.config import load_config
from lmkv.layout import KVLayout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(port: int) -> LMKVCache:
    cfg = load_config(env={}, chunk_size=16, max_local_cpu_size=0.01, metrics_port=port)
    return LMKVCache(cfg, KVLayout(2, 1, 8, torch.float32, 16), "model")


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def test_metrics_are_served_on_their_port_until_close(caplog):
    port = _free_port()
    engine = _engine(port)
    try:
        engine.metrics.hit_tokens.inc(48)
        assert "lmkv_hit_tokens_total 48.0" in _scrape(port)
        caplog.set_level(logging.ERROR, logger="lmkv.cache")
        second = _engine(port)  # the port is taken: logged, the engine still works
        try:
            assert second._metrics_server is None
            assert any("cannot serve metrics" in r.getMessage() and "metrics_port" in r.getMessage()
                       for r in caplog.records)
        finally:
            second.close()
    finally:
        engine.close()
    with socket.socket() as s:  # closed: nothing listens there any more
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_no_port_no_server():
    engine = _engine(0)
    try:
        assert engine._metrics_server is None
    finally:
        engine.close()


def test_connections_that_send_nothing_are_bounded_and_dropped(monkeypatch, capfd):
    """prometheus_client's server started a thread per connection, each waiting for its
    client for ever: 100 idle connections were 100 threads in the engine's process. At most
    METRICS_CONNECTIONS are served at once (more are closed as they come) and an idle one
    is dropped after METRICS_TIMEOUT; scrapes go on. (Found by a review.)"""
    import threading
    import time

    from lmkv import metrics

    monkeypatch.setattr(metrics, "METRICS_TIMEOUT", 0.5)
    port = _free_port()
    engine = _engine(port)
    threads = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
    try:
        time.sleep(0.2)
        assert threading.active_count() <= threads + metrics.METRICS_CONNECTIONS
        for s in idle:
            s.settimeout(3)
        assert all(s.recv(1) == b"" for s in idle)  # closed: at once or after the timeout
        assert "lmkv_hit_tokens_total" in _scrape(port)
        time.sleep(0.2)
        assert "Traceback" not in capfd.readouterr().err  # (not one per client dropped)
    finally:
        for s in idle:
            s.close()
        engine.close()


def test_a_client_that_sends_a_byte_now_and_then_is_cut_off_too(monkeypatch):
    """The timeout was per recv: clients sending one byte every few seconds kept their
    connections, and METRICS_CONNECTIONS of them stopped every scrape. A connection is cut
    METRICS_TIMEOUT after it opened."""
    import contextlib
    import threading
    import time

    from lmkv import metrics

    monkeypatch.setattr(metrics, "METRICS_TIMEOUT", 2.0)
    port = _free_port()
    engine = _engine(port)
    slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(metrics.METRICS_CONNECTIONS)]
    stop = threading.Event()

    def trickle():
        while not stop.wait(0.5):
            for s in slow:
                with contextlib.suppress(OSError):  # (cut off: the fix)
                    s.send(b"G")

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        time.sleep(3.5)
        assert "lmkv_hit_tokens_total" in _scrape(port)
    finally:
        stop.set()
        t.join()
        for s in slow:
            s.close()
        engine.close()
