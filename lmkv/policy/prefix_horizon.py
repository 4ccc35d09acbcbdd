"""prefix_horizon: keep the chunks held for a horizon that adapts, and give up a new chunk
before one still inside it; among the leaves of the prefix tree.

For reuse that comes back after more chunks than the cache holds (a conversation's next
turn), LRU keeps the newest chunks and loses each one just before its reuse. This policy
holds what it has for ``horizon`` inserts after its last use (an insert: a chunk stored, or
refused, as if it entered and left at once): the victim is the oldest leaf
past the horizon if there is one, else the newest leaf used only once (a new chunk waits
its turn instead of pushing out one that is nearer its reuse), else the newest leaf used
again (in a loop larger than the cache, part of the loop stays). A chunk evicted or refused
is remembered (``HISTORY`` keys per entry held, with its use count and when it left), and
its return moves the horizon:
- one that left past the horizon: held longer, it would have served: the horizon grows;
- one given up early (inside the horizon, or refused) that returns within (entries held)
  inserts, where LRU would still have held it: the horizon shrinks ``SHRINK`` times as
  fast. At 0 the policy is prefix LRU.
A returning chunk keeps its use count, so a conversation seen twice counts as used again.
With ``scale`` given the horizon is fixed instead: ``scale`` x (entries held) inserts.
Every operation is O(log n): two heaps with lazy deletion.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from .prefix_tree import Node, PrefixTree

HISTORY = 16  # keys remembered after they leave, per entry held
STEP = 0.01  # horizon change per returning chunk, in entries held
SHRINK = 10  # a loss against LRU weighs this many gains


@dataclass(slots=True, eq=False)
class HorizonNode(Node):
    clock: int = 0  # inserts counted when last used


class Gone(NamedTuple):
    count: int  # uses while held
    early: bool  # given up inside the horizon (or refused), not past it
    clock: int  # inserts counted when it left


class PrefixHorizonPolicy(PrefixTree):
    name = "prefix_horizon"
    node_type = HorizonNode

    def __init__(self, scale: float | None = None) -> None:
        super().__init__()
        self.scale = scale  # None: the horizon adapts; else it is scale x len(self) inserts
        self.horizon = 0.0  # inserts (adaptive)
        self.clock = 0  # inserts so far
        self.history: OrderedDict[str, Gone] = OrderedDict()  # oldest first
        self._oldest: list[tuple[int, str]] = []  # (tick, key): every leaf
        self._newest: list[tuple[bool, int, str]] = []  # (used again, -tick, key): every leaf

    def admit(self, key: str, parent: str | None, contains: Callable[[str], bool]) -> bool:
        if parent is None or contains(parent):
            return True
        self.refuse(key)
        return False

    def inserted(self, key: str, parent: str | None) -> None:
        self.clock += 1
        gone = self.history.pop(key, None)
        if gone is not None:
            self._adapt(gone)
        super().inserted(key, parent)
        if gone is not None:  # it keeps its use count
            node = self.nodes[key]
            node.count += gone.count
            self._touched(node)

    def victim(self, evictable: Callable[[str], bool]) -> str | None:
        key = self._pop(self._oldest, evictable, self._past)
        early = key is None
        if early:
            key = self._pop(self._newest, evictable)
        if key is not None:
            self._remember(key, self.nodes[key].count, early)
        return key

    def _never_left(self, key: str) -> None:
        self.history.pop(key, None)  # not a return that moves the horizon

    def crowded(self) -> bool:
        """No leaf is past the horizon: a victim now would be a newest leaf."""
        return self._pop(self._oldest, lambda _: True, self._past) is None

    def refuse(self, key: str) -> None:
        """``key``, not held, is given up before it enters (as a refused chunk is); it counts
        as an insert, one that left at once."""
        self.clock += 1
        gone = self.history.get(key)
        self._remember(key, (gone.count if gone else 0) + 1, early=True)

    def _past(self, node: HorizonNode) -> bool:
        horizon = self.horizon if self.scale is None else self.scale * len(self.nodes)
        # used before this: past the horizon; at 0 every leaf is (the clock counts inserts
        # only: a leaf used since the last insert is not "before" it, yet LRU may take it)
        return horizon <= 0 or node.clock < self.clock - horizon

    def _adapt(self, gone: Gone) -> None:
        if self.scale is not None:
            return
        step = STEP * len(self.nodes)
        if not gone.early:
            self.horizon += step
        elif self.clock - gone.clock < len(self.nodes):
            self.horizon = max(0.0, self.horizon - SHRINK * step)

    def _remember(self, key: str, count: int, early: bool) -> None:
        self.history[key] = Gone(count, early, self.clock)
        self.history.move_to_end(key)
        while len(self.history) > HISTORY * len(self.nodes) + 64:
            self.history.popitem(last=False)

    def _touched(self, node: HorizonNode) -> None:
        self._tick += 1
        node.tick = self._tick
        node.clock = self.clock
        self._leaf_again(node)

    def _leaf_again(self, node: HorizonNode) -> None:
        if node.children:
            return
        heapq.heappush(self._oldest, (node.tick, node.key))
        heapq.heappush(self._newest, (node.count >= 2, -node.tick, node.key))
        if len(self._oldest) + len(self._newest) > 8 * len(self.nodes) + 64:
            self._compact()  # here too: a cache that never fills never asks for a victim

    def _pop(self, heap: list, evictable: Callable[[str], bool],
             wanted: Callable[[HorizonNode], bool] | None = None) -> str | None:
        """The first live leaf of ``heap`` that ``evictable`` accepts; None at the first one
        ``wanted`` rejects. Stale entries (gone, used since, or no longer a leaf) are dropped."""
        skipped = []
        found = None
        while heap:
            tick, key = heap[0][-2:]
            node = self.nodes.get(key)
            if node is None or node.tick != abs(tick) or node.children:
                heapq.heappop(heap)
                continue
            if wanted is not None and not wanted(node):
                break
            if not evictable(key):
                skipped.append(heapq.heappop(heap))
                continue
            found = key
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    def _compact(self) -> None:
        """Drop the stale heap entries (amortised O(1) per operation)."""
        leaves = [n for n in self.nodes.values() if not n.children]
        self._oldest = [(n.tick, n.key) for n in leaves]
        self._newest = [(n.count >= 2, -n.tick, n.key) for n in leaves]
        for heap in (self._oldest, self._newest):
            heapq.heapify(heap)
