"""The lookup socket between vLLM's scheduler role and its worker's process
(lookup_socket.py), on a plain LMKVCache: the scheduler role's plan through it is keys
that the worker takes from the pins made there, pins never loaded are given back or
expire, and bad messages or a missing worker cost an error, not a crash or a hang."""

from __future__ import annotations

import json
import pickle
import socket
import threading
import time

import pytest
import torch

from lmkv.cache import LMKVCache
from lmkv.config import load_config
from lmkv.connector import SchedulerConnector
from lmkv.layout import KVLayout
from lmkv.memory import HEADER_BYTES
from lmkv_engines.vllm import lookup_socket
from lmkv_engines.vllm.lookup_socket import LookupClient, LookupServer, socket_path

CHUNK = 16


@pytest.fixture
def served(tmp_path):
    cfg = load_config(env={}, chunk_size=CHUNK, max_local_cpu_size=0.001)
    engine = LMKVCache(cfg, KVLayout(2, 1, 4, torch.float32, CHUNK), "model")
    server = LookupServer(engine, tmp_path / "lookups.sock")
    remote = LookupClient(cfg, [server.path], connect_timeout=5)
    yield engine, server, remote
    remote.close()
    server.close()
    engine.close()


def _store(engine: LMKVCache, tokens: list[int]) -> None:
    for key in engine.keys(tokens):
        buf = engine.allocate()
        buf.kv.normal_()
        engine.store(key, buf)
        buf.release()


