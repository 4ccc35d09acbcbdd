"""LMBackend against a real lmkv_server, and against misbehaving fake servers."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import tracemalloc

import pytest

from lmkv.backends import lm
from lmkv.backends import lm_wire as wire
from lmkv.backends.base import BackendError
from lmkv.backends.lm import LMBackend, parse_lm_url


def test_parse_lm_url():
    assert parse_lm_url("lm://127.0.0.1:65432") == ("127.0.0.1", 65432)
    assert parse_lm_url("lm://[::1]:9/") == ("::1", 9)
    for bad in ["redis://h:1", "lm://host", "lm://:1", "lm://h:1/path", "lm://h:99999"]:
        with pytest.raises(ValueError):
            parse_lm_url(bad)


def test_put_get_contains(spawn_server):
    server = spawn_server("--max-memory", "32MiB")
    backend = LMBackend(server.url)
    value = os.urandom(3 << 20)
    backend.put([("a@1", value), ("b@1", memoryview(b"abc")), ("e@1", b"")])
    assert backend.get(["a@1", "b@1", "e@1", "zz@1"]) == [value, b"abc", b"", None]
    assert backend.contains(["a@1", "zz@1"]) == [True, False]
    assert backend.health()
    backend.close()


def test_batched_reads_are_pipelined(spawn_server):
    from tests.backend_checks import check_batched_reads

    server = spawn_server("--max-memory", "4MiB")
    check_batched_reads(LMBackend(server.url), [memoryview(bytearray(8192)) for _ in range(3)])


def test_invalid_keys_and_sizes_raise_backend_error(spawn_server):
    server = spawn_server("--max-memory", "4MiB")
    backend = LMBackend(server.url, max_value_size=1000)
    for key in ["", "x" * 151, "has space", "nul\0", "ünï"]:
        with pytest.raises(BackendError, match="invalid lm:// key"):
            backend.get([key])
    with pytest.raises(BackendError, match="over max_value_size"):
        backend.put([("big@1", b"x" * 1001)])
    assert backend.contains(["big@1"]) == [False]  # nothing half-sent


def test_kill_9_raises_promptly_then_reconnects_after_restart(spawn_server):
    server = spawn_server("--max-memory", "8MiB")
    backend = LMBackend(server.url, timeout=2, connect_timeout=1)
    backend.put([("k@1", b"before")])
    assert backend.get(["k@1"]) == [b"before"]
    server.kill()
    for call in (lambda: backend.get(["k@1"]), lambda: backend.contains(["k@1"])):
        t0 = time.monotonic()
        with pytest.raises(BackendError):
            call()
        assert time.monotonic() - t0 < 3
    server.start()  # same port, empty store
    assert backend.get(["k@1"]) == [None]  # the dead connection was replaced silently
    backend.put([("k@1", b"after")])
    assert backend.get(["k@1"]) == [b"after"]


def test_restart_between_calls_is_invisible(spawn_server):
    server = spawn_server("--max-memory", "8MiB")
    backend = LMBackend(server.url, timeout=2)
    assert backend.contains(["x@1"]) == [False]
    server.restart()
    backend.put([("x@1", b"v")])  # would be lost on a stale socket
    assert backend.get(["x@1"]) == [b"v"]


class FakeServer:
    """Accepts connections and replies with ``reply`` (or nothing) to each request."""

    def __init__(self, reply: bytes | None) -> None:
        self.reply = reply
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"lm://127.0.0.1:{self.listener.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            conn.recv(wire.REQUEST_SIZE)
            if self.reply is not None:
                conn.sendall(self.reply)

    def close(self) -> None:
        self.listener.close()
        for conn in self.conns:
            conn.close()


def test_unresponsive_server_times_out():
    fake = FakeServer(reply=None)
    backend = LMBackend(fake.url, timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(BackendError, match="timed out"):
        backend.get(["k@1"])
    assert time.monotonic() - t0 < 2
    fake.close()


def test_oversized_reply_is_refused():
    huge = wire.pack_response(wire.Code.SUCCESS, 1 << 30, 4, 6, (1 << 30, 0, 0, 0))
    fake = FakeServer(reply=huge)
    backend = LMBackend(fake.url, timeout=1, max_value_size=1 << 20)
    with pytest.raises(BackendError, match="announced a 1073741824-byte value"):
        backend.get(["k@1"])
    fake.close()


def test_truncated_reply_raises():
    fake = FakeServer(reply=wire.pack_response(wire.Code.SUCCESS, 100, 4, 6) + b"x" * 10)
    backend = LMBackend(fake.url, timeout=1)
    threading.Timer(0.2, fake.close).start()
    with pytest.raises(BackendError):
        backend.get(["k@1"])


def test_connect_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = LMBackend(f"lm://127.0.0.1:{port}", connect_timeout=1)
    with pytest.raises(BackendError, match="cannot connect"):
        backend.contains(["k@1"])


def test_get_into_caller_buffer(spawn_server):
    server = spawn_server("--max-memory", "8MiB")
    backend = LMBackend(server.url)
    value = os.urandom(100_000)
    backend.put([("into@1", value)])
    slot = bytearray(200_000)
    assert backend.get_into("into@1", slot) == len(value)
    assert slot[: len(value)] == value
    assert backend.get_into("missing@1", slot) is None
    sock = backend._sock
    # a value larger than its buffer (not a chunk of this layout) is read past: a miss, and
    # the connection stays in step (the tier is not failed over one stored value)
    assert backend.get_into("into@1", bytearray(10)) is None
    small, big = bytearray(10), bytearray(200_000)
    assert backend.get_into_many(["into@1", "into@1"], [memoryview(small), memoryview(big)]) == [
        None, len(value)]
    assert big[: len(value)] == value and small == bytearray(10)
    assert backend.get(["into@1"]) == [value] and backend._sock is sock


def test_values_arrive_in_steps(spawn_server, monkeypatch):
    """A value is received into memory grown as it arrives (a length announced but not sent
    costs only what came): the bytes are the same."""
    monkeypatch.setattr(lm, "RECEIVE_STEP", 4096)
    server = spawn_server("--max-memory", "8MiB")
    backend = LMBackend(server.url)
    value = os.urandom(100_001)
    backend.put([("steps@1", value)])
    assert backend.get(["steps@1", "none@1", "steps@1"]) == [value, None, value]


def test_a_length_announced_but_not_sent_costs_only_what_came():
    """A server that announces a 1 GiB value and sends 10 bytes: the client fails the call
    without having allocated the gigabyte."""
    reply = wire.pack_response(wire.Code.SUCCESS, 1 << 30, 4, 6, (1 << 30, 0, 0, 0)) + b"x" * 10
    fake = FakeServer(reply=reply)
    backend = LMBackend(fake.url, timeout=0.5, max_value_size=1 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(BackendError):
            backend.get(["k@1"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * lm.RECEIVE_STEP
    fake.close()


def test_a_reply_code_that_is_no_reply_fails_the_call():
    fake = FakeServer(reply=wire.pack_response(500, 0, 0, 0))
    backend = LMBackend(fake.url, timeout=1)
    with pytest.raises(BackendError, match="code 500"):
        backend.get(["k@1"])
    fake.close()


def test_frozen_server_times_out_then_recovers(spawn_server):
    server = spawn_server("--max-memory", "8MiB")
    backend = LMBackend(server.url, timeout=1)
    backend.put([("f@1", b"v")])
    # a reply on the connection proves the PUT before it applied (PUT has no reply of its
    # own): without it the PUT could still be unread at SIGSTOP and race the GET of the new
    # connection after SIGCONT
    assert backend.contains(["f@1"]) == [True]
    server.proc.send_signal(signal.SIGSTOP)  # alive but not answering
    while _state(server.proc.pid) != "T":
        time.sleep(0.01)
    try:
        t0 = time.monotonic()
        with pytest.raises(BackendError, match="timed out"):
            backend.get(["f@1"])
        assert time.monotonic() - t0 < 2.5
    finally:
        server.proc.send_signal(signal.SIGCONT)
    assert backend.get(["f@1"]) == [b"v"]  # new connection; the stale one was dropped


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]
