"""--persist-dir: contents survive restarts, corrupt files are skipped."""

from __future__ import annotations

import os
import resource
import time

from lmkv.backends.lm import LMBackend


def wait_flushed(server, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while server.stats()["persist"]["pending"]:
        assert time.monotonic() < deadline, "persistence did not catch up"
        time.sleep(0.05)


def test_values_survive_graceful_restart_and_corrupt_file_is_skipped(spawn_server, tmp_path):
    persist = tmp_path / "store"
    server = spawn_server("--persist-dir", str(persist), "--max-memory", "16MiB")
    values = {f"p@{i}": os.urandom(100_000 + i) for i in range(6)}
    backend = LMBackend(server.url)
    backend.put(list(values.items()))
    backend.put([("p@0", b"overwritten")])
    values["p@0"] = b"overwritten"
    # PUT has no reply: a request answered on the same connection proves the PUTs before it
    # were read (else a loaded machine can restart the server with them still in the socket)
    assert backend.get(["p@0"]) == [b"overwritten"]
    backend.close()
    server.restart()  # SIGTERM flushes what is pending

    backend = LMBackend(server.url)
    assert backend.get(list(values)) == list(values.values())
    files = sorted(persist.glob("*.kv"))
    assert len(files) == 6 and not list(persist.glob("*.tmp"))

    # flip one byte in one file's payload and truncate another
    victim, cut = files[0], files[1]
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0xFF
    victim.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:-1])
    server.restart()
    log = server.log()
    assert "checksum mismatch" in log and "does not match its header" in log
    backend = LMBackend(server.url)
    got = backend.get(list(values))
    assert sum(v is None for v in got) == 2
    assert all(v is None or v == values[k] for k, v in zip(values, got, strict=True))
    assert server.stats()["entries"] == 4


def test_kill_9_after_flush_loses_nothing_and_eviction_deletes_files(spawn_server, tmp_path):
    persist = tmp_path / "store"
    server = spawn_server("--persist-dir", str(persist), "--max-memory", "1MiB")
    backend = LMBackend(server.url)
    for i in range(8):  # 8 x 256 KiB into 1 MiB: the first four are evicted
        backend.put([(f"k@{i}", bytes([i]) * (256 << 10))])
    backend.contains(["sync"])
    wait_flushed(server)
    assert len(list(persist.glob("*.kv"))) == 4
    server.kill()
    server.start()
    backend = LMBackend(server.url)
    got = backend.get([f"k@{i}" for i in range(8)])
    # four survive (mostly the newest: an entry pinned by the writer is skipped by
    # eviction), each byte-exact
    kept = [i for i, v in enumerate(got) if v is not None]
    assert len(kept) == 4 and 7 in kept
    assert all(got[i] == bytes([i]) * (256 << 10) for i in kept)


def test_a_failed_write_leaves_no_file_for_its_key(spawn_server, tmp_path):
    # a full disk (here: a 64 KiB file-size limit on the server process) must leave
    # neither a partial file nor the key's older value to come back at the next start
    persist = tmp_path / "store"
    server = spawn_server("--persist-dir", str(persist), "--max-memory", "4MiB")
    backend = LMBackend(server.url)
    backend.put([("f@1", b"old value"), ("f@2", b"kept")])
    backend.contains(["sync"])
    wait_flushed(server)
    assert len(list(persist.glob("*.kv"))) == 2

    pid = server.proc.pid
    unlimited = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (64 << 10, unlimited[1]))
    try:
        new = os.urandom(256 << 10)
        backend.put([("f@1", new)])
        assert backend.get(["f@1"]) == [new]  # served from memory all the same
        wait_flushed(server)
    finally:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, unlimited)
    assert not list(persist.glob("*.tmp"))
    assert len(list(persist.glob("*.kv"))) == 1
    assert server.stats()["persist"]["errors"] == 1
    assert "could not be written" in server.log()
    backend.close()

    server.restart()
    backend = LMBackend(server.url)
    assert backend.get(["f@1", "f@2"]) == [None, b"kept"]
    backend.close()
