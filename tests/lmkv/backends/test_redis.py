"""The Redis tiers against a real redis-server (and a real 3-node Redis Cluster)."""

from __future__ import annotations

import signal
import time

import pytest
import torch

from lmkv.backends.base import BackendError
from lmkv.backends.redis import RedisBackend
from tests.backend_checks import check_batched_reads, silent_dns
from tests.redis_server import RedisServer, start_cluster


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.kill()


def test_put_get_contains_with_prefix(redis_server):
    a = RedisBackend(redis_server.url + "?key_prefix=a:")
    b = RedisBackend(redis_server.url + "?key_prefix=b:")
    value = bytes(range(256)) * 4096
    a.put([("k1", value), ("k2", memoryview(b"x" * 10))])
    assert a.get(["k1", "k2", "k3"]) == [value, b"x" * 10, None]
    assert a.contains(["k1", "k3"]) == [True, False]
    assert b.get(["k1"]) == [None]  # prefixes are namespaces


def test_batched_reads(redis_server):
    check_batched_reads(RedisBackend(redis_server.url), [memoryview(bytearray(8192)) for _ in range(3)])


def test_dead_server_raises_backend_error_quickly(redis_server):
    backend = RedisBackend(redis_server.url, timeout=0.5)
    backend.put([("k", b"v")])
    redis_server.kill()
    with pytest.raises(BackendError):
        backend.get(["k"])


def test_a_name_the_dns_does_not_answer_for_fails_within_the_timeout(redis_server, monkeypatch):
    """redis-py looks names up without a timeout (a DNS server that does not answer held a
    call 10 s and more): a client is made only once its name resolved within ``timeout``."""
    answer, _ = silent_dns(monkeypatch, "redis.example")
    url = redis_server.url.replace("127.0.0.1", "redis.example")
    assert url != redis_server.url
    start = time.monotonic()
    with pytest.raises(BackendError, match="did not resolve within 0.4 s"):
        RedisBackend(url, timeout=0.4)
    assert time.monotonic() - start < 0.4 + 0.5
    answer.set()
    backend = RedisBackend(url, timeout=0.4)
    backend.put([("k", b"v")])
    assert backend.get(["k"]) == [b"v"]


def test_redis_cluster(tmp_path):
    servers = start_cluster(tmp_path)
    try:
        url = f"redis-cluster://127.0.0.1:{servers[0].port}"
        backend = RedisBackend(url)
        items = [(f"key-{i}", f"value-{i}".encode() * 1000) for i in range(50)]
        backend.put(items)  # keys spread over all three nodes' slots
        assert backend.get([k for k, _ in items]) == [v for _, v in items]
        assert backend.contains(["key-1", "nope"]) == [True, False]
        backend.close()
    finally:
        for s in servers:
            s.kill()