def test_a_load_planned_in_another_process_takes_the_chunks_pinned_there(served):
    """The metadata carries rank-free chunk ids only; the worker takes the chunks pinned
    for them under its own keys."""
    engine, server, remote = served
    prompt = list(range(500, 500 + 3 * CHUNK))
    _store(engine, prompt)
    assert [engine.key_of(i) for i in remote.keys(prompt)] == engine.keys(prompt)
    tail = prompt + [7, 8, 9]  # a partial last chunk (save_unfull_chunk) is named the same way
    assert engine.key_of(remote.tail_key(tail)) == engine.tail_key(tail)
    assert remote.tail_key(prompt) is None and engine.tail_key(prompt) is None
    sched = SchedulerConnector(remote, 4)

    class Req:
        request_id, prompt_token_ids, all_token_ids, num_tokens = "r", prompt, prompt, len(prompt)
        block_ids, num_computed_tokens = list(range(3 * CHUNK // 4)), 0

    offered, _ = sched.get_num_new_matched_tokens(Req, 0)
    assert offered == 3 * CHUNK - 1
    sched.update_state_after_alloc(Req, Req.block_ids, offered)
    Req.num_computed_tokens = offered
    meta = pickle.loads(pickle.dumps(sched.build_connector_meta([(Req, 1)])))  # as vLLM sends it
    (load,) = meta.loads
    assert [engine.key_of(i) for i in load.keys] == engine.keys(prompt)
    assert len(engine.pins) == 3
    taken = [engine.take(engine.key_of(i)) for i in load.keys]  # as the worker role does
    assert [b.ref_count for b in taken] == [2, 2, 2]  # the hot cache's and the load's
    for b in taken:
        b.release()
    assert engine.take(engine.key_of(load.keys[0])) is None
    sched.request_finished(Req)
    engine.pool.check_integrity()
    assert engine.metrics.registry.get_sample_value("lmkv_hit_tokens_total") == offered  # via the socket


def test_pins_a_request_never_loads_are_given_back(served, monkeypatch):
    engine, server, remote = served
    prompt = list(range(900, 900 + 2 * CHUNK))
    _store(engine, prompt)
    keys = remote.keys(prompt)
    assert remote.pin(keys) == [False, False]
    assert len(engine.pins) == 2 and engine.pool.num_free == engine.pool.num_slots - 2
    remote.unpin(keys)
    assert len(engine.pins) == 0
    engine.pool.check_integrity()
    # a pin never given back (a lost reply, a dead scheduler) expires
    remote.pin(keys)
    assert len(engine.pins) == 2
    monkeypatch.setattr(engine.pins, "ttl", -1.0)
    remote.pin([])  # any pin sweeps expired pins first
    assert len(engine.pins) == 0
    engine.pool.check_integrity()


def test_a_pin_names_the_chunk_before_it_in_the_workers_scope(served, monkeypatch):
    """A pin that starts past the engine's own prefix hit names the chunk before it (the
    hot cache files what it loads under that parent), in the worker's key scope."""
    engine, server, remote = served
    prompt = list(range(1100, 1100 + 3 * CHUNK))
    _store(engine, prompt)
    keys = remote.keys(prompt)
    parents = []
    real = engine.storage.fetch

    def recording(keys, parent=None, again=False):
        parents.append(parent)
        return real(keys, parent, again)

    monkeypatch.setattr(engine.storage, "fetch", recording)
    assert remote.pin(keys[1:], keys[0]) == [False, False]
    assert remote.pin(keys[:1]) == [False]
    assert parents == [engine.key_of(keys[0]), None]
    remote.unpin(keys)
    prefetched = []
    monkeypatch.setattr(engine.storage, "prefetch",
                        lambda keys, parent=None: prefetched.append((keys, parent)))
    remote.prefetch(keys[1:], keys[0])  # (so does a prefetch)
    deadline = time.monotonic() + 5
    while not prefetched and time.monotonic() < deadline:  # (a best-effort call)
        time.sleep(0.01)
    assert prefetched == [([engine.key_of(k) for k in keys[1:]], engine.key_of(keys[0]))]
    engine.pool.check_integrity()


def test_the_engines_own_prefix_hit_is_a_use_in_the_workers_cache(served, monkeypatch):
    """A lookup past the engine's own prefix hit tells the worker's hot cache that the chunks
    under that hit were used (its policy then keeps the chunk a new turn continues)."""
    engine, server, remote = served
    prompt = list(range(1200, 1200 + 2 * CHUNK + 3))
    _store(engine, prompt[: 2 * CHUNK])
    used = []
    monkeypatch.setattr(engine.storage.hot.policy, "accessed", used.append)

    class Request:
        request_id, prompt_token_ids, num_computed_tokens = "r", prompt, 0

    sched = SchedulerConnector(remote, 4)
    sched.get_num_new_matched_tokens(Request(), 2 * CHUNK)
    assert used == [engine.key_of(k) for k in remote.keys(prompt)[:2]]
    sched.request_finished(Request())


def test_bad_messages_get_an_error_reply(served):
    _, server, remote = served
    rank = remote.ranks[0]
    with pytest.raises(RuntimeError, match="unknown op"):
        rank.call("format_disk")
    with pytest.raises(RuntimeError, match="ValueError"):
        rank.call("lookup", keys=["not hex"])
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(server.path))
        s.sendall(b"{not json\n")
        reply = json.loads(s.makefile("rb").readline())
    assert reply["ok"] is False
    assert remote.lookup([]) == 0  # the server goes on
    # a line over the size limit: an error reply, then the server hangs up
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(server.path))
        s.sendall(b"x" * (lookup_socket.MAX_LINE + 10))
        f = s.makefile("rb")
        assert json.loads(f.readline())["ok"] is False
        assert f.readline() == b""
    # replies are matched to their call: a stray reply closes the connection, the next
    # call opens a new one
    remote.lookup([])
    rank._rfile = _Stray(b'{"ok": true, "id": -5, "found": 7}\n')
    with pytest.raises(ConnectionError, match="out of step"):
        remote.lookup([])
    assert remote.lookup([]) == 0


class _Stray:
    def __init__(self, line: bytes):
        self.line = line

    def readline(self, limit: int) -> bytes:
        return self.line

    def close(self) -> None:
        pass


def test_no_worker_process_fails_once_then_at_once(tmp_path):
    cfg = load_config(env={}, chunk_size=CHUNK, max_local_cpu_size=0.001)
    remote = LookupClient(cfg, [tmp_path / "nobody.sock"], connect_timeout=0.5)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="no worker process"):
        remote.lookup(["00"])
    with pytest.raises(ConnectionError):
        remote.lookup(["00"])
    assert time.monotonic() - start < 5
    remote.count_error("connector", "lookup")  # counting where it cannot be reached: no raise


def test_socket_path_is_private_and_named_after_the_engine_id(served):
    _, server, _ = served
    assert server.path.stat().st_mode & 0o777 == 0o600
    name = socket_path("abc/../x y" * 40).name
    assert name.startswith("lmkv-") and len(name) < 40 and "/" not in name
    assert socket_path("e", 0) != socket_path("e", 1)  # data-parallel ranks apart
    assert socket_path("e", 0, 1) not in (socket_path("e", 0), socket_path("e", 1))  # TP too


