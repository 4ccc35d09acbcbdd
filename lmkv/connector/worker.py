"""The worker role: moves chunks between lmkv's buffers and the engine's paged KV memory.

Whole-request mode loads everything before the forward pass and saves after it.
Layer-wise mode (use_layerwise) hands each layer to a helper thread: layer i+1 is loaded
while layer i computes, and layer i is gathered for saving while layer i+1 computes.
On a CUDA device the copies run on their own streams (lmkv.streams), ordered against
the engine's by events: the forward pass waits GPU-side for layer i's load, a layer's save
reads its pages only after the engine wrote them, and a chunk's host memory goes back to
the pool only after the copies reading it have finished.
A load that fails (at any layer) is reported by ``failed_loads`` after the forward pass:
the engine must recompute those requests' tokens, and their saves of this step are dropped.
With ``async_saves`` the host does not wait for a step's save copies either: the engine's
stream waits for them GPU-side before its next work (no page is rewritten before it is
read), and the chunks go to the hot cache once their copies are done.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, NamedTuple

import torch

from ..cache import LMKVCache
from ..memory import ChunkBuffer
from ..paged import PagedMemory, pinned
from ..streams import CopyStream, copy_stream
from .metadata import ConnectorMetadata, LoadSpec

log = logging.getLogger(__name__)


class _Saved(NamedTuple):
    """A step's save copies, issued: what to store and return to the pool once they are done."""

    mark: Any  # the save stream's mark after them
    store: list[tuple[str, ChunkBuffer, str | None]]  # (key, chunk, parent) to store
    bufs: list[ChunkBuffer]  # every chunk the copies wrote, stored or not


