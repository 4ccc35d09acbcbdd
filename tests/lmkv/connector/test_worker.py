"""The worker role on its own: it takes the chunks the scheduler role pinned, by key, and
writes them into paged memory (whole or layer by layer); a failure anywhere in a load is
reported after the forward pass, never raised into it, never left hanging, and every
chunk goes back to the pool; saves go to the hot cache except for requests it is told
to skip."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from lmkv import paged
from lmkv.cache import LMKVCache
from lmkv.config import load_config
from lmkv.connector import ConnectorMetadata, WorkerConnector
from lmkv.connector.metadata import LoadSpec, SaveSpec
from lmkv.layout import KVLayout
from lmkv.memory import ChunkBuffer
from lmkv.paged import BlockPagedMemory
from lmkv.streams import CopyStream, copy_stream

CHUNK, BLOCK, LAYERS = 8, 4, 3


def _setup(layerwise: bool):
    cfg = load_config(env={}, chunk_size=CHUNK, max_local_cpu_size=0.001, use_layerwise=layerwise)
    engine = LMKVCache(cfg, KVLayout(LAYERS, 2, 4, torch.float32, CHUNK), "model")
    kv_cache = torch.zeros(LAYERS, 2, 16, BLOCK, 2, 4)
    worker = WorkerConnector(engine)
    worker.register_kv_caches(BlockPagedMemory(kv_cache))
    return engine, worker, kv_cache


def _pinned(engine: LMKVCache, keys: list[str]) -> list[torch.Tensor]:
    kvs = []
    for key in keys:
        buf = engine.allocate()
        buf.kv.normal_()
        kvs.append(buf.kv.clone())
        engine.store(key, buf)
        buf.release()
    assert engine.pin(keys) == [False] * len(keys)
    return kvs


def _paged(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[2, L, T, Hkv, D] of the given slots."""
    return kv_cache.flatten(2, 3)[:, :, slots].transpose(0, 1)


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_load_takes_its_pins_and_writes_the_slots_it_names(layerwise):
    engine, worker, kv_cache = _setup(layerwise)
    kvs = _pinned(engine, ["a", "b"])
    slots = [torch.arange(8, 16), torch.arange(20, 25)]  # the second chunk: 5 of its 8 tokens
    worker.bind_connector_metadata(ConnectorMetadata(loads=[LoadSpec("r", ["a", "b"], slots, [2, 0])]))
    worker.start_load_kv()
    for layer in range(LAYERS):
        worker.wait_for_layer_load(layer)
    assert worker.failed_loads() == []
    assert not _paged(kv_cache, slots[0][:2]).any()  # tokens [0, skip) left alone
    assert torch.equal(_paged(kv_cache, slots[0][2:]), kvs[0][:, :, 2:])
    assert torch.equal(_paged(kv_cache, slots[1]), kvs[1][:, :, :5])
    assert len(engine.pins) == 0
    worker.wait_for_save()
    engine.pool.check_integrity()
    assert engine.metrics.loaded_tokens._value.get() == 6 + 5
    worker.close()
    engine.close()


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_failed_load_is_reported_after_the_forward_pass_and_returns_every_chunk(layerwise):
    engine, worker, _ = _setup(layerwise)
    _pinned(engine, ["a", "b"])

    def broken(chunk, slots, skip=0, layer=None):
        if layer in (None, 1):
            raise OSError("injected")

    worker.paged.load = broken
    spec = LoadSpec("r", ["a", "b"], [torch.arange(8), torch.arange(8, 16)], [0, 0])
    worker.bind_connector_metadata(ConnectorMetadata(loads=[spec]))
    worker.start_load_kv()  # never raises
    done = threading.Event()

    def forward() -> None:  # as the model's layers wait for their KV
        for layer in range(LAYERS):
            worker.wait_for_layer_load(layer)
        done.set()

    threading.Thread(target=forward, daemon=True).start()
    assert done.wait(5), "a layer's wait hung after the failure"
    assert worker.failed_loads() == [spec]
    assert engine.metrics.errors.labels("connector", "load")._value.get() == 1
    assert engine.metrics.loaded_tokens._value.get() == 0
    worker.wait_for_save()
    assert len(engine.pins) == 0
    engine.pool.check_integrity()
    assert engine.pool.num_free == engine.pool.num_slots - 2  # only the hot cache holds them
    worker.close()
    engine.close()


