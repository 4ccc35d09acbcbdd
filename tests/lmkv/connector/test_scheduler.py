"""The scheduler role's load plans, on plain request objects: which chunks are loaded into
which slots, how a hit that ends inside the last chunk is cut, and that every pinned chunk
goes back to the pool whatever the engine does with the offer."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from lmkv.cache import LMKVCache
from lmkv.config import load_config
from lmkv.connector import SchedulerConnector, WorkerConnector
from lmkv.layout import KVLayout
from lmkv.memory import HEADER_BYTES
from lmkv.paged import BlockPagedMemory

CHUNK, BLOCK = 16, 4


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def _engine(**config) -> LMKVCache:
    cfg = load_config(env={}, chunk_size=CHUNK, **{"max_local_cpu_size": 0.001, **config})
    return LMKVCache(cfg, KVLayout(2, 1, 4, torch.float32, CHUNK), "model")


def _store(engine: LMKVCache, tokens: list[int]) -> list[torch.Tensor]:
    """Store every full chunk of ``tokens`` with distinct KV; returns the chunks' KV."""
    kvs = []
    for i, key in enumerate(engine.keys(tokens)):
        buf = engine.allocate()
        buf.kv.copy_(torch.randn(buf.kv.shape))
        kvs.append(buf.kv.clone())
        engine.store(key, buf)
        buf.release()
        assert i < len(tokens) // CHUNK
    return kvs


