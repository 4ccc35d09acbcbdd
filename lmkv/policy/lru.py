"""LRU: evict the least recently used chunk (what a textbook LRU cache does)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from .base import CachePolicy


class LRUPolicy(CachePolicy):
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._order)

    def inserted(self, key: str, parent: str | None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def accessed(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def removed(self, key: str) -> None:
        self._order.pop(key, None)

    def victim(self, evictable: Callable[[str], bool]) -> str | None:
        # referenced chunks are few (the requests in flight): the scan stops early
        for key in self._order:
            if evictable(key):
                return key
        return None

    def admit(self, key: str, parent: str | None, contains: Callable[[str], bool]) -> bool:
        return True  # textbook LRU keeps everything it is given
