"""The lm:// protocol against a real lmkv_server process."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from lmkv.backends import lm_wire as wire
from lmkv.backends.lm import LMBackend

KEY = "meta-llama/Llama-3.1-8B-Instruct@2@1@-1a2b3c4d5e6f7081@bfloat16"


@pytest.fixture(scope="module")
def server(server_env, tmp_path_factory):
    from lmkv_server.launcher import ServerProcess

    log = tmp_path_factory.mktemp("protocol") / "server.log"
    with ServerProcess(
        "--max-memory", "64MiB", "--max-value-size", "16MiB", "--io-timeout", "2",
        env=server_env, log_path=log,
    ) as server:  # fmt: skip
        yield server


@pytest.fixture
def client(server):
    backend = LMBackend(server.url, timeout=5)
    yield backend
    backend.close()


def raw_connection(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"EOF after {len(data)} of {n} bytes")
        data += chunk
    return data


def request(sock: socket.socket, frame: bytes) -> wire.ResponseHeader:
    sock.sendall(frame)
    return wire.unpack_response(recv_exactly(sock, wire.RESPONSE_SIZE))


def test_round_trip_byte_exact(client):
    values = {f"{KEY}@n%{i}": os.urandom(n) for i, n in enumerate([0, 1, 4095, 300_001])}
    client.put(list(values.items()))
    assert client.get(list(values)) == list(values.values())
    assert client.contains([*values, "absent@1"]) == [True] * len(values) + [False]


def test_get_miss_is_the_reference_fail_header(server):
    with raw_connection(server) as sock:
        reply = request(sock, wire.pack_request(wire.Command.GET, b"never-stored"))
    assert reply == wire.ResponseHeader(400, 0, 1, 2, (0, 0, 0, 0), 0)


def test_overwrite(client):
    client.put([("ow@1", b"first value")])
    client.put([("ow@1", b"second")])
    assert client.get(["ow@1"]) == [b"second"]


def test_get_returns_stored_metadata(server):
    shape = (2, 4, 16, 8)
    payload = os.urandom(2 * 4 * 16 * 8 * 2)
    with raw_connection(server) as sock:
        sock.sendall(
            wire.pack_request(wire.Command.PUT, b"meta@1", len(payload), 1, 3, shape) + payload
        )
        reply = request(sock, wire.pack_request(wire.Command.GET, b"meta@1"))
        assert reply == wire.ResponseHeader(200, len(payload), 1, 3, shape, 0)
        assert recv_exactly(sock, len(payload)) == payload


def test_health_and_list(server):
    with raw_connection(server) as sock:
        assert request(sock, wire.pack_request(wire.Command.HEALTH, b"h")).code == 200
        sock.sendall(wire.pack_request(wire.Command.LIST, b"l"))  # no reply expected
        reply = request(sock, wire.pack_request(wire.Command.EXIST, b"nothing"))
        assert reply.code == 400  # the LIST sent nothing that desynchronised us


def test_bad_and_nul_padded_keys_fail_but_keep_the_connection(server):
    nul_padded = bytearray(wire.pack_request(wire.Command.GET, b"k"))
    nul_padded[37:] = bytes(149)
    bad_key = bytearray(wire.pack_request(wire.Command.EXIST, b"k"))
    bad_key[36:40] = b"a\nb\x01"
    with raw_connection(server) as sock:
        assert request(sock, bytes(nul_padded)).code == 400
        assert request(sock, bytes(bad_key)).code == 400
        # a PUT with a bad key is drained, not stored, and the stream stays in sync
        put = bytearray(wire.pack_request(wire.Command.PUT, b"k", 5))
        put[36:38] = b"\x00\xff"
        sock.sendall(bytes(put) + b"hello")
        assert request(sock, wire.pack_request(wire.Command.HEALTH, b"h")).code == 200
    assert server.stats()["traffic"]["dropped"]["bad_key"] >= 1


def test_unknown_command_closes_only_that_connection(server, client):
    with raw_connection(server) as sock:
        frame = bytearray(wire.pack_request(wire.Command.GET, b"k"))
        frame[0:4] = struct.pack("<i", 77)
        assert request(sock, bytes(frame)).code == 400
        assert sock.recv(1) == b""  # closed after the FAIL
    client.put([("still@1", b"ok")])
    assert client.get(["still@1"]) == [b"ok"]


@pytest.mark.parametrize("length", [-1, 2**31 - 1, 16 * 2**20 + 1])
def test_bad_length_closes_the_connection(server, client, length):
    with raw_connection(server) as sock:
        frame = bytearray(wire.pack_request(wire.Command.PUT, b"big@1"))
        frame[4:8] = struct.pack("<i", length)
        sock.sendall(bytes(frame))
        assert sock.recv(1) == b""
    assert client.contains(["big@1"]) == [False]
    assert server.stats()["traffic"]["protocol_errors"]["bad_length"] >= 1


def test_truncated_frames_then_close(server, client):
    put = wire.pack_request(wire.Command.PUT, b"trunc@1", 1 << 20)
    for partial in (put[:50], put + os.urandom(1000)):
        with raw_connection(server) as sock:
            sock.sendall(partial)  # header cut short / payload cut short, then EOF
    client.put([("after@1", b"fine")])
    assert client.get(["after@1", "trunc@1"]) == [b"fine", None]


def test_stalled_frame_times_out(server, client):
    with raw_connection(server) as sock:
        sock.sendall(wire.pack_request(wire.Command.PUT, b"slow@1", 1000) + b"x" * 10)
        sock.settimeout(10)
        t0 = time.monotonic()
        assert sock.recv(1) == b""  # closed by --io-timeout 2
        assert 1 < time.monotonic() - t0 < 8
    assert client.contains(["slow@1"]) == [False]
    assert server.stats()["traffic"]["protocol_errors"]["timeout"] >= 1


def test_random_garbage_never_takes_the_server_down(server, client):
    rng = __import__("random").Random(1234)
    stop = time.monotonic() + 2
    survivors = []

    def keep_working():
        backend = LMBackend(server.url, timeout=5)
        i = 0
        while time.monotonic() < stop:
            value = os.urandom(rng.randrange(1, 50_000))
            backend.put([(f"w@{i}", value)])
            assert backend.get([f"w@{i}"]) == [value]
            i += 1
        survivors.append(i)
        backend.close()

    worker = threading.Thread(target=keep_working)
    worker.start()
    sent = 0
    while time.monotonic() < stop:
        with raw_connection(server) as sock:
            blob = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 600)))
            if rng.random() < 0.5:  # a valid-looking command with garbage around it
                blob = struct.pack("<ii", rng.randrange(1, 6), rng.randrange(-5, 5000)) + blob
            try:
                sock.sendall(blob)
                sock.shutdown(socket.SHUT_WR)
                sock.settimeout(3)
                while sock.recv(65536):
                    pass
            except OSError:
                pass  # the server may reset a connection it closed early
        sent += 1
    worker.join()
    assert sent > 20 and survivors and survivors[0] > 0
    assert server.alive()
    client.put([("post-fuzz@1", b"alive")])
    assert client.get(["post-fuzz@1"]) == [b"alive"]


def test_a_frame_is_cut_off_at_io_timeout_not_twice_it(spawn_server):
    """--io-timeout bounds a frame from its first byte: a header trickled a byte every
    0.2 s, and a GET whose reader stops reading an 8 MiB value, are closed within the
    timeout plus a little (before: up to twice it, each wait could run a whole timeout)."""
    server = spawn_server("--io-timeout", "1", "--max-memory", "16MiB", "--max-value-size", "16MiB")
    frame = wire.pack_request(wire.Command.GET, b"k@1")
    with raw_connection(server) as sock:
        sock.sendall(frame[:1])
        start = time.monotonic()
        closed = None
        for i in range(1, len(frame)):
            time.sleep(0.2)
            try:
                sock.sendall(frame[i : i + 1])
            except OSError:
                closed = time.monotonic() - start
                break
            sock.setblocking(False)
            try:
                if sock.recv(1) == b"":
                    closed = time.monotonic() - start
                    break
            except BlockingIOError:
                pass
            finally:
                sock.setblocking(True)
        assert closed is not None and closed < 1.6
    with raw_connection(server) as sock:
        sock.sendall(wire.pack_request(wire.Command.PUT, b"big@1", 8 << 20) + os.urandom(8 << 20))
        assert request(sock, wire.pack_request(wire.Command.EXIST, b"big@1")).code == 200
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(wire.pack_request(wire.Command.GET, b"big@1"))
        start = time.monotonic()
        deadline = start + 10
        while server.stats()["traffic"]["connections"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert time.monotonic() - start < 1.6