def test_a_key_that_is_not_pinned_fails_the_load_and_releases_the_others():
    engine, worker, kv_cache = _setup(False)
    _pinned(engine, ["a"])
    spec = LoadSpec("r", ["a", "gone"], [torch.arange(8), torch.arange(8, 16)], [0, 0])
    worker.bind_connector_metadata(ConnectorMetadata(loads=[spec]))
    worker.start_load_kv()
    assert worker.failed_loads() == [spec]
    assert not kv_cache.any()  # nothing half-loaded
    assert len(engine.pins) == 0
    engine.pool.check_integrity()
    worker.close()
    engine.close()


@pytest.mark.parametrize("layerwise", [False, True])
def test_saves_go_to_the_hot_cache_except_for_skipped_requests(layerwise):
    engine, worker, kv_cache = _setup(layerwise)
    kv_cache.normal_()
    slots = torch.arange(16, 24)
    meta = ConnectorMetadata(saves=[SaveSpec("keep", ["k1"], [slots]),
                                    SaveSpec("skip", ["k2"], [torch.arange(24, 32)])])
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()
    for layer in range(LAYERS):
        worker.save_kv_layer(layer)
    worker.wait_for_save(skip={"skip"})
    assert engine.storage.hot.contains("k1") and not engine.storage.hot.contains("k2")
    buf = engine.storage.hot.get("k1")
    assert torch.equal(buf.kv, _paged(kv_cache, slots))
    buf.release()
    engine.pool.check_integrity()
    worker.close()
    engine.close()


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_step_told_not_to_store_stores_nothing_and_returns_its_buffers(layerwise):
    """store=False (the forward pass failed, or a load of pages someone read failed): no
    chunk of the step reaches lmkv, and the pool gets every buffer back."""
    engine, worker, kv_cache = _setup(layerwise)
    kv_cache.normal_()
    free = engine.pool.num_free
    worker.bind_connector_metadata(ConnectorMetadata(saves=[SaveSpec("r", ["k1"], [torch.arange(16, 24)])]))
    worker.start_load_kv()
    for layer in range(LAYERS):
        worker.save_kv_layer(layer)
    worker.wait_for_save(store=False)
    assert not engine.storage.hot.contains("k1") and engine.pool.num_free == free
    engine.pool.check_integrity()
    worker.close()
    engine.close()


def test_layerwise_chunks_of_a_forward_that_stopped_early_are_not_stored():
    """Only some layers were gathered (the forward pass raised at layer 1): the chunks'
    later layers hold a slot's old contents, so none is stored."""
    engine, worker, kv_cache = _setup(True)
    kv_cache.normal_()
    worker.bind_connector_metadata(ConnectorMetadata(saves=[SaveSpec("r", ["k1"], [torch.arange(16, 24)])]))
    worker.start_load_kv()
    worker.save_kv_layer(0)
    worker.wait_for_save()
    assert not engine.storage.hot.contains("k1")
    engine.pool.check_integrity()
    worker.close()
    engine.close()


def test_layerwise_buffers_of_a_step_never_waited_for_go_back_to_the_pool():
    """A step whose saves were abandoned (a layer's save failed and the adapter stopped
    calling in): the next step's first layer returns their buffers, so failures do not
    drain the pool."""
    engine, worker, kv_cache = _setup(True)
    free = engine.pool.num_free
    for step in range(3):
        worker.bind_connector_metadata(
            ConnectorMetadata(saves=[SaveSpec(f"r{step}", [f"k{step}"], [torch.arange(16, 24)])]))
        worker.start_load_kv()
        worker.save_kv_layer(0)  # and nothing after it
    last = SaveSpec("last", ["k9"], [torch.arange(16, 24)])
    worker.bind_connector_metadata(ConnectorMetadata(saves=[last]))
    worker.start_load_kv()
    for layer in range(LAYERS):
        worker.save_kv_layer(layer)
    worker.wait_for_save()
    assert engine.storage.hot.contains("k9")
    assert engine.pool.num_free == free - 1  # k9's slot, held by the hot cache
    engine.pool.check_integrity()
    worker.close()
    engine.close()


