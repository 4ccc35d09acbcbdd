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
    next lookup, counted to its cap and evicted in turn. An unreadable file that cannot be
    deleted is not taken in again after it failed once."""
    import builtins
    import errno
    from pathlib import Path

    server = DiskBackend(tmp_path, capacity_bytes=3000)
    writer = DiskBackend(tmp_path, capacity_bytes=3000)
    writer.put([("a", b"x" * 1000), ("b", b"y" * 1000)])
    assert server.contains(["a", "b", "c"]) == [True, True, False]
    assert server.get(["b"]) == [b"y" * 1000] and server.used == 2000
    server.put([("d", b"z" * 1500)])  # over the cap: one of the adopted files goes
    assert server.used <= 3000 and server.num_evictions == 1
    writer.put([("e", b"w" * 10)])
    bad = str(tmp_path / server._name("e"))
    real_open, real_unlink = builtins.open, Path.unlink

    def refusing_open(path, *args, **kwargs):
        if str(path) == bad:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, *args, **kwargs)

    def refusing_unlink(path, *args, **kwargs):
        if str(path) == bad:
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refusing_open)
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
