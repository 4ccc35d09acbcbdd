"""The contract every storage tier below the hot cache implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

Arrived = Callable[[int, int], None]  # (index in the batch, bytes read): a value is in place


class StorageBackend(ABC):
    """A key -> bytes store below the hot cache (disk, Redis, lm://, Mooncake).

    Contract:
    - Keys are ASCII strings of at most 150 bytes (the lm:// key field's size).
    - Values are opaque, already framed and checksummed bytes (see lmkv.codec): a backend
      never interprets them.
    - Calls are blocking and need not be thread-safe: the Tier above a backend makes one
      call at a time (from lmkv's I/O worker, and lookups from the engine's threads), but
      for ``contains`` where ``concurrent_contains`` is set (below). Every
      call that touches a network or a device is bounded by a timeout.
    - Failures raise ``BackendError`` (or a subclass); the caller turns them into a
      recompute, a log line and a metric. A backend never returns wrong bytes silently:
      a corrupt value is detected by the codec frame's checksum above it.
    - Calls take lists so that a backend can batch (pipeline, multi-get); one that cannot
      batch loops inside.
    - Every method below the abstract ones has a working default, so callers never probe
      for capabilities; a wrapper forwards every method, the defaults included.
    """

    num_evictions: int = 0  # entries it dropped to stay within its bounds (0: the store's own business)
    num_unreadable: int = 0  # entries it dropped because they could not be read (served as misses)
    # puts it declined without failing (a full store that evicts on its own time): not stored
    num_not_stored: int = 0
    # contains() reads local state only (an index in memory): it may run beside any other
    # call (the Tier does not make lookups wait), and its answer says nothing of the store's health
    concurrent_contains: bool = False
    # the client reconnects by itself after a failed call: keep it rather than make a new one
    reconnects: bool = False
    # a read can see a value that another client overwrites meanwhile (parts of both): a
    # frame failing its checksum is then no proof the stored value is bad, and is not
    # removed (the save of the recomputed chunk overwrites it if it is)
    torn_reads: bool = False

    @abstractmethod
    def put(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        """Store each (key, value); an existing key is overwritten."""

    @abstractmethod
    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values for ``keys`` in order; None where absent."""

    @abstractmethod
    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored (no payload transfer)."""

    def get_into(self, key: str, out: memoryview) -> int | None:
        """Read ``key``'s value into ``out``; returns its length, or None if absent or larger
        than ``out``. Backends that can read in place (files, RDMA) override this."""
        value = self.get([key])[0]
        if value is None or len(value) > len(out):
            return None
        out[: len(value)] = value
        return len(value)

    def get_into_many(self, keys: Sequence[str], outs: Sequence[memoryview],
                      arrived: Arrived | None = None) -> list[int | None]:
        """get_into for several keys in one batch (lengths, None for misses). Remote
        backends override it to pipeline the requests: one round trip, not one per key.
        ``arrived(i, n)`` is called once for each value read, once its n bytes are in
        ``outs[i]`` and before this returns, possibly on another thread: the caller checks
        each value while the others are still on their way. ``arrived`` must not raise."""
        lengths = [self.get_into(key, out) for key, out in zip(keys, outs, strict=True)]
        report(lengths, arrived)
        return lengths

    def will_get(self, keys: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """A hint: ``keys`` will be asked for soon (a run of chunks read in batches). A
        backend may start fetching them; the default does nothing. Never raises."""

    def remove(self, keys: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """Delete these keys where present (a corrupt value, say). The default keeps them:
        the codec frame's checksum rejects such a value again on every read."""

    def register_memory(self, region: memoryview) -> None:  # noqa: B027 - optional hook
        """``region`` (lmkv's chunk pool) will be the source and target of puts and
        get_into; backends with zero-copy transfers register it."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and files."""


class BackendError(RuntimeError):
    """A storage tier failed (I/O error, timeout, refused, protocol violation)."""


def report(lengths: Sequence[int | None], arrived: Arrived | None) -> None:
    """``arrived`` for each value read among ``lengths``, a batch read before the call."""
    if arrived is not None:
        for i, n in enumerate(lengths):
            if n is not None:
                arrived(i, n)
