"""PageArena: the server's value memory, one mapping cut into fixed-size pages.

A value occupies ceil(nbytes / page_size) pages, not necessarily adjacent; sockets read
into and write from the pages directly (scatter/gather), so a value is copied once on
the way in and once on the way out. Because the mapping is allocated (and optionally
pre-faulted) once, the memory bound is exact and freed pages are reused without page
faults or allocator fragmentation.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Iterable

log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; not exported by Python 3.11's mmap module


class PageArena:
    def __init__(self, num_pages: int, page_size: int, prefault: bool = True) -> None:
        if num_pages <= 0 or page_size <= 0 or page_size % mmap.PAGESIZE:
            raise ValueError(f"bad arena geometry: {num_pages} pages of {page_size} bytes")
        self.page_size = page_size
        self.num_pages = num_pages
        self._mmap = mmap.mmap(
            -1, num_pages * page_size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
        _advise(self._mmap, mmap.MADV_HUGEPAGE)
        if prefault:
            self._prefault()
        self._view = memoryview(self._mmap)
        # LIFO stack of free page ids; popping from the end hands out page 0, 1, 2, ...
        # first, so fresh values tend to be contiguous (fewer segments per send/recv).
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return self.num_pages * self.page_size

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.page_size)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` pages, or None if fewer are free (nothing is taken then)."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def segments(self, pages: list[int], nbytes: int) -> list[memoryview]:
        """Writable views covering the first ``nbytes`` of ``pages``; runs of adjacent
        pages are merged into one view."""
        size = self.page_size
        views = []
        i = 0
        remaining = nbytes
        while remaining > 0:
            start = pages[i]
            run = 1
            while i + run < len(pages) and pages[i + run] == start + run:
                run += 1
            length = min(run * size, remaining)
            views.append(self._view[start * size : start * size + length])
            remaining -= length
            i += run
        return views

    def check_integrity(self, owned: Iterable[list[int]]) -> None:
        """Every page is either free or owned exactly once; raises AssertionError."""
        seen = list(self._free)
        for pages in owned:
            seen.extend(pages)
        if sorted(seen) != list(range(self.num_pages)):
            raise AssertionError(
                f"arena pages leaked or doubly owned: {len(seen)} accounted, "
                f"{len(set(seen))} distinct, {self.num_pages} total"
            )

    def close(self) -> None:
        self._view.release()
        self._mmap.close()

    def _prefault(self) -> None:
        try:
            self._mmap.madvise(_MADV_POPULATE_WRITE)
        except OSError:
            step = mmap.PAGESIZE  # older kernels: touch every page once
            for offset in range(0, len(self._mmap), step):
                self._mmap[offset] = 0


def _advise(m: mmap.mmap, option: int) -> None:
    try:
        m.madvise(option)
    except OSError as exc:  # e.g. transparent huge pages disabled
        log.debug("madvise(%d) failed: %s", option, exc)