def _schedule(sched: SchedulerConnector, req: Request, computed: int, take: int | None = None):
    """The engine's side of a new request: its prefix hit ``computed``, lmkv's offer, of
    which it takes ``take`` tokens (all by default), blocks for the whole prompt."""
    offered, _ = sched.get_num_new_matched_tokens(req, computed)
    taken = offered if take is None else take
    n = len(req.prompt_token_ids)
    req.block_ids = list(range(100, 100 + -(-n // BLOCK)))
    req.num_computed_tokens = computed
    sched.update_state_after_alloc(req, req.block_ids, taken)
    req.num_computed_tokens += taken
    meta = sched.build_connector_meta([(req, n - req.num_computed_tokens)])
    return offered, meta


def test_a_prompt_of_whole_chunks_is_loaded_up_to_its_last_token():
    engine = _engine()
    prompt = list(range(1000, 1000 + 3 * CHUNK))
    kvs = _store(engine, prompt)
    sched = SchedulerConnector(engine, BLOCK)
    req = Request("a", prompt)
    offered, meta = _schedule(sched, req, computed=0)
    assert offered == 3 * CHUNK - 1
    (load,) = meta.loads
    assert [s.shape[0] for s in load.slot_mappings] == [CHUNK, CHUNK, CHUNK - 1]
    assert load.skips == [0, 0, 0]
    assert torch.equal(load.slot_mappings[2], torch.arange(2 * CHUNK, 3 * CHUNK - 1) + 100 * BLOCK)
    # the worker writes exactly tokens [0, 3 * CHUNK - 1) into paged memory
    kv_cache = torch.zeros(2, 2, 200, BLOCK, 1, 4)
    worker = WorkerConnector(engine)
    worker.register_kv_caches(BlockPagedMemory(kv_cache))
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()
    flat = kv_cache.permute(1, 0, 2, 3, 4, 5).reshape(2, 2, -1, 1, 4)[:, :, 100 * BLOCK :]
    for i, kv in enumerate(kvs):
        n = CHUNK - (i == 2)
        assert torch.equal(flat[:, :, i * CHUNK : i * CHUNK + n], kv[:, :, :n])
    assert not flat[:, :, 3 * CHUNK - 1].any()  # the last token's slot is left to the engine
    sched.request_finished(req)
    engine.pool.check_integrity()
    assert engine.pool.num_free == engine.pool.num_slots - 3  # only the hot cache holds them
    engine.close()


def test_a_hit_inside_the_engines_prefix_loads_only_the_tokens_beyond_it():
    engine = _engine()
    prompt = list(range(2000, 2000 + 2 * CHUNK))
    _store(engine, prompt)
    sched = SchedulerConnector(engine, BLOCK)
    offered, meta = _schedule(sched, Request("b", prompt), computed=CHUNK + BLOCK)
    assert offered == CHUNK - BLOCK - 1
    (load,) = meta.loads
    assert [s.shape[0] for s in load.slot_mappings] == [CHUNK - 1]
    assert load.skips == [BLOCK]
    for key in load.keys:  # as the worker role does
        engine.take(key).release()
    engine.close()


def test_an_engine_taking_fewer_tokens_than_offered_loads_only_those():
    engine = _engine()
    prompt = list(range(3000, 3000 + 3 * CHUNK + 5))
    _store(engine, prompt)
    sched = SchedulerConnector(engine, BLOCK)
    req = Request("c", prompt)
    offered, meta = _schedule(sched, req, computed=0, take=CHUNK + BLOCK)
    assert offered == 3 * CHUNK
    (load,) = meta.loads
    assert [s.shape[0] for s in load.slot_mappings] == [CHUNK, BLOCK]
    for key in load.keys:  # as the worker role does
        engine.take(key).release()
    sched.request_finished(req)
    engine.pool.check_integrity()
    assert engine.pool.num_free == engine.pool.num_slots - 3
    # and none at all: every pinned chunk is given back
    req = Request("d", prompt)
    _, meta = _schedule(sched, req, computed=0, take=0)
    assert not meta.loads
    sched.request_finished(req)
    engine.pool.check_integrity()
    assert engine.pool.num_free == engine.pool.num_slots - 3
    engine.close()


def test_saves_name_the_position_of_their_first_chunk_and_the_worker_sets_it():
    engine = _engine()
    prompt = list(range(2000, 2000 + 3 * CHUNK + 5))
    sched = SchedulerConnector(engine, BLOCK)
    req = Request("p", prompt, list(range(100, 100 + -(-len(prompt) // BLOCK))))
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, req.block_ids, 0)
    first = sched.build_connector_meta([(req, CHUNK + 3)])  # chunked prefill: 1 chunk, then 2
    req.num_computed_tokens = CHUNK + 3
    second = sched.build_connector_meta([(req, len(prompt) - req.num_computed_tokens)])
    assert [(s.keys, s.position) for s in first.saves + second.saves] == [
        (engine.keys(prompt)[:1], 0), (engine.keys(prompt)[1:3], CHUNK)]
    kv_cache = torch.randn(2, 2, 200, BLOCK, 1, 4)
    worker = WorkerConnector(engine)
    worker.register_kv_caches(BlockPagedMemory(kv_cache))
    keys = engine.keys(prompt)
    for meta in (first, second):
        if meta is second:  # chunk 1 is held already: the worker skips it, not its position
            buf = engine.allocate()
            engine.store(keys[1], buf, keys[0])
            buf.release()
        worker.bind_connector_metadata(meta)
        worker.start_load_kv()
        worker.wait_for_save()
    for i in (0, 2):
        buf = engine.storage.hot.get(keys[i])
        assert buf is not None and buf.position == i * CHUNK
        buf.release()
    sched.request_finished(req)
    engine.close()


def test_chunks_lmkv_lacks_below_the_engines_hit_are_saved_though_it_holds_later_ones():
    """lmkv holds chunks 2 and 3 but not 0 and 1 (their save was dropped, or a tier evicted
    them), the engine's own prefix cache holds 0 and 1: lmkv loads 2..3 and saves 0 and 1
    (not the chunks it loads), so that another instance can load the whole prompt."""
    engine = _engine(cache_policy="lru")  # (a prefix policy keeps no chunk without its parent)
    prompt = list(range(2000, 2000 + 4 * CHUNK))
    keys = engine.keys(prompt)
    for key in keys[2:]:
        buf = engine.allocate()
        engine.store(key, buf)
        buf.release()
    assert engine.lookup(keys) == 0
    sched = SchedulerConnector(engine, BLOCK)
    offered, meta = _schedule(sched, Request("a", prompt), computed=2 * CHUNK)
    assert offered == 2 * CHUNK - 1
    assert [k for s in meta.saves for k in s.keys] == keys[:2]  # not the chunks it loads
    worker = WorkerConnector(engine)
    worker.register_kv_caches(BlockPagedMemory(torch.randn(2, 2, 200, BLOCK, 1, 4)))
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()
    worker.wait_for_save()
    assert engine.lookup(keys) == 4
    engine.close()


def test_a_stale_pin_is_dropped_when_a_save_needs_its_slot(monkeypatch):
    """A pin never taken nor given back (its scheduler went away) holds a slot only until
    its ttl has passed and lmkv needs a slot, even with no new pins."""
    engine = _engine()
    prompt = list(range(5000, 5000 + CHUNK))
    _store(engine, prompt)
    engine.pin(engine.keys(prompt))
    engine.storage.hot.clear()
    slots = [engine.allocate() for _ in range(engine.pool.num_slots)]
    assert slots[-1] is None  # the pinned slot is held
    monkeypatch.setattr(engine.pins, "ttl", -1.0)
    assert engine.allocate() is not None and len(engine.pins) == 0
    engine.close()


def test_chunks_loaded_past_the_engines_prefix_join_the_hot_cache_under_their_parent(tmp_path):
    """The engine's own prefix cache holds the prompt's first chunks; lmkv loads the rest
    from the disk tier. Those join the hot cache's prefix tree under the chunk before them
    (and the tail under the last full chunk), not as roots: else the prefix policies would
    evict that parent before its continuation, which no lookup could then reach."""
    engine = _engine(local_disk=str(tmp_path), max_local_disk_size=0.01, save_unfull_chunk=True)
    prompt = list(range(5000, 5000 + 4 * CHUNK + 5))
    keys = engine.keys(prompt)
    _store(engine, prompt)
    tail = engine.tail_key(prompt)
    buf = engine.allocate()
    buf.num_tokens = 5
    engine.store(tail, buf, keys[-1])
    buf.release()
    engine.drain()
    engine.storage.hot.clear()
    for buf in engine.fetch(keys[:2]):  # chunks 0 and 1 hot again, as a lookup brings them
        buf.release()
    sched = SchedulerConnector(engine, BLOCK)
    req = Request("p", prompt)
    offered, meta = _schedule(sched, req, computed=2 * CHUNK)
    assert offered == 2 * CHUNK + 4  # chunks 2, 3 and the tail (but its last token)
    nodes = engine.storage.hot.policy.nodes
    assert [nodes[k].parent.key for k in (keys[2], keys[3], tail)] == [keys[1], keys[2], keys[3]]
    assert nodes[keys[1]].children == 1
    for key in meta.loads[0].keys:
        engine.take(key).release()
    sched.request_finished(req)
    engine.close()


@pytest.mark.parametrize("policy", ["lru", "prefix_lru", "prefix_adaptive"])
def test_a_turn_served_by_the_engines_prefix_cache_keeps_its_new_chunks(policy):
    """The engine's own prefix cache serves a conversation's earlier turn, whose chunk in
    lmkv is the oldest in a full hot cache: that use counts for lmkv's policy too, so the
    slots for the new chunks are not taken from it (a prefix policy then refuses every
    chunk after it; LRU keeps chunks no lookup reaches)."""
    layout = KVLayout(2, 1, 4, torch.float32, CHUNK)
    engine = _engine(cache_policy=policy,
                     max_local_cpu_size=4 * (HEADER_BYTES + layout.chunk_bytes) / 1e9 + 1e-9)
    assert engine.pool.num_slots == 4
    turn = list(range(3000, 3000 + CHUNK))
    _store(engine, turn)
    _store(engine, list(range(7000, 7000 + 3 * CHUNK)))  # another conversation, stored later
    prompt = turn + list(range(4000, 4000 + 2 * CHUNK + 3))
    keys = engine.keys(prompt)
    sched = SchedulerConnector(engine, BLOCK)
    req = Request("next", prompt)
    offered, meta = _schedule(sched, req, computed=CHUNK)
    assert offered == 0 and [k for s in meta.saves for k in s.keys] == keys[1:3]
    worker = WorkerConnector(engine)
    worker.register_kv_caches(BlockPagedMemory(torch.randn(2, 2, 200, BLOCK, 1, 4)))
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()
    worker.wait_for_save()
    assert engine.lookup(keys) == 3 and engine.storage.hot.num_refused == 0
    sched.request_finished(req)
    worker.close()
    engine.close()


def test_a_decode_step_with_nothing_to_save_does_not_copy_the_tokens():
    """Every step asked every scheduled request for len(all_token_ids): the bundled engine
    builds that list anew (prompt + output), so a step cost lmkv ~50 us per running request
    at 16K tokens, with nothing to load or save. The length is num_tokens."""

    @dataclass
    class Counted(Request):
        copies: int = 0

        @property
        def all_token_ids(self) -> list[int]:
            self.copies += 1
            return list(self.prompt_token_ids)

        @property
        def num_tokens(self) -> int:
            return len(self.prompt_token_ids)

    engine = _engine()
    sched = SchedulerConnector(engine, BLOCK)
    req = Counted("d", list(range(2 * CHUNK + 3)))
    _schedule(sched, req, computed=0)
    req.copies = 0
    for _ in range(5):
        assert sched.build_connector_meta([(req, 1)]).saves == []
    assert req.copies == 0
    sched.request_finished(req)
    engine.close()


def test_decode_saves_stop_at_the_tokens_known_when_the_engine_counts_drafts_ahead():
    """save_decode_cache with vLLM's async scheduling and speculative decoding: the engine's
    computed count runs past the tokens it knows (draft positions); the step saves the
    chunks of known tokens only (before: an IndexError that stopped vLLM's scheduler)."""

    @dataclass
    class Decoding(Request):
        output: list[int] = field(default_factory=list)

        @property
        def all_token_ids(self) -> list[int]:
            return self.prompt_token_ids + self.output

    engine = _engine(save_decode_cache=True)
    sched = SchedulerConnector(engine, BLOCK)
    req = Decoding("s", list(range(20)), list(range(100, 110)))
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, req.block_ids, 0)
    sched.build_connector_meta([(req, 20)])  # the prefill: chunk 0 saved
    req.output = list(range(500, 511))  # 31 tokens known
    req.num_computed_tokens = 33  # two draft positions counted ahead
    assert sched.build_connector_meta([(req, 0)]).saves == []  # chunk 1 is not all known
    req.output += [600, 601]  # the drafts accepted: 33 known
    (save,) = sched.build_connector_meta([(req, 0)]).saves
    assert save.keys == engine.keys(req.all_token_ids)[1:2] and save.position == CHUNK
    sched.request_finished(req)
    engine.close()


class _LossyCache:
    """An LMKVCache whose every pinned chunk reports it was decoded from a lossy codec."""

    def __init__(self, engine: LMKVCache):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def pin(self, keys, parent=None, again=False):
        return [True for _ in self._engine.pin(keys, parent, again)]


def test_a_request_served_lossy_kv_by_the_engines_prefix_cache_is_lossy_too():
    """Request A loads lossy chunks; they enter the engine's prefix cache. Request B, whose
    engine hit covers them, computes over that approximate KV: its saves are marked lossy
    and the quality gate may sample it (before, B was taken for exact)."""
    engine = _engine()
    shared = list(range(1000, 1000 + 2 * CHUNK))
    _store(engine, shared)
    sched = SchedulerConnector(_LossyCache(engine), BLOCK)
    a = Request("a", shared + [1, 2, 3])
    offered, meta = _schedule(sched, a, computed=0)
    assert offered == 2 * CHUNK and sched.served_lossy(a)
    for key in meta.loads[0].keys:
        engine.take(key).release()
    sched.request_finished(a)
    b = Request("b", shared + list(range(5000, 5000 + CHUNK + 3)))
    offered, meta = _schedule(sched, b, computed=2 * CHUNK)  # the engine serves the shared part
    assert offered == 0 and sched.served_lossy(b)
    (save,) = meta.saves
    assert save.lossy and save.keys == engine.keys(b.prompt_token_ids)[2:3]
    c = Request("c", list(range(9000, 9000 + 2 * CHUNK + 3)))  # unrelated: exact
    _schedule(sched, c, computed=CHUNK)
    assert not sched.served_lossy(c)
    for r in (b, c):
        sched.request_finished(r)
    engine.close()


def test_pins_of_a_request_that_was_not_scheduled_are_given_back_at_once():
    """A request looked up but not allocated (no free blocks, over the step's budget) gives
    its pins back when the step is planned, not at its next lookup: a queue of waiting
    requests would hold the hot cache's slots. Also when planning the step raises."""
    engine = _engine()
    prompt = list(range(6000, 6000 + 2 * CHUNK + 1))
    _store(engine, prompt)
    sched = SchedulerConnector(engine, BLOCK)
    waiting = Request("w", prompt)
    assert sched.get_num_new_matched_tokens(waiting, 0)[0] == 2 * CHUNK
    assert len(engine.pins) == 2
    assert sched.build_connector_meta([]).loads == []  # the step ran without it
    assert len(engine.pins) == 0
    # looked up again, allocated this time: loaded as before
    offered, meta = _schedule(sched, waiting, computed=0)
    assert offered == 2 * CHUNK and len(meta.loads[0].keys) == 2
    for key in meta.loads[0].keys:
        engine.take(key).release()
    sched.request_finished(waiting)

    other = Request("x", prompt)
    sched.get_num_new_matched_tokens(other, 0)
    with pytest.raises(ValueError):  # a request without its blocks: planning the step fails
        sched.build_connector_meta([(Request("broken", list(range(CHUNK + 1)), [], 0), CHUNK + 1),
                                    (other, 1)])
    assert len(engine.pins) == 0
    # ... also when a request planned before the failing one was to load pinned chunks
    sched.request_finished(other)
    loading = Request("y", prompt)
    assert sched.get_num_new_matched_tokens(loading, 0)[0] == 2 * CHUNK
    loading.block_ids = list(range(100, 100 + -(-len(prompt) // BLOCK)))
    sched.update_state_after_alloc(loading, loading.block_ids, 2 * CHUNK)
    loading.num_computed_tokens = 2 * CHUNK
    with pytest.raises(ValueError):
        sched.build_connector_meta([(loading, 1), (Request("broken2", list(range(CHUNK + 1)), [], 0),
                                                   CHUNK + 1)])
    assert len(engine.pins) == 0
    engine.close()


def _looked_up_then_evicted(first_token: int):
    """A request whose lookup found its 3 stored chunks, not allocated that step (its pins
    given back), the chunks then evicted by other requests' saves."""
    engine = _engine()
    prompt = list(range(first_token, first_token + 3 * CHUNK + 5))
    _store(engine, prompt)
    sched = SchedulerConnector(engine, BLOCK)
    waiting = Request("w", prompt)
    assert sched.get_num_new_matched_tokens(waiting, 0)[0] == 3 * CHUNK
    sched.build_connector_meta([])
    engine.storage.hot.clear()
    return engine, sched, waiting, prompt


def test_chunks_a_lookup_found_are_saved_if_they_left_before_the_request_was_allocated():
    """A lookup's hit counted the chunks as stored for the request at once: when the engine
    did not allocate it and they left the hot cache meanwhile, the request computed them
    and never saved them."""
    engine, sched, waiting, prompt = _looked_up_then_evicted(7000)
    offered, meta = _schedule(sched, waiting, computed=0)  # found nothing: computes it all
    assert offered == 0
    assert [k for s in meta.saves for k in s.keys] == engine.keys(prompt)
    engine.close()


def test_a_producer_reuses_no_stored_rag_chunk():
    """kv_role: producer only saves: with enable_blending it offers no blend plan."""
    doc = list(range(100, 100 + CHUNK))
    prompt = doc + [7] + list(range(300, 310))
    for role, planned in (("both", True), ("producer", False)):
        engine = _engine(kv_role=role, enable_blending=True)
        assert engine.store_chunk(doc, torch.randn(2, 2, CHUNK, 1, 4))
        sched = SchedulerConnector(engine, BLOCK, blend_separator=[7])
        plan = sched.get_blend_plan(Request("p", prompt))
        assert (plan is not None) == planned
        sched.request_finished(Request("p", prompt))
        engine.close()


def test_a_request_waiting_several_steps_counts_its_engine_hit_as_one_use():
    """The engine-prefix touch is one use per request, however often it is looked up while
    it waits for blocks (a frequency policy would count a waiting request as many uses)."""
    engine = _engine()
    prompt = list(range(8000, 8000 + 2 * CHUNK + 1))
    _store(engine, prompt)
    touches = []

    class Counting(_LossyCache):
        def pin(self, keys, parent=None, again=False):
            return self._engine.pin(keys, parent, again)

        def touch(self, keys):
            touches.append(list(keys))
            self._engine.touch(keys)

    sched = SchedulerConnector(Counting(engine), BLOCK)
    req = Request("w", prompt)
    for _ in range(3):
        sched.get_num_new_matched_tokens(req, CHUNK)
        sched.build_connector_meta([])
    assert touches == [engine.keys(prompt)[:1]]
    sched.request_finished(req)
    engine.close()


def test_a_pinned_tail_of_a_request_not_scheduled_is_given_back_too():
    """save_unfull_chunk: a prompt whose only stored piece lmkv offers is its partial last
    chunk (shorter than a chunk, or its full chunks in the engine's own cache)."""
    engine = _engine(save_unfull_chunk=True)
    for prompt, computed in ((list(range(10)), 0), (list(range(100, 100 + CHUNK + 10)), CHUNK)):
        keys = engine.keys(prompt)
        _store(engine, prompt)
        buf = engine.allocate()
        buf.num_tokens = len(prompt) % CHUNK
        engine.store(engine.tail_key(prompt), buf, keys[-1] if keys else None)
        buf.release()
        sched = SchedulerConnector(engine, BLOCK)
        req = Request(f"t{computed}", prompt)
        assert sched.get_num_new_matched_tokens(req, computed)[0] == len(prompt) - computed - 1
        assert len(engine.pins) == 1
        sched.build_connector_meta([])
        assert len(engine.pins) == 0
        sched.request_finished(req)
    engine.close()


def test_a_request_over_a_tail_loaded_lossy_in_the_engines_prefix_cache_is_lossy():
    """save_unfull_chunk: request A loads its prompt's partial last chunk lossy; B continues
    A's prompt and the engine's prefix cache serves blocks that tail filled: B computes
    over lossy KV, so it is marked lossy (the tail's key is not one of B's chunk keys)."""
    engine = _engine(save_unfull_chunk=True)
    a_prompt = list(range(100, 100 + 2 * CHUNK + 10))
    keys = engine.keys(a_prompt)
    _store(engine, a_prompt)
    buf = engine.allocate()
    buf.num_tokens = 10
    engine.store(engine.tail_key(a_prompt), buf, keys[-1])
    buf.release()
    sched = SchedulerConnector(_LossyCache(engine), BLOCK)
    a = Request("a", a_prompt)
    _, meta = _schedule(sched, a, computed=2 * CHUNK)  # the engine holds chunks 0-1: the tail
    assert sched.served_lossy(a)
    for key in meta.loads[0].keys:
        engine.take(key).release()
    sched.request_finished(a)
    b = Request("b", a_prompt + list(range(7000, 7000 + CHUNK)))
    _, meta = _schedule(sched, b, computed=2 * CHUNK + 8)
    assert sched.served_lossy(b) and all(s.lossy for s in meta.saves)
    c = Request("c", a_prompt[: 2 * CHUNK] + list(range(8000, 8000 + CHUNK)))  # another tail
    _schedule(sched, c, computed=2 * CHUNK + 8)
    assert not sched.served_lossy(c)
    for r in (b, c):
        sched.request_finished(r)
    engine.close()


def test_an_engine_hit_in_the_blend_namespace_stands_in_for_a_blend_only_where_it_costs_less():
    """A RAG prompt is salted apart in the engine's prefix cache; a hit there that leaves no
    more to compute than a blend would (the prompt sent again) means no plan and no fetch;
    a shorter hit (only the header) still gets the plan. Prompts without a second segment,
    and engines without blending, are not salted."""
    docs = [list(range(100, 100 + 2 * CHUNK)), list(range(200, 200 + 2 * CHUNK))]
    header, query = list(range(400, 400 + CHUNK)), list(range(300, 306))
    prompt = header + [7] + docs[0] + [7] + docs[1] + [7] + query
    engine = _engine(enable_blending=True, blend_recompute_ratio=0.15)
    for doc in docs:
        assert engine.store_chunk(doc, torch.randn(2, 2, len(doc), 1, 4))
    sched = SchedulerConnector(engine, BLOCK, blend_separator=[7])
    assert sched.prefix_cache_salt(Request("q", header + query)) == b""
    req = Request("p", prompt)
    assert sched.prefix_cache_salt(req).startswith(b"lmkv-blend:0.15:")
    fetched = []
    real = engine.blend_plan
    engine.blend_plan = lambda *a: fetched.append(1) or real(*a)
    plan = sched.get_blend_plan(req, CHUNK)  # the header only: blending costs less
    assert plan is not None and plan.num_cached_tokens == 4 * CHUNK
    plan = sched.get_blend_plan(req, len(prompt) - 1)  # the prompt again: no plan, no fetch
    assert plan is None and fetched == [1]
    assert sched.get_num_new_matched_tokens(req, len(prompt) - 1)[0] == 0
    assert sched.states["p"].blended  # what it computes over the hit is never saved
    # a failed load: the engine computes it again over the same salted hit, still unsaved
    sched.recompute_without_loads(req)
    assert sched.get_blend_plan(req, len(prompt) - 1) is None
    sched.get_num_new_matched_tokens(req, len(prompt) - 1)
    req.block_ids = list(range(100, 100 + -(-len(prompt) // BLOCK)))
    sched.update_state_after_alloc(req, req.block_ids, 0)
    req.num_computed_tokens = len(prompt) - 1
    assert sched.build_connector_meta([(req, 1)]).saves == []
    sched.request_finished(req)
    engine.close()
    off = _engine()
    assert SchedulerConnector(off, BLOCK).prefix_cache_salt(req) == b""
    off.close()


def test_a_request_that_will_load_nothing_is_never_held_back_for_arriving_chunks(monkeypatch):
    """loads_arriving: the chunks a prefetch holds are read up urgently, once, and arriving
    until that is done, or for ARRIVING_WAIT seconds at most; a producer's request, or one
    recomputed after a failed load, loads nothing, so it is never held back for them."""
    from types import SimpleNamespace

    import lmkv.connector.scheduler as scheduler_module

    clock = [100.0]
    monkeypatch.setattr(scheduler_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    prompt = list(range(1000, 1000 + 3 * CHUNK + 5))
    for role in ("both", "producer"):
        engine = _engine(kv_role=role)
        brought: list[tuple[list[str], str | None]] = []

        class Arrival:
            up = False
            released = 0

            def done(self):
                return self.up

            def release(self):
                self.released += 1

        arrival = Arrival()
        engine.bring_up = (lambda keys, parent=None, sent=brought, got=arrival:
                           sent.append((keys, parent)) or got)
        sched = SchedulerConnector(engine, BLOCK)
        req = Request("r", prompt)
        sched.on_new_request(req)
        keys = engine.keys(prompt)
        if role == "producer":
            assert not sched.loads_arriving(req, 0) and brought == []
        else:
            assert sched.loads_arriving(req, CHUNK)  # sent for: arriving
            assert brought == [(keys[1:], keys[0])]
            clock[0] += 1
            assert sched.loads_arriving(req, CHUNK) and len(brought) == 1  # once
            arrival.up = True
            assert not sched.loads_arriving(req, CHUNK) and len(brought) == 1  # done
            assert arrival.released == 0  # held until its lookup
            sched.get_num_new_matched_tokens(req, CHUNK)
            assert arrival.released == 1  # looked up (pinned): let go
            sched.request_finished(req)
            assert arrival.released == 1
            again = Request("again", prompt)
            sched.on_new_request(again)
            sched.recompute_without_loads(again)
            assert not sched.loads_arriving(again, 0) and len(brought) == 1
            late = Request("late", prompt)
            arrival.up = False
            assert sched.loads_arriving(late, 0) and len(brought) == 2
            clock[0] += scheduler_module.ARRIVING_WAIT  # waited long enough: looked up now
            assert not sched.loads_arriving(late, 0) and len(brought) == 2
            sched.request_finished(late)  # (left without a lookup)
            assert arrival.released == 2
            engine.bring_up = lambda keys, parent=None, sent=brought: sent.append(keys)  # None
            held = Request("held by nothing", prompt)
            assert not sched.loads_arriving(held, 0) and len(brought) == 3
            assert not sched.loads_arriving(held, 0) and len(brought) == 3  # asked once
        engine.close()


def test_a_lookup_that_fails_keeps_nothing_an_earlier_one_found():
    """What an earlier lookup found was committed at allocation even when the lookup just
    before it failed: chunks evicted meanwhile were computed and never saved."""
    engine, sched, waiting, prompt = _looked_up_then_evicted(7100)
    real = engine.pin
    engine.pin = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a rank did not answer"))
    with pytest.raises(RuntimeError):
        sched.get_num_new_matched_tokens(waiting, 0)
    engine.pin = real
    waiting.block_ids = list(range(100, 100 + -(-len(prompt) // BLOCK)))
    sched.update_state_after_alloc(waiting, waiting.block_ids, 0)  # (the engine: 0 external)
    meta = sched.build_connector_meta([(waiting, len(prompt))])
    assert [k for s in meta.saves for k in s.keys] == engine.keys(prompt)
    engine.close()


def test_chunks_being_read_up_are_let_go_when_a_later_run_cannot_start():
    class Arrival:
        def __init__(self):
            self.released = False

        def done(self):
            return False

        def release(self):
            self.released = True

    started = []

    class Cache:
        def bring_up(self, keys, parent=None):
            if started:
                raise RuntimeError("the I/O worker is gone")
            started.append(Arrival())
            return started[0]

    engine = _engine(enable_blending=True)
    sched = SchedulerConnector(engine, BLOCK, blend_separator=[3, 3])
    docs = [list(range(7200, 7200 + CHUNK)), list(range(7300, 7300 + CHUNK))]
    request = Request("rag", docs[0] + [3, 3] + docs[1] + [3, 3] + [5, 6])
    engine.bring_up = Cache().bring_up
    with pytest.raises(RuntimeError):
        sched.loads_arriving(request, 0)
    assert started and started[0].released
    engine.close()


def test_a_session_whose_prompt_grows_loads_the_partial_chunk_of_its_prompt_as_it_is_now():
    """save_unfull_chunk with a streaming session (vLLM extends a request's prompt in place
    with each new input): the partial last chunk is keyed by the prompt as it is when it is
    saved or looked up, never by the prompt the request came with. Once keyed by that first
    prompt, a lookup after a preemption loaded the first prompt's tail at the new one's
    positions (position 32 got the KV of position 16)."""
    engine = _engine(save_unfull_chunk=True)
    sched, worker = SchedulerConnector(engine, BLOCK), WorkerConnector(engine)
    kv_cache = torch.zeros(2, 2, 200, BLOCK, 1, 4)  # [K/V, layers, blocks, block, heads, dim]
    worker.register_kv_caches(BlockPagedMemory(kv_cache))

    def at(req, p):  # a token's page row
        slot = req.block_ids[p // BLOCK] * BLOCK + p % BLOCK
        return kv_cache[:, :, slot // BLOCK, slot % BLOCK]

    def step(req, num_new):  # the engine computes tokens whose KV is their position
        meta = sched.build_connector_meta([(req, num_new)])
        worker.bind_connector_metadata(meta)
        worker.start_load_kv()
        for p in range(req.num_computed_tokens, req.num_computed_tokens + num_new):
            at(req, p).fill_(p)
        assert not worker.failed_loads()
        worker.wait_for_save()
        req.num_computed_tokens += num_new
        return meta

    req = Request("s", list(range(1000, 1030)))  # a chunk and a 14-token tail
    assert sched.get_num_new_matched_tokens(req, 0)[0] == 0
    req.block_ids = list(range(10, 22))
    sched.update_state_after_alloc(req, req.block_ids, 0)
    step(req, 30)
    req.prompt_token_ids.extend([7, 8, 9, 10])  # the session's next input: 34 tokens
    step(req, 4)
    engine.drain()
    req.num_computed_tokens, req.block_ids = 0, list(range(50, 62))  # preempted: looked up again
    offered, _ = sched.get_num_new_matched_tokens(req, 0)
    assert offered == 33
    sched.update_state_after_alloc(req, req.block_ids, offered)
    req.num_computed_tokens = offered
    meta = sched.build_connector_meta([(req, 34 - offered)])
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()
    assert not worker.failed_loads()
    for p in range(offered):
        assert torch.all(at(req, p) == p), p
    worker.wait_for_save()


def _loaded_lossy_then_lost(prompt: list[int], lost: int):
    """(engine, scheduler role, keys): request "a" loaded every chunk of ``prompt`` decoded
    lossy (its pages are in the engine's prefix cache) and finished; lmkv has since lost its
    first ``lost`` chunks."""
    engine = _engine(cache_policy="lru")
    keys = engine.keys(prompt)
    _store(engine, prompt)
    sched = SchedulerConnector(_LossyCache(engine), BLOCK)
    a = Request("a", prompt + [1, 2, 3])
    _, meta = _schedule(sched, a, computed=0)
    assert sched.served_lossy(a)
    for key in meta.loads[0].keys:
        engine.take(key).release()
    sched.request_finished(a)
    for key in keys[:lost]:
        engine.storage.hot.entries.pop(key).release()
        engine.storage.hot.policy.removed(key)
    return engine, sched, keys


def test_chunks_saved_from_under_the_engines_hit_are_marked_lossy_where_it_holds_lossy_kv():
    """Chunks lmkv lacks under the engine's own hit while it holds later ones are saved from
    the engine's pages: where those pages hold KV another request loaded lossy, the save is
    marked lossy as the request's other saves are (it was stored as exact KV, to lossless
    tiers, and served as exact from then on)."""
    prompt = list(range(2000, 2000 + 4 * CHUNK))
    engine, sched, keys = _loaded_lossy_then_lost(prompt, lost=2)
    b = Request("b", prompt + [4, 5, 6])
    _, meta = _schedule(sched, b, computed=2 * CHUNK)  # the engine serves a's pages 0 and 1
    assert sched.served_lossy(b)
    (gap,) = [s for s in meta.saves if s.keys == keys[:2]]
    assert gap.lossy
    for load in meta.loads:
        for key in load.keys:
            engine.take(key).release()
    sched.request_finished(b)


def test_a_prefetch_past_the_engines_own_hit_names_the_chunk_it_continues():
    """on_new_request prefetches the chunks past the engine's hit: they are filed under the
    chunk before them (a prefix policy kept them as roots, orphans of their real parent)."""
    engine = _engine()
    sent: list[tuple[list[str], str | None]] = []
    engine.prefetch = lambda keys, parent=None: sent.append((keys, parent))
    sched = SchedulerConnector(engine, BLOCK)
    prompt = list(range(2000, 2000 + 3 * CHUNK + 5))
    keys = engine.keys(prompt)
    sched.on_new_request(Request("r", prompt), CHUNK)
    sched.on_new_request(Request("s", prompt), 0)
    sched.on_new_request(Request("t", prompt), len(prompt))  # all computed: nothing to name
    assert sent == [(keys[1:], keys[0]), (keys, None)]
    engine.close()


def test_a_request_recomputed_without_loads_over_lossy_engine_pages_is_lossy():
    """A loads chunks 0-1 lossy (they enter the engine's prefix cache). B's load failed in
    another step and B is recomputed without lmkv (recompute_without_loads): its engine hit
    covers A's lossy pages, so what B computes and saves is approximate."""
    prompt = list(range(1000, 1000 + 3 * CHUNK))
    engine, sched, keys = _loaded_lossy_then_lost(prompt, lost=3)  # (evicted, keep_hot off)
    b = Request("b", prompt + [4, 5, 6])
    sched.recompute_without_loads(b)  # e.g. a load of its step failed
    _, meta = _schedule(sched, b, computed=2 * CHUNK)  # engine serves a's lossy pages 0, 1
    saved = {k: s.lossy for s in meta.saves for k in s.keys}
    assert keys[0] in saved  # a's lossy page of chunk 0 is gathered and saved ...
    assert all(saved.values()), f"saved as exact: {saved}"
    assert sched.served_lossy(b), "over lossy engine pages, not sampled by the gate"
    sched.request_finished(b)
    engine.close()


class _LossyFrom:
    """An LMKVCache whose pins report lossy only for ``lossy_keys``."""

    def __init__(self, engine, lossy_keys):
        self._engine, self._lossy = engine, set(lossy_keys)

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def pin(self, keys, parent=None, again=False):
        return [k in self._lossy for k in keys[: len(self._engine.pin(keys, parent, again))]]


def test_an_engine_hit_into_a_chunk_loaded_lossy_that_is_this_prompts_partial_chunk():
    """A's chunks 0-1 are the engine's own (exact); lmkv loads A's chunk 2 lossy. B's prompt
    ends inside chunk 2: its engine hit covers A's lossy pages of chunk 2 (whole blocks), but
    lmkv checks only B's full chunks (0-1) against lossy_keys: B is taken for exact."""
    engine = _engine(cache_policy="lru", save_unfull_chunk=True)
    prompt = list(range(3000, 3000 + 3 * CHUNK + 3))
    keys = engine.keys(prompt)
    _store(engine, prompt)
    sched = SchedulerConnector(_LossyFrom(engine, keys[2:3]), BLOCK)
    a = Request("a", prompt)
    _, meta = _schedule(sched, a, computed=2 * CHUNK)  # chunks 0-1 from the engine
    assert sched.served_lossy(a) and meta.loads[0].keys == keys[2:3]
    for key in meta.loads[0].keys:
        engine.take(key).release()
    sched.request_finished(a)
    b = Request("b", prompt[: 2 * CHUNK + 10])
    _, meta = _schedule(sched, b, computed=2 * CHUNK + 8)  # 2 of A's lossy blocks of chunk 2
    tails = [s for s in meta.saves if s.position == 2 * CHUNK]
    assert sched.served_lossy(b), f"over A's lossy chunk-2 pages; tail saves {[s.lossy for s in tails]}"
    sched.request_finished(b)
    engine.close()


def test_an_engine_hit_into_part_of_a_chunk_loaded_lossy_default_config():
    """Default config. lmkv loads A's chunk 2 lossy (chunks 0-1 are the engine's own). B
    shares A's first 2 chunks + 8 tokens, then differs: its engine hit (block-granular)
    covers 2 of A's lossy blocks of chunk 2, but B's chunk 2 has another key than A's, so
    lmkv takes B for exact and saves B's chunk 2 (holding 8 tokens of A's lossy KV) and
    chunk 3 (computed over it) as exact: raw/zstd on lossless tiers, served after a trip."""
    engine = _engine(cache_policy="lru")
    prompt = list(range(3000, 3000 + 3 * CHUNK + 3))
    keys = engine.keys(prompt)
    _store(engine, prompt)
    sched = SchedulerConnector(_LossyFrom(engine, keys[2:3]), BLOCK)
    a = Request("a", prompt)
    _, meta = _schedule(sched, a, computed=2 * CHUNK)
    assert sched.served_lossy(a) and meta.loads[0].keys == keys[2:3]
    for key in meta.loads[0].keys:
        engine.take(key).release()
    sched.request_finished(a)
    b = Request("b", prompt[: 2 * CHUNK + 8] + list(range(7000, 7000 + 2 * CHUNK)))
    _, meta = _schedule(sched, b, computed=2 * CHUNK + 8)  # A's lossy blocks 8, 9
    saves = {s.position: s.lossy for s in meta.saves}
    assert sched.served_lossy(b) and all(saves.values()), f"B's saves (position: lossy) {saves}"
    sched.request_finished(b)
    engine.close()


def test_a_request_waiting_for_blocks_counts_its_hot_hits_and_uses_once():
    """A request waiting for memory is looked up again every step: its hot chunks were
    counted in lmkv_tier_hits_total{tier="hot"} and as uses to the policy at each lookup (3
    waiting steps and a load of 2 chunks counted 8 hits), as lmkv_lookups_total is not."""
    engine = _engine()
    prompt = list(range(8000, 8000 + 2 * CHUNK + 1))
    _store(engine, prompt)
    uses = []
    real = engine.storage.hot.policy.accessed
    engine.storage.hot.policy.accessed = lambda key: uses.append(key) or real(key)
    sched = SchedulerConnector(engine, BLOCK)
    req = Request("w", prompt)
    for _ in range(3):  # no blocks for it yet: looked up again at each step
        sched.get_num_new_matched_tokens(req, 0)
        sched.build_connector_meta([])
    offered, _ = _schedule(sched, req, 0)
    registry = engine.metrics.registry
    assert offered == 2 * CHUNK
    assert registry.get_sample_value("lmkv_lookups_total") == 1
    assert registry.get_sample_value("lmkv_tier_hits_total", {"tier": "hot"}) == 2
    assert len(uses) == 2
    sched.request_finished(req)
    engine.close()


def test_a_producer_reads_nothing_up_from_the_tiers_below(tmp_path):
    """kv_role producer only saves: its scheduler role prefetched every new request's stored
    chunks from disk (or a remote) into the hot cache, reads and evictions for chunks it
    never loads."""
    def cache(**config) -> LMKVCache:
        cfg = load_config(env={}, chunk_size=CHUNK, max_local_cpu_size=0.001,
                          local_disk=str(tmp_path), max_local_disk_size=0.01, **config)
        return LMKVCache(cfg, KVLayout(2, 1, 4, torch.float32, CHUNK), "model")

    prompt = list(range(8000, 8000 + 4 * CHUNK + 1))
    writer = cache()
    _store(writer, prompt)
    writer.drain()
    writer.close()

    producer = cache(kv_role="producer")
    sched = SchedulerConnector(producer, BLOCK)
    req = Request("p", prompt)
    sched.on_new_request(req, 0)
    producer.storage.io.drain(10)
    registry = producer.metrics.registry
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # it loads nothing
    assert registry.get_sample_value("lmkv_tier_hits_total", {"tier": "disk"}) is None
    assert not registry.get_sample_value("lmkv_prefetched_chunks_total")
    assert len(producer.storage.hot) == 0
    sched.request_finished(req)
    producer.close()