@pytest.mark.parametrize("to", ["a node of the cluster", "a node just added"])
def test_keys_of_a_slot_being_migrated_are_read_and_written_where_the_cluster_says(tmp_path, to):
    """While a slot moves between nodes (resharding), its node answers ASK for keys it does
    not hold: they were misses (read) and failed batches (write) until the move ended.
    They are now sent, after ASKING, to the node the slot is moving to, also to a node
    added to take slots (one the slot map does not name yet)."""
    import subprocess

    servers = start_cluster(tmp_path)

    def cli(server, *args):
        return subprocess.run(["redis-cli", "-p", str(server.port), *args], check=True,
                              capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        backend = RedisBackend(f"redis-cluster://127.0.0.1:{servers[0].port}")
        moved, stays = "lmkv:on-the-move", "lmkv:stays"
        slot = int(cli(servers[0], "cluster", "keyslot", moved))
        assert int(cli(servers[0], "cluster", "keyslot", stays)) != slot
        source = next(s for s in servers if backend.client.get_node_from_key(moved).port == s.port)
        if to == "a node just added":
            target = RedisServer(tmp_path / "added", cluster=True).start()
            servers.append(target)
            cli(source, "cluster", "meet", "127.0.0.1", str(target.port))
            new_id, deadline = cli(target, "cluster", "myid"), time.monotonic() + 30
            while (new_id not in cli(source, "cluster", "nodes")  # (gossip)
                   or "cluster_state:ok" not in cli(target, "cluster", "info")):
                assert time.monotonic() < deadline
                time.sleep(0.1)
        else:
            target = next(s for s in servers if s is not source)
        backend.put([("stays", b"old")])
        cli(target, "cluster", "setslot", str(slot), "importing", cli(source, "cluster", "myid"))
        cli(source, "cluster", "setslot", str(slot), "migrating", cli(target, "cluster", "myid"))
        backend.put([("on-the-move", b"value"), ("stays", b"new")])  # (ASK: to the target)
        assert cli(target, "cluster", "countkeysinslot", str(slot)) == "1"  # written there
        assert backend.get(["on-the-move", "stays", "nope"]) == [b"value", b"new", None]
        assert backend.contains(["on-the-move", "nope"]) == [True, False]
        backend.remove(["on-the-move"])
        assert backend.contains(["on-the-move"]) == [False]
        backend.close()
    finally:
        for s in servers:
            s.kill()


def test_an_unreachable_cluster_fails_the_tier_not_the_caller(tmp_path):
    """redis-py's RedisClusterException is no RedisError: it must still become a
    BackendError (a recompute, a log line, the breaker), and a stopped node costs one
    timeout, not the cluster client's retries."""
    from lmkv.backends.registry import create_backend
    from lmkv.storage.tier import Tier
    from lmkv_server.launcher import free_port

    tier = Tier("remote", create_backend(f"redis-cluster://127.0.0.1:{free_port()}", timeout=0.3))
    assert tier.contains(["a"]) is None  # no node up: nothing raised, the tier is off a while
    assert not tier.available
    servers = start_cluster(tmp_path)
    try:
        backend = RedisBackend(f"redis-cluster://127.0.0.1:{servers[0].port}", timeout=0.3)
        assert backend.contains(["a"]) == [False]
        servers[0].proc.send_signal(signal.SIGSTOP)
        keys = [f"k{i}" for i in range(30)]  # some on the stopped node
        start = time.monotonic()
        with pytest.raises(BackendError):
            backend.contains(keys)
        assert time.monotonic() - start < 1.5
        servers[0].proc.send_signal(signal.SIGCONT)
    finally:
        for s in servers:
            s.kill()


def test_a_hung_cluster_node_costs_a_lookup_one_timeout_not_one_per_key(tmp_path):
    """With a connection to every node already open, redis-py's cluster pipeline sent each
    command that timed out on a stopped node again on its own: a lookup of 96 keys held the
    engine's scheduling thread 9.5 s at remote_timeout 0.3 s. A cluster's keys now go out
    as one pipeline per node, the call failing at the first node that fails; the client is
    kept after the failure (it knows every node, a failover's new primary too)."""
    from lmkv.backends.registry import create_backend
    from lmkv.storage.tier import Tier

    servers = start_cluster(tmp_path)
    try:
        url = f"redis-cluster://127.0.0.1:{servers[0].port}"
        assert RedisBackend(url, timeout=0.3).reconnects  # (kept by LazyBackend after a failure)
        tier = Tier("remote", create_backend(url, timeout=0.3))
        keys = [f"lmkv1@model@chunk-{i}" for i in range(96)]  # spread over the three nodes
        tier.backend.put([(k, b"v") for k in keys[::2]])
        assert tier.contains(keys) == [True, False] * 48  # (a connection to every node now)
        servers[1].proc.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        try:
            assert tier.contains(keys) is None  # failed: recomputed, the breaker opens
        finally:
            took = time.monotonic() - start
            servers[1].proc.send_signal(signal.SIGCONT)
        assert took < 1.5, took
        # a dead primary never answers MOVED: after a failed node the next batch maps the
        # cluster again first (so a failover's new primary is found)
        client = tier.backend._connected()
        assert client._remap
        real, remapped = client.client.nodes_manager.initialize, []
        client.client.nodes_manager.initialize = lambda *a, **k: (remapped.append(1), real(*a, **k))[1]
        assert client.contains(keys) == [True, False] * 48 and remapped == [1]
        assert client.contains(keys) == [True, False] * 48 and remapped == [1]
        tier.close()
    finally:
        for s in servers:
            s.kill()


def test_a_key_of_another_type_is_a_miss_for_that_key_alone(redis_server):
    """A key under the prefix holding a list (another program's): GETRANGE answered
    WRONGTYPE and the whole batch failed, opening the tier's breaker for every key."""
    import redis

    backend = RedisBackend(redis_server.url)
    backend.put([("good", b"x" * 100)])
    redis.Redis.from_url(redis_server.url).lpush("lmkv:stray", b"a")
    assert backend.get(["good", "stray", "good"]) == [b"x" * 100, None, b"x" * 100]
    assert backend.contains(["good", "stray", "none"]) == [True, True, False]


def test_a_write_the_server_refuses_fails_and_other_error_replies_fail_a_read(redis_server):
    """Error replies are returned per key now (a key of another type is a miss): one the
    server gives a write (out of memory under noeviction, read-only, no permission) must
    still fail it, not count as stored."""
    import redis

    admin = redis.Redis.from_url(redis_server.url)
    backend = RedisBackend(redis_server.url)
    backend.put([("before", b"v")])
    admin.config_set("maxmemory", "1mb")
    admin.config_set("maxmemory-policy", "noeviction")
    with pytest.raises(BackendError, match="OOM|memory") as full:
        backend.put([(f"k{i}", b"x" * 100_000) for i in range(50)])
    assert "use allkeys-lru" in str(full.value)  # (lmkv sets no TTL: volatile-* evicts none)
    admin.config_set("maxmemory", "0")
    admin.acl_setuser("reader", enabled=True, nopass=True, commands=["+@read", "+ping"], keys=["*"])
    reader = RedisBackend(redis_server.url.replace("redis://", "redis://reader@"))
    with pytest.raises(BackendError, match="NOPERM|permission"):
        reader.put([("k", b"v")])
    assert reader.get(["before"]) == [b"v"]


def test_an_empty_key_prefix_is_taken_as_written(redis_server):
    import redis

    backend = RedisBackend(redis_server.url + "?key_prefix=")
    backend.put([("bare", b"v")])
    assert redis.Redis.from_url(redis_server.url).get("bare") == b"v"


def _read_counter(url: str, stat: str = "total_reads_processed"):
    """A counter of redis-server's stats (by default the client read events processed so
    far: one per request batch it received), read through a connection of its own."""
    import redis

    client = redis.Redis.from_url(url)
    client.ping()  # the connection's set-up requests are behind us
    return lambda: int(client.info("stats")[stat])


def test_a_batch_through_the_registry_is_one_exchange_with_the_server(redis_server):
    """The backend lmkv builds from a URL (connecting lazily) forwards batched reads: 16
    chunks cost the server one read event, not 16, and removes and contains pass too."""
    from lmkv.backends.registry import create_backend

    backend = create_backend(redis_server.url, timeout=2.0)
    keys = [f"chunk-{i}" for i in range(16)]
    backend.put([(k, k.encode() * 100) for k in keys])
    outs = [memoryview(bytearray(4096)) for _ in keys]
    reads = _read_counter(redis_server.url)
    before = reads()
    assert reads() - before == 1  # one INFO: the counter's own cost
    before = reads()
    lengths = backend.get_into_many(keys, outs)
    batched = reads() - before - 1
    assert lengths == [len(k) * 100 for k in keys]
    assert bytes(outs[3][: lengths[3]]) == keys[3].encode() * 100
    assert batched == 1, f"16 chunks took {batched} exchanges"
    before = reads()
    for k, out in zip(keys, outs, strict=True):
        backend.get_into(k, out)
    assert reads() - before - 1 == 16  # the unbatched path, for contrast
    backend.remove(keys[:2])
    assert backend.contains(keys[:3]) == [False, False, True]
    assert backend.num_evictions == 0
    backend.close()


@pytest.mark.parametrize("reply", [b":x\r\n", b":5\r\n", b"*1\r\n$1\r\nz\r\n"])
def test_a_garbage_reply_fails_the_tier_not_the_caller(reply):
    """A store that answers nonsense (a reply redis-py cannot parse, an integer or an array
    where a value belongs): the tier counts a failure and backs off; nothing escapes to the
    engine but a miss (before, ValueError / TypeError left the tier, the breaker stayed
    closed and every lookup hit the store again)."""
    import contextlib
    import socket
    import threading

    from lmkv.backends.registry import create_backend
    from lmkv.storage.tier import Tier

    def serve(conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as f, contextlib.suppress(OSError):
            while line := f.readline():
                args = [f.read(int(f.readline()[1:]) + 2)[:-2] for _ in range(int(line[1:]))]
                known = {b"GETRANGE": reply, b"EXISTS": b":x\r\n", b"HELLO": b"%1\r\n+proto\r\n:3\r\n"}
                conn.sendall(known.get(args[0].upper(), b"+OK\r\n"))

    def accept() -> None:
        with contextlib.suppress(OSError):  # closed at the end
            while True:
                threading.Thread(target=serve, args=(server.accept()[0],), daemon=True).start()

    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=accept, daemon=True).start()
    tier = Tier("remote", create_backend(f"redis://127.0.0.1:{server.getsockname()[1]}", 0.5),
                "zstd")
    assert tier.contains(["k"]) is None and tier.breaker.failures == 1
    tier.breaker.open_until = 0.0  # past its interval
    tier.breaker.trial = True
    assert tier.read(["k"], [None]) == [False] and tier.breaker.failures == 2
    tier.close()
    server.close()


def test_a_value_larger_than_a_chunk_frame_is_a_miss_never_read_whole(redis_server):
    """lmkv gives a remote tier the largest frame a chunk can have: a larger value under a
    chunk's key (another layout's, garbage) is a miss for that key alone, and only that
    bound's bytes of it cross the network (GETRANGE), not all of it."""
    from lmkv.backends.registry import LazyBackend
    from lmkv.cache import LMKVCache
    from lmkv.codec import max_frame_bytes
    from lmkv.config import load_config
    from lmkv.layout import KVLayout

    layout = KVLayout(2, 1, 4, torch.float32, 16)
    cache = LMKVCache(load_config(env={}, chunk_size=16, max_local_cpu_size=0.001,
                                  remote_url=redis_server.url), layout, "model")
    (tier,) = cache.storage.tiers
    assert isinstance(tier.backend, LazyBackend)
    bound = max_frame_bytes(layout.chunk_bytes)
    backend = tier.backend._connected()
    assert backend.max_value_size == bound
    cache.close()
    small = RedisBackend(redis_server.url, max_value_size=1000)
    small.put([("big", b"x" * 50_000), ("fits", b"y" * 1000)])
    sent = _read_counter(redis_server.url, "total_net_output_bytes")
    before = sent()
    assert small.get(["big", "fits", "none"]) == [None, b"y" * 1000, None]
    assert sent() - before < 10_000
    outs = [memoryview(bytearray(2000)) for _ in range(2)]
    assert small.get_into_many(["big", "fits"], outs) == [None, 1000]
    small.close()
