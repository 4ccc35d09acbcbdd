"""--persist-dir: contents survive restarts, corrupt files are skipped."""

from __future__ import annotations

import contextlib
import os
import resource
import time

import pytest

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


def test_a_second_server_on_the_same_persist_dir_is_refused(spawn_server, tmp_path):
    """Two servers persisting into one directory (an overlapping restart on another port)
    would delete each other's files: the second is refused at start, naming the directory;
    once the first has stopped, a new one takes the directory."""
    persist = tmp_path / "p"
    first = spawn_server("--max-memory", "4MiB", "--persist-dir", str(persist))
    with pytest.raises(RuntimeError, match=f"--persist-dir {persist} is in use by another process"):
        spawn_server("--max-memory", "4MiB", "--persist-dir", str(persist))
    assert first.stop() == 0
    spawn_server("--max-memory", "4MiB", "--persist-dir", str(persist))


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


def _put(store, key: bytes, n: int) -> None:
    pages = store.reserve(n)
    for seg in store.arena.segments(pages, n):
        seg[:] = b"v" * len(seg)
    store.commit(key, n, 4, 6, (n, 0, 0, 0), pages)


def test_the_write_queue_holds_no_key_that_left_without_a_file(tmp_path):
    """Keys evicted before the writer reached them leave nothing to write nor delete: the
    queue stays within the store's keys and the files' keys (it grew with every key ever
    stored while the writer fell behind). An evicted key that has a file is queued, and
    its file deleted."""
    from pathlib import Path

    from lmkv_server.arena import PageArena
    from lmkv_server.persistence import Persister
    from lmkv_server.store import Store

    store = Store(PageArena(8, 64 << 10, prefault=False), policy="lru")
    persister = Persister(Path(tmp_path), store)
    store.set_listener(persister.mark)  # the writer is not started: it has fallen behind
    for i in range(1000):
        _put(store, b"k%d" % i, 1000)
    assert persister.pending <= 8
    persister._sync(b"k999")  # as the writer does: a file for a held key
    assert persister.path_for(b"k999").exists()
    for i in range(1000, 1010):
        _put(store, b"k%d" % i, 1000)  # k999 is evicted
    persister.start()
    assert persister.flush(10)
    assert not persister.path_for(b"k999").exists()
    assert sorted(p.name for p in tmp_path.glob("*.kv")) == sorted(
        persister.path_for(b"k%d" % i).name for i in range(1002, 1010))
    persister.stop(10)


def test_a_reload_into_less_memory_deletes_the_files_that_did_not_fit(tmp_path):
    """Restarted with a smaller --max-memory, the values that do not fit (the oldest) are
    not loaded and their files go: they stayed on disk, never evicted, read again at every
    start (157 files, 21 MB, over an 8 MiB store), and disk use no longer followed memory."""
    import os
    from pathlib import Path

    from lmkv_server.arena import PageArena
    from lmkv_server.persistence import Persister
    from lmkv_server.store import Store

    store = Store(PageArena(16, 64 << 10, prefault=False))
    writer = Persister(Path(tmp_path), store)
    for i in range(8):
        _put(store, b"k%d" % i, 200_000)  # 4 pages each: all 16
        writer._sync(b"k%d" % i)
        os.utime(writer.path_for(b"k%d" % i), ns=(i * 10**9, i * 10**9))  # k7 the newest
    smaller = Store(PageArena(8, 64 << 10, prefault=False))
    reader = Persister(Path(tmp_path), smaller)
    result = reader.load()
    assert (result.loaded, result.no_room) == (2, 6)
    assert sorted(p.name for p in tmp_path.glob("*.kv")) == sorted(
        reader.path_for(b"k%d" % i).name for i in (6, 7))
    assert reader.files_deleted == 6


