"""The prefix tree under the prefix-aware policies. Only leaves of the tree (chunks no cached
chunk continues) are eviction candidates, so a cached chunk's parent is always cached: a
chunk is only useful while its whole prefix is. ``PrefixTree`` keeps the nodes and tells its
subclass when a node was touched (inserted or used) and when a node became a leaf again;
``PrefixTreePolicy`` orders the leaves in one heap by a priority the subclass defines (lazy
deletion: O(log n) per operation)."""

from __future__ import annotations

import heapq
from abc import abstractmethod
from collections.abc import Callable, Collection
from dataclasses import dataclass

from .base import CachePolicy


@dataclass(slots=True, eq=False)
class Node:
    key: str
    parent: Node | None  # the node object, so a parent dropped and stored again is a new one
    count: int = 1  # accesses, insert included
    children: int = 0  # cached chunks whose parent this is
    priority: float = 0.0
    tick: int = 0  # when the priority was last set; ties go to the older


class PrefixTree(CachePolicy):
    node_type: type[Node] = Node

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self._tick = 0

    def __len__(self) -> int:
        return len(self.nodes)

    @abstractmethod
    def _touched(self, node: Node) -> None:
        """``node`` was inserted or used (its count is up to date)."""

    @abstractmethod
    def _leaf_again(self, node: Node) -> None:
        """The last cached chunk continuing ``node`` left: it is a candidate again."""

    def inserted(self, key: str, parent: str | None) -> None:
        up = self.nodes.get(parent) if parent is not None else None  # None: a root
        node = self.node_type(key, up)
        self.nodes[key] = node
        if up is not None:
            up.children += 1
        self._touched(node)

    def accessed(self, key: str) -> None:
        node = self.nodes.get(key)
        if node is not None:
            node.count += 1
            self._touched(node)

    def continuations(self, keys: Collection[str]) -> list[str]:
        """Held keys with one of ``keys`` among their ancestors; O(held) (a rare call: the
        quality gate dropping lossy chunks)."""
        roots = {self.nodes[k] for k in keys if k in self.nodes}
        below: dict[Node, bool] = {node: True for node in roots}
        out = []
        for key, node in self.nodes.items():
            path = []
            up: Node | None = node
            while up is not None and up not in below:
                path.append(up)
                up = up.parent
            found = up is not None and below[up]
            for n in path:
                below[n] = found
            if found and node not in roots:
                out.append(key)
        return out

    def removed(self, key: str) -> None:
        node = self.nodes.pop(key, None)
        if node is None:
            return
        # an inner chunk dropped by the cache (not a victim) leaves its children in place;
        # their parent object is no longer in ``nodes``, so their removal touches nothing live
        parent = node.parent
        if parent is not None and self.nodes.get(parent.key) is parent:
            parent.children -= 1
            if parent.children == 0:
                self._leaf_again(parent)


class PrefixTreePolicy(PrefixTree):
    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[float, int, str]] = []  # (priority, tick, key); stale ones skipped

    @abstractmethod
    def priority(self, node: Node) -> float:
        """Lower is evicted first."""

    def evicted(self, node: Node) -> None:  # noqa: B027 - an optional hook
        """The policy's victim ``node`` left the cache (aging hooks in here)."""

    def _touched(self, node: Node) -> None:
        self._set(node)

    def _leaf_again(self, node: Node) -> None:
        self._push(node)

    def victim(self, evictable: Callable[[str], bool]) -> str | None:
        skipped = []
        found = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            _, tick, key = entry
            node = self.nodes.get(key)
            if node is None or node.tick != tick or node.children > 0:
                continue  # stale: gone, re-prioritised, or no longer a leaf
            if not evictable(key):
                skipped.append(entry)
                continue
            found = key
            self.evicted(node)
            break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if found is None and skipped:
            return None
        return found

    def _set(self, node: Node) -> None:
        self._tick += 1
        node.tick = self._tick
        node.priority = self.priority(node)
        if not node.children:
            self._push(node)

    def _push(self, node: Node) -> None:
        heapq.heappush(self._heap, (node.priority, node.tick, node.key))
        if len(self._heap) > 4 * len(self.nodes) + 64:  # on a push: a cache that never
            self._compact()  # fills never asks for a victim

    def _compact(self) -> None:
        """Drop the stale heap entries (amortised O(1) per operation)."""
        self._heap = [(n.priority, n.tick, k) for k, n in self.nodes.items() if not n.children]
        heapq.heapify(self._heap)