class _Recorder(CopyStream):
    """A copy stream that writes what the worker asks of it, in order, into ``log``: the
    events a CUDA stream would be ordered by, checked here without a GPU."""

    current = threading.local()  # the stream active on each thread (name), as CUDA keeps it

    def __init__(self, name: str, log: list):
        self.name, self.log, self.n = name, log, 0
        self.running = set()
        self.slow = False  # marks taken from now on stay running until a test ends them

    def _mark(self, what: str) -> str:
        self.n += 1
        mark = f"{self.name}-{what}-{self.n}"
        self.log.append((self.name, what, mark))
        return mark

    def bind_engine(self):
        self.log.append((self.name, "bind", threading.current_thread() is threading.main_thread()))

    @contextlib.contextmanager
    def active(self):
        before = getattr(self.current, "name", "engine")
        self.current.name = self.name
        try:
            yield
        finally:
            self.current.name = before

    def engine_mark(self):
        return self._mark("engine_mark")

    def mark(self):
        mark = self._mark("mark")
        if self.slow:
            self.running.add(mark)
        return mark

    def waits(self, mark):
        self.log.append((self.name, "waits", mark))

    def engine_waits(self, mark):
        self.log.append((self.name, "engine_waits", mark))

    def synchronize(self):
        self.log.append((self.name, "synchronize"))

    def done(self, mark):
        self.log.append((self.name, "done", mark))
        return mark not in self.running

    def wait(self, mark):
        self.log.append((self.name, "wait", mark))
        self.running.discard(mark)



class _LoggedPages(BlockPagedMemory):
    def __init__(self, kv_cache, log):
        super().__init__(kv_cache)
        self.log = log

    def load(self, chunk, slots, skip=0, layer=None):
        self.log.append(("pages", "load", layer, getattr(_Recorder.current, "name", "engine")))
        super().load(chunk, slots, skip, layer)

    def save(self, slots, chunk, skip=0, layer=None):
        self.log.append(("pages", "save", layer, getattr(_Recorder.current, "name", "engine")))
        super().save(slots, chunk, skip, layer)


def _at(log: list, *entry) -> int:
    return log.index(entry)


def _marks(log: list, stream: str, what: str) -> list[str]:
    return [e[2] for e in log if e[:2] == (stream, what)]


