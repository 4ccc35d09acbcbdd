"""Tier: one storage tier below the hot cache: its backend, the codec its chunks are
framed with, its circuit breaker and its metrics. Chunks are encoded where they enter a
tier and decoded where they leave it, here and nowhere else. Backends need not be
thread-safe (base.py), while a tier is used from the I/O worker (reads, writes) and from the
thread that looks chunks up (the engine's scheduler, vLLM's lookup server): the tier makes
one backend call at a time, under its lock, but for ``contains`` of a backend that sets
``concurrent_contains`` (local state only), which runs beside any call. After a failed
read, reads wait out the breaker's interval, then a probe (a lookup of a key no chunk has)
runs on a thread of its own until the backend answers: a store that hangs holds that
thread, not a caller's."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field

from ..backends.base import BackendError, StorageBackend
from ..codec import Codec, ForeignFrame, FrameError, decode_into, encode, get_codec
from ..codec.cachegen import OutOfRange
from ..codec.calibration import CacheGenTable
from ..logs import LogThrottle
from ..memory import ChunkBuffer
from ..metrics import LMKVMetrics
from .breaker import CircuitBreaker

log = logging.getLogger(__name__)

LOCK_WAIT = 5.0  # seconds a lookup waits for the backend while another call holds it
PROBE_KEY = "lmkv-probe@" + "0" * 32  # looked up to learn whether a failed backend answers


class CountedLock:
    """A re-entrant lock that counts the times it was taken: ``taken`` tells one holding of
    it (a call in progress) from the next."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.taken = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking, timeout):
            self.taken += 1
            return True
        return False

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@dataclass(eq=False)
class Tier:
    name: str
    backend: StorageBackend
    codec: Codec | str = "raw"  # or its name, resolved at construction
    table: CacheGenTable | None = None  # the model's calibration, for lossy frames
    metrics: LMKVMetrics = field(default_factory=LMKVMetrics)
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)  # reads (get, contains)
    # writes apart: a full or read-only disk still serves reads, and a read that succeeds
    # does not hide a write that keeps failing
    write_breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    _quiet: LogThrottle = field(default_factory=LogThrottle, init=False, repr=False)
    decoders: Executor | None = None  # decodes a batch's coded frames side by side; None: in turn
    _warned_range: bool = field(default=False, init=False, repr=False)
    _lock: CountedLock = field(default_factory=lambda: CountedLock(), init=False, repr=False)
    _probing: bool = field(default=False, init=False, repr=False)  # a probe thread runs
    # when a read last failed (monotonic), until a read succeeds: within twice the breaker's
    # longest interval of it only a read closes the breaker (a store that answers lookups
    # but cannot deliver chunks in time must not have it reset by them)
    _read_failed: float | None = field(default=None, init=False, repr=False)
    _closed: bool = field(default=False, init=False, repr=False)
    # the call (its _lock.taken) a lookup gave up waiting LOCK_WAIT for: lookups do not wait
    # again while that call holds the lock
    _hung: int | None = field(default=None, init=False, repr=False)
    _probe_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.codec, str):  # a codec named in a config
            self.codec = get_codec(self.codec)
        if self.backend.num_evictions:  # (a disk tier trimmed to its cap at start)
            self.metrics.evictions.labels(self.name).inc(self.backend.num_evictions)

    @property
    def lossy(self) -> bool:
        return self.codec.lossy

    @property
    def available(self) -> bool:
        """Whether reads may go to the backend now: not after a failed read until the
        breaker's interval is over and a probe, started here then, has answered."""
        if self._closed:  # (a lookup still in flight as lmkv shuts down)
            return False
        b = self.breaker
        if b.failures == 0 or b.trial:
            return True
        if b.closed:  # the interval is over
            self._probe()
        return False

    def reachable(self, op: str) -> bool:
        """``available`` for a call of kind ``op`` (get, contains), counting one the breaker
        holds off (lmkv_tier_skipped_total)."""
        if self.available:
            return True
        if not self._closed:
            self.metrics.tier_skipped.labels(self.name, op).inc()
        return False

    @property
    def writable(self) -> bool:
        """False while the write breaker holds writes off after a failed write."""
        return self.write_breaker.closed

    def make_lossless(self) -> None:
        """Write zstd from now on (the quality gate's fallback); what it stored lossy is
        then a miss on read (a foreign frame: the table is gone), recomputed, and replaced
        by the recomputed chunk's save."""
        self.codec, self.table = get_codec("zstd"), None

    def encode(self, key: str, buf: ChunkBuffer) -> memoryview | None:
        """``buf``'s frame in this tier's codec (a raw frame aliases the slot). A chunk that
        the lossy codec cannot hold within its error bound (values beyond its table's range)
        is framed lossless (zstd) instead, counted, and logged the first time. None for a
        chunk marked lossy that only a lossless frame would hold (read back, it would pass
        for exact KV)."""
        codec, table = self.codec, self.table
        if codec.lossy and table is None:  # make_lossless ran between the two reads
            codec = get_codec("zstd")
        if buf.lossy and not (codec.lossy and buf.num_tokens == buf.kv.shape[2]):
            return None
        try:
            return encode(buf, key, codec, table)
        except OutOfRange as e:
            if buf.lossy:
                return None
            self.metrics.lossless_chunks.labels(self.name).inc()
            if not self._warned_range:
                self._warned_range = True
                log.warning("lmkv: %s stores a chunk lossless: %s (lmkv_codec_lossless_chunks_total "
                            "counts them; recalibrate or raise the error target)", self.name, e)
            return encode(buf, key, get_codec("zstd"))

    def write(self, key: str, frame: memoryview) -> bool:
        """Store one framed chunk; a failure is logged and counted, and returns False."""
        if not self.writable:
            self.metrics.dropped.labels(f"save_{self.name}").inc()
            return False
        start = time.perf_counter()
        with self._lock:
            if self._closed:
                return False
            before, declined = self.backend.num_evictions, self.backend.num_not_stored
            try:
                self.backend.put([(key, frame)])
            except BackendError as e:
                self._failed("put", e)
                return False
            finally:  # failed calls too: a timeout shows as the time it took
                self._timed("put", start)
            self._recovered(self.write_breaker, "takes writes")
            evicted = self.backend.num_evictions - before
            declined = self.backend.num_not_stored - declined
        if declined > 0:  # the store answered and kept nothing: logged by the backend
            self.metrics.dropped.labels(f"save_{self.name}").inc()
            return False
        self.metrics.tier_bytes.labels(self.name, "put").inc(len(frame))
        self.metrics.evictions.labels(self.name).inc(max(0, evicted))
        return True

    def contains(self, keys: list[str]) -> list[bool] | None:
        """Which keys the tier holds; None if it could not be asked (nor within LOCK_WAIT
        seconds, while another call to the backend hangs; after one such wait, at once until
        that call has ended: a lookup runs on the engine's scheduling thread)."""
        if not self.reachable("contains"):
            return None
        if self.backend.concurrent_contains:
            return self._contains(keys)
        hung = self._hung
        held = self._lock.taken  # (the call holding the lock now, if one does)
        if not self._lock.acquire(timeout=0 if hung == held else LOCK_WAIT):
            if hung != held:
                self._hung = held
                self._quiet.log(log, logging.WARNING, "busy", "lmkv: %s did not answer a "
                                "lookup within %.0f s (a call to it hangs); lookups count it "
                                "as a miss until that call ends", self.name, LOCK_WAIT)
            self.metrics.errors.labels(self.name, "busy").inc()
            return None
        try:
            if not self.available:  # the call it waited for failed: do not ask again now
                return None
            return self._contains(keys)
        finally:
            self._lock.release()

    def _contains(self, keys: list[str]) -> list[bool] | None:
        start = time.perf_counter()
        try:
            found = self.backend.contains(keys)
        except BackendError as e:
            self._failed("contains", e)
            return None
        finally:
            self._timed("contains", start)
        # an index in memory (a disk tier's), or an answer soon after a failed read, says
        # nothing of the reads: the next read decides
        failed = self._read_failed
        if not self.backend.concurrent_contains and (
                failed is None or time.monotonic() - failed > 2 * self.breaker.max):
            self._recovered(self.breaker, "answers")
            self._read_failed = None
        return found

    def will_get(self, keys: list[str]) -> None:
        """Tell the backend that ``keys`` will be read soon (a disk tier starts the reads)."""
        if self.available and keys:
            with self._lock:
                self.backend.will_get(keys)

    def read(self, keys: list[str], bufs: list[ChunkBuffer],
             absent: set[str] | None = None) -> list[bool]:
        """Read and decode ``keys[i]`` into ``bufs[i]``, one batch (one pipelined round trip
        where the backend can). True where the chunk arrived intact; a miss, a corrupt frame
        (logged, counted, removed from the tier) or a failed tier is False. The keys the
        tier answered it does not hold go into ``absent``, if given."""
        if not keys or not self.reachable("get"):
            return [False] * len(keys)
        start = time.perf_counter()
        checked: dict[int, Exception | None] = {}  # frames checked as they landed: error
        raw = self.codec.name == "raw"
        with self._lock:
            if not self.available:  # closed, or the call it waited for failed: not again now
                return [False] * len(keys)
            unreadable = self.backend.num_unreadable
            try:
                if raw:  # frames straight into the slots, each checked
                    # whole slots: a disk tier may read whole pages into them (O_DIRECT)
                    frames = [memoryview(buf.slot.numpy()) for buf in bufs]  # checked as it lands

                    def arrived(i: int, n: int) -> None:
                        checked[i] = self._check(keys[i], bufs[i], frames[i][:n])

                    lengths = self.backend.get_into_many(keys, frames, arrived)
                    values = [None if n is None else f[:n] for f, n in zip(frames, lengths, strict=True)]
                else:
                    values = self.backend.get(keys)
            except BackendError as e:
                self._failed("get", e)
                return [False] * len(keys)
            finally:
                self._timed("get", start)
                dropped = self.backend.num_unreadable - unreadable  # logged by the backend
                if dropped > 0:
                    self.metrics.errors.labels(self.name, "unreadable").inc(dropped)
            self._recovered(self.breaker, "serves reads")
            self._read_failed = None
        if not raw:
            checked = self._check_all(keys, bufs, values)
        ok = []
        for i, (key, buf, data) in enumerate(zip(keys, bufs, values, strict=True)):
            if data is not None:
                error = checked[i] if i in checked else self._check(key, buf, data)
                ok.append(self._settle(key, data, error))
            else:
                ok.append(False)
                if absent is not None:
                    absent.add(key)
        return ok

    def _check_all(self, keys: list[str], bufs: list[ChunkBuffer], values: list
                   ) -> dict[int, Exception | None]:
        """_check of every frame that arrived, side by side on ``decoders`` if set (the
        codecs' decoders release the GIL)."""
        todo = [i for i, v in enumerate(values) if v is not None]
        if self.decoders is None or len(todo) < 2:
            return {i: self._check(keys[i], bufs[i], values[i]) for i in todo}
        futures = {i: self.decoders.submit(self._check, keys[i], bufs[i], values[i]) for i in todo}
        return {i: f.result() for i, f in futures.items()}

    def _check(self, key: str, buf: ChunkBuffer, data: memoryview | bytes) -> Exception | None:
        """Verify and decode one frame into ``buf``; the error, if any. Thread-safe: touches
        only ``buf``."""
        try:
            decode_into(data, buf, key, self.table)
        except Exception as e:  # raised again on the caller's thread unless a FrameError
            return e
        return None

    def _settle(self, key: str, data: memoryview | bytes, error: Exception | None) -> bool:
        """On the calling thread: count a checked frame, or report and remove a corrupt one
        (a foreign one, another table's or another lmkv version's, is a miss and stays:
        engines sharing the store may read it; a save of the recomputed chunk replaces it)."""
        if isinstance(error, ForeignFrame):
            self._quiet.log(log, logging.WARNING, "foreign", "lmkv: a chunk in %s cannot be read "
                            "with this lmkv's settings (%s); taken as a miss and left in place "
                            "(engines sharing the store may read it)", self.name, error)
            self.metrics.errors.labels(self.name, "foreign").inc()
            return False
        if isinstance(error, FrameError):
            self._quiet.log(log, logging.WARNING, "corrupt", "lmkv: a chunk from %s is corrupt (%s); "
                            "it will be recomputed", self.name, error)
            self.metrics.errors.labels(self.name, "corrupt").inc()
            if self.backend.torn_reads:  # (maybe read while another engine rewrote it)
                return False
            try:
                with self._lock:
                    if not self._closed:  # (a closed lazy backend would connect again)
                        self.backend.remove([key])
            except BackendError as e:
                self._quiet.log(log, logging.WARNING, "remove", "lmkv: cannot remove the corrupt "
                                "chunk from %s (%s)", self.name, e)
            return False
        if error is not None:
            raise error
        self.metrics.tier_bytes.labels(self.name, "get").inc(len(data))
        self.metrics.tier_hits.labels(self.name).inc()
        return True

    def _probe(self) -> None:
        """Start the probe thread unless one runs (or the tier is closed)."""
        with self._probe_lock:
            if self._probing or self._closed:
                return
            self._probing = True
        try:
            threading.Thread(target=self._run_probe, name=f"lmkv-probe-{self.name}",
                             daemon=True).start()
        except RuntimeError as e:  # no thread to be had: reads stay off for another interval
            with self._probe_lock:
                self._probing = False
                closing = self._closed  # close took this for a probe in the backend
            if closing:
                self._close_backend()
                return
            self.breaker.failure()
            log.warning("lmkv: cannot probe %s (%s)", self.name, e)

    def probe_at_start(self) -> None:
        """Ask the backend once, on a thread of its own, whether it answers, and log what
        it said: a store that is down at start shows in the log then (and reads wait out
        the breaker from then on), not at the first request that would have waited on it."""
        with self._probe_lock:
            if self._probing or self._closed:
                return
            self._probing = True
        try:
            threading.Thread(target=self._run_probe, args=(True,), name=f"lmkv-probe-{self.name}",
                             daemon=True).start()
        except RuntimeError as e:  # no thread to be had: the first request finds out
            with self._probe_lock:
                self._probing = False
            log.warning("lmkv: cannot probe %s at start (%s)", self.name, e)

    def _run_probe(self, at_start: bool = False) -> None:
        try:
            with self._lock:
                b = self.breaker
                if self._closed or (not at_start and (b.failures == 0 or b.trial or not b.closed)):
                    return  # closed, or a call decided it meanwhile
                start = time.perf_counter()
                try:
                    self.backend.contains([PROBE_KEY])
                except BackendError as e:
                    if not at_start:
                        self._failed("probe", e)
                        return
                    pause = b.failure()
                    self.metrics.errors.labels(self.name, "probe").inc()
                    log.warning("lmkv: the %s tier did not answer at start: %s; its chunks are "
                                "recomputed until it does (asked again in %.0f s, then after "
                                "each pause)", self.name, e, pause)
                    return
                finally:
                    self._timed("probe", start)
                if at_start:
                    log.info("lmkv: the %s tier answered at start in %.0f ms", self.name,
                             1e3 * (time.perf_counter() - start))
                    return
                b.trial = True
        except Exception:  # a defect, not the store: reads stay off for another interval
            log.exception("lmkv: probing %s failed", self.name)
            self.breaker.failure()
        finally:
            with self._probe_lock:
                self._probing = False
                closing = self._closed  # close found the probe in the backend: it closes it
            if closing:
                self._close_backend()

    def _recovered(self, breaker: CircuitBreaker, what: str) -> None:
        """A call succeeded: close ``breaker``, saying so if calls had failed."""
        cleared = breaker.success()
        if cleared is not None:
            log.info("lmkv: the %s tier %s again (after %d failed calls in %.0f s)", self.name,
                     what, *cleared)

    def _timed(self, op: str, start: float) -> None:
        self.metrics.tier_seconds.labels(self.name, op).observe(time.perf_counter() - start)

    def _failed(self, op: str, error: BackendError) -> None:
        writing = op in ("put", "remove")
        if op == "get":
            self._read_failed = time.monotonic()
        pause = (self.write_breaker if writing else self.breaker).failure()
        what = ("not writing to {} for {:.0f} s (chunks not stored there; reads go on)" if writing
                else "not reading {} for {:.0f} s (chunks it holds are recomputed)")
        log.warning("lmkv: %s %s failed: %s; %s", self.name, op, error, what.format(self.name, pause))
        self.metrics.errors.labels(self.name, op).inc()

    def close(self) -> None:
        """Close the backend; not waiting for a probe that hangs in it (the probe closes it
        when its call returns)."""
        with self._probe_lock:
            self._closed = True
            probing = self._probing
        if not probing:
            self._close_backend()

    def _close_backend(self) -> None:
        with self._lock:
            self.backend.close()