def test_two_tensor_parallel_ranks_agree_on_hits_and_pins(tmp_path):
    """Each rank stores its own shard under its own keys; the scheduler's ids hit only
    where every rank holds its shard, and every rank pins (and gives back) the same chunks."""
    cfg = load_config(env={}, chunk_size=CHUNK, max_local_cpu_size=0.001)
    engines = [LMKVCache(cfg, KVLayout(2, 1, 4, torch.float32, CHUNK, rank=r), "model")
               for r in range(2)]
    servers = [LookupServer(e, tmp_path / f"tp{r}.sock") for r, e in enumerate(engines)]
    remote = LookupClient(cfg, [s.path for s in servers], connect_timeout=5)
    try:
        prompt = list(range(700, 700 + 3 * CHUNK))
        assert engines[0].keys(prompt) != engines[1].keys(prompt)  # shards apart
        _store(engines[0], prompt)
        _store(engines[1], prompt[: 2 * CHUNK])  # rank 1 lacks the third chunk
        ids = remote.keys(prompt)
        assert remote.lookup(ids) == 2
        assert remote.pin(ids) == [False, False]
        assert [len(e.pins) for e in engines] == [2, 2]  # rank 0's third pin was given back
        remote.unpin(ids[:2])
        assert [len(e.pins) for e in engines] == [0, 0]
        for e in engines:
            e.pool.check_integrity()
    finally:
        remote.close()
        for s, e in zip(servers, engines, strict=True):
            s.close()
            e.close()


def test_tensor_parallel_ranks_each_say_when_their_chunks_arrived(tmp_path, monkeypatch):
    """A waiting request's chunks have arrived when every rank that started reading them up
    says so; a rank with nothing to bring up counts as arrived, and so does a rank whose
    worker stops answering (the request is then looked up, as without). Released, each rank
    lets go of what it holds for it."""

    class Read:
        def __init__(self):
            self.up, self.released = False, 0

        def done(self):
            return self.up

        def release(self):
            self.released += 1

    cfg = load_config(env={}, chunk_size=CHUNK, max_local_cpu_size=0.001)
    engines = [LMKVCache(cfg, KVLayout(2, 1, 4, torch.float32, CHUNK, rank=r), "model")
               for r in range(2)]
    servers = [LookupServer(e, tmp_path / f"tp{r}.sock") for r, e in enumerate(engines)]
    remote = LookupClient(cfg, [s.path for s in servers], connect_timeout=5)
    reads: list[Read | None] = [Read(), None]
    for r, e in enumerate(engines):
        monkeypatch.setattr(e, "bring_up", lambda keys, parent=None, r=r: reads[r])
    ids = remote.keys(list(range(700, 700 + 2 * CHUNK)))

    def settled(arrival) -> bool:
        time.sleep(2 * lookup_socket.POLL_INTERVAL)
        return arrival.done()

    try:
        arrival = remote.bring_up(ids)  # rank 0 reads; rank 1 has nothing to bring up
        assert arrival is not None and len(arrival.tickets) == 1
        assert not settled(arrival)
        reads[0].up = True
        assert settled(arrival)
        first = reads[0]
        arrival.release()
        assert first.released == 1
        reads[:] = [Read(), Read()]
        arrival = remote.bring_up(ids)
        assert len(arrival.tickets) == 2 and not settled(arrival)
        arrival.release()  # looked up before they arrived: both ranks let go
        assert [r.released for r in reads] == [1, 1] and not servers[0]._arrivals
        reads[:] = [Read(), Read()]
        arrival = remote.bring_up(ids)
        servers[1].close()  # rank 1's worker goes away: taken as arrived there
        assert not settled(arrival) and len(arrival.tickets) == 1
        reads[0].up = True
        assert settled(arrival)
        arrival.release()  # (rank 1 cannot be told: its worker lets go by itself)
        assert reads[0].released == 1
    finally:
        remote.close()
        for s, e in zip(servers, engines, strict=True):
            s.close()
            e.close()