@pytest.mark.parametrize("async_saves", [False, True])
@pytest.mark.parametrize("layerwise", [False, True])
def test_copies_are_ordered_against_the_engine_by_stream_marks(layerwise, async_saves, monkeypatch):
    """The order a CUDA device needs: a load waits for the engine's earlier work, the
    forward pass waits (GPU-side) for each layer's load before its attention, a chunk goes
    back to the pool only after the copies reading it are done, a layer's save reads its
    pages only after the engine wrote them, and saved chunks are stored only after their
    copies are done (with async saves the host does not wait for them: the engine's stream
    does, before its next work)."""
    log: list = []
    cfg = load_config(env={}, chunk_size=CHUNK, max_local_cpu_size=0.001, use_layerwise=layerwise)
    engine = LMKVCache(cfg, KVLayout(LAYERS, 2, 4, torch.float32, CHUNK), "model")
    kv_cache = torch.zeros(LAYERS, 2, 16, BLOCK, 2, 4)
    kvs = _pinned(engine, ["a", "b"])
    worker = WorkerConnector(engine, async_saves=async_saves)
    names = iter(["load", "save"])
    worker.register_kv_caches(_LoggedPages(kv_cache, log), lambda device: _Recorder(next(names), log))
    release, store = ChunkBuffer.release, engine.store
    monkeypatch.setattr(ChunkBuffer, "release", lambda buf: (log.append(("pool", "release")), release(buf)))
    monkeypatch.setattr(engine, "store", lambda *a: (log.append(("cache", "store")), store(*a)))
    slots = [torch.arange(0, 8), torch.arange(8, 16)]
    worker.bind_connector_metadata(ConnectorMetadata(
        loads=[LoadSpec("r", ["a", "b"], slots, [0, 0])],
        saves=[SaveSpec("r", ["c"], [torch.arange(16, 24)], parent="b", position=16)]))
    worker.start_load_kv()
    for layer in range(LAYERS):  # the forward pass, as the bundled engine's layers run it
        worker.wait_for_layer_load(layer)
        log.append(("engine", "attention", layer))
        worker.save_kv_layer(layer)
    assert worker.failed_loads() == []
    log.append(("engine", "forward done"))
    worker.wait_for_save()

    assert ("load", "bind", True) in log and ("save", "bind", True) in log
    copies = [e for e in log if e[0] == "pages"]
    assert {e[3] for e in copies if e[1] == "load"} == {"load"}  # every copy on its stream
    assert {e[3] for e in copies if e[1] == "save"} == {"save"}
    releases = [i for i, e in enumerate(log) if e == ("pool", "release")]
    load_sync = _at(log, "load", "synchronize")
    (ready, *load_marks) = [e[2] for e in log if e[0] == "load" and e[1] in ("engine_mark", "mark")]
    assert ready.startswith("load-engine_mark")  # taken before the forward pass: its earlier work
    assert _at(log, "load", "waits", ready) < min(i for i, e in enumerate(log) if e[:2] == ("pages", "load"))
    assert all(i > load_sync for i in releases)  # no chunk handed back while a copy reads it
    if layerwise:
        assert len(load_marks) == LAYERS  # one per layer (a failure adds one for the rest)
        for layer, mark in enumerate(load_marks):
            assert _at(log, "pages", "load", layer, "load") < _at(log, "load", "mark", mark) \
                < _at(log, "load", "engine_waits", mark) < _at(log, "engine", "attention", layer)
        written = _marks(log, "save", "engine_mark")
        assert len(written) == LAYERS
        for layer, mark in enumerate(written):
            assert _at(log, "engine", "attention", layer) < _at(log, "save", "engine_mark", mark) \
                < _at(log, "save", "waits", mark) < _at(log, "pages", "save", layer, "save")
    else:
        (mark,) = load_marks
        assert max(i for i, e in enumerate(log) if e[:2] == ("pages", "load")) \
            < _at(log, "load", "mark", mark) < _at(log, "load", "engine_waits", mark) \
            < _at(log, "engine", "attention", 0)
        # the host does not wait for the copies before queueing the forward pass
        assert _at(log, "engine", "attention", LAYERS - 1) < load_sync
        (written,) = _marks(log, "save", "engine_mark")
        assert _at(log, "engine", "forward done") < _at(log, "save", "engine_mark", written) \
            < _at(log, "save", "waits", written) < _at(log, "pages", "save", None, "save")
    last_save_copy = max(i for i, e in enumerate(log) if e[:2] == ("pages", "save"))
    if async_saves:
        assert ("save", "synchronize") not in log  # the host never waits for the save copies
        (issued,) = [m for m in _marks(log, "save", "mark")]
        assert last_save_copy < _at(log, "save", "mark", issued) \
            < _at(log, "save", "engine_waits", issued) < _at(log, "save", "done", issued) \
            < _at(log, "cache", "store") < releases[-1]
    else:
        save_sync = min(i for i, e in enumerate(log) if e == ("save", "synchronize"))
        assert last_save_copy < save_sync < _at(log, "cache", "store") < releases[-1]
    assert torch.equal(_paged(kv_cache, slots[0]), kvs[0]) and torch.equal(_paged(kv_cache, slots[1]), kvs[1])
    assert engine.storage.hot.contains("c")
    engine.pool.check_integrity()
    worker.close()
    engine.close()


@pytest.mark.parametrize("layerwise", [False, True])
def test_async_saves_are_stored_once_their_copies_are_done(layerwise):
    """With async saves, chunks whose copies are still running are neither stored nor
    handed back to the pool; a later step stores them once their mark is done, and
    close waits for the rest."""
    log: list = []
    engine, _, kv_cache = _setup(layerwise)
    worker = WorkerConnector(engine, async_saves=True)
    streams = iter(["load", "save"])
    recorders = {}

    def make(device):
        name = next(streams)
        recorders[name] = _Recorder(name, log)
        return recorders[name]

    worker.register_kv_caches(BlockPagedMemory(kv_cache), make)
    saves = recorders["save"]
    saves.slow = True  # the copies run on after the host moves on
    free = engine.pool.num_free

    def step(keys):
        worker.bind_connector_metadata(ConnectorMetadata(saves=[
            SaveSpec("r", [k], [torch.arange(8 * i, 8 * i + 8)], parent=None) for i, k in enumerate(keys)]))
        worker.start_load_kv()
        for layer in range(LAYERS):
            worker.save_kv_layer(layer)
        worker.wait_for_save()
        return _marks(log, "save", "mark")[-1]

    first = step(["c"])
    assert not engine.storage.hot.contains("c") and engine.pool.num_free == free - 1
    step([])  # a step without saves: the copies still run
    assert not engine.storage.hot.contains("c")
    saves.running.discard(first)
    second = step(["d"])  # the next step stores what is done, not what still runs
    assert engine.storage.hot.contains("c") and not engine.storage.hot.contains("d")
    worker.close()  # waits for the rest
    assert ("save", "wait", second) in log and engine.storage.hot.contains("d")
    assert engine.pool.num_free == free - 2  # the hot cache holds c and d, nothing else is out
    engine.pool.check_integrity()
    engine.close()


