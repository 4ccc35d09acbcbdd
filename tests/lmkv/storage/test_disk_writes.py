"""The disk tier's writes under crashes and full disks: a file is renamed into place only
with every byte in it, a failed write leaves nothing behind, and a temporary file is never
shared by two writers (engines in containers sharing a volume can have the same pid)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import pytest

from lmkv.backends import disk as disk_module
from lmkv.backends.base import BackendError
from lmkv.backends.disk import DiskBackend


def run(script: str, status: int = 0) -> str:
    """``script``'s output, run in a new interpreter that must exit with ``status``."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == status, out.stdout + out.stderr
    return out.stdout + out.stderr


@pytest.mark.parametrize("size", [1000, 2 << 20])
def test_a_process_killed_right_after_the_rename_leaves_the_whole_file(tmp_path, size):
    """(Python's write buffer was flushed at close, after the rename: a small value was a
    0-byte file under the key's name then.)"""
    run(f"""
        import os
        from lmkv.backends import disk
        real = os.replace
        def replace(src, dst):
            real(src, dst)
            os._exit(9)  # killed right after the rename (SIGKILL, the OOM killer)
        disk.os.replace = replace
        disk.DiskBackend({str(tmp_path)!r}, 1 << 30).put([("k", bytes(range(256)) * {size // 256})])
    """, status=9)  # (it did die at the rename: a write that renames another way fails here)
    again = DiskBackend(tmp_path, 1 << 30)
    assert again.get(["k"]) == [bytes(range(256)) * (size // 256)]


@pytest.mark.parametrize("size, limit", [(1000, 100), (2 << 20, (2 << 20) - 100)])
def test_a_disk_that_fills_during_a_write_leaves_no_file_behind(tmp_path, size, limit):
    """A write cut short by a full disk (RLIMIT_FSIZE fails write(2) as ENOSPC does) fails
    before the rename; within a buffer's last 8 KiB it used to fail at close, after the
    rename, leaving a torn file the index did not count (over the tier's cap)."""
    out = run(f"""
        import resource, signal
        from lmkv.backends.base import BackendError
        from lmkv.backends.disk import DiskBackend
        d = DiskBackend({str(tmp_path)!r}, 1 << 30)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
        try:
            d.put([("k", bytes({size}))])
            print("stored")
        except BackendError as e:
            print("failed:", e, d.used)
    """)
    assert "failed:" in out and out.strip().endswith(" 0"), out
    assert not list(tmp_path.iterdir())


def test_a_temporary_file_of_the_same_name_is_never_written_into(tmp_path, monkeypatch):
    """Two engines in containers sharing the directory, both PID 1, once named their n-th
    write's temporary alike: the second truncated the first's file, which then renamed an
    empty file into place. Names carry random bytes and are created exclusively."""
    d = DiskBackend(tmp_path, 1 << 20)
    monkeypatch.setattr(disk_module, "_tmp_ids", itertools.count())
    monkeypatch.setattr(disk_module.os, "urandom", lambda n: b"\0" * n)
    name = DiskBackend._name("k")
    theirs = tmp_path / f".{name}.0-{'00' * 4}.{os.getpid()}.tmp"  # another writer's, mid-write
    theirs.write_bytes(b"their bytes")
    with pytest.raises(BackendError):
        d.put([("k", b"mine")])
    assert theirs.read_bytes() == b"their bytes" and d.used == 0
    d.put([("k", b"mine")])  # the next write's name is another
    assert d.get(["k"]) == [b"mine"]


def test_files_another_process_writes_into_the_directory_are_found_and_counted(tmp_path, monkeypatch):
    """Two processes on one disk-tier directory (`engine precompute` beside a running
    server): what one writes after the other built its index is found by the other at its
    next lookup, counted to its cap once read and evicted in turn. An unreadable file that cannot be
    deleted is not taken in again after it failed once."""
    import errno
    from pathlib import Path

    server = DiskBackend(tmp_path, capacity_bytes=3000)
    writer = DiskBackend(tmp_path, capacity_bytes=3000)
    writer.put([("a", b"x" * 1000), ("b", b"y" * 1000)])
    assert server.contains(["a", "b", "c"]) == [True, True, False]
    assert server.used == 0  # a lookup takes nothing in (it runs beside the I/O thread)
    assert server.get(["a", "b"]) == [b"x" * 1000, b"y" * 1000] and server.used == 2000
    server.put([("d", b"z" * 1500)])  # over the cap: one of the adopted files goes
    assert server.used <= 3000 and server.num_evictions == 1
    writer.put([("e", b"w" * 10)])
    bad = str(tmp_path / server._name("e"))
    real_open, real_unlink = disk_module._open, Path.unlink

    def refusing_open(path):
        if str(path) == bad:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path)

    def refusing_unlink(path, *args, **kwargs):
        if str(path) == bad:
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(disk_module, "_open", refusing_open)
    monkeypatch.setattr(Path, "unlink", refusing_unlink)
    assert server.get(["e"]) == [None] and server.num_unreadable == 1
    assert server.contains(["e"]) == [False]  # not taken in again


def test_a_tier_started_with_a_smaller_cap_says_how_many_files_it_deleted(tmp_path, caplog):
    """A lowered cap (or a process with a smaller one on a shared directory) deletes files at
    start: a warning says how many, and the tier's eviction metric counts them."""
    from lmkv.metrics import LMKVMetrics
    from lmkv.storage.tier import Tier

    DiskBackend(tmp_path, capacity_bytes=10_000).put([(f"k{i}", b"x" * 1000) for i in range(9)])
    with caplog.at_level("WARNING"):
        small = DiskBackend(tmp_path, capacity_bytes=3000)
    assert len(list(tmp_path.glob("*.kv"))) == 3 and small.num_evictions == 6
    assert "6 files (least recently used first) deleted at start" in caplog.text
    metrics = LMKVMetrics()
    Tier("disk", small, "raw", metrics=metrics)
    assert metrics.registry.get_sample_value("lmkv_evictions_total", {"tier": "disk"}) == 6


def test_a_lookup_beside_a_write_counts_the_file_once(tmp_path):
    """A lookup (the engine's scheduling thread) runs beside the I/O thread's write: it
    finds the file renamed into place but not yet indexed, and leaves it to the write (it
    took it in too, and the tier's bytes were counted twice for good)."""
    import threading

    from lmkv.storage.tier import Tier

    found = []

    class Disk(DiskBackend):
        def _write(self, name, value):
            super()._write(name, value)  # in place, not yet in the index
            lookup = threading.Thread(target=lambda: found.append(tier.contains(["k"])))
            lookup.start()
            lookup.join()

    disk = Disk(tmp_path, 1 << 20, direct=False)
    tier = Tier("disk", disk, "raw")
    disk.put([("k", b"v" * 1088)])
    assert found == [[True]]
    assert disk.used == 1088 and disk.index == {disk._name("k"): 1088}


def _in_thread(fn, timeout: float = 10.0):
    """``fn()``'s result, failing the test if it has not returned within ``timeout``."""
    import threading

    out: list = []
    worker = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    worker.start()
    worker.join(timeout)
    assert out, f"did not return within {timeout} s"
    return out[0]


def test_a_fifo_or_link_in_the_directory_hangs_nothing(tmp_path):
    """Anything another process puts in a shared directory: a FIFO (opening one for reading
    waits for a writer), named as a temporary file or swapped in for a chunk's file, or a
    link. Start, lookups and reads go on; a chunk whose file is not a regular file is a
    miss."""
    os.mkfifo(tmp_path / "x.tmp")
    os.symlink("/dev/zero", tmp_path / ".y.1.1.tmp")
    disk = _in_thread(lambda: DiskBackend(tmp_path, 1 << 20, direct=False))
    disk.put([("k", b"v" * 100), ("l", b"w" * 100)])
    name = disk._name("k")
    os.mkfifo(tmp_path / "fifo")
    os.replace(tmp_path / "fifo", tmp_path / name)
    os.symlink(tmp_path / name, tmp_path / "link")
    os.replace(tmp_path / "link", tmp_path / disk._name("l"))
    assert _in_thread(lambda: disk.get_into_many(["k", "l"], [memoryview(bytearray(4096))] * 2)) \
        == [None, None]
    disk.put([("k", b"v" * 100)])
    os.mkfifo(tmp_path / "fifo")
    os.replace(tmp_path / "fifo", tmp_path / name)
    assert _in_thread(lambda: disk.get(["k"])) == [None]
    assert disk.num_unreadable == 3
    other = DiskBackend(tmp_path / "other", 1 << 20)
    os.mkfifo(tmp_path / "other" / other._name("m"))
    assert _in_thread(lambda: other.contains(["m"])) == [False]  # not a chunk's file
    assert _in_thread(lambda: other.get(["m"])) == [None]


def test_a_file_another_process_rewrote_larger_is_read_whole_not_deleted(tmp_path):
    """Two engines on one directory: one rewrites a key with a larger frame (a coded tier, a
    recompute) after the other indexed it. The other reads the file as it is now (it read
    the size it had indexed: a short frame, which its tier then deleted as corrupt)."""
    a = DiskBackend(tmp_path, 1 << 20)
    b = DiskBackend(tmp_path, 1 << 20)
    a.put([("k", b"A" * 1000)])
    b.put([("k", b"B" * 3000)])
    out = bytearray(8192)
    assert a.get_into_many(["k"], [memoryview(out)]) == [3000] and out[:3000] == b"B" * 3000
    assert a.used == 3000
    b.put([("k", b"C" * 6000)])  # larger than the reader's buffer: a miss, left in place
    assert a.get_into_many(["k"], [memoryview(bytearray(4096))]) == [None]
    assert (tmp_path / a._name("k")).stat().st_size == 6000 and a.used == 6000


def _dir_bytes(path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.name.endswith(".kv"))


def test_processes_sharing_a_directory_hold_about_one_cap_between_them(tmp_path, monkeypatch):
    """The docs promise a directory shared by processes with one cap holds about one cap,
    but each counted only the files it wrote or read: two writing different chunks filled
    it to two caps (N engines, N caps: the volume full). A write counts the directory
    again when RESCAN_SECONDS have passed (0 here)."""
    monkeypatch.setattr(disk_module, "RESCAN_SECONDS", 0.0)
    monkeypatch.setattr(disk_module, "RESCAN_RATIO", 0)
    a, b = DiskBackend(tmp_path, capacity_bytes=1000), DiskBackend(tmp_path, capacity_bytes=1000)
    for i in range(10):
        a.put([(f"a{i}", b"x" * 100)])
    for i in range(10):
        b.put([(f"b{i}", b"y" * 100)])
    assert _dir_bytes(tmp_path) <= 1000 and b.used <= 1000, (_dir_bytes(tmp_path), b.used)
    assert b.get(["b9"]) == [b"y" * 100]  # the newest stay
    a.put([("a10", b"z" * 100)])  # a forgets its files b deleted, and deletes one of b's
    assert a.used <= 1000 and a.num_evictions == 1, (a.used, a.num_evictions)
    assert _dir_bytes(tmp_path) <= 1000


def test_a_file_another_process_deleted_is_not_counted_an_eviction(tmp_path):
    """lmkv_evictions_total{tier="disk"} counted the files another process sharing the
    directory had deleted already, when this one's policy picked them."""
    a, b = DiskBackend(tmp_path, capacity_bytes=1000), DiskBackend(tmp_path, capacity_bytes=1000)
    b.put([(f"b{i}", b"y" * 100) for i in range(5)])
    assert a.get([f"b{i}" for i in range(5)]) == [b"y" * 100] * 5 and a.used == 500
    b.remove([f"b{i}" for i in range(5)])
    a.put([(f"a{i}", b"x" * 100) for i in range(8)])  # over its cap by 300: b's files picked
    assert a.num_evictions == 0 and a.used == 1000, (a.num_evictions, a.used)  # 2 gone ones left


def test_a_full_file_system_below_the_cap_makes_room_instead_of_failing_every_write(tmp_path,
                                                                                   monkeypatch):
    """Two processes on one volume of 3000 bytes, each capped at 2000 (below the free space
    at start, so no warning): once the other filled its cap, every write of this one failed
    with 'no space' for good, its tier at half its cap and never evicting."""
    import errno

    real = DiskBackend._write

    def volume_of_3000(self, name, value):
        if _dir_bytes(tmp_path) + len(value) > 3000:
            raise BackendError("disk tier write failed") from OSError(errno.ENOSPC, "No space left")
        return real(self, name, value)

    monkeypatch.setattr(DiskBackend, "_write", volume_of_3000)
    a, b = DiskBackend(tmp_path, capacity_bytes=2000), DiskBackend(tmp_path, capacity_bytes=2000)
    for i in range(20):
        b.put([(f"b{i}", b"y" * 100)])
    for i in range(20):
        a.put([(f"a{i}", b"x" * 100)])  # raised BackendError from the 11th on
    assert a.get(["a19"]) == [b"x" * 100] and _dir_bytes(tmp_path) <= 3000


def test_a_dead_writers_temporary_is_deleted_while_the_tier_runs(tmp_path, monkeypatch):
    """A process killed mid-write beside a running one left its temporary file (tens of MB,
    counted to no cap) until some process started on the directory again; a live writer's
    (locked) is kept."""
    import fcntl
    import time

    monkeypatch.setattr(disk_module, "RESCAN_SECONDS", 0.0)
    d = DiskBackend(tmp_path, capacity_bytes=1000)
    name = DiskBackend._name("x")  # as _write names its temporaries
    dead, live = (tmp_path / f".{name}.0-{'00' * 4}.999999999.tmp",
                  tmp_path / f".{name}.1-{'00' * 4}.999999998.tmp")
    dead.write_bytes(b"partial")
    with open(live, "wb") as writer:
        fcntl.flock(writer.fileno(), fcntl.LOCK_EX)
        for path in (dead, live):
            os.utime(path, (time.time() - 600, time.time() - 600))
        d.put([("k", b"v")])
        assert not dead.exists() and live.exists()


def test_files_that_are_not_the_tiers_are_left_alone(tmp_path, caplog):
    """Every *.tmp not locked was deleted at start (a name without a pid read as a dead
    writer's, even one written a second ago) and every *.kv indexed, counted to the cap and
    evicted: local_disk pointed at a shared directory, or at lmkv_server's --persist-dir,
    deleted other programs' files. Only the tier's own names are its files; the others are
    counted in the start line."""
    import logging

    mine = DiskBackend(tmp_path, capacity_bytes=10_000)
    mine.put([("k", b"v" * 100)])
    others = ["thesis.kv", "download.part.tmp", "backup.20240101.tmp", "0123.kv"]
    for name in others:
        (tmp_path / name).write_bytes(b"theirs" * 600)
    with caplog.at_level(logging.INFO, logger="lmkv.backends.disk"):
        d = DiskBackend(tmp_path, capacity_bytes=10_000)
    assert d.used == 100 and "4 files that are not lmkv chunks left alone" in caplog.text
    d.put([("big", b"x" * 9_950)])  # evicts "k" only
    assert all((tmp_path / name).exists() for name in others)
    assert d.get(["big", "k"]) == [b"x" * 9_950, None]


def test_chunk_files_are_private_and_a_world_writable_directory_is_warned_about(tmp_path, caplog):
    """Files took the umask's mode (-rw-r--r--: any local user read every prompt's KV) and a
    directory anyone may write into (the examples' /tmp paths, created first by another
    user) was taken silently: they could plant chunks this engine serves."""
    import logging
    import stat

    d = DiskBackend(tmp_path / "new", capacity_bytes=1000)
    d.put([("k", b"v")])
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "new" / DiskBackend._name("k")).stat().st_mode) == 0o600
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    with caplog.at_level(logging.WARNING, logger="lmkv.backends.disk"):
        DiskBackend(shared, capacity_bytes=1000)
    assert "may be written by other users" in caplog.text


def test_a_full_disk_retry_over_another_processs_copy_counts_it_once(tmp_path, monkeypatch):
    """The rescan after 'no space' took in another process's file of the very chunk being
    written, and the retried write counted it again: used drifted above the bytes on disk
    for good (the tier then evicted real chunks for phantom bytes)."""
    import errno

    a, other = DiskBackend(tmp_path, capacity_bytes=5000), DiskBackend(tmp_path, capacity_bytes=5000)
    a.put([(f"a{i}", b"x" * 1000) for i in range(4)])
    other.put([("k", b"y" * 1000)])
    real, failed = DiskBackend._write, []

    def full_once(self, name, value):
        if not failed:
            failed.append(name)
            raise BackendError("disk tier write failed") from OSError(errno.ENOSPC, "No space left")
        return real(self, name, value)

    monkeypatch.setattr(DiskBackend, "_write", full_once)
    a.put([("k", b"z" * 1000)])
    assert a.used == sum(a.index.values()) == _dir_bytes(tmp_path), (a.used, _dir_bytes(tmp_path))
    assert a.get(["k"]) == [b"z" * 1000]
