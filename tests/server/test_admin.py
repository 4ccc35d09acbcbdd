from __future__ import annotations

import contextlib
import socket
import time

import httpx
import pytest

from lmkv.backends.lm import LMBackend


def test_health_metrics_stats(spawn_server):
    server = spawn_server("--max-memory", "4MiB")
    backend = LMBackend(server.url)
    backend.put([("a@1", b"x" * 1000)])
    assert backend.get(["a@1", "b@1"]) == [b"x" * 1000, None]

    base = f"http://127.0.0.1:{server.admin_port}"
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}

    stats = httpx.get(f"{base}/stats").json()
    assert stats["entries"] == 1 and stats["stored_bytes"] == 1000
    assert stats["capacity_bytes"] == 4 << 20 and stats["used_bytes"] == stats["page_size"]
    traffic = stats["traffic"]
    assert traffic["requests"]["PUT"] == 1 and traffic["requests"]["GET"] == 2
    assert traffic["hits"] == 1 and traffic["misses"] == 1 and traffic["connections"] == 1

    response = httpx.get(f"{base}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    samples = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in response.text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples["lmkv_server_entries"] == 1
    assert samples["lmkv_server_memory_capacity_bytes"] == 4 << 20
    assert samples['lmkv_server_requests_total{command="get"}'] == 2
    assert samples["lmkv_server_get_hits_total"] == 1
    assert samples["lmkv_server_received_bytes_total"] == 1000
    assert samples["lmkv_server_open_connections"] == 1
    assert not any(name.startswith("python_gc") for name in samples)  # private registry
    backend.close()


def test_non_loopback_bind_warns_about_missing_auth(spawn_server):
    server = spawn_server("--max-memory", "1MiB", host="0.0.0.0")
    assert "no authentication" in server.log()
    loopback = spawn_server("--max-memory", "1MiB")
    assert "no authentication" not in loopback.log()


def test_allow_list_refuses_other_clients(spawn_server):
    server = spawn_server("--max-memory", "1MiB", "--allow", "10.0.0.0/8")
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        assert sock.recv(1) == b""  # closed at once: 127.0.0.1 is not allowed
    assert "not in --allow" in server.log()


def test_max_connections(spawn_server):
    server = spawn_server("--max-memory", "1MiB", "--max-connections", "2")
    first = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(2)]
    deadline = time.monotonic() + 5
    while server.stats()["traffic"]["connections"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as third:
        assert third.recv(1) == b""  # refused at accept
    for sock in first:
        sock.close()
    while server.stats()["traffic"]["connections"]:
        assert time.monotonic() < deadline + 5
        time.sleep(0.05)
    backend = LMBackend(server.url)  # slots free again
    assert backend.contains(["x@1"]) == [False]


def test_a_request_head_that_never_completes_frees_its_admin_connection(spawn_server):
    """A client that sends part of a request head and stalls is closed after the keep-alive
    timeout (5 s) from its first byte, more bytes or not (uvicorn alone held it for ever:
    16 such clients would have shut the admin port); a whole request still gets its answer,
    also one sent slowly in parts within the time."""
    server = spawn_server("--max-memory", "4MiB")
    addr = ("127.0.0.1", server.admin_port)
    stalled = socket.create_connection(addr, timeout=10)
    dribbled = socket.create_connection(addr, timeout=10)
    slow = socket.create_connection(addr, timeout=10)
    start = time.monotonic()
    stalled.sendall(b"G")
    dribbled.sendall(b"GE")
    slow.sendall(b"GET /health HTTP/1.1\r\n")
    time.sleep(2)
    dribbled.sendall(b"T /he")  # more bytes do not move the deadline
    slow.sendall(b"Host: x\r\n\r\n")
    assert b"200 OK" in slow.recv(4096)
    for sock in (stalled, dribbled):
        assert sock.recv(1) == b""  # closed by the server
        assert 4 < time.monotonic() - start < 9
    assert httpx.get(f"http://127.0.0.1:{server.admin_port}/health").json() == {"status": "ok"}
    for sock in (stalled, dribbled, slow):
        sock.close()



def _stalled_reader(port: int) -> socket.socket:
    """An admin client that sends many requests and reads none of the answers, until the
    server's send buffer for it is full."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    requests = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 2000
    sent, deadline = 0, time.monotonic() + 10
    while sent < len(requests) and time.monotonic() < deadline:
        try:
            sent += sock.send(requests[sent:])
        except BlockingIOError:
            time.sleep(0.05)
    return sock


def test_admin_clients_that_stop_reading_are_cut_off_and_hold_no_stop(spawn_server, tmp_path):
    """An admin client that stops reading its answers is cut off 5 s after its send buffer
    filled (it held its connection for good: 16 such held every admin connection, /health
    refused, the server restarted by its supervisor), and a SIGTERM meanwhile stops the
    server within seconds, persisting what it holds (uvicorn waited for their responses for
    ever, and a second signal did nothing)."""
    import signal

    server = spawn_server("--max-memory", "16MiB", "--persist-dir", str(tmp_path / "p"))
    backend = LMBackend(server.url)
    backend.put([("a@1", b"x" * 1000)])
    assert backend.get(["a@1"]) == [b"x" * 1000]
    backend.close()
    stalled = _stalled_reader(server.admin_port)
    deadline = time.monotonic() + 30
    with pytest.raises(ConnectionResetError):
        while time.monotonic() < deadline:
            with contextlib.suppress(BlockingIOError):
                stalled.send(b"\r\n")  # (fails once the server has cut it off)
            time.sleep(0.2)
    stalled.close()
    stalled = _stalled_reader(server.admin_port)
    time.sleep(1)
    server.proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    try:
        assert server.proc.wait(15) == 0
    finally:
        stalled.close()
    assert time.monotonic() - start < 10
    assert list((tmp_path / "p").glob("*.kv"))