def test_a_deferred_store_that_fails_costs_the_chunks_and_returns_the_buffers(monkeypatch):
    engine, _, kv_cache = _setup(False)
    worker = WorkerConnector(engine, async_saves=True)
    log: list = []
    worker.register_kv_caches(BlockPagedMemory(kv_cache), lambda device: _Recorder("s", log))
    free = engine.pool.num_free

    def broken(*a):
        raise OSError("injected store failure")

    monkeypatch.setattr(engine, "store", broken)
    worker.bind_connector_metadata(ConnectorMetadata(saves=[SaveSpec("r", ["c"], [torch.arange(8)], None)]))
    worker.start_load_kv()
    worker.wait_for_save()  # never raises: the store runs once the copies are done
    assert engine.pool.num_free == free
    assert engine.metrics.errors.labels(tier="connector", kind="save")._value.get() == 1
    engine.pool.check_integrity()
    worker.close()
    engine.close()


def test_after_a_failed_layer_the_layers_not_reached_wait_for_what_it_issued():
    log: list = []
    engine, worker, kv_cache = _setup(True)
    _pinned(engine, ["a"])
    worker.register_kv_caches(BlockPagedMemory(kv_cache), lambda device: _Recorder("load", log))

    def broken(chunk, slots, skip=0, layer=None):
        if layer == 1:
            raise OSError("injected")

    worker.paged.load = broken
    worker.bind_connector_metadata(ConnectorMetadata(loads=[LoadSpec("r", ["a"], [torch.arange(8)], [0])]))
    worker.start_load_kv()
    for layer in range(LAYERS):
        worker.wait_for_layer_load(layer)
    waited = [e[2] for e in log if e[1] == "engine_waits"]
    marks = _marks(log, "load", "mark")
    assert len(marks) == 2 and waited == [marks[0], marks[1], marks[1]]  # layer 0's, then the last
    assert len(worker.failed_loads()) == 1
    assert _at(log, "load", "mark", marks[1]) < _at(log, "load", "synchronize")
    engine.pool.check_integrity()
    worker.close()
    engine.close()


class _FakePins:
    """torch's pinning as the worker sees it on a GPU machine, on the CPU: pin_memory makes
    a copy that is_pinned then reports pinned; what was pinned is recorded."""

    def __init__(self, monkeypatch):
        self.made: list[torch.Tensor] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: self.pin(t))
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: self.is_pinned(t))

    def pin(self, t):
        self.made.append(t.clone())
        return self.made[-1]

    def is_pinned(self, t):
        return any(t.data_ptr() == p.data_ptr() for p in self.made)


