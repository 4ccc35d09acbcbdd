"""The disk tier's O_DIRECT reads: pool slots of large chunks on whole pages, cold files read
around the page cache into them, files the page cache holds copied from it, and the page
cache for every buffer or file system that O_DIRECT does not take; the same bytes always."""

from __future__ import annotations

import errno
import logging
import mmap
import os

import pytest
import torch

from lmkv.backends import disk as disk_module
from lmkv.backends.disk import DiskBackend
from lmkv.layout import KVLayout
from lmkv.memory import DIRECT_ALIGN, HEADER_BYTES, PAD_MIN_FRAME, MemoryPool

BIG = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.float32, chunk_size=256)  # 2 MiB
SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, chunk_size=4)


def drop(paths) -> bool:
    """Drop files from the page cache; False where this file system keeps them anyway."""
    cold = True
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            cold &= not disk_module._cached(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
    return cold


def resident_pages(path) -> int:
    """Pages of the file in the page cache (mincore on a mapping of it: nothing is read)."""
    import ctypes

    size = os.path.getsize(path)
    libc = disk_module._libc
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        try:
            assert libc.mincore(ctypes.c_void_p(addr), size, vec) == 0
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
        return sum(b & 1 for b in bytes(vec))
    finally:
        os.close(fd)


@pytest.fixture
def opens(monkeypatch):
    """The flags of every os.open the disk tier makes: O_DIRECT or not, per file."""
    seen: list[bool] = []
    real = os.open

    def spy(path, flags, *args, **kwargs):
        seen.append(bool(flags & disk_module.DIRECT))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(disk_module.os, "open", spy)
    return seen


def aligned_buffers(n: int, size: int) -> tuple[mmap.mmap, list[memoryview]]:
    step = -(-size // DIRECT_ALIGN) * DIRECT_ALIGN
    region = mmap.mmap(-1, n * step)
    view = memoryview(region)
    return region, [view[i * step : (i + 1) * step] for i in range(n)]


def test_slots_of_large_chunks_start_on_pages_and_frames_stay_exact():
    assert HEADER_BYTES + BIG.chunk_bytes >= PAD_MIN_FRAME
    pool = MemoryPool(BIG, 3 * (BIG.chunk_bytes + DIRECT_ALIGN))
    assert pool.num_slots == 3 and pool.slot_bytes % DIRECT_ALIGN == 0
    for _ in range(3):
        buf = pool.allocate()
        assert buf.slot.data_ptr() % DIRECT_ALIGN == 0
        assert buf.frame.numel() == HEADER_BYTES + BIG.chunk_bytes == pool.frame_bytes
        assert buf.kv.shape == BIG.chunk_shape and buf.kv.data_ptr() == buf.slot.data_ptr() + HEADER_BYTES
        assert disk_module._aligned(memoryview(buf.slot.numpy()), pool.frame_bytes)
    small = MemoryPool(SMALL, 4 * (HEADER_BYTES + SMALL.chunk_bytes))  # small chunks: no padding
    assert small.slot_bytes == small.frame_bytes and small.num_slots == 4


def test_cold_files_come_with_o_direct_and_cached_ones_from_the_page_cache(tmp_path, opens):
    disk = DiskBackend(tmp_path, 1 << 30)
    sizes = [2 * 2**20 + 64, 5000, DIRECT_ALIGN, 3 * DIRECT_ALIGN + 1]
    values = [os.urandom(n) for n in sizes]
    keys = [f"k{i}" for i in range(len(values))]
    disk.put(list(zip(keys, values, strict=True)))
    if not drop([tmp_path / disk._name(k) for k in keys]):
        pytest.skip("this file system keeps files in the page cache")
    region, outs = aligned_buffers(len(keys), max(sizes))
    opens.clear()
    assert disk.get_into_many(keys, outs) == sizes
    assert [bytes(o[:n]) for o, n in zip(outs, sizes, strict=True)] == values
    assert opens.count(True) == len(keys) and disk.direct  # each file once with O_DIRECT
    # and all of it that way: nothing went through the page cache
    assert [resident_pages(tmp_path / disk._name(k)) for k in keys] == [0] * len(keys)
    for o in outs:
        o[:] = bytes(len(o))
    for key in keys:  # now in the page cache: copied from it, O_DIRECT not asked
        with open(tmp_path / disk._name(key), "rb") as f:
            f.read()
    opens.clear()
    assert disk.get_into_many(keys, outs) == sizes
    assert [bytes(o[:n]) for o, n in zip(outs, sizes, strict=True)] == values
    assert not any(opens)
    for o in outs:
        o.release()
    region.close()


def test_a_file_shorter_than_indexed_reads_as_what_is_there(tmp_path):
    disk = DiskBackend(tmp_path, 1 << 30)
    disk.put([("k", os.urandom(3 * DIRECT_ALIGN))])
    path = tmp_path / disk._name("k")
    os.truncate(path, DIRECT_ALIGN + 10)  # behind the tier's back: the frame check rejects it
    drop([path])
    region, (out,) = aligned_buffers(1, 3 * DIRECT_ALIGN)
    assert disk.get_into_many(["k"], [out]) == [DIRECT_ALIGN + 10]
    out.release()
    region.close()


def test_unaligned_buffers_and_file_systems_without_o_direct_use_the_page_cache(
        tmp_path, monkeypatch, opens, caplog):
    disk = DiskBackend(tmp_path, 1 << 30)
    value = os.urandom(DIRECT_ALIGN * 2 + 7)
    disk.put([("k", value)])
    path = tmp_path / disk._name("k")
    drop([path])
    region, (out,) = aligned_buffers(1, 4 * DIRECT_ALIGN)
    opens.clear()
    assert disk.get_into_many(["k"], [out[1:]]) == [len(value)]  # one byte off a page
    assert bytes(out[1 : 1 + len(value)]) == value and not any(opens)
    assert disk.get_into_many(["k"], [out[: len(value)]]) == [len(value)]  # no room for whole pages
    assert not any(opens)

    real = os.open

    def no_direct(p, flags, *args, **kwargs):  # a file system that refuses O_DIRECT
        if flags & disk_module.DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(p, flags, *args, **kwargs)

    monkeypatch.setattr(disk_module.os, "open", no_direct)
    if not drop([path]):
        pytest.skip("this file system keeps files in the page cache")
    out[:] = bytes(len(out))
    with caplog.at_level(logging.INFO, logger="lmkv.backends.disk"):
        assert disk.get_into_many(["k"], [out]) == [len(value)]
    assert bytes(out[: len(value)]) == value
    assert not disk.direct and "no O_DIRECT reads here" in caplog.text
    out.release()
    region.close()


@pytest.mark.parametrize("direct", [True, False])
def test_chunks_stored_to_disk_come_back_exact_with_o_direct_on_or_off(tmp_path, opens, direct):
    """Through LMKVCache: chunks of 2 MiB stored to the disk tier, the hot cache emptied and
    the files dropped from the page cache; the fetch gives the same chunks, read with
    O_DIRECT unless local_disk_direct is false."""
    from lmkv.cache import LMKVCache
    from lmkv.config import load_config

    config = load_config(env={}, chunk_size=BIG.chunk_size, max_local_cpu_size=0.05,
                         local_disk=str(tmp_path / "disk"), max_local_disk_size=0.1,
                         local_disk_direct=direct)
    cache = LMKVCache(config, BIG, "m")
    try:
        disk = cache.storage.tiers[0].backend
        assert disk.direct is direct
        assert cache.pool.slot_bytes <= disk.max_value_bytes < 2 * cache.pool.slot_bytes
        keys = cache.keys(list(range(3 * BIG.chunk_size)))
        want = []
        for i, key in enumerate(keys):
            buf = cache.allocate()
            buf.kv.copy_(torch.randn(buf.kv.shape, generator=torch.Generator().manual_seed(i)))
            want.append(buf.kv.clone())
            cache.store(key, buf)
            buf.release()
        cache.drain()
        cache.storage.hot.clear()
        if not drop(list(disk.root.glob("*.kv"))):
            pytest.skip("this file system keeps files in the page cache")
        opens.clear()
        bufs = cache.fetch(keys)
        assert [torch.equal(b.kv, w) for b, w in zip(bufs, want, strict=True)] == [True] * 3
        assert opens.count(True) == (3 if direct else 0)
        if direct:  # read around the page cache, and no read-ahead beside it
            assert sum(resident_pages(p) for p in disk.root.glob("*.kv")) == 0
        for b in bufs:
            b.release()
    finally:
        cache.close()


def test_read_ahead_hints_are_skipped_only_while_reads_go_around_the_page_cache(tmp_path, monkeypatch):
    disk = DiskBackend(tmp_path, 1 << 30)
    disk.put([("k", os.urandom(3 * DIRECT_ALIGN))])
    advised: list[list[str]] = []
    monkeypatch.setattr(disk, "_advise", lambda names: advised.append(names))
    disk.will_get(["k"])  # nothing read yet: O_DIRECT reads are assumed, no hint
    assert advised == []
    disk.get(["k"])  # whole files as bytes (a coded tier): through the page cache, hints again
    disk.will_get(["k"])
    assert len(advised) == 1
    region, (out,) = aligned_buffers(1, 4 * DIRECT_ALIGN)
    disk.get_into_many(["k"], [out])  # an O_DIRECT batch: neither it nor later hints advise
    disk.will_get(["k"])
    assert len(advised) == 1
    disk.get_into_many(["k"], [out[1:]])  # a batch that cannot take O_DIRECT: hints again
    disk.will_get(["k"])
    assert len(advised) == 3
    assert DiskBackend(tmp_path / "b", 1 << 30, direct=False)._direct_batches is False
    out.release()
    region.close()