def test_a_pin_the_scheduler_stopped_waiting_for_is_given_back(served, monkeypatch):
    """A pin slower than the call timeout (a slow lower-tier read in the worker): the
    scheduler role's call fails (vLLM computes that request), the worker gives the pins it
    made back, and for a while calls fail at once instead of holding vLLM's scheduler
    thread for the whole timeout again."""
    engine, server, remote = served
    monkeypatch.setattr(lookup_socket, "CALL_TIMEOUT", 0.5)
    prompt = list(range(700, 700 + 3 * CHUNK))
    _store(engine, prompt)
    real = engine.storage.fetch

    def slow(keys, parent=None, again=False):
        time.sleep(1.0)
        return real(keys, parent, again)

    engine.storage.fetch = slow
    with pytest.raises(TimeoutError):
        remote.pin(remote.keys(prompt))
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="did not answer"):
        remote.lookup(remote.keys(prompt))
    assert time.monotonic() - start < 0.1
    deadline = time.monotonic() + 5
    while len(engine.pins) and time.monotonic() < deadline:  # the worker finishes its pin
        time.sleep(0.05)
    assert len(engine.pins) == 0


def test_a_worker_that_does_not_answer_is_told_once_and_again_when_it_does(served, caplog):
    """The scheduler role over a socket nobody serves: one warning, not one per request and
    call, and one when the worker answers again. Error labels a client sends are bounded."""
    import logging

    engine, server, remote = served
    cfg = load_config(env={}, chunk_size=CHUNK, max_local_cpu_size=0.001)
    path = server.path
    server.close()
    lonely = LookupClient(cfg, [path], connect_timeout=0.2)
    with caplog.at_level(logging.WARNING):
        for _ in range(20):
            with pytest.raises(ConnectionError):
                lonely.lookup(["00"])
            lonely.prefetch(["00"])
            lonely.count_error("connector", "lookup")
    assert caplog.text.count("does not answer") == 1
    again = LookupServer(engine, path)
    try:
        lonely.ranks[0].connect_timeout = 5
        assert lonely.lookup([]) == 0
        assert caplog.text.count("answers again") == 1
        with pytest.raises(RuntimeError, match="no error counter"):
            lonely.ranks[0].call("count_error", where="anything", kind="x" * 100)
    finally:
        lonely.close()
        again.close()


def test_an_unpin_the_worker_did_not_answer_is_sent_with_the_next_call(served, monkeypatch):
    """A pin taken, then any call times out (calls fail at once for a while after): the
    scheduler's unpin fails too. It is sent again before the next call once the worker
    answers (before: dropped, the slots pinned for the pin TTL, 10 minutes)."""
    engine, server, remote = served
    monkeypatch.setattr(lookup_socket, "CALL_TIMEOUT", 0.5)
    monkeypatch.setattr(lookup_socket, "BACKOFF", 0.3)
    prompt = list(range(300, 300 + 2 * CHUNK))
    _store(engine, prompt)
    keys = remote.keys(prompt)
    assert remote.pin(keys) == [False, False] and len(engine.pins) == 2
    real = engine.storage.lookup

    def slow(keys):
        time.sleep(1.0)
        return real(keys)

    engine.storage.lookup = slow
    with pytest.raises(TimeoutError):
        remote.lookup(keys)
    remote.unpin(keys)  # fails at once (the back-off): owed
    assert len(engine.pins) == 2
    engine.storage.lookup = real
    time.sleep(0.5)  # the back-off ends
    assert remote.lookup(keys) == 2  # the owed unpin goes first
    assert len(engine.pins) == 0
    engine.pool.check_integrity()


def test_an_unpin_that_may_have_reached_the_worker_is_not_sent_again(served, monkeypatch):
    """An unpin whose reply is late (the worker was busy) may have been done there: sending
    it again would give back another request's pin of the same chunk (pins count per key),
    whose load then fails. It is left to the worker (or its pin TTL)."""
    engine, server, remote = served
    monkeypatch.setattr(lookup_socket, "CALL_TIMEOUT", 0.3)
    monkeypatch.setattr(lookup_socket, "BACKOFF", 0.0)
    prompt = list(range(100, 100 + CHUNK))
    _store(engine, prompt)
    keys = remote.keys(prompt)
    remote.pin(keys)
    remote.pin(keys)  # a second request's pin of the same chunk
    real = engine.unpin
    slow = [True]

    def late(keys):
        if slow.pop() if slow else False:
            time.sleep(0.6)
        real(keys)

    engine.unpin = late
    remote.unpin(keys)  # done by the worker, its reply too late
    time.sleep(0.5)
    assert len(engine.pins) == 1
    remote.lookup(keys)
    assert len(engine.pins) == 1  # the second request's pin is still there
    remote.unpin(keys)
    assert len(engine.pins) == 0