def test_small_pageable_host_tensors_are_pinned_before_a_copy_to_a_gpu(monkeypatch):
    pins = _FakePins(monkeypatch)
    slots = torch.arange(256)
    assert paged.pinned(slots) is pins.made[0] and torch.equal(pins.made[0], slots)
    assert paged.pinned(pins.made[0]) is pins.made[0]  # pinned already
    big = torch.zeros(paged.PIN_MAX_BYTES // 4 + 1)
    assert paged.pinned(big) is big and len(pins.made) == 1  # a chunk's worth is not copied
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert paged.pinned(slots) is slots


def test_a_view_of_many_pieces_goes_to_a_device_as_the_memory_under_it(monkeypatch):
    """on_device's one copy for a view of more than MAX_PIECES contiguous pieces (a load's
    last chunk, ending inside it): the stretch of storage under the view, viewed again
    with the view's strides on the other side, reads as the view."""
    base = torch.randn(2, 5, 8, 3, 4)
    for view in (base[:, :, :5], base[:, :, 2:7], base[:, 1:2], base[1], base):
        span = paged.storage_span(view)
        assert span >= view.numel()
        stretch = view.as_strided((span,), (1,)).clone()  # what the copy moves
        assert torch.equal(stretch.as_strided(view.shape, view.stride()), view)
    assert paged.storage_span(base[:, :, :0]) == 0
    pins = _FakePins(monkeypatch)  # the stretch is sent from pinned memory only
    assert paged.on_device(base[:, :, :5], torch.device("meta")).is_contiguous()
    pins.made.append(base)
    moved = paged.on_device(base[:, :, :5], torch.device("meta"))  # 10 pieces: one copy
    assert moved.shape == (2, 5, 5, 3, 4) and moved.stride() == base.stride()
    sparse = paged.on_device(base[:, :, :1], torch.device("meta"))  # 8x the memory: as torch does
    assert sparse.shape == (2, 5, 1, 3, 4) and sparse.is_contiguous()


class _GpuPages(BlockPagedMemory):
    """Claims a GPU (what the worker's pinning rule looks at), copies on the CPU; records
    the slot mappings it is given."""

    def __init__(self, kv_cache, seen: list[torch.Tensor]):
        super().__init__(kv_cache)
        self.device = torch.device("cuda")
        self.seen = seen

    def load(self, chunk, slots, skip=0, layer=None):
        self.seen.append(slots)
        super().load(chunk, slots, skip, layer)

    def save(self, slots, chunk, skip=0, layer=None):
        self.seen.append(slots)
        super().save(slots, chunk, skip, layer)


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_slot_mapping_that_cannot_be_pinned_fails_the_load_or_save_and_leaks_nothing(
        monkeypatch, layerwise):
    """Pinning (a pinned allocation) may fail: the load fails (its tokens are recomputed)
    and a layer's save stores nothing, neither raising into the forward pass (the save
    raises in wait_for_save, after it), and every chunk goes back."""
    from lmkv.connector import worker as worker_module

    engine, _, kv_cache = _setup(layerwise)
    worker = WorkerConnector(engine)
    worker.register_kv_caches(_GpuPages(kv_cache, []), streams=lambda device: CopyStream())
    _pinned(engine, ["a", "b"])

    loads = [LoadSpec("r", ["a", "b"], [torch.arange(8, 16), torch.arange(20, 28)], [0, 0])]
    saves = [SaveSpec("s", ["c", "d"], [torch.arange(32, 40), torch.arange(40, 48)])]

    def fail(t):  # the load's first mapping, the save's second (after one buffer is taken)
        if t is loads[0].slot_mappings[0] or t is saves[0].slot_mappings[1]:
            raise RuntimeError("CUDA error: out of memory (pinned)")
        return t

    monkeypatch.setattr(worker_module, "pinned", fail)
    worker.bind_connector_metadata(ConnectorMetadata(loads=loads, saves=saves))
    worker.start_load_kv()  # never raises
    for layer in range(LAYERS):
        worker.wait_for_layer_load(layer)
    assert len(worker.failed_loads()) == 1
    for layer in range(LAYERS):
        worker.save_kv_layer(layer)  # never raises
    with pytest.raises(RuntimeError, match="pinned"):
        worker.wait_for_save()
    engine.pool.check_integrity()
    assert engine.pool.num_free == engine.pool.num_slots - 2  # "a" and "b", stored
    worker.close()
    engine.close()


def test_layerwise_save_gathers_do_not_wait_for_the_loads_copies_to_finish():
    """Layer-wise, a step that loads a prefix and saves the rest: the load job issues its
    copies and ends without waiting for them (its chunks go back in failed_loads, once they
    are done), so a layer's save gather, queued behind it on the helper thread, is issued
    while the load copies still run (it waited for every load copy on the GPU)."""
    engine, _, kv_cache = _setup(True)
    log: list = []
    _pinned(engine, ["a"])
    loads_done = threading.Event()

    class SlowLoads(_Recorder):
        def synchronize(self):
            super().synchronize()
            if self.name == "load":  # the load copies run on until the test ends them
                assert loads_done.wait(5)

    names = iter(["load", "save"])
    worker = WorkerConnector(engine)
    worker.register_kv_caches(_LoggedPages(kv_cache, log), lambda device: SlowLoads(next(names), log))
    worker.bind_connector_metadata(ConnectorMetadata(
        loads=[LoadSpec("r", ["a"], [torch.arange(0, 8)], [0])],
        saves=[SaveSpec("r", ["c"], [torch.arange(8, 16)], parent="a", position=8)]))
    worker.start_load_kv()
    for layer in range(LAYERS):
        worker.wait_for_layer_load(layer)
        worker.save_kv_layer(layer)
    deadline = time.monotonic() + 5
    while [e[2] for e in log if e[:2] == ("pages", "save")] != list(range(LAYERS)):
        assert time.monotonic() < deadline, "the save gathers waited for the loads' copies"
        time.sleep(0.01)
    loads_done.set()
    assert worker.failed_loads() == []
    worker.wait_for_save()
    assert engine.storage.hot.contains("c")
    worker.close()
    engine.pool.check_integrity()
    engine.close()


@pytest.mark.parametrize("layerwise", [False, True])
def test_slot_mappings_for_gpu_pages_are_pinned_once_per_step(monkeypatch, layerwise):
    """A copy to a GPU from pageable memory waits for everything queued on its stream: a
    slot mapping copied that way per chunk made every load a host sync per chunk (per
    chunk and layer, layer-wise). Each mapping is pinned once per step; every layer's copy
    reads that one."""
    engine, _, kv_cache = _setup(layerwise)
    seen: list[torch.Tensor] = []
    worker = WorkerConnector(engine)
    worker.register_kv_caches(_GpuPages(kv_cache, seen), streams=lambda device: CopyStream())
    pins = _FakePins(monkeypatch)
    kvs = _pinned(engine, ["a", "b"])
    slots = [torch.arange(8, 16), torch.arange(20, 25)]
    saves = [SaveSpec("s", ["c"], [torch.arange(32, 40)])]
    worker.bind_connector_metadata(ConnectorMetadata(loads=[LoadSpec("r", ["a", "b"], slots, [0, 0])],
                                                     saves=saves))
    worker.start_load_kv()
    for layer in range(LAYERS):
        worker.wait_for_layer_load(layer)
        worker.save_kv_layer(layer)
    assert worker.failed_loads() == []
    worker.wait_for_save()
    assert len(pins.made) == 3  # the two loads' mappings and the save's, whatever the layers
    assert len(seen) == 3 * (LAYERS if layerwise else 1)
    assert all(any(s is p for p in pins.made) for s in seen)
    assert torch.equal(_paged(kv_cache, slots[0]), kvs[0])
    assert torch.equal(_paged(kv_cache, slots[1]), kvs[1][:, :, :5])
    worker.close()
    engine.close()


def test_copy_streams_are_cuda_streams_only_for_cuda_pages():
    assert type(copy_stream(torch.device("cpu"))) is CopyStream
    assert type(copy_stream(torch.device("meta"))) is CopyStream


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_load_on_cuda_pages_is_issued_without_waiting_for_the_engines_stream(monkeypatch):
    """The copies wait for the engine's queued work on the device, never on the host: the
    host returns from start_load_kv while the engine's stream is still busy (a slot mapping
    copied from pageable memory would wait for it, and so would a chunk of many pieces
    copied through a pageable temporary: two chunks end inside them, at 6 and 2 of 8
    tokens, one sent as the memory under it, one gathered into pinned memory)."""
    import time

    monkeypatch.setattr(paged, "MAX_PIECES", 2)  # a short chunk's 6 pieces are many
    engine, _, _ = _setup(False)
    kv_cache = torch.zeros(LAYERS, 2, 16, BLOCK, 2, 4, device="cuda")
    worker = WorkerConnector(engine)
    worker.register_kv_caches(BlockPagedMemory(kv_cache))
    slots = [torch.arange(8, 16), torch.arange(20, 26), torch.arange(32, 34)]

    def load(keys: list[str], busy: bool) -> tuple[float, float]:
        kvs = _pinned(engine, keys)
        worker.bind_connector_metadata(ConnectorMetadata(loads=[
            LoadSpec("r", keys[:2], slots[:2], [0, 0]), LoadSpec("q", keys[2:], slots[2:], [0])]))
        torch.cuda.synchronize()
        start = time.perf_counter()
        if busy:
            torch.cuda._sleep(2_000_000_000)  # about a second of the engine's stream
        worker.start_load_kv()
        issued = time.perf_counter() - start
        assert worker.failed_loads() == []
        torch.cuda.synchronize()
        for kv, s in zip(kvs, slots, strict=True):
            assert torch.equal(_paged(kv_cache, s.cuda()).cpu(), kv[:, :, : len(s)])
        return issued, time.perf_counter() - start

    load(["w1", "w2", "w3"], busy=False)  # first uses: kernels, pinned and device blocks
    issued, total = load(["a", "b", "c"], busy=True)
    assert issued < 0.3 < total, (issued, total)
    worker.close()
    engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("async_saves", [False, True])
@pytest.mark.parametrize("layerwise", [False, True])
def test_loads_and_saves_on_cuda_pages_through_copy_streams(layerwise, async_saves):
    cfg = load_config(env={}, chunk_size=CHUNK, max_local_cpu_size=0.001, use_layerwise=layerwise)
    engine = LMKVCache(cfg, KVLayout(LAYERS, 2, 4, torch.float32, CHUNK), "model")
    kv_cache = torch.zeros(LAYERS, 2, 16, BLOCK, 2, 4, device="cuda")
    worker = WorkerConnector(engine, async_saves=async_saves)
    worker.register_kv_caches(BlockPagedMemory(kv_cache))
    kvs = _pinned(engine, ["a"])
    slots = torch.arange(8, 16)
    worker.bind_connector_metadata(ConnectorMetadata(
        loads=[LoadSpec("r", ["a"], [slots], [0])],
        saves=[SaveSpec("r", ["c"], [slots], parent=None)]))
    torch.cuda._sleep(200_000_000)  # the engine's stream is busy for a while...
    kv_cache.fill_(-1.0)  # ...then writes every page: the load must land after this
    worker.start_load_kv()
    seen = []
    for layer in range(LAYERS):
        worker.wait_for_layer_load(layer)
        seen.append(kv_cache[layer].clone())  # the engine reads the layer after its load
        worker.save_kv_layer(layer)
    assert worker.failed_loads() == []
    worker.wait_for_save()
    kv_cache.fill_(-2.0)  # the engine's next work: never before the save has read the pages
    worker.complete_saves(wait=True)
    torch.cuda.synchronize()
    for layer, pages in enumerate(seen):
        assert torch.equal(pages.flatten(1, 2)[:, slots.cuda()].cpu(), kvs[0][:, layer])
    buf = engine.storage.hot.get("c")
    assert torch.equal(buf.kv, kvs[0])
    buf.release()
    worker.close()
    engine.close()


def test_a_partial_chunk_saved_into_pinned_memory_is_copied_without_blocking(monkeypatch):
    """A prompt's partial last chunk (save_unfull_chunk) saved from GPU pages is a view of
    2 x layers pieces of its pinned slot: past MAX_PIECES it went over in one blocking copy
    through a pageable temporary, a wait for every save copy queued on the stream."""
    chunk = torch.zeros(2, 30, 256, 2, 8)  # 30 layers, chunk_size 256, a pinned pool slot
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: True)
    dst, stage = chunk[:, :, :100], torch.randn(2, 30, 100, 2, 8)  # (stage: the device's)
    flags: list[bool] = []
    real = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda t, src, non_blocking=False: (
        flags.append(bool(non_blocking)), real(t, src, non_blocking))[1])
    paged.copy_to_host(dst, stage)
    assert torch.equal(dst, stage) and flags and all(flags)


