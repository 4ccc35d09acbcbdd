"""prefix_adaptive: prefix_horizon with a fixed horizon picked online among a few, each
tried on a sample of the keys (SHARDS-style spatial sampling).

Which horizon serves most depends on the workload and the cache size: 0 (prefix LRU)
where LRU already holds a chunk until its reuse or where recency predicts it; 3-12x the
entries held where a conversation's next turn comes back after more chunks than the cache
holds. One key in ``RATE`` (by a hash of the key) is sampled, and each horizon in
``SCALES`` runs as a shadow cache of keys over the sampled keys only, holding 1/``RATE`` of
the entries the real cache holds. A sampled key's parent in a shadow is its nearest sampled
ancestor (the chunks between are taken as held). Keys are sampled, not prefix chains by
their root, because a few roots carry everything (every request of the Mooncake
conversation trace starts with the same block). A shadow refuses a new key when none of its
leaves is past the horizon: in the real cache the next chunk of that prompt would evict
this one and the rest of the prompt would be refused.

Shadow hits decay by e every ``WINDOW`` sampled references. The real cache evicts by the
horizon whose shadow has the most hits among those ahead of prefix LRU's shadow by ``Z``
standard deviations of the paired difference (the references where one hits and the other
does not), so it stays prefix LRU unless a horizon is clearly better; it moves to another
horizon only when that one's lead passes ``MARGIN``. It keeps one prefix_horizon structure,
whose horizon is read only when a victim is picked, so switching costs nothing.

The cache's capacity is not passed to policies: it is taken as the entries held when the
cache asks for its first victim after an insert (it asks only when full; the victims after
it, for one large entry or a batch of slots, pass through smaller lengths, and a cache that
starts over-full, as a disk tier restarted with a lower cap, shrinks to its size before
the next insert); until then a shadow holds at most twice the sampled share of what the
cache holds.
Every operation is O(log n): the real structure, and one step of each shadow per sampled key.
"""

from __future__ import annotations

import math
import zlib
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from .base import CachePolicy
from .prefix_horizon import PrefixHorizonPolicy

RATE = 16  # one key in RATE is sampled
SCALES = (0.0, 3.0, 6.0, 12.0)  # candidate horizons in entries held; [0]: prefix LRU
WINDOW = 16384  # sampled references over which shadow hits decay by e
Z = 3.0  # standard deviations a horizon must lead prefix LRU by
MARGIN = 0.02  # share of hits by which another horizon must lead the current one
RECENT = 4096  # keys that left, remembered with their nearest sampled ancestor
UNKNOWN = ""  # a parent neither held nor remembered: its key is taken as a root


def _sampled(key: str) -> bool:
    return zlib.crc32(key.encode()) % RATE == 0


def _any(_: str) -> bool:
    return True


@dataclass(slots=True, eq=False)
class Shadow:
    """One candidate horizon run over the sampled keys."""

    policy: PrefixHorizonPolicy
    held: set[str] = field(default_factory=set)
    hits: float = 0.0  # decayed by WINDOW
    apart: float = 0.0  # decayed references where exactly one of this and prefix LRU hit
    hit: bool = False  # at the last reference

    def reference(self, key: str, ancestor: str | None, capacity: float) -> bool:
        """A use of sampled ``key``, whose nearest sampled ancestor is ``ancestor``; whether it
        hit. The shadow holds at most ``capacity`` keys (one more while it admits)."""
        if key in self.held:
            self.policy.accessed(key)
            return True
        full = len(self.held) >= capacity
        if full and key not in self.policy.history and self.policy.crowded():
            self.policy.refuse(key)  # a returning key (history) is kept, as in the real cache
            return False
        while len(self.held) >= capacity:
            victim = self.policy.victim(_any)
            if victim is None:
                break
            self.held.discard(victim)
            self.policy.removed(victim)
        if self.policy.admit(key, ancestor, self.held.__contains__):
            self.held.add(key)
            self.policy.inserted(key, ancestor)
        return False