def test_socket_files_of_dead_servers_are_swept_at_start(tmp_path):
    """A vLLM stopped by a signal leaves its socket file (each instance's engine id names a
    new one): a starting server removes those nobody listens on, and no other file."""
    cfg = load_config(env={}, chunk_size=CHUNK, max_local_cpu_size=0.001)
    engine = LMKVCache(cfg, KVLayout(2, 1, 4, torch.float32, CHUNK), "model")
    dead = tmp_path / "lmkv-0123456789abcdef0123.sock"
    gone = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    gone.bind(str(dead))
    gone.close()  # the file stays, nobody listens
    other = tmp_path / "lmkv-notours.sock"
    other.write_text("")
    alive = LookupServer(engine, tmp_path / "lmkv-aaaaaaaaaaaaaaaaaaaa.sock")
    try:
        assert not dead.exists() and other.exists() and alive.path.exists()
        second = LookupServer(engine, tmp_path / "lmkv-bbbbbbbbbbbbbbbbbbbb.sock")
        assert alive.path.exists()  # a live server's file stays
        second.close()
    finally:
        alive.close()
        engine.close()


def test_a_server_starting_while_another_sweeps_keeps_its_socket_file(tmp_path, monkeypatch):
    """A socket bound but not yet listening refuses connections as a dead server's does: a
    rank starting at that moment swept its sibling's file away, and that rank's scheduler
    then found no worker. A server now listens before its file appears under the swept
    name; and one whose path a live server holds still fails with EADDRINUSE."""
    import errno
    import os

    cfg = load_config(env={}, chunk_size=CHUNK, max_local_cpu_size=0.001)
    engine = LMKVCache(cfg, KVLayout(2, 1, 4, torch.float32, CHUNK), "model")
    real_listen = socket.socket.listen

    def listen_after_a_sweep(sock, *args):  # another rank starts between bind and listen
        lookup_socket._sweep_dead_sockets(tmp_path)
        return real_listen(sock, *args)

    monkeypatch.setattr(socket.socket, "listen", listen_after_a_sweep)
    real_link = os.link

    def link_after_a_sweep(src, dst):  # ... or between listen and the file's appearance
        lookup_socket._sweep_dead_sockets(tmp_path)
        return real_link(src, dst)

    monkeypatch.setattr(os, "link", link_after_a_sweep)
    server = LookupServer(engine, tmp_path / ("lmkv-" + "c" * 20 + ".sock"))
    monkeypatch.undo()
    try:
        assert server.path.exists() and [p.name for p in tmp_path.iterdir()] == [server.path.name]
        remote = LookupClient(cfg, [server.path], connect_timeout=5)
        assert remote.lookup(["00" * 16]) == 0  # (a rank-free chunk hash)
        remote.close()
        with pytest.raises(OSError) as taken:
            LookupServer(engine, server.path)
        assert taken.value.errno == errno.EADDRINUSE and server.path.exists()
    finally:
        server.close()
        engine.close()


def test_a_starting_name_left_by_a_killed_server_is_swept_once_old(tmp_path):
    import os
    import time

    old, young = tmp_path / (".lmkv-" + "a" * 24), tmp_path / (".lmkv-" + "b" * 24)
    for path in (old, young):
        gone = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        gone.bind(str(path))
        gone.close()
    os.utime(old, (time.time() - 600, time.time() - 600), follow_symlinks=False)
    lookup_socket._sweep_dead_sockets(tmp_path)
    assert not old.exists() and young.exists()


