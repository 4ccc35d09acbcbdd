"""StorageManager: the hot cache over an ordered stack of lower tiers.

- put: into the hot cache now; lower tiers are written in the background.
- lookup: how many leading chunks some tier holds (indexes only, no payload moved).
- fetch: the leading chunks, each from the first tier that has it, promoted to the hot
  cache. A lower-tier failure (I/O error, corrupt frame) ends the prefix there: the rest
  is recomputed, and the failure is logged and counted.
- prefetch: the same in the background, for requests still waiting in the engine's queue.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout

from ..logs import LogThrottle
from ..memory import ChunkBuffer, MemoryPool
from ..metrics import LMKVMetrics
from ..policy import DEFAULT_POLICY
from .hot_cache import HotCache
from .io import IOWorker
from .tier import Tier

log = logging.getLogger(__name__)


LOAD_BATCH = 8  # chunks asked of a tier at once when loading a run of them
FETCH_TIMEOUT = 10.0  # seconds a load waits for the I/O worker (a stuck tier call: recompute)
CLOSE_TIMEOUT = 30.0  # seconds close waits for queued writes and the I/O worker
# a chunk a background read (prefetch, bring_up) found in no tier (each answered that it
# does not hold it) is taken as absent this long: the lookup and fetch at the request's
# admission do not ask the tiers again (a round trip to a remote store, on the engine's
# scheduling thread); at most MISSES_KEPT
MISS_TTL = 10.0
MISSES_KEPT = 1 << 16
# chunks read up for a waiting request (bring_up) are held in the hot cache until the
# request lets them go (it was looked up, or left) or this many seconds after they arrived,
# never more than half the hot cache's slots at once, and only while no save or read needs
# their slots: a cache smaller than the chunks of the requests waiting for them would
# otherwise evict them before they are loaded, for other requests' saves
ARRIVAL_HOLD = 10.0
DECODE_THREADS = min(4, len(os.sched_getaffinity(0)))  # frames of a batch decoded at once


class BroughtUp:
    """Chunks being read up to the hot cache for a request the engine keeps waiting for
    them (StorageManager.bring_up): ``done()`` once they are there; held there until
    ``release()`` (the request was looked up, or left) or ARRIVAL_HOLD seconds after."""

    def __init__(self, manager: StorageManager):
        self.manager = manager
        self.future: Future | None = None
        self.bufs: list[ChunkBuffer] = []
        self.released = False

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def release(self) -> None:
        self.manager._let_go(self)


class _Write:
    """A queued write of a chunk to tiers below; it keeps the chunk's slot until it runs."""

    __slots__ = ("key", "buf", "tiers")

    def __init__(self, key: str, buf: ChunkBuffer, tiers: list[Tier]):
        self.key, self.buf, self.tiers = key, buf, tiers