class PrefixAdaptivePolicy(CachePolicy):
    name = "prefix_adaptive"

    def __init__(self) -> None:
        self.real = PrefixHorizonPolicy(SCALES[0])
        self.shadows = [Shadow(PrefixHorizonPolicy(s)) for s in SCALES]
        self.leader = 0  # index into SCALES: the horizon the real cache evicts by
        self.capacity: float | None = None  # of a shadow: entries held at a victim / RATE
        self._inserted = True  # since the last victim
        self.ancestor: dict[str, str | None] = {}  # held key -> its nearest sampled ancestor
        self.recent: OrderedDict[str, str | None] = OrderedDict()  # the same, for keys gone

    def __len__(self) -> int:
        return len(self.real)

    @property
    def nodes(self) -> dict:
        """The real cache's prefix tree (key -> node), as the other prefix policies hold it."""
        return self.real.nodes

    def admit(self, key: str, parent: str | None, contains: Callable[[str], bool]) -> bool:
        if self.real.admit(key, parent, contains):
            return True
        ancestor = self._mark(parent)
        self._forget(key, ancestor)
        if _sampled(key):
            self._reference(key, ancestor)
        return False

    def inserted(self, key: str, parent: str | None) -> None:
        self._inserted = True
        self.real.inserted(key, parent)
        ancestor = self.ancestor[key] = self._mark(parent)
        if _sampled(key):
            self._reference(key, ancestor)

    def accessed(self, key: str) -> None:
        self.real.accessed(key)
        if key in self.ancestor and _sampled(key):
            self._reference(key, self.ancestor[key])

    def removed(self, key: str) -> None:
        self.real.removed(key)
        if key in self.ancestor:
            self._forget(key, self.ancestor.pop(key))

    def kept(self, key: str) -> None:
        self.real.kept(key)  # still held: no reference for the shadows

    def continuations(self, keys: Collection[str]) -> list[str]:
        return self.real.continuations(keys)

    def victim(self, evictable: Callable[[str], bool]) -> str | None:
        if self._inserted:  # asked only when full: len is the capacity
            self.capacity = len(self.real) / RATE
            self._inserted = False
        return self.real.victim(evictable)

    def _mark(self, key: str | None) -> str | None:
        """The nearest sampled key at or above ``key`` (None: there is none, or unknown)."""
        if key is None or _sampled(key):
            return key
        ancestor = self.ancestor.get(key, UNKNOWN)
        if ancestor == UNKNOWN:
            ancestor = self.recent.get(key)
        return ancestor

    def _forget(self, key: str, ancestor: str | None) -> None:
        self.recent[key] = ancestor
        self.recent.move_to_end(key)
        if len(self.recent) > RECENT:
            self.recent.popitem(last=False)

    def _reference(self, key: str, ancestor: str | None) -> None:
        decay = 1.0 - 1.0 / WINDOW
        capacity = self.capacity
        if capacity is None:  # not full yet; keys the cache drops without a victim
            capacity = 2 * len(self.real) / RATE + 64  # must not pile up in the shadows
        base = self.shadows[0]
        for shadow in self.shadows:
            shadow.hit = shadow.reference(key, ancestor, capacity)
            shadow.hits = shadow.hits * decay + shadow.hit
        for shadow in self.shadows:
            shadow.apart = shadow.apart * decay + (shadow.hit != base.hit)
        ahead = [i for i, s in enumerate(self.shadows)
                 if i == 0 or s.hits - base.hits > Z * math.sqrt(s.apart) + 1]
        best = max(ahead, key=lambda i: self.shadows[i].hits)
        lead = self.shadows[self.leader].hits
        if self.leader not in ahead or self.shadows[best].hits > lead * (1 + MARGIN):
            self.leader = best
            self.real.scale = SCALES[best]