class WorkerConnector:
    def __init__(self, cache: LMKVCache, key_of: Callable[[str], str] | None = None,
                 async_saves: bool = False):
        """``async_saves``: the host does not wait for a step's save copies (their chunks are
        stored at a later step, or by ``complete_saves``). Only for an engine whose later
        writes to the pages all run on the stream that ran the forward pass (the bundled
        engine); vLLM's contract is that wait_for_save returns with the pages read."""
        self.cache = cache
        self.async_saves = async_saves
        self._saved: deque[_Saved] = deque()  # issued, not yet stored or returned
        self._saved_lock = threading.Lock()  # close may run beside a step that is stuck
        # the metadata's names -> this cache's keys (rank-free ids under tensor parallelism)
        self._key = key_of or (lambda key: key)
        self.layerwise = cache.config.use_layerwise
        self.paged: PagedMemory | None = None
        self.meta = ConnectorMetadata()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="lmkv-layer") if self.layerwise else None
        self._layer_loaded: list[threading.Event] = []
        self._layer_marks: list = []  # per layer: the load stream's mark after its copies
        self._unread: list[list[ChunkBuffer | None]] | None = None  # the step's load's chunks
        self._loads: CopyStream = CopyStream()
        self._saves: CopyStream = CopyStream()
        self._save_bufs: list[tuple[str, ChunkBuffer, torch.Tensor]] = []
        self._save_jobs: list[Future] = []
        self._save_layers = 0  # layers gathered this step (layer-wise)
        self._save_error: BaseException | None = None  # a layer's save failed (layer-wise)
        self.load_job: Future | None = None  # the running layer-wise load (layer-wise mode)
        self._load_error: BaseException | None = None  # the whole-request load's failure

    def register_kv_caches(self, paged: PagedMemory,
                           streams: Callable[[torch.device], CopyStream] = copy_stream) -> None:
        """The engine's paged KV memory, in whatever layout ``paged`` implements; loads and
        saves get a copy stream each on its device."""
        lay = self.cache.layout
        want = (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype)
        got = (paged.num_layers, paged.num_kv_heads, paged.head_dim, paged.dtype)
        if got != want:
            raise ValueError(f"paged KV memory (layers, kv heads, head_dim, dtype) {got} does not "
                             f"match the lmkv layout {want}")
        self.paged = paged
        self._loads, self._saves = streams(paged.device), streams(paged.device)

    def bind_connector_metadata(self, meta: ConnectorMetadata) -> None:
        self.meta = meta

    # ---- loading --------------------------------------------------------------------
    def start_load_kv(self) -> None:
        """Start this step's loads: take each chunk the scheduler role pinned, by key.
        Never raises: a failure is reported by failed_loads."""
        loads = self.meta.loads
        self._end_load()  # an earlier step's, if failed_loads was not called
        self._load_error = None
        self.load_job = None
        self._layer_loaded = []
        self._layer_marks = []
        self._loads.bind_engine()  # this is the forward pass's thread
        self._saves.bind_engine()
        if not loads:
            return
        chunks = [[self.cache.take(self._key(k)) for k in spec.keys] for spec in loads]
        missing = [k for spec, bufs in zip(loads, chunks, strict=True)
                   for k, b in zip(spec.keys, bufs, strict=True) if b is None]
        if missing:  # never expected: the scheduler role pinned them
            self._load_error = LookupError(f"{len(missing)} chunks planned for loading are not pinned")
            self._release(chunks)
            return
        stream = self._loads
        try:
            slots = [[self._pinned(s) for s in spec.slot_mappings] for spec in loads]
            ready = stream.engine_mark()  # the pages' earlier readers and writers are done
        except Exception as e:  # nothing was issued
            self._load_error = e
            self._release(chunks)
            return
        if not self.layerwise:
            # the copies run on while the host queues the forward pass; their chunks go
            # back to the pool in failed_loads, after the forward pass (a failed load's too)
            self._unread = chunks
            try:
                with stream.active():
                    stream.waits(ready)
                    try:
                        self._load(loads, slots, chunks)
                    finally:  # the forward pass waits for what was issued, failed or not
                        stream.engine_waits(stream.mark())
            except Exception as e:
                self._load_error = e
            return
        num_layers = self.cache.layout.num_layers
        self._layer_loaded = [threading.Event() for _ in range(num_layers)]
        self._layer_marks = [None] * num_layers
        # back to the pool in failed_loads, once the job has issued them all and they are
        # done (the job does not wait for them: the layers' save gathers queue behind it)
        self._unread = chunks
        try:
            self.load_job = self._executor.submit(self._load_layers, loads, slots, chunks, ready,
                                                  self._layer_loaded, self._layer_marks)
        except Exception as e:  # (an executor shut down): nothing was issued
            self._load_error = e
            for event in self._layer_loaded:
                event.set()

    def _load_layers(self, loads, slots, chunks, ready, events: list[threading.Event],
                     marks: list) -> None:
        stream = self._loads
        try:
            with stream.active():
                stream.waits(ready)
                for layer, event in enumerate(events):
                    self._load(loads, slots, chunks, layer)
                    marks[layer] = stream.mark()
                    event.set()
        finally:  # after a failure the forward pass goes on; failed_loads tells the engine
            try:  # the layers not reached wait for whatever the failed one had issued
                if None in marks:
                    last = stream.mark()
                    marks[:] = [last if m is None else m for m in marks]
            finally:
                for event in events:
                    event.set()

    def _end_load(self) -> None:
        """Wait for the layer-wise load job to have issued its copies, then return the
        step's load chunks to the pool once the copies are done."""
        if self.load_job is not None:
            wait([self.load_job])
            self._load_error = self._load_error or self.load_job.exception()
            self.load_job = None
        self._finish_whole_load()

    def _finish_whole_load(self) -> None:
        """Return the load's chunks to the pool once its copies are done; a failure to wait
        for them fails the load."""
        if self._unread is None:
            return
        chunks, self._unread = self._unread, None
        try:
            self._release_after(self._loads, chunks)
        except Exception as e:
            self._load_error = self._load_error or e

    def _load(self, loads, slots, chunks, layer: int | None = None) -> None:
        for bufs, mappings in zip(chunks, slots, strict=True) if layer in (None, 0) else ():
            for buf, mapping in zip(bufs, mappings, strict=True):  # (checked once a load)
                if buf.num_tokens < mapping.shape[0]:  # (a foreign frame under a full chunk's key)
                    raise ValueError(f"a stored chunk holds {buf.num_tokens} tokens, its load "
                                     f"maps {mapping.shape[0]}")
        for spec, mappings, bufs in zip(loads, slots, chunks, strict=True):
            for buf, mapping, skip in zip(bufs, mappings, spec.skips, strict=True):
                # a mapping shorter than the chunk (a load ending before the last prompt
                # token) loads that many of its tokens
                self.paged.load(buf.kv[:, :, : mapping.shape[0]], mapping, skip, layer)

    def _pinned(self, slots: torch.Tensor) -> torch.Tensor:
        """A slot mapping in pinned memory where the pages are on a GPU (paged.pinned), once
        per step: layer-wise copies reuse it for every layer."""
        return pinned(slots) if self.paged.device.type == "cuda" else slots

    def _release_after(self, stream: CopyStream, chunks: list[list[ChunkBuffer | None]]) -> None:
        """Return ``chunks`` to the pool once ``stream``'s copies reading them are done."""
        try:
            stream.synchronize()
        finally:
            self._release(chunks)

    @staticmethod
    def _release(chunks: list[list[ChunkBuffer | None]]) -> None:
        for bufs in chunks:
            for buf in bufs:
                if buf is not None:
                    buf.release()

    def wait_for_layer_load(self, layer: int) -> None:
        if self._layer_loaded:
            self._layer_loaded[layer].wait()
            self._loads.engine_waits(self._layer_marks[layer])

    def failed_loads(self) -> list[LoadSpec]:
        """After the forward pass: this step's loads if any part of them failed (all of
        them: a failure leaves it unknown which pages hold what), else []. The engine must
        recompute the tokens of those requests, and of any request that shares their pages."""
        self._end_load()
        if self._load_error is None:
            if self.meta.loads:
                self.cache.metrics.loaded_tokens.inc(sum(
                    slots.shape[0] - skip for spec in self.meta.loads
                    for slots, skip in zip(spec.slot_mappings, spec.skips, strict=True)))
            return []
        n = sum(len(spec.keys) for spec in self.meta.loads)
        log.warning("lmkv: loading %d chunks of %d requests failed (%r); their tokens are "
                    "recomputed", n, len(self.meta.loads), self._load_error)
        self.cache.count_error("connector", "load")
        self._load_error = None
        return list(self.meta.loads)

    # ---- saving ---------------------------------------------------------------------
    def save_kv_layer(self, layer: int) -> None:
        """Gather ``layer`` of this step's new chunks (layer-wise), beside the next layer's
        compute. Never raises (it runs inside the forward pass): a failure stores none of the
        step's chunks, and wait_for_save raises it."""
        if not self.layerwise or not self.meta.saves:
            return
        try:
            if layer == 0:
                self._save_error = None
                self._save_layers = 0
                self._drop_gathered()  # a step whose saves were never waited for
                self._save_bufs = self._allocate_saves()
            self._save_layers += 1
            if self._save_bufs and self._save_error is None:
                # the gather reads the layer's pages after the engine wrote them
                self._save_jobs.append(self._executor.submit(
                    self._gather, self._save_bufs, self._saves.engine_mark(), layer))
        except Exception as e:
            self._save_error = self._save_error or e

    def _drop_gathered(self) -> None:
        """Return the buffers of layer gathers that wait_for_save never took, once their
        copies are done."""
        self._save_jobs, jobs = [], self._save_jobs
        self._save_bufs, bufs = [], self._save_bufs
        if bufs:
            wait(jobs)
            try:
                self._saves.synchronize()
            finally:
                self._release([[buf for _, buf, _ in bufs]])

    def _gather(self, bufs, written, layer: int | None = None) -> None:
        stream = self._saves
        with stream.active():
            stream.waits(written)
            for _, buf, slots in bufs:
                self.paged.save(slots, buf.kv[:, :, : slots.shape[0]], 0, layer)

    def wait_for_save(self, skip: set[str] | frozenset[str] = frozenset(), store: bool = True) -> None:
        """End of the step: new chunks go to the hot cache; lower tiers are written in the
        background and never waited for here. Chunks of the requests in ``skip`` (computed
        over pages whose load failed) are not stored; with ``store`` False (the forward
        pass failed, or pages it read were never loaded) none are, and in layer-wise mode
        none are unless every layer was gathered. The chunk buffers are returned either way:
        once their copies are done (at once on the CPU; with ``async_saves`` on a GPU, at a
        later step)."""
        if not self.meta.saves:
            return
        bufs: list[tuple[str, ChunkBuffer, torch.Tensor]] = []
        skip_keys = {self._key(k) for spec in self.meta.saves if spec.request_id in skip
                     for k in spec.keys}
        mark, keep = None, []
        try:
            try:
                if self.layerwise:
                    bufs, self._save_bufs = self._save_bufs, []
                    jobs, self._save_jobs = self._save_jobs, []
                    wait(jobs)  # all gathers have stopped touching the buffers before any raises
                    error, self._save_error = self._save_error, None
                    if error is not None:
                        raise error
                    for job in jobs:
                        job.result()
                    if self._save_layers != self.cache.layout.num_layers:  # the forward stopped early
                        store = False
                elif store:
                    bufs = self._allocate_saves()
                    self._gather(bufs, self._saves.engine_mark())
            finally:  # the chunks hold the pages' KV once the copies are done (a failed gather's too)
                mark = self._copies_issued()
            if store:
                parents = {self._key(k): None if p is None else self._key(p)
                           for spec in self.meta.saves for k, p in spec.parents().items()}
                keep = [(key, buf, parents.get(key)) for key, buf, _ in bufs if key not in skip_keys]
        finally:  # a failed gather stores nothing and still returns its buffers
            self.meta = ConnectorMetadata()
            self._save_layers = 0
            with self._saved_lock:
                self._saved.append(_Saved(mark, keep, [buf for _, buf, _ in bufs]))
            self.complete_saves()

    def _copies_issued(self) -> Any:
        """After a step's save copies: without ``async_saves`` the host waits for them (None);
        with it, the engine's stream does, GPU-side, before its next work, and their mark is
        returned."""
        if not self.async_saves:
            self._saves.synchronize()
            return None
        mark = self._saves.mark()
        self._saves.engine_waits(mark)
        return mark

    def complete_saves(self, wait: bool = False) -> None:
        """Store the chunks of the saves whose copies are done and return their buffers to
        the pool; with ``wait``, of every save issued (the host waits for the copies). A
        failure to store costs those chunks (a later recompute), a log line and a metric."""
        with self._saved_lock:
            self._complete_saves(wait)

    def _complete_saves(self, wait: bool) -> None:
        while self._saved:
            saved = self._saved[0]
            try:
                if wait:
                    self._saves.wait(saved.mark)
                elif not self._saves.done(saved.mark):
                    return  # marks of one stream complete in order
                copied = True
            except Exception as e:  # the copies' state is unknown: nothing of them is stored
                copied, error = False, e
            self._saved.popleft()
            try:
                for key, buf, parent in saved.store if copied else ():
                    self.cache.store(key, buf, parent)
            except Exception as e:
                copied, error = False, e
            finally:
                self._release([saved.bufs])
            if not copied:
                log.warning("lmkv: storing %d saved chunks failed (%s); they will be recomputed "
                            "next time", len(saved.store), error)
                self.cache.count_error("connector", "save")

    def _allocate_saves(self) -> list[tuple[str, ChunkBuffer, torch.Tensor]]:
        """A buffer and a slot mapping (pinned where the pages are on a GPU) per chunk to
        save; on an error, the buffers taken so far go back before it is raised."""
        out: list[tuple[str, ChunkBuffer, torch.Tensor]] = []
        try:
            for spec in self.meta.saves:
                for i, (name, slots) in enumerate(zip(spec.keys, spec.slot_mappings, strict=True)):
                    key = self._key(name)
                    if self.cache.storage.hot.contains(key):  # stored already: skip the gather
                        self.cache.storage.written_below(key)
                        continue
                    slots = self._pinned(slots)
                    buf = self.cache.allocate()
                    if buf is None:  # the hot cache is full of pinned chunks: skip this save
                        log.debug("lmkv: no free chunk slot; not saving %s", key)
                        return out
                    buf.position = spec.position + i * self.cache.chunk_size
                    buf.num_tokens = slots.shape[0]  # fewer for a prompt's partial last chunk
                    buf.lossy = spec.lossy
                    out.append((key, buf, slots))
        except BaseException:
            self._release([[buf for _, buf, _ in out]])
            raise
        return out

    def close(self) -> None:
        self._end_load()
        self._drop_gathered()
        self.complete_saves(wait=True)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
