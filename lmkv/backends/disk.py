"""The local disk tier: one file per chunk, written atomically, capped in size.

Files are named by a hash of the key. A write goes to a temporary file that is renamed
into place, so a crash mid-write leaves either the old entry or none, never a torn one
(and the frame checksum catches anything else). The index is rebuilt from the directory
at start, so the cache survives restarts; a cache policy (lmkv.policy, by name) picks the
files evicted to stay under the cap. The backend contract carries no prefix parents, so
every file is a root to the policy: prefix_lfu is LFU with aging here, lru plain LRU.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from ..policy import CachePolicy, make_policy
from .base import BackendError, StorageBackend

log = logging.getLogger(__name__)
SUFFIX = ".kv"


class DiskBackend(StorageBackend):
    def __init__(self, root: str | Path, capacity_bytes: int, policy: CachePolicy | str = "lru"):
        self.root = Path(root)
        self.policy = make_policy(policy) if isinstance(policy, str) else policy  # over file names
        self.capacity = capacity_bytes
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise BackendError(f"cannot create the disk tier directory {self.root}: {e}") from e
        self.index: dict[str, int] = {}  # file name -> bytes
        self.used = 0
        self.num_evictions = 0
        self._rebuild_index()

    def _rebuild_index(self) -> None:
        entries = []
        for entry in os.scandir(self.root):
            if entry.name.endswith(".tmp"):  # a write interrupted by a crash
                os.unlink(entry.path)
            elif entry.name.endswith(SUFFIX) and entry.is_file():
                st = entry.stat()
                entries.append((st.st_mtime, entry.name, st.st_size))
        for _, name, size in sorted(entries):  # oldest first
            self._add(name, size)
        self._evict_to(self.capacity)
        if entries:
            log.info("disk tier %s: %d entries, %.1f MB", self.root, len(self.index), self.used / 1e6)

    @staticmethod
    def _name(key: str) -> str:
        return hashlib.blake2b(key.encode(), digest_size=16).hexdigest() + SUFFIX

    def put(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        for key, value in items:
            size = len(value)
            if size > self.capacity:
                raise BackendError(f"a {size}-byte entry exceeds the disk tier cap ({self.capacity})")
            name = self._name(key)
            self._forget(name)
            self._evict_to(self.capacity - size)
            tmp = self.root / f".{name}.{os.getpid()}.tmp"
            try:
                with open(tmp, "wb") as f:
                    f.write(value)
                os.replace(tmp, self.root / name)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise BackendError(f"disk tier write failed: {e}") from e
            self._add(name, size)

    def _add(self, name: str, size: int) -> None:
        self.index[name] = size
        self.used += size
        self.policy.inserted(name, None)

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            name = self._name(key)
            if name not in self.index:
                out.append(None)
                continue
            try:
                out.append((self.root / name).read_bytes())
                self.policy.accessed(name)
            except FileNotFoundError:
                self._forget(name)
                out.append(None)
            except OSError as e:
                raise BackendError(f"disk tier read failed: {e}") from e
        return out

    def get_into(self, key: str, out: memoryview) -> int | None:
        name = self._name(key)
        if name not in self.index:
            return None
        size = self.index[name]
        if size > len(out):
            return None  # not a frame this reader can hold; treated as a miss
        try:
            with open(self.root / name, "rb", buffering=0) as f:
                n = f.readinto(out[:size])
        except FileNotFoundError:
            self._forget(name)
            return None
        except OSError as e:
            raise BackendError(f"disk tier read failed: {e}") from e
        self.policy.accessed(name)
        return n

    def get_into_many(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[int | None]:
        """get_into for a batch, with the kernel told first that all of its files are
        wanted (POSIX_FADV_WILLNEED): their reads are queued together instead of one file
        at a time (31 cold 1 MB files: ~1.5x faster here)."""
        if hasattr(os, "posix_fadvise"):
            for key in keys:
                name = self._name(key)
                if name not in self.index:
                    continue
                try:
                    fd = os.open(self.root / name, os.O_RDONLY)
                except OSError:
                    continue  # get_into reports it
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)
        return [self.get_into(key, out) for key, out in zip(keys, outs, strict=True)]

    def contains(self, keys: Sequence[str]) -> list[bool]:
        return [self._name(k) in self.index for k in keys]

    def remove(self, keys: Sequence[str]) -> None:
        for key in keys:
            name = self._name(key)
            if self._forget(name):
                (self.root / name).unlink(missing_ok=True)

    def _forget(self, name: str) -> bool:
        size = self.index.pop(name, None)
        if size is None:
            return False
        self.used -= size
        self.policy.removed(name)
        return True

    def _evict_to(self, limit: int) -> None:
        while self.used > limit and self.index:
            name = self.policy.victim(lambda _: True)  # no reader holds a file open across calls
            assert name is not None, "the policy lost track of the disk tier's files"
            self._forget(name)
            self.num_evictions += 1
            (self.root / name).unlink(missing_ok=True)
