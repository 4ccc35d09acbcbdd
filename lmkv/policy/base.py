"""CachePolicy: which chunk a bounded cache gives up, and which it does not keep at all.

The cache owns the entries; the policy only sees keys. The cache reports every insert,
hit and removal, and asks for a victim when it needs room. A chunk names its prefix
parent (the chunk before it in the same prompt, None for a first chunk or a content-keyed
RAG chunk); a prefix-aware policy uses it to evict leaves first. Every operation is O(1)
or O(log n) in the number of entries. A policy never returns a key the cache marks as not
evictable (a referenced or pinned chunk).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection


class CachePolicy(ABC):
    name: str = ""

    @abstractmethod
    def inserted(self, key: str, parent: str | None) -> None:
        """``key`` entered the cache (``parent``, when given, is in it)."""

    @abstractmethod
    def accessed(self, key: str) -> None:
        """A hit on ``key`` (or a store of a key already held)."""

    @abstractmethod
    def removed(self, key: str) -> None:
        """``key`` left the cache (evicted, replaced or dropped by the cache)."""

    @abstractmethod
    def victim(self, evictable: Callable[[str], bool]) -> str | None:
        """The key to evict next among those ``evictable`` accepts; None if there is none.
        The cache then removes it (and calls ``removed``)."""

    def continuations(self, keys: Collection[str]) -> list[str]:
        """The held keys after any of ``keys`` in their prompts (children, theirs, ...), for
        a cache that drops inner chunks. A policy that keeps no prefix tree knows none."""
        return []

    def kept(self, key: str) -> None:
        """The victim ``key`` could not be removed after all (a failed delete): it stays, as
        a chunk that entered anew (so the next victims are others), not as one that came
        back. For caches whose chunks name no parent (the disk tier)."""
        self.removed(key)
        self._never_left(key)
        self.inserted(key, None)

    def _never_left(self, key: str) -> None:  # noqa: B027 - an optional hook
        """Forget what was remembered of ``key`` as a chunk that left (``kept``)."""

    def admit(self, key: str, parent: str | None, contains: Callable[[str], bool]) -> bool:
        """Whether a new chunk is worth keeping. By default every chunk whose prefix parent
        is held: a chunk whose parent is gone can never be served (lookups stop at the gap)."""
        return parent is None or contains(parent)

    def __len__(self) -> int:
        return 0