def test_a_reload_that_cannot_read_a_file_gives_its_pages_back(tmp_path, monkeypatch):
    """A read error in one persisted file (a bad sector) skips that file and returns the
    pages reserved for it; a directory or link named like a temporary file is left alone."""
    import errno
    from pathlib import Path

    import lmkv_server.persistence as persistence
    from lmkv_server.arena import PageArena
    from lmkv_server.store import Store

    store = Store(PageArena(16, 64 << 10, prefault=False))
    writer = persistence.Persister(Path(tmp_path), store)
    for key in (b"good", b"bad"):
        _put(store, key, 300_000)
        writer._sync(key)
    (tmp_path / "snapshot.tmp").mkdir()
    bad = str(writer.path_for(b"bad"))
    real_open = open

    class Failing:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def __getattr__(self, name):
            return getattr(self.f, name)

        def readinto(self, view):
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(persistence, "open", lambda path, *a, **k: (
        Failing(real_open(path, *a, **k)) if str(path) == bad else real_open(path, *a, **k)),
        raising=False)
    again = Store(PageArena(16, 64 << 10, prefault=False))
    result = persistence.Persister(Path(tmp_path), again).load()
    assert (result.loaded, result.unreadable, result.corrupt) == (1, 1, 0)
    again.check_integrity()
    assert (tmp_path / "snapshot.tmp").is_dir() and (tmp_path / bad).exists()  # (maybe transient)


def test_a_reload_deletes_corrupt_files_and_leaves_those_that_are_not_its(tmp_path, caplog):
    """Corrupt files were skipped and left, read and warned about at every start for good
    (10,000 files of a format bump: 10,000 warnings a start); any *.tmp was deleted and any
    *.kv read as a value file. Corrupt ones are deleted (their key is lost anyway), another
    format version's left with one line, files not named as values left alone."""
    import logging
    from pathlib import Path

    from lmkv_server.arena import PageArena
    from lmkv_server.persistence import MAGIC, Persister
    from lmkv_server.store import Store

    store = Store(PageArena(16, 64 << 10, prefault=False))
    writer = Persister(Path(tmp_path), store)
    for key in (b"good", b"cut", *(b"v2-%d" % i for i in range(5))):
        _put(store, key, 1000)
        writer._sync(key)
    cut = writer.path_for(b"cut")
    cut.write_bytes(cut.read_bytes()[:-10])
    _put(store, b"zeroed", 1000)
    writer._sync(b"zeroed")
    zeroed = writer.path_for(b"zeroed")  # a header lost (a power loss): corrupt, not foreign
    zeroed.write_bytes(bytes(64) + zeroed.read_bytes()[64:])
    for i in range(5):  # as a later format would write them
        path = writer.path_for(b"v2-%d" % i)
        path.write_bytes(MAGIC[:-1] + b"\x02" + path.read_bytes()[len(MAGIC):])
    theirs = ["notes.kv", "download.tmp", "ab.kv.tmp"]
    for name in theirs:
        (tmp_path / name).write_bytes(b"theirs")
    with caplog.at_level(logging.WARNING):
        result = Persister(Path(tmp_path), Store(PageArena(16, 64 << 10, prefault=False))).load()
    assert result == (1, 2, 0, 0, 5, 3), result
    assert not cut.exists() and not zeroed.exists()
    assert all(writer.path_for(b"v2-%d" % i).exists() for i in range(5))
    assert all((tmp_path / name).exists() for name in theirs)
    assert sum("another format version" in r.message for r in caplog.records) == 1


def test_a_second_signal_stops_a_server_whose_persist_writes_hang(server_env, tmp_path):
    """A persist directory whose writes hang (an NFS mount gone) held the stop for ever: the
    stop waited for the flush, and a second SIGTERM did nothing. Now the stop says what is
    pending, and a second signal ends the process at once, saying what was not written.
    (The hang is made in the server process by a sitecustomize module: every write waits
    until the process ends.)"""
    import signal
    import subprocess

    from lmkv_server.launcher import ServerProcess

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import threading\n"
        "from lmkv_server import persistence\n"
        "def _sync(self, key):\n"
        "    threading.Event().wait()\n"
        "persistence.Persister._sync = _sync\n")
    env = {**server_env, "PYTHONPATH": f"{hook}{os.pathsep}{server_env.get('PYTHONPATH', '')}"}
    log = tmp_path / "server.log"
    server = ServerProcess("--persist-dir", str(tmp_path / "store"), "--max-memory", "16MiB",
                           env=env, log_path=log).start()
    try:
        backend = LMBackend(server.url)
        backend.put([("first@1", b"x" * 1000), ("next@1", b"y" * 1000)])
        assert backend.get(["next@1"]) == [b"y" * 1000]
        backend.close()
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while "pending values" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(1)
        assert server.proc.poll() is None  # still flushing: the write hangs
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(5) == 1
        text = log.read_text()
        assert "writing 2 pending values" in text and "again stops without them" in text
        assert "stopped at a second signal: 2 values not persisted" in text
    finally:
        server.kill()


