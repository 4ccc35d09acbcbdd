"""--max-memory holds while clients write three times that."""

from __future__ import annotations

import os
import threading

from lmkv.backends.lm import LMBackend

CAP = 8 << 20
VALUE = 256 << 10


def test_lru_eviction_keeps_memory_under_cap(spawn_server):
    server = spawn_server("--max-memory", str(CAP), "--page-size", "64KiB")
    peaks = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            peaks.append(server.stats()["used_bytes"])

    def write(worker: int):
        backend = LMBackend(server.url)
        for i in range(3 * CAP // VALUE // 4):
            backend.put([(f"ev@{worker}@{i}", os.urandom(VALUE))])
        backend.contains(["sync"])  # a round trip: every PUT before it was processed
        backend.close()

    watcher = threading.Thread(target=watch)
    watcher.start()
    writers = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    done.set()
    watcher.join()

    stats = server.stats()
    assert stats["capacity_bytes"] == CAP
    assert max(peaks + [stats["used_bytes"]]) <= CAP
    assert stats["entries"] == CAP // VALUE  # full, to the page
    assert stats["evictions"] == 3 * CAP // VALUE - stats["entries"]
    assert stats["traffic"]["bytes_in"] == 3 * CAP
    # LRU order: after CAP more bytes from one client, exactly its keys remain
    backend = LMBackend(server.url)
    fresh = [f"fresh@{i}" for i in range(CAP // VALUE)]
    backend.put([(key, bytes([i]) * VALUE) for i, key in enumerate(fresh)])
    assert backend.contains(fresh) == [True] * len(fresh)
    assert backend.contains([f"ev@{w}@{i}" for w in range(4) for i in range(24)]) == [False] * 96
    assert backend.get(fresh[-1:]) == [bytes([len(fresh) - 1]) * VALUE]
    assert server.stats()["used_bytes"] == CAP


def test_value_above_cap_is_refused_without_crash(spawn_server, tmp_path):
    """Each is counted; the log says so once a minute (a line per PUT flooded it)."""
    server = spawn_server("--max-memory", "1MiB", "--max-value-size", "4MiB")
    backend = LMBackend(server.url)
    backend.put([("small@1", b"kept")])
    for i in range(20):  # drained and dropped: no reply in lm://
        backend.put([(f"huge@{i}", os.urandom(2 << 20))])
    assert backend.get(["huge@1", "small@1"]) == [None, b"kept"]
    stats = server.stats()
    assert stats["traffic"]["dropped"]["too_large"] == 20
    assert stats["used_bytes"] <= stats["capacity_bytes"] and server.alive()
    assert (tmp_path / "server-0.log").read_text().count("too_large") == 1


def test_empty_values_count_against_the_cap(spawn_server):
    server = spawn_server("--max-memory", "1MiB", "--page-size", "64KiB")  # 16 pages
    backend = LMBackend(server.url)
    backend.put([(f"empty@{i}", b"") for i in range(100)])
    assert backend.get(["empty@99", "empty@0"]) == [b"", None]
    stats = server.stats()
    assert stats["entries"] == 16 and stats["evictions"] == 84
    assert stats["used_bytes"] == stats["capacity_bytes"] == 1 << 20
    backend.close()


def test_an_empty_put_is_stored_without_waiting_for_the_next_frame(spawn_server):
    """An empty value's PUT waited for a first payload byte, which was the next frame's: a
    client that closed after it lost the value, one that went quiet had it unseen by others
    until --io-timeout closed its connection as a protocol error."""
    import socket
    import time

    from lmkv.backends import lm_wire as wire
    from lmkv.backends.lm import lmcache_key

    server = spawn_server("--io-timeout", "2", "--max-memory", "16MiB")
    other = LMBackend(server.url, timeout=5)
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(wire.pack_request(wire.Command.PUT, lmcache_key("empty@closed").encode(), 0))
    quiet = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    quiet.sendall(wire.pack_request(wire.Command.PUT, lmcache_key("empty@quiet").encode(), 0))
    deadline = time.monotonic() + 1.5
    while other.contains(["empty@closed", "empty@quiet"]) != [True, True]:
        assert time.monotonic() < deadline, "an empty value's PUT was not stored"
        time.sleep(0.05)
    assert other.get(["empty@closed", "empty@quiet"]) == [b"", b""]
    time.sleep(2.5)  # past --io-timeout: the quiet connection sent whole frames only
    assert server.stats()["traffic"]["protocol_errors"]["timeout"] == 0
    quiet.close()
    other.close()


def test_a_put_that_stops_early_evicts_about_what_it_sent(spawn_server):
    """A full cache: another client's PUT that announces 4 MiB and then disconnects after
    its header (or after part of its payload) evicts no value for the bytes it never sent;
    while such a PUT stalls, other clients' PUTs are still stored."""
    import socket
    import time

    from lmkv.backends import lm_wire as wire

    server = spawn_server("--max-memory", str(CAP), "--page-size", "64KiB",
                          "--max-value-size", "8MiB", "--io-timeout", "5")
    backend = LMBackend(server.url)
    keys = [f"victim@{i}" for i in range(CAP // VALUE)]
    for i, key in enumerate(keys):
        backend.put([(key, bytes([i]) * VALUE)])
    assert backend.contains(keys) == [True] * len(keys)

    def truncated_put(sent: int, stall: float = 0.3) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        sock.sendall(wire.pack_request(wire.Command.PUT, b"evil@1", 4 << 20) + b"x" * sent)
        time.sleep(stall)
        return sock

    truncated_put(0).close()  # a header alone
    assert backend.contains(keys) == [True] * len(keys)
    truncated_put(VALUE).close()  # a quarter MiB of payload: about that is evicted
    assert sum(backend.contains(keys)) >= len(keys) - 3
    stalled = truncated_put(0, stall=0)
    backend.put([("legit@1", b"L" * VALUE)])
    assert backend.get(["legit@1"]) == [b"L" * VALUE]
    stalled.close()
    assert server.stats()["evictions"] <= 4
    backend.close()


def test_a_stalled_put_holds_no_free_memory_that_other_puts_need(spawn_server):
    """Half the memory free: a PUT announcing all of it that stalls after its header holds
    none of it (before, it took every free page at once), so another client's PUT of the
    same size is stored without evicting anything."""
    import socket
    import time

    from lmkv.backends import lm_wire as wire

    server = spawn_server("--max-memory", str(CAP), "--page-size", "64KiB",
                          "--max-value-size", "8MiB", "--io-timeout", "5")
    backend = LMBackend(server.url)
    keys = [f"kept@{i}" for i in range(CAP // VALUE // 2)]
    for i, key in enumerate(keys):
        backend.put([(key, bytes([i]) * VALUE)])
    half = CAP - len(keys) * VALUE
    stalled = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    stalled.sendall(wire.pack_request(wire.Command.PUT, b"stalled@1", half))
    time.sleep(0.3)
    assert server.stats()["used_bytes"] == len(keys) * VALUE
    backend.put([("legit@1", b"L" * half)])
    assert backend.get(["legit@1"]) == [b"L" * half]
    assert backend.contains(keys) == [True] * len(keys) and server.stats()["evictions"] == 0
    stalled.close()
    backend.close()


def test_a_client_that_stops_reading_its_get_holds_the_value_seconds_not_io_timeout(spawn_server):
    """A GET's value cannot be evicted while it is sent: a client that asks for a large value
    and reads none of it is cut off after 5 s without progress (it held the value for all of
    io_timeout, 30 s, and every PUT that needed its room was dropped meanwhile)."""
    import socket
    import time

    from lmkv.backends import lm_wire as wire
    from lmkv.backends.lm import lmcache_key

    server = spawn_server("--max-memory", "64MiB")
    backend = LMBackend(server.url, timeout=30)
    backend.put([("big@1", b"z" * (48 << 20))])
    assert backend.contains(["big@1"]) == [True]
    reader = socket.create_connection(("127.0.0.1", server.port))
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reader.sendall(wire.pack_request(wire.Command.GET, lmcache_key("big@1").encode()))
    time.sleep(1)
    start, stored = time.monotonic(), None
    while time.monotonic() - start < 20:
        backend.put([("new@1", b"n" * (32 << 20))])  # needs big@1's room
        if backend.contains(["new@1"]) == [True]:
            stored = time.monotonic() - start
            break
        time.sleep(0.5)
    reader.close()
    backend.close()
    assert stored is not None and stored < 8, stored
    assert "its reader took none of a reply for 5s" in server.log()