class StorageManager:
    def __init__(self, pool: MemoryPool, tiers: list[Tier], metrics: LMKVMetrics,
                 io_queue_size: int = 256, keep_hot: bool = True, policy: str = DEFAULT_POLICY):
        self.hot = HotCache(pool, policy, on_evict=self._evicted)
        # keep_hot False (LMCache's local_cpu: false): the pool only stages loads and saves;
        # no chunk stays in it, and the tiers below serve every hit
        self.keep_hot = keep_hot
        self.lossless_only = False  # the quality gate tripped: lossy chunks are never served
        self.tiers = tiers
        self.metrics = metrics
        self.io = IOWorker(io_queue_size)
        # a batch of coded frames read from a tier is decoded side by side (threads start on use)
        self.decoders = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="lmkv-decode")
        region = memoryview(pool.storage.numpy()).cast("B")
        for tier in tiers:
            tier.metrics = metrics  # one registry for the whole stack
            tier.decoders = self.decoders
            tier.backend.register_memory(region)
        self._inflight: set[str] = set()  # keys a background prefetch is bringing up
        # chunks held for waiting requests -> when they arrived, and the slots (indexes)
        # they hold with how many holds each: see ARRIVAL_HOLD
        self._held: dict[BroughtUp, float] = {}
        self._held_slots: Counter[int] = Counter()
        self._held_cap = pool.num_slots // 2
        # writes queued and not started, oldest first: each keeps its chunk's slot, so
        # behind a slow tier they give way (the latest first) to a save or read that finds
        # no slot (_slot), as holds do
        self._queued: dict[_Write, None] = {}
        # queued prefetch jobs -> the hot chunks before their run, held for them (a job that
        # runs takes its own, which its slots never evict); these give way to a save or read
        # with no slot
        self._prefixes: dict[object, list[ChunkBuffer]] = {}
        # chunks a background read found in no tier -> when (time.monotonic()): see MISS_TTL
        self._missed: OrderedDict[str, float] = OrderedDict()
        # hot chunks whose write below was dropped or failed -> the tiers that lack them:
        # written there when next used (at most one entry per hot chunk)
        self._unwritten: dict[str, set[str]] = {}
        self._stuck: Future | None = None  # a load that timed out, while it still runs
        self._quiet = LogThrottle()
        self._lock = threading.Lock()
        self._closed = False

    # ---- writes -------------------------------------------------------------------
    def allocate(self) -> ChunkBuffer | None:
        self._sweep_held()  # stale holds keep slots that saves need
        buf = self._slot()
        self.metrics.hot_chunks.set(len(self.hot))  # (it may have evicted)
        if buf is None:
            self.metrics.dropped.labels("no_memory").inc()
        return buf

    def put(self, key: str, buf: ChunkBuffer, parent: str | None = None) -> bool:
        """Store ``buf`` under ``key`` (the chunk after ``parent`` in its prompt; None for a
        first or content-keyed chunk): hot now if the policy keeps it, lower tiers in the
        background. The caller keeps its own reference and releases it as usual. A chunk
        marked lossy (computed over KV decoded lossy) goes only where it is read back as
        lossy: the hot cache until the quality gate trips, whole chunks to lossy tiers.
        False when it went nowhere (the policy refused it and no write was queued)."""
        hot = self.keep_hot and self.hot.put(key, buf, parent)
        self.metrics.hot_chunks.set(len(self.hot))
        if self._missed:
            with self._lock:
                self._missed.pop(key, None)  # stored here now: asked for again
        tiers = self.tiers
        if buf.lossy:  # (a partial chunk, or one beyond a table's range, is framed lossless)
            whole = buf.num_tokens == buf.kv.shape[2]
            tiers = [t for t in tiers if t.lossy] if whole and not self.lossless_only else []
        queued = bool(tiers) and self._submit_write(key, buf, tiers)
        if hot or queued:
            self.metrics.stored_chunks.inc()
        return hot or queued

    def _submit_write(self, key: str, buf: ChunkBuffer, tiers: list[Tier] | None = None) -> bool:
        """Queue ``buf``'s write to ``tiers`` (default: all below); False (counted) if the
        queue is full, and a hot chunk is then written when it is next used
        (``_write_again``). A queued write may still be dropped so: ``_slot``."""
        write = _Write(key, buf, self.tiers if tiers is None else tiers)
        buf.retain()
        with self._lock:
            self._queued[write] = None
        try:
            if self.io.submit(lambda: self._write(write)) is not None:
                return True
        except RuntimeError:  # closed
            if self._unqueue(write):
                buf.release()
            return False
        if self._unqueue(write):
            self._drop(write)
        return False

    def _unqueue(self, write: _Write) -> bool:
        """Take ``write`` off the queued ones: False if it was taken already (dropped)."""
        with self._lock:
            return self._queued.pop(write, False) is None

    def _drop(self, write: _Write) -> None:
        """A write that will not run (taken off the queued ones): counted, its slot given
        back, and its chunk written when next used if it stays hot."""
        write.buf.release()
        for tier in write.tiers:
            self.metrics.dropped.labels(f"save_{tier.name}").inc()
        self._note_unwritten(write.key, write.tiers)

    def _note_unwritten(self, key: str, tiers: list[Tier], written: list[Tier] = ()) -> None:
        """``tiers`` lack the hot chunk ``key`` (a dropped or failed write); ``written``
        have it now."""
        with self._lock:
            buf = self.hot.entries.get(key)
            if buf is None or buf.lossy:  # gone, or decoded lossy (never coded again)
                self._unwritten.pop(key, None)
                return
            names = (self._unwritten.get(key, set()) - {t.name for t in written}) | {
                t.name for t in tiers}
            if names:
                self._unwritten[key] = names
            else:
                self._unwritten.pop(key, None)

    def _evicted(self, key: str) -> None:
        self.metrics.evictions.labels("hot").inc()
        with self._lock:  # always: _note_unwritten may be adding this key right now
            self._unwritten.pop(key, None)

    def _write_again(self, key: str, buf: ChunkBuffer) -> None:
        """A hot chunk being used whose earlier write to some tiers was lost: queue it again
        to those of them that take writes now."""
        with self._lock:
            names = self._unwritten.get(key)
            if not names:
                return
            tiers = [t for t in self.tiers if t.name in names and t.writable]
            if not tiers:
                return
            names.difference_update(t.name for t in tiers)
            if not names:
                del self._unwritten[key]
        self._submit_write(key, buf, tiers)

    def touch(self, keys: list[str]) -> None:
        """A use of the leading hot ``keys``, whose tokens the engine served from its own
        memory (a use to the policy, as a load would be); a chunk among them whose write
        below was lost (a tier down when it was saved) is queued again, as a load of it
        would: an engine's own prefix cache serves its most used prefixes, which would
        otherwise never reach a shared tier after an outage."""
        n = self.hot.touch(keys)
        if not self._unwritten:
            return
        for key in keys[:n]:
            if key in self._unwritten and (buf := self.hot.hold(key)) is not None:
                try:
                    self._write_again(key, buf)
                finally:
                    buf.release()

    def written_below(self, key: str) -> None:
        """A save of ``key`` found it hot already: if its write below was lost, queue it again."""
        if key not in self._unwritten:
            return
        buf = self.hot.get(key)
        if buf is not None:
            self._write_again(key, buf)
            buf.release()

    def _write(self, write: _Write) -> None:
        """On the I/O thread: the chunk into its tiers, encoded once per codec (nothing if
        the write was dropped while queued)."""
        if not self._unqueue(write):
            return
        key, buf, tiers = write.key, write.buf, write.tiers
        failed = []
        try:
            frames: dict[tuple, memoryview] = {}
            for tier in tiers:
                if not tier.writable:
                    self.metrics.dropped.labels(f"save_{tier.name}").inc()
                    failed.append(tier)
                    continue
                try:  # a failure its backend did not report (a bug): logged, counted, and
                    how = (tier.codec, id(tier.table))  # the other tiers still get the chunk
                    if how not in frames:
                        frames[how] = tier.encode(key, buf)
                    if frames[how] is None:  # approximate KV that only a lossless frame holds
                        self.metrics.dropped.labels(f"save_{tier.name}").inc()
                        continue
                    if not tier.write(key, frames[how]):
                        failed.append(tier)
                except Exception:
                    log.exception("lmkv: writing a chunk to the %s tier failed", tier.name)
                    self.metrics.errors.labels(tier.name, "put").inc()
                    failed.append(tier)
        finally:
            buf.release()
            if failed or key in self._unwritten:
                self._note_unwritten(key, failed, [t for t in tiers if t not in failed])
            if self._missed and len(failed) < len(tiers):  # (a prefetch on this thread may
                with self._lock:  # have noted it after put cleared it)
                    self._missed.pop(key, None)

    # ---- reads --------------------------------------------------------------------
    def lookup(self, keys: list[str]) -> int:
        """Number of leading ``keys`` stored in some tier (past the hot ones, none where a
        background read missed the first of the rest lately: MISS_TTL)."""
        n = 0
        remaining = list(keys)
        while n < len(remaining) and self.hot.contains(remaining[n]):
            n += 1
        rest = remaining[n:]
        if not rest or self._missed_lately(rest[0]):
            return n
        found = [self.hot.contains(k) for k in rest]  # (hot again past a chunk below it)
        for tier in self.tiers:
            here = tier.contains(rest)
            if here is not None:
                found = [a or b for a, b in zip(found, here, strict=True)]
        for f in found:
            if not f:
                break
            n += 1
        return n

    def fetch(self, keys: list[str], parent: str | None = None,
              again: bool = False) -> list[ChunkBuffer]:
        """The longest prefix of ``keys`` that can be had, as chunks in the hot cache with a
        reference for the caller each; chunks read from a tier join the hot cache after
        ``parent`` (the chunk before ``keys[0]`` in its prompt) or the chunk before them.
        Chunks below the hot cache are read in one job on the I/O worker, ahead of
        background work; a job that has not finished within FETCH_TIMEOUT (the worker is
        stuck in a tier call) ends the prefix, and until it finishes later loads take hot
        chunks only. A chunk a background read missed lately (MISS_TTL) ends the prefix
        without asking the tiers again. A key repeated in ``keys`` (content keys of repeated
        text) gets one more reference to the same chunk. ``again``: a request fetched for
        before and not served yet (it waits for memory) asks again: its hot chunks count as
        neither hits nor uses a second time."""
        unique = list(dict.fromkeys(keys))
        if len(unique) < len(keys):
            got = dict(zip(unique, self.fetch(unique, parent, again), strict=False))
            out, used = [], set()
            for key in keys:
                if key not in got:
                    break
                out.append(got[key].retain() if key in used else got[key])
                used.add(key)  # (every chunk fetched is reached before the first key missed)
            return out
        out: list[ChunkBuffer] = []
        for key in keys:
            buf = self.hot.get(key, use=not again)
            if buf is None:
                break
            if not again:
                self.metrics.tier_hits.labels("hot").inc()
            if self._unwritten:
                self._write_again(key, buf)
            out.append(buf)
        rest = keys[len(out):]
        if (rest and self.tiers and not self.io_stuck() and not self._missed_lately(rest[0])
                and not self._nowhere_below(rest[0])):
            parent = keys[len(out) - 1] if out else parent
            start = time.monotonic()
            deadline = start + FETCH_TIMEOUT / 2  # no batch starts after it
            try:
                out += self._wait_load(self.io.submit(
                    lambda: self._load_run(rest, parent=parent, deadline=deadline), urgent=True))
            except BaseException:  # the chunks retained here go back before the error does
                for buf in out:
                    buf.release()
                raise
            finally:
                self.metrics.load_wait_seconds.observe(time.monotonic() - start)
        return out

    def _nowhere_below(self, key: str) -> bool:
        """Whether every tier below says at once (an index in memory: a disk tier's) that it
        lacks ``key``: then a fetch need not wait for the I/O worker, which may be busy
        with a write, to be told so."""
        return not self._up_to_a_gap([key], set())

    def _missed_lately(self, key: str) -> bool:
        """Whether a background read found ``key`` in no tier within MISS_TTL seconds."""
        if not self._missed:
            return False
        with self._lock:
            when = self._missed.get(key)
            return when is not None and time.monotonic() - when < MISS_TTL

    def _note_missed(self, key: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._missed[key] = now
            self._missed.move_to_end(key)
            # the oldest first: those past MISS_TTL mean nothing any more
            while self._missed and (len(self._missed) > MISSES_KEPT
                                    or now - next(iter(self._missed.values())) >= MISS_TTL):
                self._missed.popitem(last=False)

    def io_stuck(self) -> bool:
        """Whether a load timed out waiting for the I/O worker, which has not been free
        since (a tier call is stuck)."""
        with self._lock:
            if self._stuck is not None and self._stuck.done():
                self._stuck = None
            return self._stuck is not None

    def _wait_load(self, fut: Future) -> list[ChunkBuffer]:
        try:
            return fut.result(FETCH_TIMEOUT)
        except FuturesTimeout:
            if fut.done():  # the job's own TimeoutError (the same class), or the job ended
                return fut.result()  # just after the wait gave up: its chunks are ours
        if not fut.cancel():  # it runs: what it loads goes back when it ends
            def give_back(f: Future) -> None:
                if f.exception() is None:
                    for buf in f.result():
                        buf.release()
            fut.add_done_callback(give_back)
        with self._lock:  # done when the worker is free again (urgent jobs run first)
            self._stuck = self.io.submit(lambda: None, urgent=True)
        log.error("lmkv: a load waited %.0f s for the I/O worker (a tier call is stuck); its "
                  "chunks are recomputed, and loads take hot chunks only until it ends",
                  FETCH_TIMEOUT)
        self.metrics.errors.labels("io", "timeout").inc()
        return []

    def _load_run(self, keys: list[str], prefetch: bool = False, parent: str | None = None,
                  deadline: float = math.inf, keep: int = 0, soon: bool = False) -> list[ChunkBuffer]:
        """On the I/O thread: the leading ``keys`` that some tier has, each retained (in the
        hot cache as the chunks after ``parent`` in their prompt). Each tier is asked for a
        batch of chunks at once (one pipelined round trip); no batch starts after
        ``deadline`` (a slow tier: the chunks loaded so far are the prefix). A prefetch
        keeps only its first ``keep`` chunks and the last one loaded (the next batch's
        parent; the others are in the hot cache), so that the loads it lets run between its
        batches can take their slots (and, for a background one, not ``soon``, the jobs
        bringing chunks up for waiting requests). A prefetch notes the chunk it missed where
        no tier holds it (MISS_TTL)."""
        out: list[ChunkBuffer] = []
        done = 0  # chunks loaded (a prefetch has released all but the last)
        if len(set(keys)) < len(keys):  # a repeat (a client's list) ends the run
            keys = keys[: next(i for i, k in enumerate(keys) if k in keys[:i])]
        parents = dict(zip(keys, [parent, *keys[:-1]], strict=True))
        # the chunk these continue stays while their slots are taken (a prefix policy
        # refuses chunks whose parent is gone)
        held = self.hot.hold(parent) if parent is not None else None
        try:
            if len(keys) > LOAD_BATCH:
                for tier in self.tiers:  # the whole run, so that reads queue ahead of the batches
                    tier.will_get(keys)
            for start in range(0, len(keys), LOAD_BATCH):
                if start and time.monotonic() > deadline:
                    break
                if start and prefetch:  # a load the engine waits for goes first
                    self.io.run_urgent(soon=not soon)
                batch = keys[start : start + LOAD_BATCH]
                absent: set[str] = set()
                loaded = self._load_batch(batch, prefetch, parents, absent)
                for key in batch:
                    buf = loaded.pop(key, None)
                    if buf is None:
                        break
                    out.append(buf)
                    done += 1
                for buf in loaded.values():  # loaded beyond a missing chunk
                    buf.release()
                if prefetch:
                    for buf in out[keep:-1]:
                        buf.release()
                    del out[keep:-1]
                if done < start + len(batch):
                    if prefetch and keys[done] in absent:  # what a request's lookup at
                        self._note_missed(keys[done])  # admission need not ask again
                    break
        except BaseException:  # (a decoder's bug: failed and corrupt reads are misses)
            for buf in out:
                buf.release()
            raise
        finally:
            if held is not None:
                held.release()
        return out

    def prefetch(self, keys: list[str], parent: str | None = None) -> None:
        """Pull the leading stored chunks of ``keys`` into the hot cache, in one background
        job (dropped, and counted, when the background queue is full); loads queued meanwhile
        run between its batches. ``parent`` as for fetch (a prefix policy files the chunks
        under it, not as roots)."""
        if not self.keep_hot:
            return
        prefix: list[ChunkBuffer] = []  # held until the job ends (_prefixes while queued)
        seen: set[str] = set()
        for key in keys:
            buf = self.hot.hold(key)
            if buf is None:
                break
            prefix.append(buf)
            seen.add(key)
        n = len(prefix)
        job, filed = object(), False
        with self._lock:
            run = []
            for key in keys[n:]:
                if key in self._inflight or key in seen:  # another prompt's job is bringing
                    break  # this prefix up; or a repeat (a client's list), where the run ends
                run.append(key)
                seen.add(key)
            if run:
                self._inflight.update(run)
                if prefix:
                    self._prefixes[job], filed = prefix, True
        parent = keys[n - 1] if n else parent
        try:
            queued = bool(run) and self.io.submit(
                lambda: self._prefetch_run(run, parent, job)) is not None
        except RuntimeError:  # the worker is closed (lmkv shutting down)
            queued = False
        if not queued:
            self._release_prefix(job, None if filed else prefix)
            if run:
                with self._lock:
                    self._inflight.difference_update(run)
                self.metrics.dropped.labels("prefetch").inc()

    def bring_up(self, keys: list[str], parent: str | None = None) -> BroughtUp | None:
        """Where a background prefetch (queued or running) holds one of ``keys`` (a fetch of
        them would wait for it), read the leading stored chunks of ``keys`` into the hot
        cache in a job ahead of queued saves and prefetches (behind loads the engine waits
        for), not waited for. The chunks stay held there until the returned arrival is
        released (see ARRIVAL_HOLD); the job reads nothing if the arrival was released, or
        its deadline passed, before it ran (one job per waiting request, asked once each: a
        request let go costs its queue entry only). None where none is held, while the I/O
        worker is stuck in a tier call (a fetch then takes hot chunks only, at once), where the
        first chunk not hot is in no tier whose index answers at once, or with lmkv closing.
        ``parent`` as for fetch."""
        self._sweep_held()
        if self.io_stuck():
            return None
        with self._lock:
            if self._inflight.isdisjoint(keys):
                return None
        first = next((k for k in keys if not self.hot.contains(k)), None)
        if first is None or self._nowhere_below(first):
            return None  # a fetch now takes what there is without waiting for the I/O worker
        deadline = time.monotonic() + FETCH_TIMEOUT / 2  # as a fetch's: no batch after it
        arrival = BroughtUp(self)

        def run() -> None:
            if arrival.released or time.monotonic() > deadline:
                return  # let go (looked up, aborted) or too late before it ran: not read
            cap = self._held_cap  # kept while it runs (other holds give way to it: _slot)
            try:
                bufs = self._load_run(keys, prefetch=True, parent=parent, deadline=deadline,
                                      keep=cap, soon=True)
            except Exception:  # nobody waits for this job's future: said here
                log.exception("lmkv: reading chunks up for a waiting request failed")
                return
            self._hold(arrival, bufs[:cap])
            for buf in bufs[cap:]:  # (the last one read, past those kept)
                buf.release()
        try:
            arrival.future = self.io.submit(run, soon=True)
        except RuntimeError:  # the worker is closed
            return None
        return arrival

    def _hold(self, arrival: BroughtUp, bufs: list[ChunkBuffer]) -> None:
        """Hold the leading ``bufs`` that fit in half the hot cache for ``arrival`` (its
        reference each); release the others."""
        with self._lock:
            n = 0
            if not arrival.released:  # (let go before they arrived: looked up, or gone)
                for buf in bufs:
                    if buf.index not in self._held_slots and len(self._held_slots) >= self._held_cap:
                        break
                    self._held_slots[buf.index] += 1
                    n += 1
                arrival.bufs = bufs[:n]
                self._held[arrival] = time.monotonic()
            self.metrics.held_chunks.set(len(self._held_slots))
        for buf in bufs[n:]:
            buf.release()

    def _let_go(self, arrival: BroughtUp) -> None:
        with self._lock:
            arrival.released = True
            if self._held.pop(arrival, None) is None:
                return
            bufs, arrival.bufs = arrival.bufs, []
            for buf in bufs:
                if self._held_slots[buf.index] > 1:
                    self._held_slots[buf.index] -= 1
                else:
                    del self._held_slots[buf.index]
            self.metrics.held_chunks.set(len(self._held_slots))
        for buf in bufs:
            buf.release()

    def _slot(self) -> ChunkBuffer | None:
        """A free slot, evicting what the policy picks; where none is to be had, the chunks
        held for waiting requests are let go, the latest request's first (the earliest is
        likeliest to be looked up next), then those queued prefetches hold before their
        runs (the latest first: its run may then be refused by a prefix policy), then queued
        writes are dropped, the latest first, until one is: holds and writes behind a slow
        tier only take slots no save or read needs."""
        buf = self.hot.allocate()
        while buf is None:
            with self._lock:
                latest = next(reversed(self._held), None)
                prefix = self._prefixes.popitem()[1] if latest is None and self._prefixes else None
                write = None if latest is not None or prefix is not None else self._freeing_write()
            if latest is not None:
                latest.release()
            elif prefix is not None:
                for held in prefix:
                    held.release()
            elif write is not None:
                self._drop(write)
                self._quiet.log(log, logging.WARNING, "writes", "lmkv: dropped a queued write "
                                "to the tiers below for a free chunk slot (%d still queued: "
                                "the tiers below take chunks slower than they are saved)",
                                len(self._queued))
            else:
                return None
            buf = self.hot.allocate()
        return buf

    def _freeing_write(self) -> _Write | None:
        """The latest queued write whose chunk only it (and the hot cache, where the chunk
        is hot) holds: dropping it frees or unpins a slot (others are in use by loads or a
        save under way anyway), taken off the queued ones; None if there is none. Under
        the lock."""
        for write in reversed(self._queued):
            hot = self.hot.entries.get(write.key) is write.buf
            if write.buf.ref_count <= 1 + hot:
                del self._queued[write]
                return write
        return None

    def _sweep_held(self) -> None:
        """Let go of the chunks held over ARRIVAL_HOLD seconds (their request never asked)."""
        if not self._held:
            return
        now = time.monotonic()
        with self._lock:  # (in the order they were held: the stale ones come first)
            stale = list(itertools.takewhile(lambda item: now - item[1] > ARRIVAL_HOLD,
                                             self._held.items()))
        stale = [arrival for arrival, _ in stale]
        for arrival in stale:
            self._let_go(arrival)
        if stale:
            self._quiet.log(log, logging.WARNING, "held", "lmkv: let go of the chunks read up "
                            "for %d waiting requests that did not ask for them within %.0f s",
                            len(stale), ARRIVAL_HOLD)

    def _release_prefix(self, job: object, bufs: list[ChunkBuffer] | None = None) -> None:
        """Give back the hot chunks held for queued prefetch ``job`` (``bufs`` where they
        were not filed under it); none where ``_slot`` took them back."""
        with self._lock:
            bufs = self._prefixes.pop(job, bufs or [])
        for buf in bufs:
            buf.release()

    def _prefetch_run(self, keys: list[str], parent: str | None, job: object) -> None:
        with self._lock:  # running: its holds are its own now, not a queued job's to give way
            prefix = self._prefixes.pop(job, [])
        try:
            for buf in self._load_run(keys, prefetch=True, parent=parent):
                buf.release()
        finally:
            for buf in prefix:
                buf.release()
            with self._lock:
                self._inflight.difference_update(keys)

    def _load_batch(self, keys: list[str], prefetch: bool, parents: dict[str, str | None],
                    absent: set[str]) -> dict[str, ChunkBuffer]:
        """On the I/O thread: ``keys``' chunks, retained for the caller: those in the hot
        cache (retained first, so that the slots taken below cannot evict them), the others
        read from the first tier that has them, one batch per tier, put in the hot cache in
        prompt order (a chunk after its parent, whichever tier each came from). ``absent``
        gets the keys every tier answered it does not hold (not those a tier could not be
        asked about: held off by its breaker, failed, or no slot to read into)."""
        loaded: dict[str, ChunkBuffer] = {}
        try:
            for key in keys:
                buf = self.hot.get(key)
                if buf is not None:
                    loaded[key] = buf
            hot = set(loaded)
            missing = self._up_to_a_gap([k for k in keys if k not in loaded], absent)
            nowhere = set(missing)  # held by no tier asked so far
            for tier in self.tiers:
                if not missing:
                    break
                said: set[str] = set()
                if tier.reachable("get"):
                    missing = self._read_tier(tier, missing, loaded, said)
                nowhere &= said
            absent.update(nowhere)
        except BaseException:
            for buf in loaded.values():
                buf.release()
            raise
        for key in keys:
            if key in loaded and key not in hot:  # read from a tier
                buf = loaded[key]
                if self.keep_hot:  # refused once the quality gate tripped, if decoded lossy
                    self.hot.put(key, buf, parents.get(key))
                if buf.lossy and self.lossless_only:  # (decoded as the gate tripped)
                    buf.release()
                    del loaded[key]  # a miss: the keys after it are not used
                elif prefetch:
                    self.metrics.prefetched_chunks.inc()
        self.metrics.hot_chunks.set(len(self.hot))
        return loaded

    def _up_to_a_gap(self, missing: list[str], absent: set[str]) -> list[str]:
        """``missing`` up to the first key no tier holds, where every tier's index answers at
        once (a disk tier's): chunks past it would be read, counted as hits and dropped (a
        lowered disk cap keeps a prompt's later chunks, not its first). That key goes into
        ``absent``."""
        if not missing or not all(t.backend.concurrent_contains for t in self.tiers):
            return missing
        held = [t.contains(missing) for t in self.tiers]
        if None in held:
            return missing
        for i, key in enumerate(missing):
            if not any(h[i] for h in held):
                absent.add(key)
                return missing[:i]
        return missing

    def _read_tier(self, tier: Tier, keys: list[str], loaded: dict[str, ChunkBuffer],
                   absent: set[str]) -> list[str]:
        """Read ``keys`` from one tier into new chunks (added to ``loaded``); returns the keys
        it did not have or could not deliver intact (those it answered it does not have go
        into ``absent`` too). Where slots would have to be taken from hot chunks, the tier
        is first asked which keys it holds, so that no hot chunk is evicted for a miss."""
        rest: list[str] = []
        if self.hot.pool.num_free < len(keys):
            held = tier.contains(keys)
            if held is not None:
                rest = [k for k, h in zip(keys, held, strict=True) if not h]
                keys = [k for k, h in zip(keys, held, strict=True) if h]
                absent.update(rest)
                if not keys:
                    return rest
        bufs = []
        for _ in keys:
            buf = self._slot()
            if buf is None:
                self.metrics.dropped.labels("no_memory").inc()
                self._quiet.log(log, logging.WARNING, "no_memory", "lmkv: no free chunk slot "
                                "to read a chunk from %s into (all %d of the hot cache's slots "
                                "are in use by loads, saves and pins): it is recomputed. A "
                                "larger max_local_cpu_size keeps the chunks of waiting requests",
                                tier.name, self.hot.pool.num_slots)
                break
            bufs.append(buf)
        batch, missing = keys[: len(bufs)], keys[len(bufs) :]
        try:
            results = tier.read(batch, bufs, absent)
        except BaseException:  # (a decoder's bug, not a bad frame: those are misses)
            for buf in bufs:
                buf.release()
            raise
        for key, buf, ok in zip(batch, bufs, results, strict=True):
            if not ok:
                buf.release()
                missing.append(key)
                continue
            loaded[key] = buf
        return missing + rest

    def make_lossless(self) -> list[str]:
        """The quality gate's fallback: lossy tiers write zstd from now on and stop serving
        what they stored lossy (such chunks are then misses, recomputed and replaced), and
        the hot cache drops the chunks it holds decoded from lossy frames. Returns the names
        of the tiers changed."""
        self.lossless_only = True
        changed = []
        for tier in self.tiers:
            if tier.lossy:
                tier.make_lossless()
                changed.append(tier.name)
        self.hot.drop_lossy()
        self.metrics.hot_chunks.set(len(self.hot))
        return changed

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Finish background writes (for up to ``timeout`` seconds: what is still queued
        then is lost, and logged), then stop the I/O worker and drop the hot cache. A
        second call does nothing."""
        if self._closed:
            return
        self._closed = True
        stopped = self.io.close(timeout)  # runs what is queued first (it logs a stuck job)
        with self._lock:
            held = list(self._held)
        for arrival in held:
            arrival.release()
        self.decoders.shutdown(wait=stopped)
        self.hot.clear()
        self.metrics.hot_chunks.set(0)
        for tier in self.tiers if stopped else ():  # (a stuck job holds its tier's lock)
            tier.close()