def test_a_reload_ranks_what_it_loaded_before_serving(tmp_path):
    """The policy is told of the reloaded values at the end of the reload, before the
    server listens, not by the first request after it (which then held the store's lock
    for all of them: 1.4 s for 200,000 values), still the oldest first."""
    from pathlib import Path

    from lmkv_server.arena import PageArena
    from lmkv_server.persistence import Persister
    from lmkv_server.store import Store

    store = Store(PageArena(8, 64 << 10, prefault=False), policy="lru")
    writer = Persister(Path(tmp_path), store)
    for i in range(4):
        _put(store, b"k%d" % i, 1000)
        writer._sync(b"k%d" % i)
        os.utime(writer.path_for(b"k%d" % i), ns=(i * 10**9, i * 10**9))  # k3 the newest
    again = Store(PageArena(4, 64 << 10, prefault=False), policy="lru")
    assert Persister(Path(tmp_path), again).load().loaded == 4
    told = []
    real = again._policy.inserted
    again._policy.inserted = lambda key, parent: told.append(key) or real(key, parent)
    _put(again, b"new", 1000)  # evicts the oldest file's value
    assert told == ["new"]
    assert sorted(again.keys()) == [b"k1", b"k2", b"k3", b"new"]


def test_a_full_disk_is_told_once_a_minute_also_for_keys_that_had_a_file(tmp_path, monkeypatch,
                                                                          caplog):
    """From a review: each failed rewrite of a key that had a file also logged "removed ...:
    the newer value ... could not be written", unthrottled: a line per PUT of an existing
    key while the disk is full (engines saving the same prefix)."""
    import errno
    import logging
    from pathlib import Path

    import lmkv_server.persistence as persistence
    from lmkv_server.arena import PageArena
    from lmkv_server.store import Store

    store = Store(PageArena(64, 64 << 10, prefault=False))
    writer = persistence.Persister(Path(tmp_path), store)
    keys = [b"k%d" % i for i in range(50)]
    for key in keys:
        _put(store, key, 1000)
        writer._sync(key)  # each has its file
    real_open = open

    def full_disk(path, *a, **k):
        if str(path).endswith(persistence.TMP_SUFFIX):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, *a, **k)

    monkeypatch.setattr(persistence, "open", full_disk, raising=False)
    store.set_listener(writer.mark)
    writer.start()
    with caplog.at_level(logging.WARNING):
        for key in keys:  # the same keys put again
            _put(store, key, 1000)
        assert writer.flush(10)
    writer.stop(10)
    assert writer.errors == len(keys) and writer.files_deleted == len(keys)
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) <= 2, f"{len(lines)} lines for one full disk"


def test_a_link_planted_in_the_persist_dir_is_never_written_through(tmp_path):
    """The temporary file's name follows from the key, which a client picks: a link put
    there (another user, a shared directory) made the server overwrite the link's target
    with a value the client chose. Links are not followed, files are created 0600, and a
    directory others may write into is refused at start."""
    import os
    import stat
    from pathlib import Path

    from lmkv_server.arena import PageArena
    from lmkv_server.persistence import TMP_SUFFIX, Persister
    from lmkv_server.store import Store

    target = tmp_path / "victim.txt"
    target.write_text("ORIGINAL")
    persist = tmp_path / "p"
    store = Store(PageArena(8, 64 << 10, prefault=False))
    writer = Persister(Path(persist), store)
    assert writer.unsafe() is None and stat.S_IMODE(persist.stat().st_mode) == 0o700
    path = writer.path_for(b"evil")
    os.symlink(target, path.with_name(path.name + TMP_SUFFIX))
    _put(store, b"evil", 1000)
    writer._sync(b"evil")
    assert target.read_text() == "ORIGINAL"
    assert path.is_file() and not path.is_symlink()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    persist.chmod(0o775)  # a group's volume: its choice
    assert writer.unsafe() is None
    persist.chmod(0o777)
    assert "may be written by anyone (mode 777)" in writer.unsafe()
