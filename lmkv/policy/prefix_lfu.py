"""prefix_lfu: LFU with dynamic aging (LFU-DA) among the leaves of the prefix tree, with
the use counts of recently evicted chunks remembered.

A chunk's priority is the cache's age L plus the times it was used; the victim is the
leaf of lowest priority, and L rises to it. A one-pass chunk enters at L + 1 and goes
before any chunk used again, so one-pass prompts do not flush reused prefixes; a chunk
reused long ago falls behind as L rises, so old popularity ages out. A chunk evicted and
stored again (the next turn of a conversation that left the cache) comes back with its
count: the last ``HISTORY`` x (entries held) evicted keys keep theirs."""

from __future__ import annotations

from collections import OrderedDict

from .prefix_tree import Node, PrefixTreePolicy

HISTORY = 16  # evicted keys remembered, per entry held


class PrefixLFUPolicy(PrefixTreePolicy):
    name = "prefix_lfu"

    def __init__(self) -> None:
        super().__init__()
        self.age = 0.0  # L
        self.history: OrderedDict[str, int] = OrderedDict()  # evicted key -> count, oldest first

    def priority(self, node: Node) -> float:
        return self.age + node.count

    def inserted(self, key: str, parent: str | None) -> None:
        super().inserted(key, parent)
        seen = self.history.pop(key, 0)
        if seen:
            node = self.nodes[key]
            node.count += seen
            self._set(node)

    def _never_left(self, key: str) -> None:
        self.history.pop(key, None)  # no count to come back with

    def evicted(self, node: Node) -> None:
        self.age = max(self.age, node.priority)
        self.history[node.key] = node.count
        while len(self.history) > HISTORY * len(self.nodes) + 64:
            self.history.popitem(last=False)