def test_an_eager_steps_metadata_goes_to_a_gpu_from_pinned_memory(monkeypatch):
    """ids, positions, slots, block tables, sequence lengths and query starts went to the
    GPU from pageable tensors: each such copy first waits for everything queued on the
    engine's stream (this step's loads, the last step's saves)."""
    from lmkv_engines.minimal.model_runner import ModelRunner
    from lmkv_engines.minimal.request import Request
    from lmkv_engines.minimal.sampling_params import SamplingParams
    from lmkv_engines.minimal.scheduler import ScheduledRequest

    pins = _FakePins(monkeypatch)
    sent: list[tuple[tuple[int, ...], bool]] = []
    real_to = torch.Tensor.to

    def to(t, *args, **kwargs):
        dev = args[0] if args else kwargs.get("device")
        if isinstance(dev, torch.device) and dev.type == "cuda":  # (no GPU: recorded only)
            sent.append((tuple(t.shape), pins.is_pinned(t)))
            return t
        return real_to(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    runner = ModelRunner.__new__(ModelRunner)  # (_prepare needs no model)
    runner.device, runner.block_size, runner.launcher = torch.device("cuda"), 4, None
    req = Request("r", list(range(10)), SamplingParams(max_tokens=1))
    req.block_ids = [3, 5, 7]
    runner._prepare([ScheduledRequest(req, 10)])
    assert len(sent) == 6 and all(was_pinned for _, was_pinned in sent), sent
