"""LMBackend against a real lmkv_server, and against misbehaving fake servers."""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import socket
import struct
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator

import pytest

from lmkv.backends import lm, lm_socket
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
    for key in ["", "x" * 151, " lead", "trail ", "nul\0", "ü" * 76]:  # (152 bytes in UTF-8)
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


Handler = Callable[[socket.socket], None]


class FakeServer:
    """A scripted lm:// server: ``handler(conn)`` serves each connection in its own thread;
    connections stay open until close()."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
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
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):  # closed under the handler
            self.handler(conn)

    def close(self) -> None:
        self.listener.close()
        for conn in self.conns:
            conn.close()


def reply_once(reply: bytes | None) -> Handler:
    """Reads one request and sends ``reply`` (or nothing)."""

    def handler(conn: socket.socket) -> None:
        conn.recv(wire.REQUEST_SIZE)
        if reply is not None:
            conn.sendall(reply)

    return handler


def reply_each(reply: bytes, first: bytes = b"") -> Handler:
    """Answers every request with ``reply``, the first one preceded by ``first``."""

    def handler(conn: socket.socket) -> None:
        prefix = first
        while len(conn.recv(wire.REQUEST_SIZE, socket.MSG_WAITALL)) == wire.REQUEST_SIZE:
            conn.sendall(prefix + reply)
            prefix = b""

    return handler


@pytest.mark.parametrize("timeout,call,bound", [
    (0.5, "get", 2), (lm_socket.MIN_TIMEOUT, "contains", 0.5),  # the shortest timeout too
])
def test_unresponsive_server_times_out(timeout, call, bound):
    fake = FakeServer(reply_once(None))
    backend = LMBackend(fake.url, timeout=timeout)
    t0 = time.monotonic()
    with pytest.raises(BackendError, match="timed out"):
        getattr(backend, call)(["k@1"])
    assert time.monotonic() - t0 < bound
    fake.close()


def test_a_put_to_a_store_that_trickles_its_reads_fails_within_the_timeout():
    """A store that takes a value's bytes but too slowly (64 KiB every 0.2 s, so each send
    moves some) fails a put within one timeout; before, the put ran on for as long as any
    byte moved within a timeout (a stopped server's socket buffers: 3 timeouts in a soak)."""

    def trickle(conn: socket.socket) -> None:
        end = time.monotonic() + 6
        while time.monotonic() < end and conn.recv(64 << 10):
            time.sleep(0.2)
        conn.close()

    fake = FakeServer(trickle)
    backend = LMBackend(fake.url, timeout=1, max_value_size=32 << 20)
    t0 = time.monotonic()
    with pytest.raises(BackendError, match="timed out"):
        backend.put([("k@1", bytes(16 << 20))])
    assert time.monotonic() - t0 < 2.5
    fake.close()


def test_an_oversized_reply_costs_no_memory_and_a_value_sent_is_a_miss_for_its_key_alone():
    """A value over max_value_size (or the caller's buffer) is read past through a bounded
    scratch buffer: a miss for that key, the batch's other keys read in step (it failed the
    whole batch and the connection); one announced but never sent times out, with no
    allocation of the announced size."""
    huge = wire.pack_response(wire.Code.SUCCESS, 1 << 30, 4, 6, (1 << 30, 0, 0, 0))
    fake = FakeServer(reply_once(huge))
    backend = LMBackend(fake.url, timeout=1, max_value_size=1 << 20)
    tracemalloc.start()
    with pytest.raises(BackendError, match="timed out"):
        backend.get(["k@1"])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 << 20  # (a scratch buffer of RECEIVE_STEP), not the 1 GiB announced
    fake.close()

    def value(n: int) -> bytes:
        return wire.pack_response(wire.Code.SUCCESS, n, 4, 6, (n, 0, 0, 0)) + bytes([n % 251]) * n

    replies = {lm.lmcache_key("small@1").encode(): value(1000),
               lm.lmcache_key("big@1").encode(): value(3 << 20)}

    def serve(conn: socket.socket) -> None:
        while len(request := conn.recv(wire.REQUEST_SIZE, socket.MSG_WAITALL)) == wire.REQUEST_SIZE:
            conn.sendall(next(v for k, v in replies.items() if k in request))

    fake = FakeServer(serve)
    backend = LMBackend(fake.url, timeout=5, max_value_size=1 << 20)
    assert backend.get(["small@1", "big@1", "small@1"]) == [bytes([1000 % 251]) * 1000, None,
                                                           bytes([1000 % 251]) * 1000]
    outs = [memoryview(bytearray(1 << 20)) for _ in range(3)]
    assert backend.get_into_many(["small@1", "big@1", "small@1"], outs) == [1000, None, 1000]
    assert backend.get_into("big@1", bytearray(1 << 20)) is None
    assert backend._sock is not None  # the connection stayed up
    fake.close()


def test_a_negative_reply_length_is_out_of_step():
    """A length of -5 read as a slice bound took all but 5 bytes of the slot as a value."""
    fake = FakeServer(reply_once(wire.pack_response(wire.Code.SUCCESS, -5, 4, 6)))
    backend = LMBackend(fake.url, timeout=1)
    with pytest.raises(BackendError, match="out of step"):
        backend.get_into_many(["k@1"], [memoryview(bytearray(100))])
    fake.close()


def test_a_call_that_raises_mid_batch_drops_the_connection_so_no_reply_is_misread():
    """Replies left unread on the connection (a callback that raised) would be read as the
    answers to the next call's requests: the connection is dropped instead."""
    values = {lm.lmcache_key(k).encode(): k.encode() * 100 for k in ("a@1", "b@1")}

    def serve(conn: socket.socket) -> None:
        while len(request := conn.recv(wire.REQUEST_SIZE, socket.MSG_WAITALL)) == wire.REQUEST_SIZE:
            v = next(v for k, v in values.items() if k in request)
            conn.sendall(wire.pack_response(wire.Code.SUCCESS, len(v), 4, 6, (len(v), 0, 0, 0)) + v)

    fake = FakeServer(serve)
    backend = LMBackend(fake.url, timeout=5)

    def arrived(i: int, n: int) -> None:
        raise RuntimeError("a callback's bug")

    outs = [memoryview(bytearray(1000)) for _ in range(2)]
    with pytest.raises(RuntimeError, match="callback"):
        backend.get_into_many(["a@1", "a@1"], outs, arrived)
    assert backend._sock is None
    assert backend.get(["b@1"]) == [b"b@1" * 100]
    fake.close()


def test_truncated_reply_raises():
    fake = FakeServer(reply_once(wire.pack_response(wire.Code.SUCCESS, 100, 4, 6) + b"x" * 10))
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


@contextlib.contextmanager
def _dropping_port() -> Iterator[int]:
    """A loopback port whose listener's accept queue is full: the kernel drops the SYNs of
    a connection to it (a link that drops packets)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    queued = []
    try:
        for _ in range(8):
            c = socket.socket()
            c.settimeout(0.2)
            try:
                c.connect(("127.0.0.1", port))
            except OSError:
                c.close()
                break
            queued.append(c)
        yield port
    finally:
        for c in queued:
            c.close()
        listener.close()


def test_connecting_takes_no_longer_than_a_call_may():
    """A link that drops the connection's packets: the connect gives up within the call's
    timeout (remote_timeout), not after the fixed connect bound."""
    with _dropping_port() as port:
        backend = LMBackend(f"lm://127.0.0.1:{port}", timeout=0.5)
        assert backend.connect_timeout == 0.5
        start = time.monotonic()
        with pytest.raises(BackendError, match="cannot connect"):
            backend.contains(["k@1"])
        assert time.monotonic() - start < 0.5 + 1.0
    assert LMBackend("lm://127.0.0.1:1", timeout=30).connect_timeout == 3.0


def test_a_name_the_dns_does_not_answer_for_costs_the_connect_bound(spawn_server, monkeypatch):
    """The system resolver takes no timeout: a DNS server that does not answer held each
    connect for its retries (10 s and more). The lookup is bounded by connect_timeout, and
    calls that come while it hangs share the one lookup; once the name resolves, the same
    backend connects to the real server."""
    server = spawn_server("--max-memory", "4MiB")
    port = int(server.url.rsplit(":", 1)[1])
    from tests.backend_checks import silent_dns

    answer, asked = silent_dns(monkeypatch, "kvstore.example")
    backend = LMBackend(f"lm://kvstore.example:{port}", timeout=0.4)
    try:
        for _ in range(3):
            start = time.monotonic()
            with pytest.raises(BackendError, match="did not resolve within 0.4 s"):
                backend.contains(["k@1"])
            assert time.monotonic() - start < 0.4 + 0.5
        assert asked == ["kvstore.example"]  # one lookup in flight, shared
    finally:
        answer.set()
    deadline = time.monotonic() + 5
    while lm.net._lookups and time.monotonic() < deadline:  # the hung lookup ends
        time.sleep(0.01)
    backend.put([("k@1", b"v")])  # (with the late answer, kept: no lookup again)
    assert backend.get(["k@1"]) == [b"v"]
    assert asked == ["kvstore.example"]
    backend.close()


def test_an_address_that_drops_packets_does_not_keep_the_next_from_being_tried(spawn_server,
                                                                               monkeypatch):
    """A name with two addresses, the first dropping the connection's packets (a broken
    IPv6 route): the second is tried with a connect bound of its own, as
    socket.create_connection does (a review found the first spending the whole bound)."""
    server = spawn_server("--max-memory", "4MiB")
    good = int(server.url.rsplit(":", 1)[1])
    real = socket.getaddrinfo
    with _dropping_port() as dropping:
        def two_addresses(host, port, *args, **kwargs):
            if host != "two.example":
                return real(host, port, *args, **kwargs)
            if kwargs.get("flags", 0) & socket.AI_NUMERICHOST:
                raise socket.gaierror("not numeric")
            return (real("127.0.0.1", dropping, type=socket.SOCK_STREAM)
                    + real("127.0.0.1", good, type=socket.SOCK_STREAM))

        monkeypatch.setattr(socket, "getaddrinfo", two_addresses)
        monkeypatch.setattr(lm.net, "_answers", {})
        backend = LMBackend(f"lm://two.example:{good}", timeout=0.5)
        backend.put([("k@1", b"v")])
        assert backend.get(["k@1"]) == [b"v"]
        backend.close()


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
    fake = FakeServer(reply_once(reply))
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
    fake = FakeServer(reply_once(wire.pack_response(500, 0, 0, 0)))
    backend = LMBackend(fake.url, timeout=1)
    with pytest.raises(BackendError, match="code 500"):
        backend.get(["k@1"])
    fake.close()


@pytest.mark.parametrize("reply, first", [
    (wire.pack_response(999), b""),
    (wire.pack_response(wire.Code.SUCCESS, 5), b""),  # a body, which these replies never have
    (wire.pack_response(wire.Code.SUCCESS), b"\0"),  # one stray byte: the stream out of step
], ids=["code-999", "length-5", "one-byte-out-of-step"])
def test_exist_and_health_fail_on_a_reply_that_is_no_answer(reply, first):
    fake = FakeServer(reply_each(reply, first))
    backend = LMBackend(fake.url, timeout=1)
    with pytest.raises(BackendError, match="answered with code"):
        backend.contains(["a@1", "b@1", "c@1"])
    assert backend._sock is None  # dropped, not read on out of step
    with pytest.raises(BackendError, match="answered with code"):
        backend.health()
    fake.close()


@pytest.mark.parametrize("code, answer", [(wire.Code.SUCCESS, True), (wire.Code.FAIL, False)])
def test_exist_and_health_answers_keep_the_connection(code, answer):
    fake = FakeServer(reply_each(wire.pack_response(code)))
    backend = LMBackend(fake.url, timeout=1)
    assert backend.contains(["a@1", "b@1"]) == [answer, answer]
    assert backend.health() is answer
    assert len(fake.conns) == 1
    fake.close()


@pytest.mark.parametrize("call", [
    lambda backend: backend.get(["k@1"]),
    lambda backend: backend.get_into("k@1", bytearray(4096)),
    lambda backend: backend.get_into_many(["k@1"], [memoryview(bytearray(4096))]),
], ids=["get", "get_into", "get_into_many"])
def test_a_reply_stalled_after_its_header_times_out_within_the_timeout(call):
    """Each receive waits only for the time left to the reply's deadline, not for a whole
    timeout of its own (which took 0.3 + 0.5 s here)."""
    def header_late_then_stall(conn: socket.socket) -> None:
        conn.recv(wire.REQUEST_SIZE)
        time.sleep(0.3)
        conn.sendall(wire.pack_response(wire.Code.SUCCESS, 1000, 4, 6, (1000, 0, 0, 0)))

    fake = FakeServer(header_late_then_stall)
    backend = LMBackend(fake.url, timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(BackendError, match="timed out"):
        call(backend)
    assert time.monotonic() - t0 < 0.65
    fake.close()


def test_a_batch_of_exists_is_bounded_by_one_timeout():
    """A store that answers each EXIST just within the timeout: a lookup of 4 keys fails
    after one timeout, not after four."""
    def slow_answers(conn: socket.socket) -> None:
        while len(conn.recv(wire.REQUEST_SIZE, socket.MSG_WAITALL)) == wire.REQUEST_SIZE:
            time.sleep(0.3)
            conn.sendall(wire.pack_response(wire.Code.SUCCESS))

    fake = FakeServer(slow_answers)
    backend = LMBackend(fake.url, timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(BackendError, match="timed out"):
        backend.contains(["a@1", "b@1", "c@1", "d@1"])
    assert time.monotonic() - t0 < 0.8
    fake.close()


@pytest.mark.parametrize("name, seconds", [
    ("timeout", math.inf), ("timeout", math.nan), ("timeout", 1e-7), ("timeout", 0.0),
    ("timeout", -1.0), ("connect_timeout", math.inf), ("connect_timeout", 1e-4),
])
def test_timeouts_must_be_finite_and_at_least_a_millisecond(name, seconds):
    message = f"{name} must be finite and at least 0.001 s, got {seconds!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        LMBackend("lm://127.0.0.1:1", **{name: seconds})


def test_a_wait_under_a_microsecond_is_still_a_wait():
    """The kernel reads a timeval of 0 as no timeout: a wait is rounded up to 1 us."""
    assert [struct.unpack("@ll", lm_socket.timeval(s)) for s in (1e-7, 0.0, 0.0015, 2.5)] == [
        (0, 1), (0, 1), (0, 1500), (2, 500_000)]
    ours, peer = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, lm_socket.timeval(1e-7))
    threading.Timer(2, peer.close).start()  # ends the wait if it has no timeout
    with pytest.raises(BlockingIOError):
        ours.recv(1)
    ours.close()


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


def _answering_server(answer, batch: int = 1) -> socket.socket:
    """A fake lm:// server on a free port: it reads ``batch`` request headers, then sends
    ``answer(header)`` for each (bytes). Close it when done."""

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while True:
                heads = []
                for _ in range(batch):
                    raw = conn.recv(wire.REQUEST_SIZE, socket.MSG_WAITALL)
                    if len(raw) < wire.REQUEST_SIZE:
                        return
                    heads.append(wire.unpack_request(raw))
                for head in heads:
                    conn.sendall(answer(head))

    server = socket.create_server(("127.0.0.1", 0))

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                threading.Thread(target=serve, args=(server.accept()[0],), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return server


def test_get_and_contains_send_a_batch_before_reading_any_answer():
    """A batch of GETs (the zstd and cachegen serdes read this way) or EXISTs is one
    exchange: a server that answers only once the whole batch has arrived serves it (before,
    each key waited for its answer first: N round trips, and here a timeout)."""
    stored = {wire.encode_key(lm.lmcache_key(k)): v for k, v in (("a@1", b"A" * 5000), ("c@1", b"C" * 10))}

    def answer(head) -> bytes:
        value = stored.get(head.key)
        if head.command == wire.Command.EXIST:
            return wire.pack_response(wire.Code.SUCCESS if value else wire.Code.FAIL)
        if value is None:
            return wire.pack_response(wire.Code.FAIL)
        return wire.pack_response(wire.Code.SUCCESS, len(value)) + value

    server = _answering_server(answer, batch=3)
    backend = LMBackend(f"lm://127.0.0.1:{server.getsockname()[1]}", timeout=1.0)
    assert backend.get(["a@1", "b@1", "c@1"]) == [b"A" * 5000, None, b"C" * 10]
    assert backend.contains(["c@1", "b@1", "a@1"]) == [True, False, True]
    backend.close()
    server.close()


def test_a_miss_that_carries_a_value_puts_the_stream_out_of_step():
    """A FAIL reply to GET with a length (lmkv_server and LMCache's server send none): the
    bytes after it are no reply's, so the call fails and the connection is dropped (before,
    it was taken as a miss and the next reply was read from the middle of those bytes)."""
    server = _answering_server(lambda head: wire.pack_response(wire.Code.FAIL, 5) + b"xxxxx")
    backend = LMBackend(f"lm://127.0.0.1:{server.getsockname()[1]}", timeout=1.0)
    for read in (lambda: backend.get(["a@1"]),
                 lambda: backend.get_into_many(["a@1"], [memoryview(bytearray(64))])):
        with pytest.raises(BackendError, match="out of step"):
            read()
    backend.close()
    server.close()
