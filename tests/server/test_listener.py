"""Connections as the listener admits them: TCP keepalive, the idle timeout, and a
connection whose thread cannot start."""

from __future__ import annotations

import contextlib
import resource
import socket
import time
from pathlib import Path

import pytest

from lmkv.backends import lm_wire as wire
from lmkv.backends.base import BackendError
from lmkv.backends.lm import LMBackend
from lmkv_server.arena import PageArena
from lmkv_server.config import ServerConfig
from lmkv_server.protocol import Connection
from lmkv_server.store import Store


def test_accepted_sockets_have_tcp_keepalive():
    config = ServerConfig(max_memory=1 << 20, prefault=False)
    store = Store(PageArena(config.num_pages, config.page_size, prefault=False))
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(
        server.getsockname(), timeout=5
    ):
        accepted, _ = server.accept()
        conn = Connection(accepted, store, config)
        option = conn.sock.getsockopt
        assert option(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert option(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 60
        assert option(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 10
        assert option(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 6
        accepted.close()
    store.arena.close()


def test_idle_connections_are_closed_after_idle_timeout(spawn_server):
    server = spawn_server("--max-memory", "1MiB", "--idle-timeout", "1")
    health = wire.pack_request(wire.Command.HEALTH, b"h")
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        for _ in range(6):  # a request every 0.3 s keeps the connection open
            sock.sendall(health)
            assert len(sock.recv(wire.RESPONSE_SIZE, socket.MSG_WAITALL)) == wire.RESPONSE_SIZE
            time.sleep(0.3)
        t0 = time.monotonic()
        sock.settimeout(10)
        assert sock.recv(1) == b""  # then closed by the server
        assert 0.5 < time.monotonic() - t0 < 8
    deadline = time.monotonic() + 10
    while (stats := server.stats()["traffic"])["connections"]:  # its thread ends a bit later
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    assert stats["idle_timeouts"] == 1 and stats["connections"] == 0
    assert "idle for 1.0s; closing" in server.log()
    backend = LMBackend(server.url)  # lmkv's client reconnects after an idle close
    assert backend.contains(["x@1"]) == [False]
    time.sleep(1.5)
    assert backend.contains(["x@1"]) == [False]
    backend.close()


def test_a_connection_whose_thread_cannot_start_frees_its_slot(spawn_server):
    server = spawn_server("--max-memory", "1MiB", "--max-connections", "1")
    pid = server.proc.pid
    status = Path(f"/proc/{pid}/status").read_text()
    vm_size = int(next(ln for ln in status.splitlines() if ln.startswith("VmSize:")).split()[1])
    unlimited = resource.prlimit(pid, resource.RLIMIT_AS)
    # 4 MiB of address space to spare: less than a thread stack (8 MiB by default)
    resource.prlimit(pid, resource.RLIMIT_AS, ((vm_size << 10) + (4 << 20), unlimited[1]))
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            assert sock.recv(1) == b""  # closed: no thread to serve it
    finally:
        resource.prlimit(pid, resource.RLIMIT_AS, unlimited)
    assert "can't start new thread" in server.log()
    assert server.stats()["traffic"]["connections"] == 0
    backend = LMBackend(server.url)  # the one connection slot is free
    assert backend.contains(["x@1"]) == [False]
    backend.close()


def test_a_port_in_use_is_a_clear_error_before_the_memory_is_touched(server_env):
    """Before: a traceback, after touching all of --max-memory."""
    import subprocess
    import sys

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "lmkv_server", "127.0.0.1", str(port),
                              "--max-memory", "8GiB"],  # pre-faulted by default
                             env=server_env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and time.monotonic() - start < 20
    assert out.stderr.strip().splitlines()[-1] == (
        f"lmkv_server: error: cannot listen on 127.0.0.1:{port}: Address already in use "
        "(is another lmkv_server running?)")
    assert "Traceback" not in out.stderr


def test_more_memory_than_the_machine_has_available_is_refused_by_name(server_env):
    """Before: the memory was mapped and touched page by page until the OOM killer ended the
    server (in a container of 200 MB with --max-memory 512MiB: killed, no message)."""
    import subprocess
    import sys

    from lmkv.host_memory import host_memory_available

    available = host_memory_available()
    assert available is not None
    out = subprocess.run([sys.executable, "-m", "lmkv_server", "127.0.0.1", "0", "--max-memory",
                          str(available + (1 << 30))], env=server_env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "more than this machine (or its container) has available" in out.stderr.splitlines()[-1]


def test_a_connection_is_refused_until_the_server_can_answer_it(server_env, tmp_path):
    """While the server touches its memory (made to take 3 s here), a client's connect is
    refused, so it counts the store as down and goes on; once the server is up, calls are
    answered (before: the kernel accepted the connection on the listening port and the
    client waited out its timeout). A second server started on the same port meanwhile
    listens first; the slow one then stops with the port-in-use error, no traceback."""
    import subprocess
    import sys

    from lmkv_server.launcher import free_port

    slow = tmp_path / "slow_server.py"
    slow.write_text(
        "import sys, time\n"
        "import lmkv_server.app as app\n"
        "class Slow(app.PageArena):\n"
        "    def __init__(self, *a, **k):\n"
        "        time.sleep(3)\n"
        "        super().__init__(*a, **k)\n"
        "app.PageArena = Slow\n"
        "from lmkv_server.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    port = free_port()
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, str(slow), "127.0.0.1", str(port),
                                 "--max-memory", "8MiB"], env=server_env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        client = LMBackend(f"lm://127.0.0.1:{port}", timeout=1.0)
        deadline, failed = time.monotonic() + 60, 0
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            start = time.monotonic()
            try:
                assert client.contains(["k"]) == [False]
                break
            except BackendError:
                assert time.monotonic() - start < 0.5  # at once, never a timeout
                failed += 1
                time.sleep(0.05)
        assert failed > 0  # it was asked while starting
        client.close()
        proc.terminate()
        proc.wait(timeout=30)
        with open(tmp_path / "slow.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, str(slow), "127.0.0.1", str(port),
                                     "--max-memory", "8MiB"], env=server_env, stdout=log,
                                    stderr=subprocess.STDOUT)
        time.sleep(0.5)  # (bound, touching its memory)
        fast = subprocess.Popen([sys.executable, "-m", "lmkv_server", "127.0.0.1", str(port),
                                 "--max-memory", "8MiB"], env=server_env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert proc.wait(timeout=30) == 1
            out = (tmp_path / "slow.log").read_text()
            assert (f"lmkv_server: error: cannot listen on 127.0.0.1:{port}: Address already in "
                    "use (is another lmkv_server running?)") in out and "Traceback" not in out
            assert fast.poll() is None  # the one that listened serves on
        finally:
            fast.terminate()
            fast.wait(timeout=30)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_an_admin_port_in_use_stops_the_start_instead_of_serving_half(server_env):
    """The admin port is bound with the lm:// port, before anything runs: a port in use
    ends the start with a clear error (before: the lm:// listener ran on without the admin
    server, and the process never exited)."""
    import subprocess
    import sys

    with socket.create_server(("127.0.0.1", 0)) as busy, socket.create_server(("127.0.0.1", 0)) as free:
        admin, port = busy.getsockname()[1], free.getsockname()[1]
        free.close()
        out = subprocess.run([sys.executable, "-m", "lmkv_server", "127.0.0.1", str(port),
                              "--max-memory", "8MiB", "--admin-port", str(admin)],
                             env=server_env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        f"lmkv_server: error: cannot listen on --admin-port 127.0.0.1:{admin}: Address already "
        "in use (is another lmkv_server running?)")


def test_misbehaving_clients_are_logged_once_a_minute_and_refusals_counted(spawn_server):
    """1000 GETs with a bad key, 50 unknown commands on new connections and 20 connections
    past --max-connections: a few log lines (before: one per frame or connection), each
    fault counted (refusals had no metric)."""
    import re

    server = spawn_server("--max-memory", "1MiB", "--max-connections", "2")

    def wait_for_connections(n: int) -> None:  # (the server's threads see closes a bit later)
        deadline = time.monotonic() + 20
        while server.stats()["traffic"]["connections"] != n:
            assert time.monotonic() < deadline, server.stats()["traffic"]
            time.sleep(0.01)

    bad_key = wire.REQUEST.pack(wire.Command.GET, 0, wire.Fmt.KV_2LTD, wire.DType.FLOAT16, 0,
                                *wire.NO_SHAPE, b"bad\x01key".ljust(wire.KEY_SIZE))
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(bad_key * 1000)
        got = 0
        while got < 1000 * wire.RESPONSE_SIZE:  # every one answered
            got += len(sock.recv(1 << 16))
    for _ in range(50):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(b"\xff" * wire.REQUEST_SIZE)
            with contextlib.suppress(ConnectionResetError):
                sock.recv(64)
        wait_for_connections(0)  # gone before the next: none of these is refused

    held = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(2)]
    wait_for_connections(2)
    for _ in range(20):
        with (socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock,
              contextlib.suppress(ConnectionResetError)):
            assert sock.recv(1) == b""  # closed by the server
    for sock in held:
        sock.close()
    deadline = time.monotonic() + 10
    while "refusing a connection" not in server.log():  # (written by the server's thread)
        assert time.monotonic() < deadline
        time.sleep(0.05)
    log = server.log()
    assert log.count("bad key") == 1 and log.count("unknown command") == 1
    assert log.count("refusing a connection") == 1
    metrics = server.admin("/metrics")
    assert re.search(r'lmkv_server_refused_connections_total\{reason="max_connections"\} 20', metrics)
    assert re.search(r'lmkv_server_protocol_errors_total\{kind="bad_key"\} 1000', metrics)


def test_a_low_open_file_limit_lowers_max_connections_so_clients_are_refused_not_hung(server_env):
    """Under a hard limit of 64 open files, --max-connections 1024 is lowered to what fits
    (with a warning), so the client past it is refused at once; before, accept failed with
    EMFILE and that client hung in the backlog. The admin port keeps at most 16 connections
    (the rest are closed at accept), so idle ones there cannot use the descriptors up."""
    import resource
    import subprocess
    import sys

    from lmkv_server.launcher import free_port

    port, admin = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmkv_server", "127.0.0.1", str(port), "--max-memory", "8MiB",
         "--no-prefault", "--admin-port", str(admin), "--max-connections", "1024"],
        env=server_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)))
    held = []
    try:
        deadline = time.monotonic() + 30
        while True:
            probe = LMBackend(f"lm://127.0.0.1:{port}")
            try:
                probe.health()
                break
            except BackendError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
            finally:
                probe.close()
        held += [socket.create_connection(("127.0.0.1", admin), timeout=5) for _ in range(40)]
        time.sleep(0.5)
        closed = 0
        for sock in held:
            sock.settimeout(0.2)
            with contextlib.suppress(TimeoutError):
                try:
                    closed += sock.recv(1) == b""
                except ConnectionResetError:
                    closed += 1
        assert closed >= 40 - 16
        held += [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(16)]
        late = LMBackend(f"lm://127.0.0.1:{port}", timeout=3)
        start = time.monotonic()
        with pytest.raises(BackendError):
            late.health()
        assert time.monotonic() - start < 2  # refused, not left to time out
    finally:
        for sock in held:
            sock.close()
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert "--max-connections lowered from 1024 to 16" in out
    assert "Traceback" not in out


