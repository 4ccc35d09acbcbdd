"""prefix_lru: LRU among the leaves of the prefix tree (a chunk leaves only after every
cached chunk that continues it)."""

from __future__ import annotations

from .prefix_tree import Node, PrefixTreePolicy


class PrefixLRUPolicy(PrefixTreePolicy):
    name = "prefix_lru"

    def priority(self, node: Node) -> float:
        return float(self._tick)
