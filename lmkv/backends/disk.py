"""The local disk tier: one file per chunk, written atomically, capped in size.

Files are named by a hash of the key. A write goes to a temporary file that is renamed
into place, so a crash mid-write leaves either the old entry or none, never a torn one
(and the frame checksum catches anything else). The index is rebuilt from the directory
at start, so the cache survives restarts; a cache policy (lmkv.policy, by name) picks the
files evicted to stay under the cap. The backend contract carries no prefix parents, so
every file is a root to the policy: prefix_lfu is LFU with aging here, lru plain LRU.

A file that the page cache holds whole (mincore) is copied from it; any other is read with
O_DIRECT where the buffer allows (page-aligned, room for whole pages: lmkv's pool slots for
large chunks): on a cold batch that read faster than WILLNEED plus buffered reads.
Elsewhere, reads go through the page cache.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import hashlib
import itertools
import logging
import mmap
import os
import re
import stat
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..logs import LogThrottle
from ..memory import DIRECT_ALIGN
from ..policy import CachePolicy, make_policy
from .base import Arrived, BackendError, StorageBackend

log = logging.getLogger(__name__)
SUFFIX = ".kv"
# the files of this tier: a chunk's (its key's hash, _name), a write's temporary (_write),
# the start's probe (_check_room); any other file in the directory is left alone
CHUNK_FILE = re.compile(r"[0-9a-f]{32}\.kv")
TEMP_FILE = re.compile(r"\.(?:[0-9a-f]{32}\.kv\.\d+-[0-9a-f]{8}|probe)\.\d+\.tmp")
READERS = 4  # files read side by side in a batch
DIRECT = getattr(os, "O_DIRECT", 0)
MAP_FAILED = ctypes.c_void_p(-1).value
# errors of one file, not of the tier: that file is a miss and leaves the tier, the batch
# is served (any other error, e.g. too many open files, fails the batch: the breaker's)
FILE_ERRORS = frozenset(getattr(errno, n) for n in ("EIO", "EACCES", "EPERM", "EISDIR", "ELOOP",
                                                    "ENXIO", "ENODEV", "ESTALE", "EUCLEAN",
                                                    "EBADMSG") if hasattr(errno, n))
_tmp_ids = itertools.count()  # temporary file names unique within the process
# every file here is opened so that a FIFO or device never blocks the open (another process
# may put anything in a shared directory), and a link is not followed (its target is not
# this tier's); _open checks that it is a regular file
OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
UNLOCKED_TMP_SECONDS = 60  # an unlocked temporary file older than this has no live writer
# a write first counts the directory again (the files other processes sharing it wrote or
# deleted) when this long has passed since the last count, or RESCAN_RATIO times what that
# count took (a directory of many files costs the writing thread no more than 2% of its time)
RESCAN_SECONDS = 10.0
RESCAN_RATIO = 50
NO_SPACE = frozenset(getattr(errno, n) for n in ("ENOSPC", "EDQUOT") if hasattr(errno, n))


def _load_libc() -> ctypes.CDLL | None:
    """libc's mmap, mincore and munmap, declared (None where there is no libc to load)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


_libc = _load_libc() if DIRECT else None