def test_clients_that_drop_mid_frame_are_logged_once_a_minute(spawn_server):
    """30 clients that send half a header and reset the connection: one log line (before:
    one per connection, at INFO, unthrottled)."""
    import struct

    server = spawn_server("--max-memory", "1MiB")
    for _ in range(30):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        sock.sendall(wire.pack_request(wire.Command.GET, b"k")[:10])
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        time.sleep(0.02)
        sock.close()  # RST
    deadline = time.monotonic() + 10
    while server.stats()["traffic"]["connections"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    log = server.log()
    lines = [line for line in log.splitlines() if "connection error" in line or "inside a frame" in line]
    assert 1 <= len(lines) <= 2, log


def test_an_ipv6_address_is_served_and_a_name_that_does_not_resolve_is_a_clear_error(
        spawn_server, server_env):
    """The listening socket was IPv4 only: '::1' failed with 'Unknown error -9'."""
    import subprocess
    import sys

    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            pass
    except OSError:
        pytest.skip("no IPv6 loopback here")
    server = spawn_server("--max-memory", "8MiB", host="::1")
    backend = LMBackend(server.url)
    backend.put([("k@1", b"v" * 1000)])
    assert backend.get(["k@1"]) == [b"v" * 1000]
    backend.close()
    out = subprocess.run([sys.executable, "-m", "lmkv_server", "no-such-host.invalid", "1234",
                          "--max-memory", "8MiB"], env=server_env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and "Unknown error" not in out.stderr
    assert "cannot listen on no-such-host.invalid:1234: " in out.stderr.strip().splitlines()[-1]


def test_localhost_listens_on_its_ipv4_address_as_before(spawn_server):
    """A name resolving to ::1 and 127.0.0.1 listened on the first (often ::1): clients of
    lm://127.0.0.1 were refused."""
    server = spawn_server("--max-memory", "8MiB", host="localhost")
    backend = LMBackend(f"lm://127.0.0.1:{server.port}")
    backend.put([("k@1", b"v")])
    assert backend.get(["k@1"]) == [b"v"]
    backend.close()
