"""StorageManager: the hot cache over an ordered stack of lower tiers.

- put: into the hot cache now; lower tiers are written in the background.
- lookup: how many leading chunks some tier holds (indexes only, no payload moved).
- fetch: the leading chunks, each from the first tier that has it, promoted to the hot
  cache. A lower-tier failure (I/O error, corrupt frame) ends the prefix there: the rest
  is recomputed, and the failure is logged and counted.
- prefetch: the same in the background, for requests still waiting in the engine's queue.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..backends.base import BackendError, StorageBackend
from ..codec import CODECS, FrameError, decode_into, encode
from ..codec.calibration import CacheGenTable
from ..codec.frame import CODEC_BYTE
from ..memory import ChunkBuffer, MemoryPool
from ..metrics import LMKVMetrics
from .breaker import CircuitBreaker
from .hot_cache import HotCache
from .io import IOWorker

log = logging.getLogger(__name__)


LOAD_BATCH = 8  # chunks asked of a tier at once when loading a run of them


@dataclass
class Tier:
    name: str
    backend: StorageBackend
    codec: str = "raw"
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    table: CacheGenTable | None = None  # the model's calibration, for cachegen frames

    @property
    def lossy(self) -> bool:
        return self.codec == "cachegen"


class StorageManager:
    def __init__(self, pool: MemoryPool, tiers: list[Tier], metrics: LMKVMetrics,
                 io_queue_size: int = 256, keep_hot: bool = True):
        self.hot = HotCache(pool)
        # keep_hot False (LMCache's local_cpu: false): the pool only stages loads and saves;
        # no chunk stays in it, and the tiers below serve every hit
        self.keep_hot = keep_hot
        self.tiers = tiers
        self.metrics = metrics
        self.io = IOWorker(io_queue_size)
        region = memoryview(pool.storage.numpy()).cast("B")
        for tier in tiers:
            tier.backend.register_memory(region)
        self._inflight: dict[str, Future] = {}  # key -> running fetch of that key
        self._lock = threading.Lock()

    # ---- writes -------------------------------------------------------------------
    def allocate(self) -> ChunkBuffer | None:
        buf = self.hot.allocate()
        if buf is None:
            self.metrics.dropped.labels("no_memory").inc()
        return buf

    def put(self, key: str, buf: ChunkBuffer) -> None:
        """Store ``buf`` under ``key``: hot now, lower tiers in the background. The caller
        keeps its own reference and releases it as usual."""
        if self.keep_hot:
            self.hot.put(key, buf)
        self.metrics.stored_chunks.inc()
        self.metrics.hot_chunks.set(len(self.hot))
        for tier in self.tiers:
            buf.retain()
            fut = self.io.submit(lambda t=tier, b=buf: self._write(t, key, b))
            if fut is None:
                buf.release()
                self.metrics.dropped.labels(f"save_{tier.name}").inc()

    def _write(self, tier: Tier, key: str, buf: ChunkBuffer) -> None:
        if not tier.breaker.closed:
            buf.release()
            self.metrics.dropped.labels(f"save_{tier.name}").inc()
            return
        try:
            codec, table = tier.codec, tier.table
            if codec == "cachegen" and table is None:  # make_lossless ran in between
                codec = "zstd"
            frame = encode(buf, key, codec, table)
            start = time.perf_counter()
            before = tier.backend.num_evictions
            tier.backend.put([(key, frame)])
            self.metrics.tier_seconds.labels(tier.name, "put").observe(time.perf_counter() - start)
            self.metrics.tier_bytes.labels(tier.name, "put").inc(len(frame))
            self.metrics.evictions.labels(tier.name).inc(
                max(0, tier.backend.num_evictions - before))
            tier.breaker.success()
        except BackendError as e:
            self._failed(tier, "put", e)
        finally:
            buf.release()

    # ---- reads --------------------------------------------------------------------
    def lookup(self, keys: list[str]) -> int:
        """Number of leading ``keys`` stored in some tier."""
        n = 0
        remaining = list(keys)
        while n < len(remaining) and self.hot.contains(remaining[n]):
            n += 1
        rest = remaining[n:]
        if not rest:
            return n
        found = [False] * len(rest)
        for tier in self.tiers:
            if not tier.breaker.closed:
                continue
            try:
                here = tier.backend.contains(rest)
                tier.breaker.success()
            except BackendError as e:
                self._failed(tier, "contains", e)
                continue
            found = [a or b for a, b in zip(found, here, strict=True)]
        for f in found:
            if not f:
                break
            n += 1
        return n

    def fetch(self, keys: list[str]) -> list[ChunkBuffer]:
        """The longest prefix of ``keys`` that can be had, as chunks in the hot cache with a
        reference for the caller each. Chunks below the hot cache are read in one job on
        the I/O worker, ahead of background work."""
        out: list[ChunkBuffer] = []
        for key in keys:
            buf = self.hot.get(key)
            if buf is None:
                break
            self.metrics.tier_hits.labels("hot").inc()
            out.append(buf)
        rest = keys[len(out):]
        if rest and self.tiers:
            out += self.io.submit(lambda: self._load_run(rest), urgent=True).result()
        return out

    def _load_run(self, keys: list[str]) -> list[ChunkBuffer]:
        """On the I/O thread: the leading ``keys`` that some tier has, each retained. Each
        tier is asked for a batch of chunks at once (one pipelined round trip)."""
        out: list[ChunkBuffer] = []
        for start in range(0, len(keys), LOAD_BATCH):
            batch = keys[start : start + LOAD_BATCH]
            loaded = self._load_batch(batch, prefetch=False)
            for key in batch:
                buf = loaded.pop(key, None) or self.hot.get(key)
                if buf is None:
                    break
                out.append(buf)
            for buf in loaded.values():  # loaded beyond a missing chunk
                buf.release()
            if len(out) < start + len(batch):
                break
        return out

    def prefetch(self, keys: list[str]) -> None:
        """Pull the leading stored chunks of ``keys`` into the hot cache in the background."""
        if not self.keep_hot:
            return
        for key in keys:
            if self.hot.contains(key):
                continue
            with self._lock:
                if key in self._inflight:
                    continue
                fut = self.io.submit(lambda k=key: self._load(k, prefetch=True))
                if fut is None:
                    self.metrics.dropped.labels("prefetch").inc()
                    return
                self._inflight[key] = fut
                fut.add_done_callback(lambda _f, k=key: self._done(k))

    def _done(self, key: str) -> None:
        with self._lock:
            self._inflight.pop(key, None)

    def _load(self, key: str, prefetch: bool) -> bool:
        """On the I/O thread: read ``key`` from the first tier that has it into the hot cache."""
        if self.hot.contains(key):
            return True
        loaded = self._load_batch([key], prefetch)
        for buf in loaded.values():
            buf.release()
        return bool(loaded)

    def _load_batch(self, keys: list[str], prefetch: bool) -> dict[str, ChunkBuffer]:
        """On the I/O thread: read those of ``keys`` missing from the hot cache, each from
        the first tier that has it, one batch per tier. Returns the chunks read, put in the
        hot cache and retained for the caller."""
        loaded: dict[str, ChunkBuffer] = {}
        missing = [k for k in keys if not self.hot.contains(k)]
        for tier in self.tiers:
            if not missing:
                break
            if tier.breaker.closed:
                missing = self._read_tier(tier, missing, prefetch, loaded)
        return loaded

    def _read_tier(self, tier: Tier, keys: list[str], prefetch: bool,
                   loaded: dict[str, ChunkBuffer]) -> list[str]:
        """Read ``keys`` from one tier into hot-cache chunks (added to ``loaded``); returns
        the keys it did not have or could not deliver intact."""
        bufs = []
        for _ in keys:
            buf = self.hot.allocate()
            if buf is None:
                self.metrics.dropped.labels("no_memory").inc()
                break
            bufs.append(buf)
        batch, missing = keys[: len(bufs)], keys[len(bufs) :]
        if not batch:
            return missing
        start = time.perf_counter()
        try:
            if tier.codec == "raw":
                frames = [memoryview(buf.frame.numpy()) for buf in bufs]
                lengths = tier.backend.get_into_many(batch, frames)
                values = [None if n is None else f[:n] for f, n in zip(frames, lengths, strict=True)]
            else:
                values = tier.backend.get(batch)
        except BackendError as e:
            for buf in bufs:
                buf.release()
            self._failed(tier, "get", e)
            return keys
        tier.breaker.success()
        self.metrics.tier_seconds.labels(tier.name, "get").observe(time.perf_counter() - start)
        for key, buf, data in zip(batch, bufs, values, strict=True):
            if data is None:
                buf.release()
                missing.append(key)
                continue
            try:
                decode_into(data, buf, key, tier.table)
            except FrameError as e:
                buf.release()
                missing.append(key)
                log.warning("lmkv: a chunk from %s is corrupt (%s); it will be recomputed",
                            tier.name, e)
                self.metrics.errors.labels(tier.name, "corrupt").inc()
                try:
                    tier.backend.remove([key])
                except BackendError as e:
                    log.warning("lmkv: cannot remove the corrupt chunk from %s (%s)", tier.name, e)
                continue
            buf.lossy = data[CODEC_BYTE] == CODECS["cachegen"]
            self.metrics.tier_bytes.labels(tier.name, "get").inc(len(data))
            if self.keep_hot:
                self.hot.put(key, buf)
            loaded[key] = buf
            self.metrics.tier_hits.labels(tier.name).inc()
            if prefetch:
                self.metrics.prefetched_chunks.inc()
        self.metrics.hot_chunks.set(len(self.hot))
        return missing

    def _failed(self, tier: Tier, op: str, error: BackendError) -> None:
        pause = tier.breaker.failure()
        log.warning("lmkv: %s %s failed: %s; skipping %s for %.0f s (chunks are recomputed)",
                    tier.name, op, error, tier.name, pause)
        self.metrics.errors.labels(tier.name, op).inc()

    def make_lossless(self) -> list[str]:
        """The quality gate's fallback: lossy tiers write zstd from now on and stop serving
        what they stored lossy (such chunks are then rejected, dropped and recomputed), and
        the hot cache drops the chunks it holds decoded from lossy frames. Returns the names
        of the tiers changed."""
        changed = []
        for tier in self.tiers:
            if tier.lossy:
                tier.codec, tier.table = "zstd", None
                changed.append(tier.name)
        self.hot.drop_lossy()
        self.metrics.hot_chunks.set(len(self.hot))
        return changed

    def close(self) -> None:
        """Finish background writes, then stop the I/O worker and drop the hot cache."""
        self.io.drain()
        self.io.close()
        self.hot.clear()
        for tier in self.tiers:
            tier.backend.close()

