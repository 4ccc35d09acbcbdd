"""Persister: mirrors the store into a directory so that its contents survive a restart.

One file per key, written behind the store by one thread: a PUT marks its key dirty and
the thread later writes whatever value the key has then (so a key overwritten ten times
before the thread gets to it is written once), or deletes the file if the key is gone
(evicted). Disk use therefore follows the memory bound. Writes are atomic (tmp file +
rename); a crash loses at most the keys still pending, never leaves a torn file under a
final name. A write that fails (disk full) removes the key's file too: a restart must
not bring back the older value it held. On start the index is rebuilt by reading every
file, newest first, verifying its checksum: corrupt or truncated files are deleted (their
key is lost either way), files of another format version are left, as is any file not
named as this module names them; the start line counts each kind.

File layout (little-endian):
    header  "<8sHii4iQ": magic, key length, fmt, dtype, shape0..3, value length
    crc32   "<I" over header, key and value
    key     key length bytes
    value   value length bytes
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import stat
import struct
import threading
import zlib
from collections import OrderedDict
from enum import Enum
from pathlib import Path
from typing import NamedTuple

from lmkv.backends.lm_wire import WireError, check_key
from lmkv.logs import LogThrottle

from .store import Store

log = logging.getLogger(__name__)

MAGIC = b"LMKVSRV\x01"
HEADER = struct.Struct("<8sHii4iQ")
CRC = struct.Struct("<I")
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"  # held by the server that persists into the directory
VALUE_FILE = re.compile(r"[0-9a-f]{40}\.kv")  # path_for's names
TEMP_FILE = re.compile(r"[0-9a-f]{40}\.kv\.tmp")  # theirs while written


class _Outcome(Enum):
    LOADED = "loaded"
    CORRUPT = "corrupt"
    NO_ROOM = "no_room"
    UNREADABLE = "unreadable"
    FOREIGN = "foreign"


class LoadResult(NamedTuple):
    loaded: int
    corrupt: int  # deleted: truncated, or bad size, key or checksum
    no_room: int  # deleted: valid, but the store was full (oldest files)
    unreadable: int = 0  # left: an I/O error reading it
    foreign: int = 0  # left: another format version's (its magic)
    others: int = 0  # left: files not named as values are


class Persister:
    def __init__(self, directory: Path, store: Store) -> None:
        self.directory = directory
        self.store = store
        self._dirty: OrderedDict[bytes, None] = OrderedDict()
        # keys that have a file: an evicted key without one (and not being written) leaves
        # nothing to do, so the queue holds at most the store's keys and the files' keys
        self._files: set[bytes] = set()
        self._writing: bytes | None = None
        self._cond = threading.Condition()
        self._busy = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.files_written = 0
        self.files_deleted = 0
        self.errors = 0
        self._quiet = LogThrottle()
        self._lock_fd: int | None = None

    @property
    def pending(self) -> int:
        return len(self._dirty) + self._busy

    def unsafe(self) -> str | None:
        """Why the directory must not be used (created 0700 where it is missing): a user
        other than the server's (or root) owns it, or anyone may write into it (they could
        plant values it would serve); None where it is fine (a group-writable directory is
        the group's choice, as a volume mounted for a group is)."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(self.directory)
        if st.st_uid not in (os.geteuid(), 0):
            return (f"--persist-dir {self.directory} belongs to another user (uid {st.st_uid}): "
                    "give the server a directory of its own")
        if st.st_mode & 0o002:
            return (f"--persist-dir {self.directory} may be written by anyone (mode "
                    f"{stat.S_IMODE(st.st_mode):o}): chmod o-w it, or give the server a "
                    "directory of its own")
        return None

    def lock(self) -> bool:
        """Take the directory for this process (until it exits): False where another live
        process holds it (another lmkv_server, an overlapping restart: each would delete the
        other's files). A file system without locks is taken as it is, with a warning."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.directory / LOCK_NAME,
                     os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except OSError as e:
            log.warning("cannot lock %s (%s): make sure no other lmkv_server persists into it",
                        self.directory, e)
        self._lock_fd = fd  # (kept open: the lock lasts as long as the process)
        return True

    def load(self) -> LoadResult:
        """Rebuild the store from the directory (call before serving)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        files, others = [], 0
        for item in os.scandir(self.directory):
            if not item.is_file(follow_symlinks=False) or item.name == LOCK_NAME:
                continue  # (a directory, a link someone put here)
            if TEMP_FILE.fullmatch(item.name):
                try:
                    os.unlink(item.path)  # a write interrupted by a crash
                except OSError as exc:
                    log.warning("cannot remove the temporary file %s: %s", item.path, exc)
            elif VALUE_FILE.fullmatch(item.name):
                files.append((item.stat().st_mtime_ns, item.path))
            else:
                others += 1
        files.sort(reverse=True)  # newest first: they win the space if it runs out
        counts = dict.fromkeys(_Outcome, 0)
        for _, path in files:
            try:
                outcome = self._load_file(Path(path))
            except OSError as exc:
                self._quiet.log(log, logging.WARNING, "unreadable", "persisted file %s cannot be "
                                "read (%s): left in place, not loaded", path, exc)
                outcome = _Outcome.UNREADABLE
            counts[outcome] += 1
        self.store.rank_reloaded()
        if counts[_Outcome.NO_ROOM]:
            log.warning("%d persisted values (the oldest) did not fit in max_memory; their files "
                        "were deleted", counts[_Outcome.NO_ROOM])
        if counts[_Outcome.FOREIGN]:
            log.warning("%d persisted files of another format version (another lmkv_server's) "
                        "left in place, not loaded: delete them if no server of that version "
                        "uses %s", counts[_Outcome.FOREIGN], self.directory)
        return LoadResult(*(counts[o] for o in _Outcome), others)

    def start(self) -> None:
        self.store.set_listener(self.mark)
        self._thread = threading.Thread(target=self._run, name="lmkv-persist", daemon=True)
        self._thread.start()

    def mark(self, key: bytes, present: bool = True) -> None:
        """``key``'s value was committed (``present``) or removed from the store."""
        with self._cond:
            if present or key in self._files or key == self._writing:
                self._dirty[key] = None
                self._cond.notify()
            else:  # never written: no file to delete, nothing to do
                self._dirty.pop(key, None)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every marked key is on disk; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._dirty and not self._busy, timeout)

    def stop(self, timeout: float | None = None) -> None:
        """Write what is pending, then end the thread."""
        self.store.set_listener(None)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def path_for(self, key: bytes) -> Path:
        # keys hold '/', '@', ...; a digest gives a safe, fixed-length name
        return self.directory / (hashlib.sha256(key).hexdigest()[:40] + SUFFIX)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._dirty or self._stopping)
                if not self._dirty:
                    return
                key, _ = self._dirty.popitem(last=False)
                self._busy = True
                self._writing = key
            try:
                self._sync(key)
            except OSError as exc:
                self.errors += 1  # (a full disk fails every write: told once a minute)
                self._quiet.log(log, logging.ERROR, "write", "persisting %r failed: %s",
                                key[:60], exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._writing = None
                    self._cond.notify_all()

    def _sync(self, key: bytes) -> None:
        path = self.path_for(key)
        entry = self.store.acquire(key, touch=False)
        if entry is None:
            self._delete(path)
            self._has_file(key, False)
            return
        try:
            header = HEADER.pack(
                MAGIC, len(key), entry.fmt, entry.dtype, *entry.shape, entry.length
            )
            segments = self.store.segments(entry)
            crc = zlib.crc32(key, zlib.crc32(header))
            for segment in segments:
                crc = zlib.crc32(segment, crc)
            tmp = path.with_name(path.name + TMP_SUFFIX)
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)  # a crash's leftover (or a link put there: never followed)
                with open(tmp, "xb", opener=_private) as f:
                    f.write(header)
                    f.write(CRC.pack(crc))
                    f.write(key)
                    for segment in segments:
                        f.write(segment)
                os.replace(tmp, path)
            except OSError:
                self._remove_stale(key, tmp, path)
                raise
            self._has_file(key, True)
            self.files_written += 1
        finally:
            self.store.release(entry)

    def _has_file(self, key: bytes, present: bool) -> None:
        with self._cond:
            if present:
                self._files.add(key)
            else:
                self._files.discard(key)

    def _remove_stale(self, key: bytes, tmp: Path, path: Path) -> None:
        """After a failed write of ``key``: remove the partial ``tmp`` and the key's older
        file, which a restart would otherwise serve in place of the value in memory."""
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        else:
            self.files_deleted += 1
            self._quiet.log(log, logging.WARNING, "removed", "removed %s: the newer value of %r "
                            "could not be written", path, key[:60])  # (a full disk: every rewrite)
        self._has_file(key, False)

    def _delete(self, path: Path) -> None:
        """Delete a value's file (gone already is fine), counted; OSError if it cannot be."""
        try:
            path.unlink()
            self.files_deleted += 1
        except FileNotFoundError:
            pass

    def _load_file(self, path: Path) -> _Outcome:
        with open(path, "rb", buffering=0, opener=_private) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(HEADER.size + CRC.size)
            if len(head) < HEADER.size + CRC.size:
                return self._corrupt(path, "truncated header")
            magic, key_len, fmt, dtype, s0, s1, s2, s3, length = HEADER.unpack_from(head)
            (expected_crc,) = CRC.unpack_from(head, HEADER.size)
            if magic != MAGIC:  # another version's, or a header damaged (a power loss)
                if magic[:-1] == MAGIC[:-1]:
                    return _Outcome.FOREIGN
                return self._corrupt(path, "bad magic")
            if size != len(head) + key_len + length:
                return self._corrupt(path, f"size {size} does not match its header")
            key = f.read(key_len)
            try:
                check_key(key)
            except WireError as exc:
                return self._corrupt(path, str(exc))
            if self.path_for(key) != path:
                return self._corrupt(path, "file name does not match its key")
            pages = self.store.reserve(length, evict=False) if self.store.fits(length) else None
            if pages is None:  # no room: deleted, so that disk use follows the memory bound
                try:
                    self._delete(path)
                except OSError as exc:  # left there: read again at the next start
                    log.warning("cannot remove %s: %s", path, exc)
                return _Outcome.NO_ROOM
            self._files.add(key)
            crc = zlib.crc32(key, zlib.crc32(head[: HEADER.size]))
            try:
                for segment in self.store.arena.segments(pages, length):
                    if not _read_exactly(f, segment):
                        self.store.abort(pages)
                        return self._corrupt(path, "short read")
                    crc = zlib.crc32(segment, crc)
            except BaseException:  # an I/O error: the pages go back before it is reported
                self.store.abort(pages)
                raise
            if crc != expected_crc:
                self.store.abort(pages)
                return self._corrupt(path, "checksum mismatch")
        self.store.commit(
            key, length, fmt, dtype, (s0, s1, s2, s3), pages, oldest=True, notify=False
        )
        return _Outcome.LOADED

    def _corrupt(self, path: Path, why: str) -> _Outcome:
        """A file that holds no value whole: deleted (its key is lost either way), logged."""
        try:
            self._delete(path)
            done = "deleted"
        except OSError as exc:
            done = f"cannot be deleted ({exc.strerror or exc}): left"
        log.warning("persisted file %s is corrupt (%s): %s", path, why, done)  # (once: deleted)
        return _Outcome.CORRUPT


def _private(path: str, flags: int) -> int:
    """open()'s opener for the directory's files: a link is never followed, and a file
    created is its owner's alone."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _read_exactly(f, view: memoryview) -> bool:
    while view.nbytes:
        n = f.readinto(view)
        if not n:
            return False
        view = view[n:]
    return True
