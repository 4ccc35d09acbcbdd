"""Keys, the memory pool, the hot cache, the codec frame and the disk tier."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from lmkv.backends.base import BackendError
from lmkv.backends.disk import DiskBackend
from lmkv.codec import FrameError, decode_into, encode
from lmkv.keys import KeyScope, prefix_hashes
from lmkv.layout import KVLayout
from lmkv.memory import MemoryPool
from lmkv.policy import POLICIES
from lmkv.storage.hot_cache import HotCache
from lmkv.storage.tier import Tier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, chunk_size=4)


def test_chained_hashes_name_whole_prefixes():
    a = prefix_hashes(list(range(12)), 4)
    b = prefix_hashes(list(range(8)) + [99, 9, 10, 11], 4)
    c = prefix_hashes([0, 1, 2, 99] + list(range(4, 12)), 4)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert a[0] != c[0] and a[1] != c[1]  # a change in chunk 0 changes every later key
    assert len(prefix_hashes(list(range(7)), 4)) == 1  # only full chunks


def test_scopes_never_share_keys():
    h = prefix_hashes(list(range(4)), 4)[0]
    base = KeyScope("model-a", LAYOUT)
    others = [
        KeyScope("model-b", LAYOUT),
        KeyScope("model-a", KVLayout(2, 2, 8, torch.bfloat16, 4)),
        KeyScope("model-a", KVLayout(2, 2, 8, torch.float32, 4, rank=1, world_size=2)),
        KeyScope("model-a", LAYOUT, namespace="tenant-1"),
    ]
    keys = {base.key(h)} | {s.key(h) for s in others}
    assert len(keys) == 5 and all(len(k) <= 150 and k.isascii() for k in keys)


def test_pool_refcounts_and_integrity():
    pool = MemoryPool(LAYOUT, 3 * (64 + LAYOUT.chunk_bytes))
    bufs = [pool.allocate() for _ in range(3)]
    assert pool.allocate() is None
    bufs[0].retain()
    bufs[0].release()
    assert pool.num_free == 0
    for b in bufs:
        b.release()
    pool.check_integrity()
    assert pool.num_free == 3
    with pytest.raises(AssertionError):
        bufs[0].release()


def test_a_pinned_pool_locks_its_own_size_and_unlocks_it(monkeypatch):
    """On a GPU host the pool is page-locked at its size (torch's pinned allocator rounds
    up to a power of two: a 40 GiB pool would lock 64 GiB), and unlocked with the pool. A
    failed lock is an error naming the key to lower. (CUDA's calls recorded here.)"""
    import gc

    calls = []

    class Cudart:
        fail = False

        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("lock", ptr, size))
            return 2 if self.fail else 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unlock", ptr))
            return 0

    cudart = Cudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    slot = 64 + LAYOUT.chunk_bytes
    pool = MemoryPool(LAYOUT, 3 * slot, pin=True)
    (op, ptr, size), = calls
    assert op == "lock" and size == 3 * slot + 4096  # (+ alignment), not a power of two
    assert ptr <= pool.storage.data_ptr() < ptr + size
    del pool
    gc.collect()
    assert calls[-1] == ("unlock", ptr)
    cudart.fail = True  # (a ValueError: engine serve says it as its error, no traceback)
    with pytest.raises(ValueError, match="cannot pin that much memory; lower max_local_cpu_size"):
        MemoryPool(LAYOUT, 3 * slot, pin=True)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_hot_cache_never_evicts_a_referenced_chunk(policy):
    pool = MemoryPool(LAYOUT, 2 * (64 + LAYOUT.chunk_bytes))
    hot = HotCache(pool, policy)
    a, b = hot.allocate(), hot.allocate()
    hot.put("a", a)
    hot.put("b", b)
    b.release()  # "b" is held by the cache only; "a" also by us
    c = hot.allocate()  # evicts b, the only unreferenced entry, though a is older
    assert c is not None and hot.contains("a") and not hot.contains("b")
    assert hot.allocate() is None  # a (ours) and c (ours) are both referenced
    for x in (a, c):
        x.release()
    hot.clear()
    pool.check_integrity()
    assert pool.num_free == 2


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_frame_round_trip_and_rejections(codec):
    pool = MemoryPool(LAYOUT, 2 * (64 + LAYOUT.chunk_bytes))
    src, dst = pool.allocate(), pool.allocate()
    src.kv.copy_(torch.randn(LAYOUT.chunk_shape))
    frame = bytes(encode(src, "k1", codec))
    decode_into(frame, dst, "k1")
    assert torch.equal(src.kv, dst.kv)
    flipped = bytearray(frame)
    flipped[len(frame) // 2] ^= 0x40
    for bad, why in [(bytes(flipped), "checksum|decode"), (frame[:-7], "truncated"),
                     (frame[:20], "truncated"), (b"\0" * len(frame), "not an lmkv frame")]:
        with pytest.raises(FrameError, match=why):
            decode_into(bad, dst, "k1")
    with pytest.raises(FrameError, match="another key"):
        decode_into(frame, dst, "k2")
    other = MemoryPool(KVLayout(2, 2, 8, torch.float16, 4), 64 + LAYOUT.chunk_bytes).allocate()
    with pytest.raises(FrameError, match="expected"):
        decode_into(frame, other, "k1")


def test_disk_tier_survives_restart_and_respects_its_cap(tmp_path):
    disk = DiskBackend(tmp_path, capacity_bytes=300)
    disk.put([("a", b"x" * 100), ("b", b"y" * 100)])
    assert disk.get(["a", "b", "c"]) == [b"x" * 100, b"y" * 100, None]
    disk.get(["a"])  # a is now most recently used
    disk.put([("c", b"z" * 150)])  # must evict b (LRU) to fit
    assert disk.contains(["a", "b", "c"]) == [True, False, True]
    assert disk.used <= 300
    _temp(tmp_path, _dead_pid()).write_bytes(b"partial")  # a crashed write
    again = DiskBackend(tmp_path, capacity_bytes=300)
    assert again.get(["a", "c"]) == [b"x" * 100, b"z" * 150]
    assert not list(tmp_path.glob("*.tmp"))
    out = bytearray(200)
    assert again.get_into("c", memoryview(out)) == 150 and out[:150] == b"z" * 150
    with pytest.raises(BackendError, match="exceeds"):
        again.put([("big", b"0" * 400)])
    smaller = DiskBackend(tmp_path, capacity_bytes=160)  # restart with a lower cap evicts
    assert smaller.used <= 160


@pytest.mark.parametrize("read", ["get", "get_into_many"])
def test_a_restart_evicts_by_last_use_not_last_write(tmp_path, read):
    """Files read since they were written count as used at the read: a restarted tier that
    must shrink evicts the one written later but never read."""
    disk = DiskBackend(tmp_path, capacity_bytes=300)
    disk.put([("a", b"x" * 100), ("b", b"y" * 100)])
    for age, key in ((200, "a"), (100, "b")):  # a written before b
        path = tmp_path / DiskBackend._name(key)
        os.utime(path, (path.stat().st_atime - age, path.stat().st_mtime - age))
    if read == "get":
        assert disk.get(["a"]) == [b"x" * 100]
    else:
        assert disk.get_into_many(["a"], [memoryview(bytearray(100))]) == [100]
    smaller = DiskBackend(tmp_path, capacity_bytes=150)
    assert smaller.contains(["a", "b"]) == [True, False]


def _temp(root, pid: int, n: int = 0):
    """A write's temporary file, named as the disk tier names them."""
    return root / f".{DiskBackend._name('t')}.{n}-{'00' * 4}.{pid}.tmp"


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_disk_tier_keeps_the_temporaries_of_a_live_writer(tmp_path):
    """Another process writing into the same directory (a second rank or engine) keeps its
    in-flight temporaries at this one's start; a dead writer's are removed."""
    live, dead = _temp(tmp_path, os.getppid()), _temp(tmp_path, _dead_pid(), 1)
    live.write_bytes(b"being written")
    dead.write_bytes(b"partial")
    DiskBackend(tmp_path, capacity_bytes=300)
    assert live.exists() and not dead.exists()


def test_a_writer_in_another_pid_namespace_keeps_its_temporaries(tmp_path, monkeypatch):
    """Engines in containers sharing a volume are all PID 1: a live write is told by the
    lock its writer holds, not by the pid in its name; an unlocked temporary of a live pid
    counts as a dead writer's once it is old."""
    locked = _temp(tmp_path, os.getpid())  # as another container's PID 1 names it
    stale = _temp(tmp_path, os.getppid(), 1)
    with open(locked, "wb") as writer:
        fcntl.flock(writer.fileno(), fcntl.LOCK_EX)
        stale.write_bytes(b"partial")
        os.utime(stale, (time.time() - 600, time.time() - 600))
        DiskBackend(tmp_path, capacity_bytes=300)
        assert locked.exists() and not stale.exists()
    DiskBackend(tmp_path, capacity_bytes=300)  # the lock is gone: a dead writer's
    assert not locked.exists()
    real_replace, renamed = os.replace, []

    def replace(src, dst):  # a write's temporary is locked up to its rename
        fd = os.open(src, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        renamed.append(src)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    disk = DiskBackend(tmp_path, capacity_bytes=300)
    disk.put([("k", b"x" * 10)])
    assert renamed and disk.get(["k"]) == [b"x" * 10] and not list(tmp_path.glob("*.tmp"))


def test_a_directory_whose_leftovers_cannot_be_touched_still_starts(tmp_path, monkeypatch, caplog):
    """A dead writer's temporary that cannot be deleted, or a file that cannot be examined
    (a read-only volume, another owner's files): the tier starts, warns and indexes the rest;
    a directory that cannot be listed is a clear error."""
    DiskBackend(tmp_path, capacity_bytes=300).put([("a", b"x" * 10)])
    tmp = _temp(tmp_path, _dead_pid())
    tmp.write_bytes(b"partial")
    real_unlink = os.unlink

    def refuse(path, *args, **kwargs):
        if str(path) == str(tmp):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refuse)
    with caplog.at_level(logging.WARNING, logger="lmkv.backends.disk"):
        disk = DiskBackend(tmp_path, capacity_bytes=300)
    assert disk.get(["a"]) == [b"x" * 10] and tmp.exists()
    assert "leaving" in caplog.text and tmp.name in caplog.text
    monkeypatch.setattr(os, "scandir", lambda _: (_ for _ in ()).throw(
        PermissionError(errno.EACCES, "Permission denied")))
    with pytest.raises(BackendError, match="cannot list"):
        DiskBackend(tmp_path, capacity_bytes=300)


def test_a_disk_that_refuses_deletes_fails_the_tier_not_the_caller(tmp_path, monkeypatch):
    """Read-only or unwritable (EROFS, EACCES): a write that must evict, or the removal of a
    corrupt chunk, is a BackendError, so the tier logs, counts and backs off; the files it
    could not delete stay counted, and a removed one is never offered again (before, a
    corrupt chunk stayed a hit: read, rejected and recomputed at every use)."""
    disk = DiskBackend(tmp_path, capacity_bytes=250)
    tier = Tier("disk", disk)
    assert tier.write("a", memoryview(b"x" * 100)) and tier.write("b", memoryview(b"y" * 100))
    real = Path.unlink

    def refuse(self, missing_ok=False):
        if self.parent == tmp_path:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)
    assert not tier.write("c", memoryview(b"z" * 100))  # must evict: refused, not raised
    assert tier.metrics.errors.labels("disk", "put")._value.get() == 1
    assert disk.used == sum(f.stat().st_size for f in tmp_path.glob("*.kv")) == 200
    with pytest.raises(BackendError, match="cannot delete"):
        disk.remove(["a"])
    assert disk.contains(["a", "b"]) == [False, True] and disk.used == 200
    assert disk.get(["a", "b"]) == [None, b"y" * 100]
    assert disk.get_into_many(["a"], [memoryview(bytearray(100))]) == [None]
    monkeypatch.setattr(Path, "unlink", real)
    disk.put([("c", b"z" * 100)])  # deletes work again: the file is evicted in its turn
    assert disk.used <= 250 and disk.contains(["c"]) == [True]
    assert disk.used == sum(f.stat().st_size for f in tmp_path.glob("*.kv"))


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_delete_refused_once_does_not_stop_the_tiers_writes(tmp_path, monkeypatch, policy):
    """An eviction whose delete fails (EIO, EBUSY) leaves the file counted and known to the
    cache policy: later writes evict as usual, that file included, and the cap holds. Before,
    the prefix policies had given the file up as a victim: it was never offered again, and
    once eviction needed it every write failed for the rest of the run."""
    disk = DiskBackend(tmp_path, capacity_bytes=350, policy=policy)
    disk.put([(k, b"x" * 100) for k in "abc"])
    real = Path.unlink
    refused = []

    def refuse_once(self, missing_ok=False):
        if self.parent == tmp_path and not refused:
            refused.append(self.name)
            raise OSError(errno.EIO, "Input/output error", str(self))
        return real(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse_once)
    with pytest.raises(BackendError, match="cannot delete"):
        disk.put([("d", b"y" * 100)])
    assert refused and disk.used == 300 and len(disk.index) == 3
    for i in range(12):  # every old file must go in turn, the refused one too
        disk.put([(f"n{i}", b"z" * 100)])
        assert disk.used <= 350 and disk.used == sum(f.stat().st_size for f in tmp_path.glob("*.kv"))
    assert disk.contains(["a", "b", "c"]) == [False, False, False]
    assert disk.contains(["n9", "n10", "n11"]) == [True, True, True]