def test_chunks_that_arrived_for_a_waiting_request_are_still_hot_at_its_lookup(tmp_path, monkeypatch):
    """A hot cache smaller than the waiting requests' chunks (here: 16 slots, LRU): other
    requests' saves between the chunks' arrival and the request's lookup do not evict them
    (the worker holds them until the lookup), so the lookup reads nothing from the disk
    on vLLM's scheduling thread."""
    layout = KVLayout(2, 1, 4, torch.float32, CHUNK)
    cfg = load_config(env={}, chunk_size=CHUNK,
                      max_local_cpu_size=16 * (HEADER_BYTES + layout.chunk_bytes) / 1e9,
                      cache_policy="lru", local_disk=str(tmp_path / "disk"), max_local_disk_size=0.01)
    engine = LMKVCache(cfg, layout, "model")
    server = LookupServer(engine, tmp_path / "lookups.sock")
    remote = LookupClient(cfg, [server.path], connect_timeout=5)
    gate = threading.Event()
    try:
        assert engine.storage.hot.pool.num_slots <= 16
        prompt = list(range(900, 900 + 4 * CHUNK + 3))
        _store(engine, prompt)
        engine.drain()
        engine.storage.hot.clear()
        disk = engine.storage.tiers[0].backend
        real, reads = disk.get_into_many, []

        def read(keys, *args, **kwargs):
            gate.wait(10)
            reads.extend(keys)
            return real(keys, *args, **kwargs)

        monkeypatch.setattr(disk, "get_into_many", read)
        sched = SchedulerConnector(remote, 4)

        class Req:
            request_id, prompt_token_ids, all_token_ids, num_tokens = "r", prompt, prompt, len(prompt)
            block_ids, num_computed_tokens = list(range(len(prompt) // 4 + 1)), 0

        sched.on_new_request(Req)
        assert sched.loads_arriving(Req, 0)
        gate.set()
        deadline = time.monotonic() + 10
        while sched.loads_arriving(Req, 0):
            assert time.monotonic() < deadline, "the chunks never arrived"
            time.sleep(lookup_socket.POLL_INTERVAL)
        engine.drain()
        for key in engine.keys(list(range(5000, 5000 + 40 * CHUNK))):  # other requests' saves
            engine.drain()  # (each queued write holds a slot)
            buf = engine.allocate()
            engine.store(key, buf)
            buf.release()
        read_before = len(reads)
        assert sched.get_num_new_matched_tokens(Req, 0)[0] == 4 * CHUNK
        assert len(reads) == read_before  # all hot: nothing read at the lookup
        sched.request_finished(Req)
    finally:
        gate.set()
        remote.close()
        server.close()
        engine.close()


def test_a_request_whose_chunks_are_coming_up_is_left_waiting_until_they_are_hot(tmp_path, monkeypatch):
    """vLLM's scheduler asks the worker whether a request's chunks are still on their way up
    from a lower tier (its prefetch at arrival reads them): while they are, the request is
    left waiting (loads_arriving); once they are hot it is looked up and loads them all.
    A worker that stopped tracking the read (bounded) says it is done."""
    cfg = load_config(env={}, chunk_size=CHUNK, max_local_cpu_size=0.001,
                      local_disk=str(tmp_path / "disk"), max_local_disk_size=0.01)
    engine = LMKVCache(cfg, KVLayout(2, 1, 4, torch.float32, CHUNK), "model")
    server = LookupServer(engine, tmp_path / "lookups.sock")
    remote = LookupClient(cfg, [server.path], connect_timeout=5)
    try:
        prompt = list(range(700, 700 + 3 * CHUNK + 3))
        _store(engine, prompt)
        engine.drain()
        engine.storage.hot.clear()
        disk = engine.storage.tiers[0].backend
        gate = threading.Event()
        real = disk.get_into_many
        monkeypatch.setattr(disk, "get_into_many", lambda *a, **k: gate.wait(10) and real(*a, **k))
        sched = SchedulerConnector(remote, 4)

        class Req:
            request_id, prompt_token_ids, all_token_ids, num_tokens = "r", prompt, prompt, len(prompt)
            block_ids, num_computed_tokens = list(range(len(prompt) // 4 + 1)), 0

        ids = remote.keys(prompt)
        assert remote.bring_up(ids) is None  # no prefetch holds them: nothing on its way
        sched.on_new_request(Req)  # (vLLM's on_new_request: the prefetch reads from disk)
        for _ in range(3):
            assert sched.loads_arriving(Req, 0)
            time.sleep(2 * lookup_socket.POLL_INTERVAL)
        gate.set()
        deadline = time.monotonic() + 10
        while sched.loads_arriving(Req, 0):
            assert time.monotonic() < deadline, "the chunks never arrived"
            time.sleep(lookup_socket.POLL_INTERVAL)
        assert all(engine.storage.hot.contains(k) for k in engine.keys(prompt))  # hot: no wait
        assert sched.get_num_new_matched_tokens(Req, 0)[0] == 3 * CHUNK
        sched.request_finished(Req)

        # many waiting requests: one question to the worker per poll, not one per request
        # (a longer poll interval here: a busy machine must not make two polls of one)
        monkeypatch.setattr(lookup_socket, "POLL_INTERVAL", 0.2)
        gate.clear()
        engine.storage.hot.clear()
        engine.prefetch(engine.keys(prompt))
        asked = []
        call = remote.ranks[0].call
        monkeypatch.setattr(remote.ranks[0], "call", lambda op, **a: asked.append(op) or call(op, **a))
        waiting = [remote.bring_up(ids) for _ in range(5)]
        time.sleep(lookup_socket.POLL_INTERVAL)
        assert not any(w.done() for w in waiting) and asked.count("arrived") == 1
        # the worker tracks a bounded number of reads, for ARRIVAL_TTL at most: one it no
        # longer tracks is done (that request is looked up: never held back for good)
        monkeypatch.setattr(lookup_socket, "MAX_ARRIVALS", 5)
        later = remote.bring_up(ids)
        time.sleep(lookup_socket.POLL_INTERVAL)
        assert waiting[0].done() and not any(w.done() for w in waiting[1:] + [later])
        monkeypatch.setattr(lookup_socket, "ARRIVAL_TTL", 0.0)
        last = remote.bring_up(ids)
        assert list(server._arrivals) == [int(t) for _, t in last.tickets]  # the others expired
        gate.set()
    finally:
        gate.set()
        remote.close()
        server.close()
        engine.close()


def test_after_a_reset_no_chunk_stored_before_is_loaded_and_requests_known_then_store_nothing(served):
    """vLLM resets its caches after loading new weights in place (reset_cache): lmkv loads no
    chunk stored before (old weights' KV), and a request known then (it may have computed
    over the old weights) stores nothing; chunks stored after the reset are found again."""
    engine, server, remote = served
    prompt = list(range(700, 700 + 2 * CHUNK + 1))
    _store(engine, prompt[: 2 * CHUNK])
    sched = SchedulerConnector(remote, 4)

    def request(rid):
        class Req:
            request_id, prompt_token_ids, all_token_ids, num_tokens = rid, prompt, prompt, len(prompt)
            block_ids, num_computed_tokens = list(range(-(-len(prompt) // 4))), 0
        return Req

    def saved(req, offered):  # allocated and computed to the end: the chunk ids it saves
        sched.update_state_after_alloc(req, req.block_ids, offered)
        req.num_computed_tokens = offered
        meta = sched.build_connector_meta([(req, len(prompt) - offered)])
        for load in meta.loads:  # (as the worker does)
            for i in load.keys:
                engine.take(engine.key_of(i)).release()
        return [i for s in meta.saves for i in s.keys]

    old = request("old")
    assert sched.get_num_new_matched_tokens(old, 0)[0] == 2 * CHUNK
    sched.reset()
    assert len(engine.pins) == 0  # its pins went back
    assert sched.get_num_new_matched_tokens(old, 0)[0] == 0
    assert saved(old, 0) == []
    new = request("new")
    assert sched.get_num_new_matched_tokens(new, 0)[0] == 0  # the old weights' chunks
    ids = saved(new, 0)
    assert len(ids) == 2
    for i in ids:  # the worker stores what the step computed, under the new names
        buf = engine.allocate()
        buf.kv.normal_()
        engine.store(engine.key_of(i), buf)
        buf.release()
    assert sched.get_num_new_matched_tokens(request("again"), 0)[0] == 2 * CHUNK
    for rid in ("old", "new", "again"):
        sched.request_finished(request(rid))
    engine.pool.check_integrity()


def test_a_peer_of_another_user_is_refused(monkeypatch):
    """The socket's path is predictable where vLLM's engine_id is set: another local user's
    process could bind it first (the scheduler role would ask it) or connect to it. Both
    ends check the peer's uid (SO_PEERCRED)."""
    import os
    import struct

    from lmkv_engines.vllm import lookup_socket

    a, b = socket.socketpair(socket.AF_UNIX)
    try:
        lookup_socket._same_user(a)  # this process: fine
        real = socket.socket.getsockopt
        monkeypatch.setattr(socket.socket, "getsockopt", lambda self, *args: (
            struct.pack("iII", 1, 4242, 4242) if args[:2] == (socket.SOL_SOCKET, socket.SO_PEERCRED)
            else real(self, *args)))
        monkeypatch.setattr(os, "geteuid", lambda: 1000)
        with pytest.raises(PermissionError, match="uid 4242"):
            lookup_socket._same_user(a)
    finally:
        a.close()
        b.close()