class DiskBackend(StorageBackend):
    # lookups need not wait for a batch read: contains reads the index (and stats a file it
    # lacks) and changes nothing; files of other processes are taken in by reads
    concurrent_contains = True

    def __init__(self, root: str | Path, capacity_bytes: int, policy: CachePolicy | str = "lru",
                 direct: bool = True, max_value_bytes: int | None = None):
        self.root = Path(root)
        # a file larger than any value its reader takes (a chunk's largest frame) is never
        # claimed nor read: it stays counted, for the policy to evict
        self.max_value_bytes = capacity_bytes if max_value_bytes is None else max_value_bytes
        self.num_unreadable = 0
        self._quiet = LogThrottle()
        self.policy = make_policy(policy) if isinstance(policy, str) else policy  # over file names
        self.capacity = capacity_bytes
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise BackendError(f"cannot create the disk tier directory {self.root}: {e}") from e
        self.index: dict[str, int] = {}  # file name -> bytes
        self.spoiled: set[str] = set()  # removed files that could not be deleted: counted, never read
        self._unreadable_left: set[str] = set()  # unreadable files that could not be deleted
        self.used = 0
        self.num_evictions = 0
        self._pool: ThreadPoolExecutor | None = None  # reader threads, started at the first batch
        self.direct = direct and bool(DIRECT)  # O_DIRECT reads, until the file system refuses one
        # whether reads go around the page cache: the last batch read into buffers that take
        # O_DIRECT (assumed until a batch or a plain get says otherwise); read-ahead hints are
        # skipped only then, since those reads would go around them
        self._direct_batches = self.direct
        self._rebuild_index()
        self._next_scan = time.monotonic() + RESCAN_SECONDS
        self._check_room()

    def _check_room(self) -> None:
        """Warn at start about a directory this tier cannot fill: not writable (its chunks
        are read, never written), or with less free space than the cap (writes would fail
        with 'no space' before the tier evicts anything); and about one that other users may
        write into (they could plant chunks this engine would serve)."""
        with contextlib.suppress(OSError):
            st = os.stat(self.root)
            if st.st_mode & 0o002 or st.st_uid not in (os.geteuid(), 0):
                log.warning("disk tier %s may be written by other users (owner uid %d, mode %o): "
                            "they could plant chunks this engine serves; give it a directory of "
                            "its own (chmod 700)", self.root, st.st_uid, stat.S_IMODE(st.st_mode))
        probe = self.root / f".probe.{os.getpid()}.tmp"
        try:
            probe.write_bytes(b"lmkv")
            probe.unlink()
        except OSError as e:
            log.warning("disk tier %s is not writable (%s): its chunks are read, never written",
                        self.root, e.strerror or e)
            return
        try:
            st = os.statvfs(self.root)
        except OSError:
            return
        room = st.f_bavail * st.f_frsize + self.used
        if self.capacity > room:
            log.warning("disk tier %s: its cap (%.3g GB, max_local_disk_size) is above what its "
                        "file system has free for it (%.3g GB); lower the cap, or writes will fail "
                        "with 'no space' before the tier evicts", self.root, self.capacity / 1e9,
                        room / 1e9)

    def _scan(self, min_age: float = 0.0) -> tuple[list[tuple[float, str, int]], int]:
        """The directory's chunk files, (mtime, name, size) each, and how many files in it
        are not this tier's; a dead writer's temporary at least ``min_age`` seconds old is
        deleted on the way. OSError where the directory cannot be listed; a file that
        cannot be examined or deleted is left as it is, logged."""
        entries, others = [], 0
        with os.scandir(self.root) as listing:
            found = list(listing)
        for entry in found:
            try:
                if TEMP_FILE.fullmatch(entry.name):
                    old = min_age <= 0 or time.time() - entry.stat(follow_symlinks=False).st_mtime >= min_age
                    if old and not _writer_alive(entry.path):  # a write cut by a crash
                        os.unlink(entry.path)
                elif CHUNK_FILE.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    entries.append((st.st_mtime, entry.name, st.st_size))
                else:
                    others += 1
            except FileNotFoundError:  # gone meanwhile (another process sharing the directory)
                continue
            except OSError as e:  # a read-only directory, another owner's file: left as it is
                self._quiet.log(log, logging.WARNING, "rebuild", "disk tier %s: leaving %s as it "
                                "is (%s)", self.root, entry.name, e.strerror or e)
        return entries, others

    def _rebuild_index(self) -> None:
        try:
            entries, others = self._scan()
        except OSError as e:
            raise BackendError(f"cannot list the disk tier directory {self.root}: {e}") from e
        for _, name, size in sorted(entries):  # least recently used (read or written) first
            self._add(name, size)
        try:
            self._evict_to(self.capacity)
            if self.num_evictions:
                log.warning("disk tier %s: %d files (least recently used first) deleted at start "
                            "to fit its cap (%.3g GB, max_local_disk_size)", self.root,
                            self.num_evictions, self.capacity / 1e9)
        except BackendError as e:  # a read-only directory fuller than this cap: still read
            log.warning("disk tier %s holds %.3g GB, above its cap (%.3g GB), and cannot shrink "
                        "(%s): its chunks are read; writes fail until files can be deleted",
                        self.root, self.used / 1e9, self.capacity / 1e9, e)
        if entries or others:
            log.info("disk tier %s: %d entries, %.1f MB%s", self.root, len(self.index), self.used / 1e6,
                     f"; {others} files that are not lmkv chunks left alone" if others else "")

    @staticmethod
    def _name(key: str) -> str:
        return hashlib.blake2b(key.encode(), digest_size=16).hexdigest() + SUFFIX

    def put(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        if time.monotonic() >= self._next_scan:
            self._rescan()
        for key, value in items:
            size = len(value)
            if size > self.capacity:
                raise BackendError(f"a {size}-byte entry exceeds the disk tier cap ({self.capacity})")
            name = self._name(key)
            if name in self.index:  # replaced: its older value must not outlive a failed write
                self._unlink(name)
                self._forget(name)
            self._evict_to(self.capacity - size)
            try:
                self._write_here(name, value)
            except BackendError as e:
                if getattr(e.__cause__, "errno", None) not in NO_SPACE:
                    raise
                self._make_room(size, e)
                if name in self.index:  # another process's copy, counted by the rescan
                    self._forget(name)
                self._write_here(name, value)  # once more; a second failure is the tier's
            self._add(name, size)

    def _write_here(self, name: str, value: bytes | memoryview) -> None:
        try:
            self._write(name, value)
        except FileNotFoundError:  # the directory was removed under us: start it afresh
            self._recreate()
            self._write(name, value)

    def _make_room(self, size: int, error: BackendError) -> None:
        """The file system is full below this tier's cap (other processes' files, counted
        to their caps, or other data): count the directory again and evict ``size`` bytes
        more than that leaves, so the tier keeps writing instead of failing every write."""
        self._rescan()
        self._evict_to(min(self.used, self.capacity) - size)
        self._quiet.log(log, logging.WARNING, "no-space", "disk tier %s: the file system is full "
                        "(%s) with the tier at %.3g of its %.3g GB cap; evicted to make room (lower "
                        "max_local_disk_size to what the volume has for it: with several processes "
                        "on one directory, each counts the files it knows to its own cap)",
                        self.root, error.__cause__.strerror, self.used / 1e9, self.capacity / 1e9)

    def _rescan(self) -> None:
        """Count the directory again: files that other processes sharing it wrote are taken
        into the index (to this tier's cap and policy), those they deleted forgotten, and a
        dead writer's temporary older than UNLOCKED_TMP_SECONDS deleted. Runs on the writing
        thread, at most every RESCAN_SECONDS and 1/RESCAN_RATIO of its time."""
        start = time.monotonic()
        try:
            present = {name: size for _, name, size in self._scan(UNLOCKED_TMP_SECONDS)[0]}
        except OSError:  # the directory is gone: the write recreates it
            present = dict(self.index)
        for name in [n for n in self.index if n not in present]:
            self._forget(name)
        for name, size in present.items():
            if name in self.index:
                self._resize(name, size)
            elif name not in self._unreadable_left:
                self._add(name, size)
        self._next_scan = time.monotonic() + max(RESCAN_SECONDS, RESCAN_RATIO * (time.monotonic() - start))

    def _write(self, name: str, value: bytes | memoryview) -> None:
        """``value`` into file ``name`` through a temporary file renamed into place;
        FileNotFoundError where the directory is gone, BackendError for other failures."""
        # unique per write (two tiers of one process may write the same key at once) and
        # created exclusively: engines in containers sharing the directory may share a pid
        tmp = self.root / f".{name}.{next(_tmp_ids)}-{os.urandom(4).hex()}.{os.getpid()}.tmp"
        created = False
        try:
            with open(tmp, "xb", buffering=0, opener=_private) as f:
                created = True
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # a live write: kept at others' starts
                view = memoryview(value).cast("B")
                while view:  # every byte in the file before the rename (a full disk fails here)
                    view = view[f.write(view):]
                os.replace(tmp, self.root / name)
        except OSError as e:
            if created:  # (never another writer's file of the same name)
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
            if isinstance(e, FileNotFoundError) and not self.root.is_dir():
                raise
            raise BackendError(f"disk tier write failed: {e}") from e

    def _recreate(self) -> None:
        """The tier's directory is gone (removed by hand, a cleanup job): whatever the index
        counted went with it, so the index restarts empty in a new directory."""
        log.warning("disk tier %s: the directory was removed; recreating it (%d entries lost)",
                    self.root, len(self.index))
        for name in list(self.index):
            self._forget(name)
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise BackendError(f"cannot recreate the disk tier directory {self.root}: {e}") from e

    def _add(self, name: str, size: int) -> None:
        self.index[name] = size
        self.used += size
        self.policy.inserted(name, None)

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        self._direct_batches = False  # whole files as bytes (coded tiers): through the page cache
        out: list[bytes | None] = []
        for key in keys:
            name = self._name(key)
            size = self._claimable(name)
            if size is None:
                out.append(None)
                continue
            try:
                with os.fdopen(_open(self.root / name), "rb") as f:
                    data = f.read(self.max_value_bytes + 1)  # never more than a value can be
                    _touch(f.fileno())
            except FileNotFoundError:
                self._forget(name)
                out.append(None)
                continue
            except OSError as e:
                if e.errno not in FILE_ERRORS:
                    raise BackendError(f"disk tier read failed: {e}") from e
                self._unreadable(name, e)
                out.append(None)
                continue
            self._resize(name, len(data))  # (rewritten since it was indexed: another process)
            if len(data) > self.max_value_bytes:
                out.append(None)
                continue
            out.append(data)
            self.policy.accessed(name)
        return out

    def get_into(self, key: str, out: memoryview) -> int | None:
        return self.get_into_many([key], [out])[0]

    def get_into_many(self, keys: Sequence[str], outs: Sequence[memoryview],
                      arrived: Arrived | None = None) -> list[int | None]:
        """get_into for a batch: the kernel is told first that every file is wanted
        (POSIX_FADV_WILLNEED, so their reads are queued together), then READERS threads
        read them side by side (16 cold 8 MiB files: 2.0 GB/s vs 0.9 one after another),
        each calling ``arrived`` for its file as soon as it is read. The index and the
        policy are only touched on the calling thread."""
        wanted: list[tuple[int, str, int]] = []  # (position, file name, size)
        for i, (key, out) in enumerate(zip(keys, outs, strict=True)):
            name = self._name(key)
            size = self._claimable(name)
            if size is not None and size <= len(out):
                wanted.append((i, name, size))  # larger: not a frame this reader holds
        # one way for the whole batch: O_DIRECT where every buffer takes it (then no read-ahead,
        # which would only read the files a second time), else read-ahead and the page cache
        direct = self.direct and all(_aligned(outs[i], size) for i, _, size in wanted)
        if wanted:
            self._direct_batches = direct
        if not direct:
            self._advise([name for _, name, _ in wanted])

        def read(i: int, name: str, size: int) -> tuple[int | None, int] | OSError:
            got = self._read(name, outs[i], direct)
            if arrived is not None and not isinstance(got, OSError) and got[0] is not None:
                arrived(i, got[0])
            return got

        if len(wanted) > 1:
            results = list(self._readers().map(lambda w: read(*w), wanted))
        else:
            results = [read(*w) for w in wanted]
        lengths: list[int | None] = [None] * len(keys)
        failed: OSError | None = None
        for (i, name, _), result in zip(wanted, results, strict=True):
            if isinstance(result, FileNotFoundError):
                self._forget(name)
            elif isinstance(result, OSError) and result.errno in FILE_ERRORS:
                self._unreadable(name, result)
            elif isinstance(result, OSError):
                failed = result
            else:
                lengths[i], size = result
                self._resize(name, size)
                if lengths[i] is not None:
                    self.policy.accessed(name)
        if failed is not None:
            raise BackendError(f"disk tier read failed: {failed}") from failed
        return lengths

    def _read(self, name: str, out: memoryview, direct: bool) -> tuple[int | None, int] | OSError:
        """One file into ``out`` (runs on a reader thread): (its length, or None where it no
        longer fits ``out`` nor a value: rewritten larger by another process since it was
        indexed; the file's size now), or the error. With ``direct`` (``out`` takes
        O_DIRECT), a file the page cache does not hold whole is read with O_DIRECT; whatever
        is left goes through the page cache."""
        path = self.root / name
        try:
            fd = _open(path)
            try:
                size = os.fstat(fd).st_size  # (not the index's: the file may have been replaced)
                if size > min(len(out), self.max_value_bytes):
                    return None, size
                done = 0
                if direct and self.direct and not _cached(fd, size):
                    done = self._read_direct(fd, path, out, size)
                while done < size:
                    n = os.preadv(fd, [out[done:size]], done)
                    if n == 0:
                        break  # the file is shorter than when it was indexed: the check says so
                    done += n
                _touch(fd)
                return done, size
            finally:
                os.close(fd)
        except OSError as e:
            return e

    def _read_direct(self, fd: int, path: Path, out: memoryview, size: int) -> int:
        """The first ``size`` bytes of the file open as ``fd`` into ``out`` with O_DIRECT,
        in whole pages; the bytes in place (0 where the file system takes no O_DIRECT: reads
        go through the page cache from then on). The file is reopened through /proc, so a
        file renamed over ``path`` meanwhile is not mixed in."""
        same = f"/proc/self/fd/{fd}"
        try:
            fd = os.open(same if os.path.exists(same) else path, os.O_RDONLY | DIRECT)
        except OSError as e:
            return self._no_direct(e)
        try:
            end = -(-size // DIRECT_ALIGN) * DIRECT_ALIGN
            done = 0
            while done < size:
                n = os.preadv(fd, [out[done:end]], done)
                done += n
                if n == 0 or done % DIRECT_ALIGN:  # the end of the file
                    break
            return min(done, size)
        except OSError as e:
            return self._no_direct(e)
        finally:
            os.close(fd)

    def _no_direct(self, error: OSError) -> int:
        """An O_DIRECT open or read failed: EINVAL (the file system takes none) turns them off
        for good; anything else is raised. 0 bytes in place either way."""
        if error.errno != errno.EINVAL:
            raise error
        if self.direct:
            self.direct = self._direct_batches = False
            log.info("disk tier %s: no O_DIRECT reads here (%s); reading through the page cache",
                     self.root, error)
        return 0

    def _readers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READERS, thread_name_prefix="lmkv-disk-read")
        return self._pool

    def will_get(self, keys: Sequence[str]) -> None:
        # read-ahead into the page cache would only double O_DIRECT's reads of the same files
        if not self._direct_batches:
            self._advise([n for n in map(self._name, keys) if n in self.index])

    def _advise(self, names: list[str]) -> None:
        """POSIX_FADV_WILLNEED on these files: the kernel starts reading them now."""
        if not hasattr(os, "posix_fadvise"):
            return
        for name in names:
            try:
                fd = _open(self.root / name)
            except OSError:
                continue  # the read reports it
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                os.close(fd)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Reads the index (and stats a file it lacks) but changes nothing: lookups run beside
        the I/O thread's writes and reads, which alone take files into the index."""
        return [self._claimable(self._name(k), adopt=False) is not None for k in keys]

    def _claimable(self, name: str, adopt: bool = True) -> int | None:
        """The size of file ``name`` if it may be read: indexed (or written since the index
        was built by another process sharing the directory, such as `engine precompute`
        beside a running server: taken into the index now, with ``adopt``), no larger than
        a value can be, not a removed file left undeleted."""
        size = self.index.get(name)
        if size is None:
            size = self._adopt(name) if adopt else self._foreign_size(name)
        if size is None or size > self.max_value_bytes or name in self.spoiled:
            return None
        return size

    def _adopt(self, name: str) -> int | None:
        """Index file ``name`` if another process wrote it (one stat per miss); its size."""
        size = self._foreign_size(name)
        if size is not None:
            self._add(name, size)  # (counted to the cap: the next write evicts to make room)
        return size

    def _foreign_size(self, name: str) -> int | None:
        """The size of file ``name`` that this tier did not index, if it is a regular file
        (not a link) that may be read."""
        if name in self._unreadable_left:
            return None
        try:
            st = os.stat(self.root / name, follow_symlinks=False)
        except OSError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def _resize(self, name: str, size: int) -> None:
        """File ``name`` holds ``size`` bytes now (another process replaced it)."""
        old = self.index.get(name)
        if old is not None and old != size:
            self.index[name] = size
            self.used += size - old

    def remove(self, keys: Sequence[str]) -> None:
        for key in keys:
            name = self._name(key)
            if name in self.index:
                try:
                    self._unlink(name)
                except BackendError:  # still counted (and evicted by the policy in its turn)
                    self.spoiled.add(name)
                    raise
                self._forget(name)

    def _unlink(self, name: str) -> bool:
        """Delete a chunk's file: False where it was gone already (another process sharing
        the directory deleted it); BackendError if the file system refuses (read-only,
        permissions): the file is then still counted."""
        try:
            (self.root / name).unlink()
        except FileNotFoundError:
            return False
        except OSError as e:
            raise BackendError(f"disk tier cannot delete {name}: {e}") from e
        return True

    def _unreadable(self, name: str, error: OSError) -> None:
        """A file that cannot be read (a bad block, another owner's permissions, a directory
        in its place): a miss from now on, deleted where the file system lets us, counted
        (``num_unreadable``) and logged. The rest of its batch is served."""
        try:
            (self.root / name).unlink()
        except FileNotFoundError:
            pass
        except OSError:  # never taken into the index again (another process's file, say)
            self._unreadable_left.add(name)
        self._forget(name)
        self.num_unreadable += 1
        self._quiet.log(log, logging.WARNING, "unreadable", "disk tier %s: cannot read %s (%s); "
                        "dropped from the tier, its chunk is recomputed", self.root, name,
                        error.strerror or error)

    def _forget(self, name: str) -> bool:
        size = self.index.pop(name, None)
        self.spoiled.discard(name)
        if size is None:
            return False
        self.used -= size
        self.policy.removed(name)
        return True

    def _evict_to(self, limit: int) -> None:
        """Delete the policy's victims until ``used`` is at most ``limit``; BackendError where
        the file system refuses a delete (the file stays counted, and known to the policy)."""
        while self.used > limit and self.index:
            name = self.policy.victim(lambda _: True)  # no reader holds a file open across calls
            if name is None:
                raise BackendError("disk tier: its cache policy offers no file to evict")
            try:
                deleted = self._unlink(name)
            except BackendError:  # given up as a victim: the policy must know the file again
                self.policy.kept(name)
                raise
            self._forget(name)
            self.num_evictions += deleted  # (not one another process had deleted)


def _private(path: str, flags: int) -> int:
    """open()'s opener for the tier's files: readable by their owner alone (KV reveals the
    prompts it was computed from)."""
    return os.open(path, flags | os.O_CLOEXEC, 0o600)


def _writer_alive(path: str) -> bool:
    """Whether a live process is writing temporary file ``path`` (".<name>.<n>.<pid>.tmp"):
    another engine sharing the directory, whose write must not be cut off. A writer holds
    an exclusive lock on its file until the rename, which tells it apart across PID
    namespaces (containers sharing a volume, each engine PID 1). An unlocked file is a
    dead writer's unless it is young and its pid lives here (between the file's creation
    and its lock; or a writer that does not lock). Anything but a regular file is left
    alone (counted as live: not a write of this tier's)."""
    try:
        fd = _open(path)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):
            return True
        raise
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:  # a file system without locks: the pid and age decide
            pass
        age = time.time() - os.fstat(fd).st_mtime
    finally:
        os.close(fd)
    if age > UNLOCKED_TMP_SECONDS:
        return False
    try:
        pid = int(path.rsplit(".", 2)[-2])
    except ValueError:
        return False
    if pid == os.getpid():  # this process's earlier life (a container's PID 1 restarted)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _open(path: str | Path) -> int:
    """A descriptor of regular file ``path`` for reading (OPEN_FLAGS); OSError ENXIO for
    anything else there (a FIFO, a device), ELOOP for a link."""
    fd = os.open(path, OPEN_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.ENXIO, "not a regular file", str(path))
        return fd
    except BaseException:
        os.close(fd)
        raise


def _cached(fd: int, size: int) -> bool:
    """Whether the page cache holds every page of the file's first ``size`` bytes (mincore on
    a mapping of it: no page is read). False where that cannot be told."""
    if _libc is None or size == 0:
        return False
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, MAP_FAILED):
        return False
    try:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        if _libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
            return False
        return all(b & 1 for b in bytes(vec))
    finally:
        _libc.munmap(ctypes.c_void_p(addr), size)


def _touch(fd: int) -> None:
    """A file just read gets the time of now: a restart indexes files in the order of their
    times, so the order is that of their last use, not of their last write."""
    with contextlib.suppress(OSError):  # a read-only volume: the order of the writes stays
        os.utime(fd)


def _aligned(out: memoryview, size: int) -> bool:
    """Whether an O_DIRECT read of ``size`` bytes in whole pages fits ``out``."""
    if out.readonly or len(out) == 0 or len(out) < -(-size // DIRECT_ALIGN) * DIRECT_ALIGN:
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(out)) % DIRECT_ALIGN == 0