def test_a_read_only_directory_fuller_than_the_cap_is_still_read(tmp_path, monkeypatch, caplog):
    """Start-up over a directory that holds more than this cap and refuses deletes (a lowered
    cap, a shared read-only volume): the tier starts, says so, and serves what it holds."""
    DiskBackend(tmp_path, capacity_bytes=1000).put([(k, b"x" * 100) for k in "abcd"])
    monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: (_ for _ in ()).throw(
        OSError(errno.EROFS, "Read-only file system", str(self))))
    with caplog.at_level("WARNING"):
        disk = DiskBackend(tmp_path, capacity_bytes=250)
    assert "above its cap" in caplog.text and "cannot shrink" in caplog.text
    assert disk.get(["a", "d"]) == [b"x" * 100, b"x" * 100]


def test_a_failed_overwrite_leaves_no_older_value(tmp_path, monkeypatch):
    """A key rewritten with a new value that cannot be written (disk full) is gone, now and
    after a restart, rather than left with its older value."""
    disk = DiskBackend(tmp_path, capacity_bytes=1000)
    disk.put([("a", b"old" * 10)])
    real_open = open

    def full(path, *args, **kwargs):
        if str(path).endswith(".tmp"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", full)
    with pytest.raises(BackendError, match="write failed"):
        disk.put([("a", b"new" * 10)])
    monkeypatch.undo()
    assert disk.contains(["a"]) == [False] and disk.used == 0
    assert DiskBackend(tmp_path, capacity_bytes=1000).get(["a"]) == [None]


def test_a_removed_disk_directory_is_recreated(tmp_path, caplog):
    """The tier's directory removed under a running engine (by hand, a cleanup job): the
    chunks in it are misses, and the next write recreates the directory and starts the
    index afresh, instead of every later save failing."""
    import shutil

    root = tmp_path / "kv"
    disk = DiskBackend(root, capacity_bytes=1000)
    disk.put([("a", b"x" * 100), ("b", b"y" * 100)])
    shutil.rmtree(root)
    assert disk.get(["a"]) == [None]
    disk.put([("c", b"z" * 100)])
    assert "directory was removed" in caplog.text
    assert root.is_dir() and disk.used == 100 and disk.contains(["b", "c"]) == [False, True]
    assert disk.get(["c"]) == [b"z" * 100]
    assert DiskBackend(root, capacity_bytes=1000).get(["c"]) == [b"z" * 100]


def test_disk_tier_batched_reads(tmp_path):
    """The disk tier's batch read (which first asks the kernel to read ahead every file of
    the batch) returns what get_into does, misses included; a file removed behind the
    tier's back is a miss it forgets."""
    from tests.backend_checks import check_batched_reads

    disk = DiskBackend(tmp_path, capacity_bytes=1 << 20)
    check_batched_reads(disk, [memoryview(bytearray(8192)) for _ in range(3)])
    (tmp_path / disk._name("batch-a")).unlink()
    assert disk.get_into_many(["batch-a", "batch-b"], [memoryview(bytearray(8192))] * 2) == [None, 8192]
    assert not disk.contains(["batch-a"])[0]


def test_disk_tier_reads_a_batch_side_by_side_into_the_right_buffers(tmp_path):
    """A batch larger than the reader threads: every value lands in its own buffer, one
    that does not fit is a miss, and a hint for any keys never raises."""
    from lmkv.backends.disk import READERS

    disk = DiskBackend(tmp_path, capacity_bytes=1 << 22)
    n = 3 * READERS + 1
    values = [bytes([i]) * (1000 + 37 * i) for i in range(n)]
    disk.put([(f"v{i}", v) for i, v in enumerate(values)])
    disk.will_get([f"v{i}" for i in range(n)] + ["absent"])
    outs = [memoryview(bytearray(2000)) for _ in range(n)]
    outs[2] = memoryview(bytearray(10))  # too small for its value
    got = disk.get_into_many([f"v{i}" for i in range(n)], outs)
    assert got[2] is None
    for i in (j for j in range(n) if j != 2):
        assert got[i] == len(values[i]) and bytes(outs[i][: got[i]]) == values[i]
    readers = list(disk._pool._threads)
    disk.close()
    assert readers and not any(t.is_alive() for t in readers)


@pytest.mark.parametrize("batched", [True, False])
def test_a_file_that_cannot_be_read_is_a_miss_and_leaves_the_tier(tmp_path, monkeypatch, caplog,
                                                                     batched):
    """One unreadable file (a directory in its place, a bad block) is a miss: the rest of
    its batch is served, the file leaves the index (no later lookup finds it, so no later
    batch fails on it), it is counted and logged. An error of the tier itself (too many
    open files) still fails the batch, for the breaker, and keeps every file."""
    disk = DiskBackend(tmp_path, capacity_bytes=1 << 22)
    disk.put([(k, k.encode() * 100) for k in ("v0", "v1", "v2")])

    def read(keys):
        if batched:
            outs = [memoryview(bytearray(1000)) for _ in keys]
            return [None if n is None else bytes(o[:n]) for o, n in
                    zip(outs, disk.get_into_many(keys, outs), strict=True)]
        return disk.get(keys)

    (tmp_path / disk._name("v1")).unlink()
    (tmp_path / disk._name("v1")).mkdir()  # EISDIR
    assert read(["v0", "v1", "v2"]) == [b"v0" * 100, None, b"v2" * 100]
    assert disk.contains(["v0", "v1", "v2"]) == [True, False, True]
    assert disk.num_unreadable == 1 and "cannot read" in caplog.text

    def fail_reads(code: int, message: str) -> None:
        def fail(*args, **kwargs):
            error = OSError(code, message)
            if batched:  # a reader thread's result
                return error
            raise error

        if batched:
            monkeypatch.setattr(DiskBackend, "_read", fail)
        else:  # the module's open
            monkeypatch.setattr("lmkv.backends.disk._open", fail)

    fail_reads(errno.EIO, "Input/output error")
    assert read(["v0"]) == [None]
    assert disk.contains(["v0", "v2"]) == [False, True] and disk.num_unreadable == 2
    assert not (tmp_path / disk._name("v0")).exists()  # deleted: the next write starts afresh
    fail_reads(errno.EMFILE, "Too many open files")
    with pytest.raises(BackendError, match="disk tier read failed"):
        read(["v2"])
    assert disk.contains(["v2"]) == [True] and disk.num_unreadable == 2
    monkeypatch.undo()
    assert read(["v2"]) == [b"v2" * 100]
    disk.close()


def test_a_disk_tier_reads_no_file_larger_than_a_frame(tmp_path):
    """A file larger than any frame its reader takes (another program's, a value rewritten
    under the name) is never claimed by a lookup nor read into memory; it stays counted for
    the cap, and the policy evicts it like any other."""
    disk = DiskBackend(tmp_path, capacity_bytes=1 << 20, max_value_bytes=100)
    disk.put([("ok", b"a" * 100)])
    (tmp_path / disk._name("big")).write_bytes(b"b" * 5000)
    (tmp_path / disk._name("grew")).write_bytes(b"c" * 50)
    disk = DiskBackend(tmp_path, capacity_bytes=1 << 20, max_value_bytes=100)
    assert disk.used == 5150
    assert disk.contains(["ok", "big", "grew"]) == [True, False, True]
    (tmp_path / disk._name("grew")).write_bytes(b"c" * 5000)  # after it was indexed
    assert disk.get(["ok", "big", "grew"]) == [b"a" * 100, None, None]
    outs = [memoryview(bytearray(8192)) for _ in range(2)]
    assert disk.get_into_many(["ok", "big"], outs) == [100, None]
    disk.capacity = 200
    disk.put([("new", b"n" * 100)])  # evicts the least recently used: the large file
    assert not (tmp_path / disk._name("big")).exists()


def test_disk_writes_of_one_key_from_two_tiers_never_share_a_temporary(tmp_path, monkeypatch):
    """Two tiers of one process over one directory (two engines in a process) writing the
    same key at once each write their own temporary file."""
    import builtins

    opened = []
    real = builtins.open

    def record(path, mode="r", *args, **kwargs):
        if "w" in mode or "x" in mode:
            opened.append(str(path))
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", record)
    a, b = DiskBackend(tmp_path, 1 << 20), DiskBackend(tmp_path, 1 << 20)
    a.put([("k", b"x" * 10)])
    b.put([("k", b"y" * 10)])
    temporaries = [p for p in opened if p.endswith(".tmp") and ".probe." not in p]
    assert len(temporaries) == 2 and len(set(temporaries)) == 2
    assert all(f".{os.getpid()}.tmp" in p for p in temporaries)  # the writer, for a restart


def test_batched_loads_stop_at_the_first_missing_or_corrupt_chunk(tmp_path):
    """A run of chunks is read from a tier in batches; the hit ends at the first chunk no
    tier has or that arrives corrupt, chunks read beyond it are not handed out, and every
    reference is given back."""
    from lmkv.metrics import LMKVMetrics
    from lmkv.storage.manager import LOAD_BATCH, StorageManager, Tier

    n = 2 * LOAD_BATCH + 3
    pool = MemoryPool(LAYOUT, (n + 2) * (64 + LAYOUT.chunk_bytes))
    manager = StorageManager(pool, [Tier("disk", DiskBackend(tmp_path / "disk", 1 << 30))],
                             LMKVMetrics())
    keys = [f"k{i}" for i in range(n)]
    for key in keys:
        buf = manager.allocate()
        buf.kv.copy_(torch.randn(buf.kv.shape))
        manager.put(key, buf)
        buf.release()
    manager.io.drain()
    want = {}
    for key in keys:
        buf = manager.hot.get(key)
        want[key] = buf.kv.clone()
        buf.release()
    disk = manager.tiers[0].backend
    for missing, cut in ((n, None), (LOAD_BATCH + 2, "remove"), (3, "corrupt")):
        manager.hot.clear()
        if cut == "remove":
            disk.remove([keys[missing]])
        elif cut == "corrupt":
            data = bytearray(disk.get([keys[missing]])[0])
            data[-1] ^= 0xFF
            disk.put([(keys[missing], bytes(data))])
        bufs = manager.fetch(keys)
        assert len(bufs) == missing
        for key, buf in zip(keys[:missing], bufs, strict=True):
            assert torch.equal(buf.kv, want[key])
            buf.release()
    manager.close()
    pool.check_integrity()
    assert pool.num_free == pool.num_slots


def test_a_chunk_written_to_two_tiers_with_one_codec_is_encoded_once(tmp_path, monkeypatch):
    from lmkv.codec.base import Zstd
    from lmkv.metrics import LMKVMetrics
    from lmkv.storage.manager import StorageManager, Tier

    calls = []
    real = Zstd.encode
    monkeypatch.setattr(Zstd, "encode", lambda self, kv, table, position=0:
                        calls.append(1) or real(self, kv, table, position))
    pool = MemoryPool(LAYOUT, 4 * (64 + LAYOUT.chunk_bytes))
    tiers = [Tier("disk", DiskBackend(tmp_path / "a", 1 << 30), "zstd"),
             Tier("remote", DiskBackend(tmp_path / "b", 1 << 30), "zstd"),
             Tier("third", DiskBackend(tmp_path / "c", 1 << 30), "raw")]
    manager = StorageManager(pool, tiers, LMKVMetrics())
    assert all(t.decoders is manager.decoders for t in tiers)  # one decoder pool per stack
    for i in range(3):
        buf = manager.allocate()
        buf.kv.normal_()
        manager.put(f"k{i}", buf)
        buf.release()
    manager.io.drain()
    assert len(calls) == 3  # once per chunk, not once per tier
    assert [t.backend.contains(["k0", "k1", "k2"]) for t in tiers] == [[True] * 3] * 3
    manager.close()


@pytest.mark.parametrize(("policy", "kept"), [("lru", False), ("prefix_lfu", True)])
def test_disk_tier_evicts_by_its_policy(tmp_path, policy, kept):
    disk = DiskBackend(tmp_path, capacity_bytes=400, policy=policy)
    disk.put([("hot", b"h" * 100)])
    for _ in range(3):
        assert disk.get(["hot"]) == [b"h" * 100]
    for i in range(20):  # one-pass writes; "hot" is read after every 4 (LRU has dropped it)
        disk.put([(f"scan{i}", b"s" * 100)])
        if i % 4 == 3:
            assert disk.get(["hot"]) == [b"h" * 100 if kept or i < 3 else None]
    assert disk.contains(["hot"]) == [kept]
    assert disk.used <= 400 and len(disk.index) == len(disk.policy) == 4
    assert disk.num_evictions == 17
    files = sorted(p.name for p in tmp_path.glob("*.kv"))
    assert files == sorted(disk.index)


def test_a_batch_of_coded_frames_is_decoded_side_by_side(tmp_path, monkeypatch):
    """Frames of a coded tier (not raw) are decoded on its decoder threads (the storage
    manager's), several at once, each into its own buffer; a corrupt one among them is still
    caught and removed."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from lmkv.codec.base import Zstd
    from lmkv.metrics import LMKVMetrics
    from lmkv.storage.tier import Tier

    running, most, lock = [0], [0], threading.Lock()
    real = Zstd.decode_into

    def slow(self, *args, **kwargs):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)  # long enough for the others to start
        try:
            return real(self, *args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(Zstd, "decode_into", slow)
    pool = MemoryPool(LAYOUT, 12 * (64 + LAYOUT.chunk_bytes))
    tier = Tier("disk", DiskBackend(tmp_path, 1 << 30), "zstd", metrics=LMKVMetrics(),
                decoders=ThreadPoolExecutor(4))
    src = []
    for i in range(5):
        buf = pool.allocate()
        buf.kv.normal_()
        tier.write(f"k{i}", tier.encode(f"k{i}", buf))
        src.append(buf)
    path = next(p for p in tmp_path.glob("*.kv") if p.name == tier.backend._name("k3"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    dst = [pool.allocate() for _ in range(5)]
    assert tier.read([f"k{i}" for i in range(5)], dst) == [True, True, True, False, True]
    assert most[0] >= 2
    for i in (0, 1, 2, 4):
        assert torch.equal(dst[i].kv, src[i].kv)
    assert tier.backend.contains(["k3"]) == [False]  # the corrupt frame was removed


def test_a_disk_tier_it_cannot_fill_is_told_at_start(tmp_path, caplog, monkeypatch):
    """A cap above the file system's free space, or a directory it cannot write: a warning
    at start (before, it started silently and failed every write)."""
    import shutil
    from pathlib import Path

    free = shutil.disk_usage(tmp_path).free
    DiskBackend(tmp_path / "big", capacity_bytes=free * 4)
    assert "is above what its file system has free" in caplog.text
    caplog.clear()
    DiskBackend(tmp_path / "fine", capacity_bytes=1 << 20)
    assert caplog.text == ""
    real = Path.write_bytes

    def read_only(path, data):
        if path.name.startswith(".probe."):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, data)

    monkeypatch.setattr(Path, "write_bytes", read_only)
    DiskBackend(tmp_path / "ro", capacity_bytes=1 << 20)
    assert "is not writable (Read-only file system)" in caplog.text


def test_a_hot_cache_past_the_machines_memory_is_refused_by_name(monkeypatch):
    """Where the available memory can be read, a larger hot cache is refused before any
    page is touched; where it cannot, an allocation that fails is said by name too (it
    was the allocator's RuntimeError)."""
    from lmkv import memory

    with pytest.raises(ValueError, match=r"max_local_cpu_size \(the hot cache\): .* GB asked, but"):
        MemoryPool(LAYOUT, 1 << 50)
    monkeypatch.setattr(memory, "host_memory_available", lambda: None)
    with pytest.raises(ValueError, match=r"max_local_cpu_size \(the hot cache\): cannot allocate"):
        MemoryPool(LAYOUT, 1 << 50)
    monkeypatch.setattr(memory, "host_memory_available", lambda: 10 << 20)
    assert MemoryPool(LAYOUT, 1 << 20).num_slots > 0


@pytest.mark.parametrize("version", ["v2", "v1", "v1 container view"])
def test_a_containers_memory_limit_counts_less_its_use_and_not_its_page_cache(tmp_path, version):
    """Under a memory cgroup limit (on the process's own group or one above it, cgroup v2
    or v1) the memory available is the limit less what the group uses, its inactive page
    cache (a checkpoint just read) not counted as used. Only v2's root group was read: in a
    v1 cgroup of 400 MB lmkv saw the machine's 21 GB and was killed filling its hot cache."""
    from lmkv import memory

    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal: 100000000 kB\nMemAvailable: 50000000 kB\n")
    if version == "v2":
        (proc / "self" / "cgroup").write_text("0::/slice/job\n")
        names, base = ("memory.max", "memory.current", "inactive_file"), root
    else:
        (proc / "self" / "cgroup").write_text(
            "12:cpu,cpuacct:/job\n" + ("5:memory:/slice/job\n" if version == "v1" else
                                       "5:memory:/docker/abc\n"))
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        base = root / "memory"
    job = base / "slice" / "job" if version != "v1 container view" else base

    def group(path, limit, used, inactive):
        path.mkdir(parents=True, exist_ok=True)
        (path / names[0]).write_text(f"{limit}\n")
        (path / names[1]).write_text(f"{used}\n")
        (path / "memory.stat").write_text(f"anon 3000000000\n{names[2]} {inactive}\n")

    unlimited = "max" if version == "v2" else str((1 << 63) - 4096)
    group(job, 20_000_000_000, 19_000_000_000, 15_000_000_000)
    if version != "v1 container view":
        group(base / "slice", 17_000_000_000, 19_000_000_000, 15_000_000_000)  # tighter, above
    assert memory.host_memory_available(str(proc), str(root)) == (
        17_000_000_000 if version != "v1 container view" else 20_000_000_000) - 4_000_000_000
    group(job, unlimited, 19_000_000_000, 0)
    if version != "v1 container view":
        group(base / "slice", unlimited, 19_000_000_000, 0)
    assert memory.host_memory_available(str(proc), str(root)) == 50_000_000 * 1024
